"""Seeded random-weight `deepseek4` (DeepSeek-V4) GGUF files of any geometry, in llama.cpp's layout.

Tensor names and shapes come from `ds4layout` (the table the reader validates against); metadata keys are
the ones llama.cpp's converter (`conversion/deepseek.py` DeepseekV4Model) writes. Quant types follow the
release checkpoint as the converter maps it: routed experts `expert_qtype` (MXFP4 in published files),
the checkpoint's FP8 matrices Q8_0 and its BF16 matrices BF16 when `dense="release"` (all F32 when
`dense="F32"`), norms / mHC / sinks / ape / bias F32, tid2eid I32.

`write_deepseek4(path, spec, source=...)` can take the weights from a caller (the oracle test passes a
transformers model's, already rounded through the quantizer); without one it draws random weights:
matrices N(0, 1/fan_in), norms 1 + N(0, 0.05), mHC projections N(0, 0.02) (HF's init range), MXFP4 experts
as random codes with one E8M0 scale per block chosen for the same std, tid2eid k distinct random experts
per token. Streams chunk by chunk (the V4-Flash-shaped preset is ~31 GB) at disk speed: the MXFP4 experts
(88% of its bytes) are views of one random 34 MiB tile of blocks at random offsets (`synth_common.tiled_chunks`),
BF16 matrices one table gather per weight.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as GT, GGUFWriter, quants

from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf import ds4layout
from betelgeuse.gguf.modelconfig import DS4_RATIOS, Deepseek4Params, ModelConfig
from betelgeuse.gguf.qtypes import block_size
from betelgeuse.gguf.quants_synth import BLOCK_TYPES
from betelgeuse.gguf.synth_common import (CHUNK_ELEMS, add_tokenizer, matrix_chunks, nbytes, tensor_rng,
                                          tiled_chunks, write_gguf)

ARCH = "deepseek4"
MOSTLY_MXFP4_MOE = 38          # LlamaFileType (gguf 0.19 does not name it)


@dataclass(slots=True, frozen=True)
class DS4Spec:
    n_layer: int
    n_embd: int
    n_head: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    compress_ratios: tuple[int, ...] = ()     # per layer (the first n_layer used); () = V4-Flash's pattern
    n_hash_layers: int = 3                     # (at most n_layer are: a --layers override keeps the rest valid)
    n_shared: int = 1
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    context_length: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0                  # YaRN on compressed layers (1.0 = no scaling)
    rope_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    swiglu_limit: float = 10.0
    routed_scale: float = 1.5
    rms_eps: float = 1e-6
    expert_qtype: str = "MXFP4"                # "F32" | "Q8_0" | "MXFP4" | a type of quants_synth.BLOCK_TYPES
    dense: str = "release"                     # "release" (Q8_0/BF16/F32 as the converter) | "F32"
    router_skew: float = 0.0                   # popularity (synth_router.py); only with router_drift > 0
    router_drift: float = 0.0                  # a calibrated router (synth_router.py; synth.calibrated): 0 = random
    router_scale: float = 1.0
    router_window: float = 8.0
    router_decay: float = 1.0
    router_target: str = ""
    seed: int = 0
    chat_template: str = "default"   # gguf/templates.py: default | qwen3 | deepseek-v4

    def ratios(self) -> tuple[int, ...]:
        if self.compress_ratios:
            return tuple(self.compress_ratios)[:self.n_layer]
        return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(self.n_layer))

    def hash_layers(self) -> int:
        return min(self.n_hash_layers, self.n_layer)

    def config(self) -> ModelConfig:
        """The ModelConfig a reader builds from the file this spec writes."""
        yarn = self.rope_factor != 1.0
        p = Deepseek4Params(
            q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
            rope_dim=self.rope_dim, n_shared=self.n_shared, n_hash_layers=self.hash_layers(),
            sliding_window=self.sliding_window, index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim, index_topk=self.index_topk, hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps, compress_ratios=self.ratios(),
            swiglu_limit=(self.swiglu_limit,) * self.n_layer, swiglu_limit_shexp=(self.swiglu_limit,) * self.n_layer,
            compress_rope_theta=self.compress_rope_theta, rope_scaling="yarn" if yarn else "none",
            rope_factor=self.rope_factor if yarn else 1.0, rope_orig_ctx=self.rope_orig_ctx if yarn else 0,
            yarn_beta_fast=self.yarn_beta_fast, yarn_beta_slow=self.yarn_beta_slow,
            routed_scale=self.routed_scale, weights_norm=True)
        return ModelConfig(arch=ARCH, n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, n_head_kv=1,
                           head_dim=self.head_dim, n_ff_exp=self.n_ff_exp, n_expert=self.n_expert,
                           n_expert_used=self.n_expert_used, n_vocab=self.n_vocab,
                           context_length=self.context_length, rope_theta=self.rope_theta, rms_eps=self.rms_eps,
                           norm_topk_prob=True, name=f"betelgeuse-synth-ds4-{self.n_layer}L", ds4=p)


DS4_PRESETS: dict[str, DS4Spec] = {
    # ~1 MB: unit tests (sliding, CSA, HCA; 2 hash layers; windows a 300-token prompt crosses)
    "ds4-tiny": DS4Spec(n_layer=4, n_embd=64, n_head=4, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2,
                        o_lora_rank=32, n_expert=8, n_expert_used=2, n_ff_exp=32, n_vocab=512,
                        compress_ratios=(0, 4, 128, 4), n_hash_layers=2, sliding_window=16, index_n_heads=16,
                        index_head_dim=32, index_topk=4, context_length=4096, rope_factor=4.0, rope_orig_ctx=64),
    # DeepSeek-V4-Flash's per-layer shapes (hidden 4096, 64 heads x 512, 256 experts of 13,369,344 B at
    # MXFP4, top-6 + shared): 8 of its 43 layers, 31.0 GB (27.4 GB of experts + Q8_0/BF16 dense and the
    # BF16 embedding/head), what fits the GPU machine's 64 GiB disk beside the bench's other files
    "ds4-flash": DS4Spec(n_layer=8, n_embd=4096, n_head=64, head_dim=512, rope_dim=64, q_lora_rank=1024,
                         o_groups=8, o_lora_rank=1024, n_expert=256, n_expert_used=6, n_ff_exp=2048,
                         n_vocab=129280),
}

_F32_2D = ("hc_attn_fn", "hc_ffn_fn", "output_hc_fn", "attn_compressor_ape", "indexer_compressor_ape")


def validate(spec: DS4Spec) -> None:
    s = spec
    if s.expert_qtype not in ("F32", "Q8_0", "MXFP4", *BLOCK_TYPES):
        raise InvalidRequestError(f"expert_qtype {s.expert_qtype!r} not supported "
                                  f"({', '.join(('F32', 'Q8_0', 'MXFP4', *BLOCK_TYPES))})")
    if s.expert_qtype in BLOCK_TYPES and (s.n_embd % 256 or s.n_ff_exp % 256):
        raise InvalidRequestError(f"n_embd {s.n_embd} and n_ff_exp {s.n_ff_exp} must be multiples of 256 for "
                                  f"{s.expert_qtype} experts")
    if s.router_skew and not s.router_drift:
        raise InvalidRequestError(f"router_skew {s.router_skew} needs the calibrated router for deepseek4 synth models "
                                  "(router_drift > 0: `--router calibrated`)")
    if not 0 <= s.router_drift < 1 or s.router_skew < 0:
        raise InvalidRequestError(f"router_drift must be in [0, 1) and router_skew >= 0, got {s.router_drift}, "
                                  f"{s.router_skew}")
    if s.router_drift and min(s.head_dim - s.rope_dim, s.o_lora_rank) < 8:
        raise InvalidRequestError("a calibrated router needs head_dim - rope_dim and o_lora_rank of 8 or more")
    if s.dense not in ("release", "F32"):
        raise InvalidRequestError(f"dense {s.dense!r} not supported (release, F32)")
    for f in ("n_layer", "n_embd", "n_head", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
              "n_expert", "n_expert_used", "n_ff_exp", "n_vocab", "sliding_window", "hc_mult"):
        if getattr(s, f) <= 0:
            raise InvalidRequestError(f"{f} must be positive, got {getattr(s, f)}")
    if len(s.ratios()) != s.n_layer or any(r not in DS4_RATIOS for r in s.ratios()):
        raise InvalidRequestError(f"compress_ratios {s.ratios()} must list {s.n_layer} values in {DS4_RATIOS}")
    if s.n_expert_used > s.n_expert or s.n_head % s.o_groups or s.rope_dim > min(s.head_dim, s.index_head_dim):
        raise InvalidRequestError("n_expert_used <= n_expert, o_groups | n_head and rope_dim <= head dims required")
    if s.n_hash_layers < 0:
        raise InvalidRequestError(f"n_hash_layers must be >= 0, got {s.n_hash_layers}")
    if any(d % 32 for d in (s.n_embd, s.n_ff_exp, s.q_lora_rank, s.o_lora_rank * s.o_groups,
                            s.n_head * s.head_dim // s.o_groups)):
        raise InvalidRequestError("every matrix row length must be a multiple of 32 (Q8_0 / MXFP4 blocks)")


def qtype_of(spec: DS4Spec, name: str, shape: tuple[int, ...]) -> GT:
    """The type a tensor is stored in (module doc)."""
    k = ds4layout.kind(name)
    if k == "ffn_gate_tid2eid":
        return GT.I32
    return release_qtype(spec, k, shape, ds4layout.FP8, ds4layout.BF16, _F32_2D)


def release_qtype(spec: DS4Spec, kind: str, shape: tuple[int, ...], fp8, bf16, f32_2d) -> GT:
    """The type a tensor of `kind` takes as llama.cpp's converter maps the release checkpoint: routed experts
    `expert_qtype`; 1-D, the `f32_2d` kinds and everything of dense="F32" F32; the checkpoint's FP8 matrices Q8_0,
    its BF16 ones BF16 (the layout's `fp8` / `bf16` kinds); F32 otherwise (deepseek4 and deepseek41 share it)."""
    if kind in ds4layout.EXPERTS:
        return GT[spec.expert_qtype]
    if len(shape) == 1 or kind in f32_2d or spec.dense == "F32":
        return GT.F32
    if kind in fp8:
        return GT.Q8_0
    if kind in bf16:
        return GT.BF16
    return GT.F32


_MXFP4_PER = 1 << 20            # MXFP4 blocks per chunk (17 MiB)


@functools.lru_cache(maxsize=4)
def _mxfp4_tile(seed: int, e0: int) -> np.ndarray:
    """2 x _MXFP4_PER random MXFP4 blocks uint8 [n, 17] (34 MiB, made once per seed and scale): uniform e2m1
    codes (RMS 5.85 in ggml's doubled units), one E8M0 exponent per block in e0-1 .. e0+1 (a binade of jitter).
    Read-only: the writer thread gets views of it."""
    n = 2 * _MXFP4_PER
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, e0, 39])))
    raw = rng.integers(0, 2 ** 64 - 1, size=(n * 17 + 7) // 8, dtype=np.uint64, endpoint=True)
    raw = raw.view(np.uint8)[: n * 17].reshape(n, 17)
    raw[:, 0] = (np.arange(256) % 3 + (e0 - 1)).astype(np.uint8)[raw[:, 0]]     # a gather: no per-block math
    raw.flags.writeable = False
    return raw


def _mxfp4_chunks(rng: np.random.Generator, seed: int, n_blocks: int, std: float) -> Iterator[np.ndarray]:
    """n_blocks random MXFP4 blocks with weights ~std: views of the tile at random block offsets (tiled_chunks),
    so the 27 GB of V4-Flash experts cost no generation, only the write."""
    e0 = 128 + int(round(math.log2(std / 5.85)))      # 2^(e0-128) * 5.85 ~ std
    yield from tiled_chunks(rng, _mxfp4_tile(seed, e0), n_blocks, _MXFP4_PER)


@functools.lru_cache(maxsize=16)
def _bf16_table(seed: int, std: float) -> np.ndarray:
    """65536 pairs of BF16 N(0, std) draws, as uint32 (two bf16 bit patterns each): a random uint16 picks a pair."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, 30])))
    x = rng.standard_normal(2 * 65536).astype(np.float32) * np.float32(std)
    return quants.quantize(x, GT.BF16).view(np.uint16).view(np.uint32)


def _bf16_chunks(rng: np.random.Generator, seed: int, rows: int, cols: int, std: float) -> Iterator[np.ndarray]:
    """A random (rows, cols) BF16 matrix ~N(0, std), row chunks: one table gather per two weights (~15x faster
    than drawing normals and rounding them)."""
    table = _bf16_table(seed, std)
    step = max(1, CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0) * cols
        m = (n + 1) // 2
        idx = rng.integers(0, 2 ** 64 - 1, size=(m + 3) // 4, dtype=np.uint64, endpoint=True).view(np.uint16)[:m]
        yield table.take(idx).view(np.uint16)[:n]


def _distinct_ids(rng: np.random.Generator, rows: int, n: int, k: int) -> np.ndarray:
    """[rows, k] int32: k distinct values of range(n) per row, uniformly (redraws the rows with a repeat;
    an argsort of rows x n randoms when k is not small against n)."""
    if 2 * k > n:
        return np.argsort(rng.random((rows, n)), axis=1)[:, :k].astype(np.int32)
    ids = rng.integers(0, n, size=(rows, k))
    while True:
        s = np.sort(ids, axis=1)
        bad = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not bad.any():
            return ids.astype(np.int32)
        ids[bad] = rng.integers(0, n, size=(int(bad.sum()), k))


def _random_chunks(spec: DS4Spec, name: str, shape: tuple[int, ...], gt: GT, cfg) -> Iterator[np.ndarray]:
    rng, k = tensor_rng(spec, name), ds4layout.kind(name)
    if gt == GT.I32:                                   # tid2eid [V, k]: k distinct experts per token
        V, kk = shape
        yield _distinct_ids(rng, V, cfg.n_expert, kk)
        return
    if len(shape) == 1:
        n = shape[0]
        if k.endswith("norm"):
            yield (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
        elif k.endswith("_scale"):
            yield (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        else:                                          # sinks, hc bases, exp_probs_b
            yield (0.1 * rng.standard_normal(n)).astype(np.float32)
        return
    if k in ("attn_compressor_ape", "indexer_compressor_ape"):
        yield (0.1 * rng.standard_normal(shape)).astype(np.float32)
        return
    if k in ("hc_attn_fn", "hc_ffn_fn", "output_hc_fn"):
        yield (0.02 * rng.standard_normal(shape)).astype(np.float32)
        return
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    std = cols ** -0.5
    if k == "token_embd":
        std = 1.0
    if gt == GT.MXFP4:
        yield from _mxfp4_chunks(rng, spec.seed, rows * cols // 32, std)
    elif gt.name in BLOCK_TYPES:
        yield from matrix_chunks(rng, rows, cols, std, gt.name, seed=spec.seed)
    elif gt == GT.BF16:
        yield from _bf16_chunks(rng, spec.seed, rows, cols, std)
    else:
        yield from matrix_chunks(rng, rows, cols, std, {GT.F32: "F32", GT.Q8_0: "Q8_0"}[gt])


# ---- a calibrated router (gguf/synth_router.py) ---------------------------------------------------------------

_RHO_K = 0.25                  # share of the kernel head's key (= value) energy on its constant rope dims


def _unit(gt: GT) -> tuple[int, int]:
    """(bytes, elements) of one unit of `gt`: an element (F32, BF16, I32) or a block (Q8_0, MXFP4, the K-quants)."""
    elems, size = block_size(int(gt))
    return size, elems


def constant_dim(spec: DS4Spec) -> int:
    """The constant residual channel j of a file with a calibrated router (as qwen3moe's synth.skew_dim)."""
    return int(np.random.default_rng([spec.seed, 7]).integers(spec.n_embd))


def _first(spec: DS4Spec, name: str, shape) -> np.ndarray:
    return next(_random_chunks(spec, name, shape, GT.F32, spec.config()))


def router_plan(spec: DS4Spec):
    """The calibrated-router wiring (synth_router.RouterPlan) of a spec with router_drift > 0, else None.

    The kernel head is layer 0's last query head. Its query (q_b rows reading one q_a row that reads only j) lives
    on the rope dims (interleaved pairs) and is normalised per head; the shared key/value row gets, on its rope
    dims, a constant part of _RHO_K of its energy (attn_kv rows reading only j), so scores depend on the distance
    alone (within the sliding window) while the values keep the tokens' own projections on the other dims. The
    head's non-rope output reaches D through o_lora rows R of its group (the group's last |D| rows) and one-hot
    rows of the output projection; layer 0's attention post-mix is the same for every stream (post rows of
    hc_attn_fn zero, bases 0), so every stream holds the same z and the streams' mixing keeps it."""
    if not spec.router_drift:
        return None
    from betelgeuse.gguf.synth_router import (RouterPlan, drift_gain, kernel_design, kernel_scores, pair_vectors,
                                              pick_dims, SIM_TOKENS)
    hd, rd, j = spec.head_dim, spec.rope_dim, constant_dim(spec)
    nope = hd - rd
    D, N, rng = pick_dims(spec.seed, spec.n_embd, j, min(nope, spec.o_lora_rank, spec.n_embd // 8))
    kn = _first(spec, "blk.0.attn_kv_a_norm.weight", (hd,)).astype(np.float64)
    # score = q.k / sqrt(hd); q (RMS 1 over hd) has all its energy on the rope dims, k the share _RHO_K there:
    # with vectors of RMS 1 over the rd rope dims, score = sum x_i y_i kn_i sqrt(rho hd) / rd cos(Delta theta_i)
    f = math.sqrt(rd / (_RHO_K * hd))
    a = kernel_design(rd, spec.rope_theta, spec.router_window, spec.router_decay, horizon=spec.sliding_window - 1)
    xq, xk, (pq, pk), a_real = pair_vectors(a * f, np.ones(rd // 2), kn[nope::2], rd)
    uq, uk = np.zeros(hd), np.zeros(rd)
    uq[nope::2], uk[0::2] = xq, xk
    uq[nope + 2 * pq + 1] = math.sqrt(rd - (xq ** 2).sum())
    uk[2 * pk + 1] = math.sqrt(rd - (xk ** 2).sum())
    scores = kernel_scores(a_real / f, rd, spec.rope_theta, SIM_TOKENS)
    scores[spec.sliding_window:] = -np.inf
    value_var = (1.0 - _RHO_K) * hd / nope            # per non-rope dim of the normalised key/value row
    proj = np.linalg.qr(rng.standard_normal((nope, nope)))[0][:D.size]
    return RouterPlan(j=j, drift_dims=D, noise_dims=N, head=spec.n_head - 1, head_dim=hd, uq=uq, uk=uk, a=a_real / f,
                      scores=scores, gain=drift_gain(scores) / math.sqrt(value_var), proj=proj)


def _encode(v: np.ndarray, gt: GT) -> np.ndarray:
    """A float row [cols] in `gt`'s bytes [cols / elements per unit, unit bytes]."""
    v = np.asarray(v, np.float32)[None]
    b = v if gt == GT.F32 else quants.quantize(v, gt)
    return np.ascontiguousarray(b).view(np.uint8).reshape(-1, _unit(gt)[0])


def _edited(chunks, gt: GT, cols: int, zero_rows=None, zero_cols=(), set_rows=None, const_col=None):
    """The chunks of a [rows, cols] tensor (any chunking, in order) with edits, applied to copies: zero_rows
    (period, mask [period]): rows r with mask[r % period] all zero; zero_cols: these columns zero (qs bytes for
    Q8_0); const_col (j, value) (F32/BF16); set_rows {row: float [cols]} (rows inside one chunk), last."""
    ub, per = _unit(gt)
    upr = cols // per                                   # units per row
    zc = np.asarray(sorted(zero_cols), np.int64)
    off = 0
    for ch in chunks:
        b = np.array(ch, copy=True)
        u = b.view(np.uint8).reshape(-1, ub)
        n = u.shape[0]
        rows = np.arange(off // upr, (off + n - 1) // upr + 1)
        if zero_rows is not None:
            period, mask = zero_rows
            for r in rows[mask[rows % period]]:
                u[max(0, r * upr - off): max(0, (r + 1) * upr - off)] = 0
        if zc.size:
            idx = rows[:, None] * upr + (zc // per)[None, :] - off
            ok = (idx >= 0) & (idx < n)
            if per == 1:
                u[idx[ok]] = 0
            else:                                       # Q8_0: the column's qs byte
                assert gt == GT.Q8_0, gt
                u[idx[ok], 2 + np.broadcast_to(zc % 32, idx.shape)[ok]] = 0
        if const_col is not None:
            idx = rows * upr + const_col[0] - off
            u[idx[(idx >= 0) & (idx < n)]] = _encode(np.full(1, const_col[1]), gt)[0]
        for r, v in (set_rows or {}).items():
            if rows[0] <= r <= rows[-1]:
                assert r * upr - off >= 0 and (r + 1) * upr - off <= n, "set_rows needs whole rows in a chunk"
                u[r * upr - off:(r + 1) * upr - off] = _encode(v, gt)
        off += n
        yield b


def _calibrated_chunks(spec: DS4Spec, plan, name: str, shape: tuple[int, ...], gt: GT, cfg) -> Iterator[np.ndarray]:
    """A tensor of a file with a calibrated router: the random one with the wiring of router_plan (and synth_router's
    module doc) applied: reserved dims j, D, N never written by a sublayer, layer 0's kernel head, the routers."""
    k = ds4layout.kind(name)
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    base = lambda: _random_chunks(spec, name, shape, gt, cfg)          # noqa: E731
    hd, rd, H, g, ol = spec.head_dim, spec.rope_dim, spec.n_head, spec.o_groups, spec.o_lora_rank
    nope, h, j, D = hd - rd, plan.head, plan.j, plan.drift_dims
    held = np.zeros(spec.n_embd, bool)
    held[list(plan.reserved)] = True
    gs, hh = h // (H // g), h % (H // g)                 # the head's group, its index inside the group
    R = np.arange(ol - D.size, ol)                        # the group's o_lora rows that carry z
    cols, E = shape[-1], spec.n_expert
    if k == "token_embd":
        yield from _edited(base(), gt, cols, zero_cols=D, const_col=(j, 1.0))
    elif k in ("attn_norm", "ffn_norm"):
        w = next(base()).copy()
        w[held] = 1.0                                     # the reserved dims pass the norms unscaled
        yield w
    elif k == "attn_sinks" and layer == 0:
        w = next(base()).copy()
        w[h] = -30.0                                      # the kernel head puts no weight on its sink
        yield w
    elif k == "hc_attn_fn" and layer == 0:
        w = next(base()).copy()
        w[spec.hc_mult:2 * spec.hc_mult] = 0.0            # layer 0's attention post-mix: the same for every stream
        yield w
    elif k == "hc_attn_base" and layer == 0:
        w = next(base()).copy()
        w[spec.hc_mult:2 * spec.hc_mult] = 0.0
        yield w
    elif k == "attn_q_a" and layer == 0:
        v = np.zeros(cols, np.float32)
        v[j] = 1.0
        yield from _edited(base(), gt, cols, set_rows={shape[0] - 1: v})
    elif k == "attn_q_b" and layer == 0:
        rows = {}
        for r in range(hd):
            v = np.zeros(cols, np.float32)
            v[cols - 1] = plan.uq[r]                      # reads only q_a's last row (the constant)
            rows[h * hd + r] = v
        yield from _edited(base(), gt, cols, set_rows=rows)
    elif k == "attn_kv":
        rows = {}
        if layer == 0:
            kappa = math.sqrt(_RHO_K / (1 - _RHO_K) * nope / rd)
            for r in range(rd):
                v = np.zeros(cols, np.float32)
                v[j] = kappa * plan.uk[r]
                rows[nope + r] = v
        yield from _edited(base(), gt, cols, zero_cols=np.r_[j, D], set_rows=rows)
    elif k == "attn_output_a" and layer == 0:
        rows = {}
        for i, r in enumerate(R):
            v = np.zeros(cols, np.float32)
            v[hh * hd: hh * hd + nope] = plan.gain * plan.proj[i]
            rows[gs * ol + int(r)] = v
        yield from _edited(base(), gt, cols, zero_cols=np.arange(hh * hd, (hh + 1) * hd), set_rows=rows)
    elif k == "attn_output_b":
        rows, zc = {}, ()
        if layer == 0:
            zc = gs * ol + R
            for i, d in enumerate(D):
                v = np.zeros(cols, np.float32)
                v[gs * ol + R[i]] = 1.0
                rows[int(d)] = v
        yield from _edited(base(), gt, cols, zero_rows=(spec.n_embd, held), zero_cols=zc, set_rows=rows)
    elif k in ("ffn_down_shexp", "ffn_down_exps"):
        yield from _edited(base(), gt, cols, zero_rows=(spec.n_embd, held))
    elif k == "ffn_gate_inp":
        rng = tensor_rng(spec, name)
        c = -np.log1p(rng.permutation(E).astype(np.float64))
        w = plan.router(E, spec.n_embd, spec.router_skew, spec.router_drift, spec.router_scale, 1.0, c - c.mean(), rng)
        yield w if gt == GT.F32 else quants.quantize(w, gt)
    elif k == "exp_probs_b":
        yield np.zeros(shape, np.float32)                 # popularity comes through j, in the logits
    elif k == "ffn_gate_tid2eid":                         # hash layers: k experts per token, drawn with popularity
        rng = tensor_rng(spec, name)
        c = -np.log1p(rng.permutation(E).astype(np.float64))
        key = spec.router_skew * c[None, :] + rng.gumbel(size=(shape[0], E))
        yield np.argsort(-key, axis=1)[:, :shape[1]].astype(np.int32)
    else:
        yield from base()


def _source_chunks(arr, gt: GT) -> Iterator[np.ndarray]:
    if gt.name in BLOCK_TYPES:
        raise InvalidRequestError(f"real weights cannot be written as {gt.name} (gguf-py has no quantizer for it)")
    a = np.ascontiguousarray(arr)
    if gt == GT.I32:
        yield a.astype(np.int32)
    elif gt == GT.F32:
        yield a.astype(np.float32)
    else:
        yield quants.quantize(a.astype(np.float32), gt)


def tensor_plan(spec: DS4Spec, source: Callable[[str], np.ndarray] | None = None):
    """(name, torch shape, type, chunk generator) for every tensor, in llama.cpp's order."""
    cfg = spec.config()
    rp = router_plan(spec) if source is None else None
    plan = []
    for name, shape in ds4layout.tensors(cfg):
        gt = qtype_of(spec, name, shape)
        if rp is not None:
            gen = (lambda n=name, s=shape, g=gt: _calibrated_chunks(spec, rp, n, s, g, cfg))
        elif source is None:
            gen = (lambda n=name, s=shape, g=gt: _random_chunks(spec, n, s, g, cfg))
        else:
            gen = (lambda n=name, s=shape, g=gt: _source_chunks(source(n), g))
        plan.append((name, shape, gt, gen))
    return plan


def add_metadata(w: GGUFWriter, spec: DS4Spec, tokenizer: bool = True, name: str | None = None) -> None:
    """The keys llama.cpp's converter writes for DeepseekV4ForCausalLM (plus a small tokenizer), under the writer's
    architecture prefix (deepseek41 files share them)."""
    s, a = spec, w.arch
    w.add_name(name or f"betelgeuse-synth-{'ds4' if a == ARCH else a}-{s.n_layer}L-{s.n_expert}x{s.n_ff_exp}-"
                       f"{s.expert_qtype}")
    w.add_file_type(MOSTLY_MXFP4_MOE if s.expert_qtype == "MXFP4" else BLOCK_TYPES.get(s.expert_qtype)
                    or (0 if s.dense == "F32" else 7))
    w.add_quantization_version(2)
    w.add_block_count(s.n_layer)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(1)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    if s.rope_factor != 1.0:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", s.rope_factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", s.rope_orig_ctx)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", s.yarn_beta_fast)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", s.yarn_beta_slow)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_uint32(f"{a}.expert_gating_func", 4)                      # SQRTSOFTPLUS
    w.add_uint32(f"{a}.rope.dimension_count", s.rope_dim)
    w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_uint32(f"{a}.expert_shared_count", s.n_shared)
    w.add_float32(f"{a}.expert_weights_scale", s.routed_scale)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(s.swiglu_limit)] * s.n_layer)
    w.add_array(f"{a}.swiglu_clamp_shexp", [float(s.swiglu_limit)] * s.n_layer)
    w.add_uint32(f"{a}.attention.indexer.head_count", s.index_n_heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", s.index_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", s.index_topk)
    w.add_uint32(f"{a}.attention.output_group_count", s.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", s.o_lora_rank)
    w.add_array(f"{a}.attention.compress_ratios", list(s.ratios()))
    w.add_float32(f"{a}.attention.compress_rope_freq_base", s.compress_rope_theta)
    w.add_uint32(f"{a}.hyper_connection.count", s.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", s.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", s.hc_eps)
    w.add_uint32(f"{a}.hash_layer_count", s.hash_layers())
    w.add_uint32(f"{a}.embedding_length_out", s.n_embd * s.hc_mult)
    w.add_uint32("betelgeuse.synth.seed", s.seed)
    rp = router_plan(s)
    if rp is not None:
        from betelgeuse.gguf.synth_router import add_router_metadata
        w.add_float32("betelgeuse.synth.router_skew", s.router_skew)
        w.add_uint32("betelgeuse.synth.skew_dim", rp.j)
        add_router_metadata(w, s, rp, gate="sqrtsoftplus")
    if tokenizer:
        add_tokenizer(w, s.n_vocab, s.chat_template)


def write_deepseek4(path: str | os.PathLike, spec: DS4Spec, source: Callable[[str], np.ndarray] | None = None,
                    progress: bool = True) -> None:
    """Write `spec` at `path`; `source(gguf_name)` -> float32 array (torch shape; int for tid2eid) supplies
    the weights instead of the random generator."""
    validate(spec)
    write_gguf(path, ARCH, tensor_plan(spec, source), lambda w: add_metadata(w, spec), progress)


def model_nbytes(spec: DS4Spec) -> int:
    return sum(nbytes(shape, gt) for _, shape, gt, _ in tensor_plan(spec))
