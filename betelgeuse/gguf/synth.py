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
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter, LlamaFileType

from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf.synth_common import add_tokenizer, matrix_chunks, nbytes, tensor_rng, write_gguf
from betelgeuse.gguf.synth_ds4 import DS4_PRESETS, DS4Spec, write_deepseek4
from betelgeuse.gguf.synth_ds4 import model_nbytes as ds4_nbytes

ARCH = "qwen3moe"


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
_EMB_STD = 1.0               # token embedding std
_SKEW_CONST = 1.0            # A: value of the constant channel (must fit Q8_0: A/d <= 127)
_RESID_VAR_PER_LAYER = 0.35  # residual variance added per layer (attention + MoE), measured with HF on tiny/small


def spec_from_preset(name: str, **overrides):
    """A preset with some fields replaced (the CLI's `--layers`, `--seed`, ...). `ds4-*` presets are
    `deepseek4` models (DS4Spec); a field the preset's spec does not have is an error naming it."""
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


def tensor_plan(spec: SynthSpec) -> list[tuple[str, tuple[int, ...], GT, Callable[[], Iterator[np.ndarray]]]]:
    """(name, torch-order shape, type, chunk generator) for every tensor, in file order."""
    q, j, s = spec.qtype, skew_dim(spec), spec
    gq, f32 = _QTYPES[q], GT.F32
    qd, kvd, e, ff = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_embd, s.n_ff_exp
    plan = []

    def add(name, shape, gt, fn):
        plan.append((name, shape, gt, lambda: fn(tensor_rng(s, name))))

    add("token_embd.weight", (s.n_vocab, e), gq,
        lambda r: matrix_chunks(r, s.n_vocab, e, _EMB_STD, q, const_col=(j, _SKEW_CONST)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
        add(p + "attn_q.weight", (qd, e), gq, lambda r: matrix_chunks(r, qd, e, e ** -0.5, q))
        add(p + "attn_k.weight", (kvd, e), gq, lambda r: matrix_chunks(r, kvd, e, e ** -0.5, q))
        add(p + "attn_v.weight", (kvd, e), gq, lambda r: matrix_chunks(r, kvd, e, e ** -0.5, q))
        add(p + "attn_output.weight", (e, qd), gq, lambda r: matrix_chunks(r, e, qd, qd ** -0.5, q, zero_row=j))
        add(p + "attn_q_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "attn_k_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "ffn_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
        add(p + "ffn_gate_inp.weight", (s.n_expert, e), f32, lambda r, i=i: _router(r, s, i, j))
        # experts one after another: expert x's slice of each *_exps tensor is contiguous
        add(p + "ffn_gate_exps.weight", (s.n_expert, ff, e), gq,
            lambda r: (c for _ in range(s.n_expert) for c in matrix_chunks(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_up_exps.weight", (s.n_expert, ff, e), gq,
            lambda r: (c for _ in range(s.n_expert) for c in matrix_chunks(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_down_exps.weight", (s.n_expert, e, ff), gq,
            lambda r: (c for _ in range(s.n_expert) for c in matrix_chunks(r, e, ff, ff ** -0.5, q, zero_row=j)))
    add("output_norm.weight", (e,), f32, lambda r: _norm(r, e, j))
    add("output.weight", (s.n_vocab, e), gq, lambda r: matrix_chunks(r, s.n_vocab, e, e ** -0.5, q))
    return plan


def model_nbytes(spec) -> int:
    """Bytes of tensor data (without header) of the file `write_model` would write."""
    if isinstance(spec, DS4Spec):
        return ds4_nbytes(spec)
    return sum(nbytes(shape, gt) for _, shape, gt, _ in tensor_plan(spec))


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


def write_model(path: str | os.PathLike, spec, progress: bool = True) -> None:
    """Write `spec` (a SynthSpec, or a DS4Spec for `deepseek4`) as a GGUF file at `path` (atomically:
    `path.partial`, then rename)."""
    if isinstance(spec, DS4Spec):
        write_deepseek4(path, spec, progress=progress)
        return
    validate(spec)
    write_gguf(path, ARCH, tensor_plan(spec), lambda w: _add_metadata(w, spec), progress)


