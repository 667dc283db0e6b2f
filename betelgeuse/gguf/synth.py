"""Seeded random-weight qwen3moe GGUF files of any geometry, in llama.cpp's tensor layout.

Every test and benchmark gets a model without a download. `write_model` streams: it never holds
more than one chunk (~16 MiB) of weights in RAM, so the bench preset (~32 GB) writes at disk speed.
Q8_0 matrices are generated as quantized blocks directly (random int8 `qs`, an f16 scale per block
chosen for the target std) instead of quantizing float weights; F32/F16/BF16 matrices are drawn
from a normal distribution. Same spec (seed included) -> byte-identical file.

Scales (why the model is numerically sane): matrices have std 1/sqrt(fan_in), so a unit-RMS input
gives unit-variance outputs; embeddings ~N(0, 1); norm weights 1 + N(0, 0.05). The residual stream
then grows only like sqrt(layers) and logits have std ~1 (differ between tokens).

Router skew s >= 0 (`SynthSpec.router_skew`): random routers route almost uniformly; real ones do
not. Mechanism: one residual coordinate j (`betelgeuse.synth.skew_dim`) is a constant channel:
column j of token_embd is the constant A for every token, and row j of attn_output and of every
expert's down matrix is zero, so no layer writes to it and the residual keeps h[j] = A at every
layer (real models have such "massive activation" channels). After RMSNorm, x[j] = A / rms(h),
which is nearly the same for every token of a layer. Column j of router (ffn_gate_inp) row e is
s * c_e / E[x[j]] with c_e = -log(1 + rank_e) (centered), rank_e a per-layer random permutation
of the experts. This adds ~s * c_e to expert e's logit for every token: with Gumbel-like logit
noise of unit scale, popularity of the expert of rank r goes roughly like (1 + r)^-s, a Zipf
profile of exponent ~s. s = 0 adds nothing (column j of the router is zero). E[x[j]] per layer
comes from a calibrated estimate of the residual RMS growth, so the skew holds at depth too.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter, LlamaFileType, quants

from betelgeuse.errors import InvalidRequestError

ARCH = "qwen3moe"


def __getattr__(name):
    if name == "DS4Spec":      # the deepseek4 spec lives beside its writer (synth_ds4.py)
        from betelgeuse.gguf.synth_ds4 import DS4Spec
        return DS4Spec
    raise AttributeError(name)


@dataclass(slots=True, frozen=True)
class SynthSpec:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    context_length: int = 4096
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    qtype: str = "Q8_0"          # "F32" | "F16" | "BF16" | "Q8_0": big matrices; norms and router stay F32
    router_skew: float = 0.0     # Zipf-like expert popularity exponent; 0 = no added bias (module doc)
    seed: int = 0
    chat_template: str = "default"   # gguf/templates.py: default | qwen3 | deepseek-v4


PRESETS: dict[str, SynthSpec] = {
    # ~3 MB: unit tests, HF transformers reference
    "tiny": SynthSpec(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=16,
                      n_expert_used=4, n_ff_exp=32, n_vocab=1024, context_length=2048),
    # ~240 MB: CPU/GPU comparisons
    "small": SynthSpec(n_layer=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_expert=64,
                       n_expert_used=8, n_ff_exp=256, n_vocab=8192, router_skew=1.0),
    # Qwen3-30B-A3B shape at Q8_0, ~32 GB
    "bench": SynthSpec(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
                       n_expert_used=8, n_ff_exp=768, n_vocab=151936, context_length=40960,
                       router_skew=1.0),
}

_QTYPES = {"F32": GT.F32, "F16": GT.F16, "BF16": GT.BF16, "Q8_0": GT.Q8_0}
_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
               "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0}
_CHUNK_ELEMS = 8 << 20       # weights generated per chunk (Q8_0: ~8.5 MiB, F32: 32 MiB)
_EMB_STD = 1.0               # token embedding std
_SKEW_CONST = 1.0            # A: value of the constant channel (must fit Q8_0: A/d <= 127)
_RESID_VAR_PER_LAYER = 0.35  # residual variance added per layer (attention + MoE), measured with HF on tiny/small
_Q8_UNIFORM_STD = math.sqrt((256 ** 2 - 1) / 12) * math.sqrt(1 + 1 / 48)  # int8 uniform x scale jitter


def spec_from_preset(name: str, **overrides):
    """A preset with some fields replaced (the CLI's `--layers`, `--seed`, ...). `ds4-*` presets are
    `deepseek4` models (DS4Spec); a field the preset's spec does not have is an error naming it."""
    from betelgeuse.gguf.synth_ds4 import DS4_PRESETS
    presets = {**PRESETS, **DS4_PRESETS}
    if name not in presets:
        raise InvalidRequestError(f"unknown synth preset {name!r} (known: {', '.join(presets)})")
    base = presets[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    bad = sorted(set(given) - set(base.__dataclass_fields__))
    if bad:
        raise InvalidRequestError(f"preset {name!r} ({type(base).__name__}) has no field(s) {', '.join(bad)}")
    return replace(base, **given)


def validate(spec: SynthSpec) -> None:
    """User mistakes in a spec -> InvalidRequestError naming the field."""
    from betelgeuse.gguf.templates import chat_template
    chat_template(spec.chat_template)
    if spec.qtype not in _QTYPES:
        raise InvalidRequestError(f"qtype {spec.qtype!r} not supported (use one of {', '.join(_QTYPES)})")
    for f in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used",
              "n_ff_exp", "n_vocab", "context_length"):
        if getattr(spec, f) <= 0:
            raise InvalidRequestError(f"{f} must be positive, got {getattr(spec, f)}")
    if spec.n_expert_used > spec.n_expert:
        raise InvalidRequestError(f"n_expert_used {spec.n_expert_used} > n_expert {spec.n_expert}")
    if spec.n_head % spec.n_head_kv:
        raise InvalidRequestError(f"n_head {spec.n_head} not a multiple of n_head_kv {spec.n_head_kv}")
    if spec.router_skew < 0:
        raise InvalidRequestError(f"router_skew must be >= 0, got {spec.router_skew}")
    if spec.qtype == "Q8_0":
        for f in ("n_embd", "n_ff_exp"):
            if getattr(spec, f) % 32:
                raise InvalidRequestError(f"{f}={getattr(spec, f)} must be a multiple of 32 for Q8_0")
        if (spec.n_head * spec.head_dim) % 32:
            raise InvalidRequestError("n_head*head_dim must be a multiple of 32 for Q8_0")
    if spec.n_vocab < 256 + 3:
        raise InvalidRequestError(f"n_vocab {spec.n_vocab} too small: needs 256 byte tokens + 3 specials")


def skew_dim(spec: SynthSpec) -> int:
    """The constant residual channel j (module doc)."""
    return int(np.random.default_rng([spec.seed, 7]).integers(spec.n_embd))


def expected_skew_input(spec: SynthSpec, layer: int) -> float:
    """E[x[j]] at the router input of `layer`: A / rms(h), rms from the calibrated growth model."""
    var = _EMB_STD ** 2 + (_SKEW_CONST ** 2 - _EMB_STD ** 2) / spec.n_embd + _RESID_VAR_PER_LAYER * (layer + 0.5)
    return _SKEW_CONST / math.sqrt(var)


# ---- weight generators: each yields the tensor's bytes in order, chunk by chunk ----

def _rng(spec: SynthSpec, name: str) -> np.random.Generator:
    # Per-tensor stream keyed by the name, so adding a tensor never changes the others.
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([spec.seed, zlib.crc32(name.encode())])))


def _q8_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q8_0 rows: uint8 (rows, cols/32, 34) = f16 scale d + 32 int8 qs; weights d*qs have ~std."""
    nb = rows * cols // 32
    words = rng.integers(0, 2 ** 64 - 1, size=(nb * 34 + 7) // 8, dtype=np.uint64, endpoint=True)
    raw = words.view(np.uint8)[: nb * 34].reshape(nb, 34)
    d16 = raw.view(np.uint16)[:, 0]                    # (nb,) random bits -> scale, jitter in [0.75, 1.25)
    jitter = 0.75 + 0.5 * (np.arange(256, dtype=np.float64) + 0.5) / 256
    table = (jitter * (std / _Q8_UNIFORM_STD)).astype(np.float16).view(np.uint16)
    d16[:] = table[d16 >> 8]                          # a gather: 2x faster than float math per block
    return raw.reshape(rows, cols // 32, 34)


def _matrix_chunks(rng: np.random.Generator, rows: int, cols: int, std: float, qtype: str,
                   zero_row: int | None = None, const_col: tuple[int, float] | None = None) -> Iterator[np.ndarray]:
    """A (rows, cols) matrix in `qtype`, row chunks; optional zero row / constant column."""
    step = max(1, _CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if qtype == "Q8_0":
            blk = _q8_blocks(rng, n, cols, std)        # (n, cols/32, 34)
            if zero_row is not None and r0 <= zero_row < r0 + n:
                blk[zero_row - r0] = 0                # d = 0, qs = 0
            if const_col is not None:
                j, a = const_col
                b, p = divmod(j, 32)
                d = blk[:, b, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
                q = np.clip(np.rint(a / d), -127, 127).astype(np.int8)
                blk[:, b, 2 + p] = q.view(np.uint8)
            yield blk
            continue
        x = rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std)
        if zero_row is not None and r0 <= zero_row < r0 + n:
            x[zero_row - r0] = 0
        if const_col is not None:
            x[:, const_col[0]] = const_col[1]
        yield x if qtype == "F32" else x.astype(np.float16) if qtype == "F16" else quants.quantize(x, GT.BF16)


def _norm(rng: np.random.Generator, n: int, keep: int | None) -> Iterator[np.ndarray]:
    w = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
    if keep is not None:
        w[keep] = 1.0                                 # the constant channel passes norms unscaled
    yield w


def _router(rng: np.random.Generator, spec: SynthSpec, layer: int, j: int) -> Iterator[np.ndarray]:
    w = (rng.standard_normal((spec.n_expert, spec.n_embd)) / math.sqrt(spec.n_embd)).astype(np.float32)
    rank = rng.permutation(spec.n_expert)             # popularity rank of each expert in this layer
    c = -np.log1p(rank.astype(np.float64))
    c -= c.mean()
    w[:, j] = (spec.router_skew * c / expected_skew_input(spec, layer)).astype(np.float32)
    yield w


def tiled_chunks(rng: np.random.Generator, tile: np.ndarray, n: int, per: int) -> Iterator[np.ndarray]:
    """`n` units (rows of `tile`: blocks, elements) in chunks of at most `per`, each a view of `tile` at a random
    offset: no generation and no copy per chunk, so a writer that uses it runs at disk speed. `tile` holds at
    least 2 * per units (so the offsets vary) and is never written to (the views go to the writer thread)."""
    assert len(tile) >= min(n, 2 * per), (len(tile), n, per)
    for u0 in range(0, n, per):
        k = min(per, n - u0)
        o = int(rng.integers(0, len(tile) - k + 1))
        yield tile[o: o + k]


def _nbytes(shape: tuple[int, ...], gt: GT) -> int:
    n = math.prod(shape)
    return {GT.F32: 4 * n, GT.F16: 2 * n, GT.BF16: 2 * n, GT.Q8_0: n // 32 * 34, GT.MXFP4: n // 32 * 17,
            GT.I32: 4 * n}[gt]


def tensor_plan(spec: SynthSpec) -> list[tuple[str, tuple[int, ...], GT, Callable[[], Iterator[np.ndarray]]]]:
    """(name, torch-order shape, type, chunk generator) for every tensor, in file order."""
    q, j, s = spec.qtype, skew_dim(spec), spec
    gq, f32 = _QTYPES[q], GT.F32
    qd, kvd, e, ff = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_embd, s.n_ff_exp
    plan = []

    def add(name, shape, gt, fn):
        plan.append((name, shape, gt, lambda: fn(_rng(s, name))))

    add("token_embd.weight", (s.n_vocab, e), gq,
        lambda r: _matrix_chunks(r, s.n_vocab, e, _EMB_STD, q, const_col=(j, _SKEW_CONST)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
        add(p + "attn_q.weight", (qd, e), gq, lambda r: _matrix_chunks(r, qd, e, e ** -0.5, q))
        add(p + "attn_k.weight", (kvd, e), gq, lambda r: _matrix_chunks(r, kvd, e, e ** -0.5, q))
        add(p + "attn_v.weight", (kvd, e), gq, lambda r: _matrix_chunks(r, kvd, e, e ** -0.5, q))
        add(p + "attn_output.weight", (e, qd), gq, lambda r: _matrix_chunks(r, e, qd, qd ** -0.5, q, zero_row=j))
        add(p + "attn_q_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "attn_k_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "ffn_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
        add(p + "ffn_gate_inp.weight", (s.n_expert, e), f32, lambda r, i=i: _router(r, s, i, j))
        # experts one after another: expert x's slice of each *_exps tensor is contiguous
        add(p + "ffn_gate_exps.weight", (s.n_expert, ff, e), gq,
            lambda r: (c for _ in range(s.n_expert) for c in _matrix_chunks(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_up_exps.weight", (s.n_expert, ff, e), gq,
            lambda r: (c for _ in range(s.n_expert) for c in _matrix_chunks(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_down_exps.weight", (s.n_expert, e, ff), gq,
            lambda r: (c for _ in range(s.n_expert) for c in _matrix_chunks(r, e, ff, ff ** -0.5, q, zero_row=j)))
    add("output_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
    add("output.weight", (s.n_vocab, e), gq, lambda r: _matrix_chunks(r, s.n_vocab, e, e ** -0.5, q))
    return plan


def model_nbytes(spec) -> int:
    """Bytes of tensor data (without header) of the file `write_model` would write."""
    from betelgeuse.gguf.synth_ds4 import DS4Spec, model_nbytes as ds4_nbytes
    if isinstance(spec, DS4Spec):
        return ds4_nbytes(spec)
    return sum(_nbytes(shape, gt) for _, shape, gt, _ in tensor_plan(spec))


def _add_metadata(w: GGUFWriter, spec: SynthSpec) -> None:
    s = spec
    w.add_name(f"betelgeuse-synth-{s.n_layer}L-{s.n_expert}x{s.n_ff_exp}-{s.qtype}")
    w.add_file_type(int(_FILE_TYPES[s.qtype]))
    if s.qtype == "Q8_0":
        w.add_quantization_version(2)
    w.add_block_count(s.n_layer)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff_exp * s.n_expert_used)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_uint32("betelgeuse.synth.seed", s.seed)
    w.add_float32("betelgeuse.synth.router_skew", s.router_skew)
    w.add_uint32("betelgeuse.synth.skew_dim", skew_dim(s))
    add_tokenizer(w, s.n_vocab, s.chat_template)


def add_tokenizer(w: GGUFWriter, n_vocab: int, chat_template: str = "default") -> None:
    """A byte-level BPE of `n_vocab` tokens trained on CORPUS, Qwen-style specials, the chat template (by name:
    gguf/templates.py)."""
    from betelgeuse.gguf.templates import chat_template as template_named
    from betelgeuse.tokenizer import train_vocab
    v = train_vocab(CORPUS, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    w.add_token_merges(v.merges)
    w.add_bos_token_id(v.endoftext_id)
    w.add_eos_token_id(v.im_end_id)
    w.add_pad_token_id(v.endoftext_id)
    w.add_add_bos_token(False)
    w.add_chat_template(template_named(chat_template))


# Tokenizer training text: a few paragraphs of plain English plus some non-ASCII, so that the
# vocabulary has real word pieces and multi-byte characters span several tokens.
CORPUS = [
    "The river ran low that summer, and the people of the valley walked out onto the dry stones to "
    "look for things the water had kept. They found coins, a bicycle, a blue bottle with a letter in "
    "it, and the old iron bell that had fallen from the chapel tower in the great storm of 1911.",
    "A mixture of experts is a neural network in which a small router chooses, for every token, a few "
    "experts out of many. Each expert is a feed-forward network. Only the chosen experts run, so the "
    "model can be very large while each token costs little. The hard part is memory: the experts must "
    "be somewhere, and moving them from the disk to the GPU takes time.",
    "She opened the window, counted the boats in the harbour (there were twelve, and one of them was "
    "red), and wrote the number in her notebook next to yesterday's: eleven. Tomorrow, she thought, "
    "there would be thirteen. There were never fewer, only more, as if the sea were making them.",
    "To build the project, run the tests first. If a test fails, read the message; it names the file "
    "and the line. Don't guess! Measure the time it takes, write it down, and compare it with the "
    "number you expected. A result you cannot repeat is not a result.",
    "In the morning the market was full of voices: fishermen selling what they had caught, children "
    "running between the stalls, an old man playing the violin for anyone who would listen. Bread, "
    "cheese, apples, onions, honey and salt were piled high on the wooden tables.",
    "Numbers matter: 3 apples, 14 pears, 159 cherries, 2653 grapes, 58979 seeds; 3.14159, 2.71828, "
    "1,000,000 and 0.001. Dates like 2024-06-01 and times like 12:30 appear everywhere in text.",
    "Questions and answers. What is the capital of France? Paris. What is two plus two? Four. Who wrote "
    "this? We did. Why is the sky blue? Because the air scatters blue light more than red light.",
    "Café, naïve, façade, über, señor, smörgåsbord. Здравствуйте, мир. こんにちは世界。你好，世界。"
    "Γειά σου κόσμε. مرحبا بالعالم. 🙂 🚀 ✨ — “quoted” ‘text’ … ½ ° € £ ¥.",
    "def route(tokens, experts, k=8):\n    scores = router(tokens)\n    top = scores.topk(k)\n"
    "    return [experts[i] for i in top.indices]\n\nfor layer in range(48):\n    x = layer(x)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How "
    "vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.",
]

# Qwen3-style ChatML with Qwen3's tool block (tools in <tools></tools>, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn) and its `enable_thinking=False` empty think block.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if (loop.first and message['content']) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call['function'] %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def write_model(path: str | os.PathLike, spec, progress: bool = True) -> None:
    """Write `spec` (a SynthSpec, or a DS4Spec for `deepseek4`) as a GGUF file at `path` (atomically:
    `path.partial`, then rename)."""
    from betelgeuse.gguf.synth_ds4 import DS4Spec, write_deepseek4
    if isinstance(spec, DS4Spec):
        write_deepseek4(path, spec, progress=progress)
        return
    validate(spec)
    write_gguf(path, ARCH, tensor_plan(spec), lambda w: _add_metadata(w, spec), progress)


def write_gguf(path: str | os.PathLike, arch: str, plan, add_metadata: Callable[[GGUFWriter], None],
               progress: bool = True) -> None:
    """The streaming writer shared by every architecture: `plan` lists (name, torch shape, type, chunk
    generator) in file order; `add_metadata(writer)` adds the key/value pairs."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch)
    add_metadata(w)
    for name, shape, gt, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, gt), raw_dtype=gt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    total = sum(_nbytes(shape, gt) for _, shape, gt, _ in plan)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {path.name}")
    # Generation (numpy, main thread) overlaps with the write (GIL released) in a writer thread.
    q: queue.Queue = queue.Queue(maxsize=4)
    err: list[BaseException] = []

    def writer() -> None:
        while (buf := q.get()) is not None:
            try:
                if not err:
                    fout.write(memoryview(buf).cast("B"))
            except BaseException as e:  # surfaced in the main thread
                err.append(e)

    t = threading.Thread(target=writer, name="synth-writer", daemon=True)
    t.start()
    try:
        for name, shape, gt, gen in plan:
            n = 0
            for chunk in gen():
                chunk = np.ascontiguousarray(chunk)
                n += chunk.nbytes
                q.put(chunk)
                if bar is not None:
                    bar.update(chunk.nbytes)
                if err:
                    raise err[0]
            assert n == _nbytes(shape, gt), (name, n, _nbytes(shape, gt))
            pad = GGUFWriter.ggml_pad(n, w.data_alignment) - n
            if pad:
                q.put(np.zeros(pad, np.uint8))
    finally:
        q.put(None)
        t.join()
        if bar is not None:
            bar.close()
    if err:
        w.close()
        raise err[0]
    w.close()
    os.replace(tmp, path)
