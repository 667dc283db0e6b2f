"""Seeded random-weight qwen3moe GGUF files of any geometry, in llama.cpp's tensor layout.

Every test and benchmark gets a model without a download. `write_model` streams: it never holds
more than one chunk (~16 MiB) of weights in RAM, so the bench preset (~32 GB) writes at disk speed.
Q8_0 matrices are generated as quantized blocks directly (random int8 `qs`, an f16 scale per block
chosen for the target std) instead of quantizing float weights; the K- and i-quants (`qtype` Q4_K, Q2_K,
IQ2_XXS, ..., and the Q4_K_M mix) as random valid blocks calibrated to the target std (gguf-py cannot
quantize to them; gguf/quants_synth.py); F32/F16/BF16 matrices are drawn from a normal distribution.
Same spec (seed included) -> byte-identical file.

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
from betelgeuse.gguf.qtypes import block_size
from betelgeuse.gguf.quants_synth import BLOCK_TYPES
from betelgeuse.gguf.synth_common import add_tokenizer, matrix_chunks, nbytes, tensor_rng, write_gguf
from betelgeuse.gguf.synth_ds4 import DS4_PRESETS, DS4Spec, write_deepseek4
from betelgeuse.gguf.synth_ds4 import model_nbytes as ds4_nbytes
from betelgeuse.gguf.synth_ds41 import DS41_PRESETS, DS41Spec, write_deepseek41
from betelgeuse.gguf.synth_ds41 import model_nbytes as ds41_nbytes

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
    qtype: str = "Q8_0"          # big matrices (norms and router stay F32): "F32" | "F16" | "BF16" | "Q8_0" all of
                                 # them; an expert type of quants_synth.BLOCK_TYPES ("Q4_K", "Q2_K", "IQ2_XXS", ...):
                                 # the experts, Q8_0 elsewhere; "Q4_K_M": experts Q4_K, attention Q6_K/Q8_0 (_mix)
    router_skew: float = 0.0     # Zipf-like expert popularity exponent; 0 = no added bias (module doc)
    router_drift: float = 0.0    # share of the router logits' variance read from a drifting state (synth_router.py)
    router_scale: float = 1.0    # all router logits x this (moves the weights, not the choice)
    router_window: float = 8.0   # the drift's attention kernel ~ (1 + Delta / window)^-decay
    router_decay: float = 1.0
    router_target: str = ""      # name of the statistics the router was calibrated to ("" = none)
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
               "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
               **{n: LlamaFileType(v) for n, v in BLOCK_TYPES.items()}, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M}
_ROLES = ("embd", "attn_qko", "attn_v", "output", "experts")


def _mix(qtype: str) -> dict[str, str]:
    """The type of each matrix role for a spec's qtype (see SynthSpec.qtype). Q4_K_M follows llama.cpp's mix in
    spirit: Q6_K for attention q/k/output and the output head, Q8_0 for attn_v and the embedding (whose constant
    channel needs Q8_0), Q4_K experts."""
    if qtype in _QTYPES:
        return dict.fromkeys(_ROLES, qtype)
    if qtype == "Q4_K_M":
        return {"embd": "Q8_0", "attn_qko": "Q6_K", "attn_v": "Q8_0", "output": "Q6_K", "experts": "Q4_K"}
    return {**dict.fromkeys(_ROLES, "Q8_0"), "experts": qtype}
_EMB_STD = 1.0               # token embedding std
_SKEW_CONST = 1.0            # A: value of the constant channel (must fit Q8_0: A/d <= 127)
_RESID_VAR_PER_LAYER = 0.35  # residual variance added per layer (attention + MoE), measured with HF on tiny/small
_RESID_VAR_CALIBRATED = (0.045, 0.0005)   # the same for calibrated-router files (expected_skew_input)
ROUTERS = ("preset", "calibrated", "uniform")


def spec_from_preset(name: str, router: str | None = None, **overrides):
    """A preset with some fields replaced (the CLI's `--layers`, `--seed`, ...). `ds4-*` presets are
    `deepseek4` models (DS4Spec), `ds41-*` presets `deepseek41` ones (DS41Spec); a field the preset's spec does not
    have is an error naming it.
    router: "preset" / None (the preset's router_skew), "calibrated" (`calibrated`: locality and popularity fitted
    to real decode statistics) or "uniform" (skew 0, no drift: the worst case for caching)."""
    presets = {**PRESETS, **DS4_PRESETS, **DS41_PRESETS}
    if name not in presets:
        raise InvalidRequestError(f"unknown synth preset {name!r} (known: {', '.join(presets)})")
    base = presets[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    if "qtype" in given and "expert_qtype" in base.__dataclass_fields__:
        given["expert_qtype"] = given.pop("qtype")     # deepseek4: --qtype names the routed experts' type
    bad = sorted(set(given) - set(base.__dataclass_fields__))
    if bad:
        raise InvalidRequestError(f"preset {name!r} ({type(base).__name__}) has no field(s) {', '.join(bad)}")
    if router not in (None, *ROUTERS):
        raise InvalidRequestError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    spec = replace(base, **given)
    if router == "uniform":
        return replace(spec, router_skew=0.0, router_drift=0.0, router_scale=1.0, router_target="")
    if router == "calibrated":
        return calibrated(spec)
    return spec


def validate(spec: SynthSpec) -> None:
    """User mistakes in a spec -> InvalidRequestError naming the field."""
    from betelgeuse.gguf.templates import chat_template
    chat_template(spec.chat_template)
    if spec.qtype not in _FILE_TYPES:
        raise InvalidRequestError(f"qtype {spec.qtype!r} not supported (use one of {', '.join(_FILE_TYPES)})")
    mix = _mix(spec.qtype)
    for role, dims in (("experts", ("n_embd", "n_ff_exp")), ("attn_qko", ("n_embd",))):
        blk = block_size(int(GT[mix[role]]))[0]
        for f in dims:
            if getattr(spec, f) % blk:
                raise InvalidRequestError(f"{f}={getattr(spec, f)} must be a multiple of {blk} for {mix[role]} "
                                          f"({role} of qtype {spec.qtype})")
    blk = block_size(int(GT[mix["attn_qko"]]))[0]
    if (spec.n_head * spec.head_dim) % blk:
        raise InvalidRequestError(f"n_head*head_dim must be a multiple of {blk} for {mix['attn_qko']} (qtype {spec.qtype})")
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
    if not 0 <= spec.router_drift < 1:
        raise InvalidRequestError(f"router_drift must be in [0, 1), got {spec.router_drift}")
    if spec.router_scale <= 0 or spec.router_window <= 0 or spec.router_decay <= 0:
        raise InvalidRequestError("router_scale, router_window and router_decay must be positive")
    if "Q8_0" in mix.values():
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
    if spec.router_drift:
        # a calibrated router's file (attention values read only the tokens' own dims): residual variance
        # 1 + a x + b x^2 at x = layer + 0.5, measured through the reference model on the small preset (8 layers)
        # and on the bench geometry (16 layers): 1.32 and 1.83 at their last layers
        x = layer + 0.5
        return _SKEW_CONST / math.sqrt(1.0 + _RESID_VAR_CALIBRATED[0] * x + _RESID_VAR_CALIBRATED[1] * x * x)
    var = _EMB_STD ** 2 + (_SKEW_CONST ** 2 - _EMB_STD ** 2) / spec.n_embd + _RESID_VAR_PER_LAYER * (layer + 0.5)
    return _SKEW_CONST / math.sqrt(var)


# ---- weight generators: each yields the tensor's bytes in order, chunk by chunk ----

def _norm(rng: np.random.Generator, n: int, keep) -> Iterator[np.ndarray]:
    w = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
    if keep is not None:
        w[keep] = 1.0                 # the constant channel (and a calibrated router's dims) pass norms unscaled
    yield w


def _router(rng: np.random.Generator, spec: SynthSpec, layer: int, j: int, plan=None) -> Iterator[np.ndarray]:
    w = (rng.standard_normal((spec.n_expert, spec.n_embd)) / math.sqrt(spec.n_embd)).astype(np.float32)
    rank = rng.permutation(spec.n_expert)             # popularity rank of each expert in this layer
    c = -np.log1p(rank.astype(np.float64))
    c -= c.mean()
    if plan is not None:                              # a calibrated router (synth_router.py): reads N, D and j only
        yield plan.router(spec.n_expert, spec.n_embd, spec.router_skew, spec.router_drift, spec.router_scale,
                          expected_skew_input(spec, layer), c, rng)
        return
    w[:, j] = (spec.router_skew * c / expected_skew_input(spec, layer)).astype(np.float32)
    if spec.router_scale != 1.0:
        w *= np.float32(spec.router_scale)
    yield w


def router_plan(spec: SynthSpec):
    """The calibrated-router wiring of a spec with router_drift > 0 (synth_router.RouterPlan), else None. Layer 0's
    last query head (and so the last KV head) carries the kernel."""
    if not spec.router_drift:
        return None
    from betelgeuse.gguf.synth_router import plan_router
    hd = spec.head_dim
    qn = next(_norm(tensor_rng(spec, "blk.0.attn_q_norm.weight"), hd, None))
    kn = next(_norm(tensor_rng(spec, "blk.0.attn_k_norm.weight"), hd, None))
    return plan_router(spec.seed, spec.n_embd, skew_dim(spec), hd, spec.rope_theta, qn, kn, head=spec.n_head - 1,
                       window=spec.router_window, decay=spec.router_decay)


def tensor_plan(spec: SynthSpec) -> list[tuple[str, tuple[int, ...], GT, Callable[[], Iterator[np.ndarray]]]]:
    """(name, torch-order shape, type, chunk generator) for every tensor, in file order."""
    j, s = skew_dim(spec), spec
    mix = _mix(spec.qtype)
    qe, qa, qv, qo, q = mix["embd"], mix["attn_qko"], mix["attn_v"], mix["output"], mix["experts"]
    f32 = GT.F32
    qd, kvd, e, ff = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_embd, s.n_ff_exp
    rp = router_plan(s)
    # a calibrated router's reserved dims (synth_router.py): no layer writes j, D or N (D: only the kernel head);
    # D is zero in the embedding; attention values read only N, the tokens' own coordinates (values that read
    # the residual would carry context means from layer to layer, which makes its RMS grow with depth in a way
    # that depends on the geometry; the router's weights need that growth predictable)
    D = () if rp is None else tuple(int(x) for x in rp.drift_dims)
    held = (j,) if rp is None else rp.reserved
    keep = j if rp is None else list(held)
    not_n = () if rp is None else tuple(int(x) for x in np.setdiff1d(np.arange(e), rp.noise_dims))
    plan = []

    def add(name, shape, gt, fn):
        plan.append((name, shape, GT[gt] if isinstance(gt, str) else gt, lambda: fn(tensor_rng(s, name))))

    def mat(r, rows, cols, std, qt, **kw):
        return matrix_chunks(r, rows, cols, std, qt, seed=s.seed, **kw)

    add("token_embd.weight", (s.n_vocab, e), qe,
        lambda r: mat(r, s.n_vocab, e, _EMB_STD, qe, const_col=(j, _SKEW_CONST), zero_cols=D))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        k0 = rp is not None and i == 0            # layer 0 holds the kernel head (synth_router.py)
        # its rows are given outright, which needs a quantizer: Q8_0 there when the mix has a K-quant attention
        qk = "Q8_0" if k0 and qa in BLOCK_TYPES else qa
        add(p + "attn_norm.weight", (e,), f32, lambda r: _norm(r, e, keep))
        add(p + "attn_q.weight", (qd, e), qk, lambda r, k0=k0, qk=qk: mat(
            r, qd, e, e ** -0.5, qk, set_rows=rp.query_rows(e) if k0 else None))
        add(p + "attn_k.weight", (kvd, e), qk, lambda r, k0=k0, qk=qk: mat(
            r, kvd, e, e ** -0.5, qk, set_rows=rp.key_rows(e, s.n_head // s.n_head_kv) if k0 else None))
        add(p + "attn_v.weight", (kvd, e), qv, lambda r: mat(
            r, kvd, e, (e - len(not_n)) ** -0.5, qv, zero_cols=not_n))
        add(p + "attn_output.weight", (e, qd), qk, lambda r, k0=k0, qk=qk: mat(
            r, e, qd, qd ** -0.5, qk, zero_rows=held, zero_cols=rp.head_cols() if k0 else (),
            set_rows=rp.output_rows(qd) if k0 else None))
        add(p + "attn_q_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "attn_k_norm.weight", (s.head_dim,), f32, lambda r: _norm(r, s.head_dim, None))
        add(p + "ffn_norm.weight", (e,), f32, lambda r: _norm(r, e, keep))
        add(p + "ffn_gate_inp.weight", (s.n_expert, e), f32, lambda r, i=i: _router(r, s, i, j, rp))
        # experts one after another: expert x's slice of each *_exps tensor is contiguous
        add(p + "ffn_gate_exps.weight", (s.n_expert, ff, e), q,
            lambda r: (c for _ in range(s.n_expert) for c in mat(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_up_exps.weight", (s.n_expert, ff, e), q,
            lambda r: (c for _ in range(s.n_expert) for c in mat(r, ff, e, e ** -0.5, q)))
        add(p + "ffn_down_exps.weight", (s.n_expert, e, ff), q,
            lambda r: (c for _ in range(s.n_expert) for c in mat(r, e, ff, ff ** -0.5, q, zero_rows=held)))
    add("output_norm.weight", (e,), f32, lambda r: _norm(r, e, keep))
    add("output.weight", (s.n_vocab, e), qo, lambda r: mat(r, s.n_vocab, e, e ** -0.5, qo))
    return plan


def model_nbytes(spec) -> int:
    """Bytes of tensor data (without header) of the file `write_model` would write."""
    if isinstance(spec, DS41Spec):          # registry: before DS4Spec, its base class
        return ds41_nbytes(spec)
    if isinstance(spec, DS4Spec):
        return ds4_nbytes(spec)
    return sum(nbytes(shape, gt) for _, shape, gt, _ in tensor_plan(spec))


def _add_metadata(w: GGUFWriter, spec: SynthSpec) -> None:
    s = spec
    w.add_name(f"betelgeuse-synth-{s.n_layer}L-{s.n_expert}x{s.n_ff_exp}-{s.qtype}")
    w.add_file_type(int(_FILE_TYPES[s.qtype]))
    if s.qtype not in ("F32", "F16", "BF16"):
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
    from betelgeuse.gguf.synth_router import add_router_metadata
    add_router_metadata(w, s, router_plan(s), gate="softmax")
    add_tokenizer(w, s.n_vocab, s.chat_template)


def write_model(path: str | os.PathLike, spec, progress: bool = True) -> None:
    """Write `spec` (a SynthSpec, or a DS4Spec for `deepseek4`) as a GGUF file at `path` (atomically:
    `path.partial`, then rename)."""
    if isinstance(spec, DS41Spec):          # registry: before DS4Spec, its base class
        write_deepseek41(path, spec, progress=progress)
        return
    if isinstance(spec, DS4Spec):
        write_deepseek4(path, spec, progress=progress)
        return
    validate(spec)
    write_gguf(path, ARCH, tensor_plan(spec), lambda w: _add_metadata(w, spec), progress)




def calibrated(spec):
    """`spec` (SynthSpec or DS4Spec) with a router calibrated to synth_router.TARGET for its geometry: skew, drift
    and logit scale from a simulation of its realised wiring (synth_router.calibrate)."""
    from betelgeuse.gguf import synth_router as R
    from betelgeuse.gguf.synth_ds4 import router_plan as ds4_router_plan
    probe = replace(spec, router_drift=0.5)
    if isinstance(spec, DS4Spec):
        plan, gate = ds4_router_plan(probe), "sqrtsoftplus"
    else:
        validate(probe)
        plan, gate = router_plan(probe), "softmax"
    c = R.calibrate(spec.n_expert, spec.n_expert_used, plan.scores, gate, plan.dims)
    return replace(spec, router_skew=c["router_skew"], router_drift=c["router_drift"], router_scale=c["router_scale"],
                   router_target=R.TARGET_NAME)
