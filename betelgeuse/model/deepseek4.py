"""The DeepSeek-V4 (`deepseek4`) forward pass in torch, split into the pieces the out-of-core engine drives.

The MoEModel surface of model/interface.py (embed / attention_block / moe_input / route / moe_output / logits,
new_cache, check_ids, expert_act); `Deepseek4Reference` adds experts dequantized on demand from the file and
runs the whole pass in-process (the oracle test compares it with transformers 5.24 `deepseek_v4`).

Math (research note §1, transformers `modeling_deepseek_v4.py`, llama.cpp `src/models/deepseek4.cpp`):
  residual X [T, hc, D]: hc = 4 streams (mHC), the embedding copied into each
  per sublayer: post, comb, u = hc_pre(X)            (fp32, Sinkhorn-normalised comb)
                X = post * f(norm(u)) + comb^T X
  attention f: one shared K=V head of head_dim, per-head unweighted q norm, interleaved RoPE on the last
    rope_dim dims (theta rope_theta on sliding layers; compress_rope_theta + YaRN on compressed layers),
    keys = the sliding window (t-window+1..t) plus compressed entries: ratio 4 (CSA: overlapping
    compressor, lightning-indexer top-k) or ratio 128 (HCA: all visible entries); per-head sinks; the
    output de-rotated at the query position, grouped low-rank output projection.
  MoE f: sqrt(softplus(router)) scores; top-k of scores + bias (or tid2eid[token] on hash layers);
    weights renormalised x routed_scale; SwiGLU experts with clamps; plus the shared expert.
  head: hc collapse (sigmoid mix, no Sinkhorn), RMSNorm, output.

Cache state per layer (`DS4Cache`), in fixed shapes sized for the sequence's max_len: the K=V rows of the last
`window` positions (a ring), and per compressor (attention's and the indexer's) the projected rows of the open
window (CSA: and of the previous one, whose first half the next entry pools) and the compressed entries. A decode
step (one token) runs the static form: the position on the device, every shape fixed, so it is graph-capturable
(worker/decode_graphs.py, worker/lanes.py); a longer pass runs the prefill form, in position-aligned chunks (model/
chunks.py), each from its layer's own length (DS4Cache.fed). Decode and chunked prefill equal a whole-prompt prefill
within float noise (tests/model/test_deepseek4_oracle.py); a prefill resumed at a chunk boundary equals the unbroken
one bit for bit (tests/model/test_deepseek4_resume.py), which is what the prefix cache's snapshots of the whole
state rest on (snapshot / restore, DS4Cache.mark: worker/snapshot_cache.py).

The per-row math goes through `ops`: TorchOps here (the CPU path, exact against transformers), the fused Triton
kernels of kernels/triton_ds4.py on CUDA (a few launches per layer instead of hundreds: the Sinkhorn iterations of
mHC alone were ~120 small ops per sublayer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from betelgeuse.errors import InvalidRequestError, ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds4layout
from betelgeuse.kernels import dense
from betelgeuse.kernels.torch_moe import expert_ffn
from betelgeuse.model.kv_cache import _UIDS, grow_rows
from betelgeuse.model.layers import check_token_ids
from betelgeuse.model.reference import ReferenceExperts
from betelgeuse.routing_approx import Residency, approx_hash, approx_topk
from betelgeuse.settings import AUTO

QUERY_CHUNK = ds4layout.QUERY_CHUNK   # attention queries per block (bounds the score tensor; attention_block)



def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with statistics in float32; weight (float32) applied in float32 (as HF)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf if w is None else w.float() * xf).to(x.dtype)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass(slots=True)
class InterleavedRope:
    """Interleaved-pair RoPE (pairs (2i, 2i+1)) on the last 2*len(inv_freq) dims of a head."""
    inv_freq: torch.Tensor          # [rope_dim/2] float32
    pairs: torch.Tensor = field(init=False)     # [rope_dim] float32: each inverse frequency twice (for its pair)

    def __post_init__(self):
        self.pairs = self.inv_freq.repeat_interleave(2)

    @classmethod
    def plain(cls, dim: int, theta: float, device) -> "InterleavedRope":
        return cls((1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device))

    @classmethod
    def yarn(cls, dim: int, theta: float, factor: float, orig_ctx: int, beta_fast: float, beta_slow: float,
             device) -> "InterleavedRope":
        """transformers' _compute_yarn_parameters (truncate=True), op for op; the attention factor is 1
        (DeepSeek-V4 applies no YaRN mscale; llama.cpp cancels ggml's with dsv4_rope_attn_factor)."""
        def corr_dim(rot):
            return (dim * math.log(orig_ctx / (rot * 2 * math.pi))) / (2 * math.log(theta))
        low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        ext_factor = 1 - ramp
        return cls((inter * (1 - ext_factor) + extra * ext_factor).to(device))

    def cos_sin(self, positions: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope_dim] float32 (each angle repeated for its pair; out [2, T, rope_dim]:
        written there). Three kernels: the angles are float32(p) * inv_freq, each computed for both of its pair's
        dims (the same bits as computing it once and repeating it)."""
        pairs = self.pairs
        if out is None:
            out = torch.empty((2, positions.shape[0], pairs.shape[0]), dtype=torch.float32, device=pairs.device)
        freqs = positions[:, None] * pairs[None, :]    # int64 x float32: the position cast to float32 in the kernel
        return torch.cos(freqs, out=out[0]), torch.sin(freqs, out=out[1])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d] with cos/sin [T, r] -> x with its last r dims rotated (in float32, as HF)."""
    r = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-r], x[..., -r:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + rot.float() * sin).to(x.dtype)], dim=-1)


# ---- per-sequence state: fixed shapes sized for max_len ---------------------------------------------

@dataclass(slots=True)
class CompState:
    """One compressor's state (attention's or the indexer's) in one layer, in fixed shapes."""
    kv: torch.Tensor                # [R, C] projected rows of the last R positions: position p at row p % R
    gate: torch.Tensor              # [R, C] (R = 2 x ratio for the overlapping ratio-4 windows, ratio for 128)
    entries: torch.Tensor           # [ceil(max_len / ratio), d] entry w (tokens w*ratio..) at row w; the rows of
                                    # windows not yet closed are scratch (the static decode writes them each step)
    ratio: int                      # tokens per entry (4 or 128)


@dataclass(slots=True)
class LayerState:
    swa: torch.Tensor                # [window, head_dim] K=V ring: position p at row p % window
    comp: CompState | None = None
    idx: CompState | None = None


@dataclass(slots=True, kw_only=True)
class CompressedCache:
    """begin / begin_static / commit / truncate of a sequence state with compressed entries (DS4Cache, deepseek41's
    DS41Cache): `length` tokens consumed, `max_len` the limit, `_pending` the tokens of the pass in flight, `device`,
    `pos` the static form's position [1] on the device.

    A prefill pass runs in position-aligned chunks, each layer chunk after chunk (model/chunks.py): `fed[l]` counts
    the tokens of the pass in flight that layer l has consumed, so a chunk starts at length + fed[l] (`chunk_done`
    after each). mark(n): the pass whose chunk ends at n keeps each layer's state as it stood there (`marked`, and
    `mark_host`: host-side state at n, deepseek41's Engram history), take_mark() -> the StateSnapshot: the prefix
    cache's checkpoint of a prompt (worker/snapshot_cache.py). A subclass gives n_layers, used(l, n) (views of layer
    l's tensors holding something after n prefilled tokens) and host_state() / set_host_state()."""
    _pending: int = field(default=0, repr=False)
    # identity of the state's tensors for captured decode graphs: kept by reset(), new when the tensors are (grow)
    uid: int = field(default_factory=lambda: next(_UIDS))
    pos: torch.Tensor | None = field(default=None, repr=False)  # [1] int64 on the device (begin_static)
    fed: list[int] = field(default_factory=list, repr=False)    # per layer: tokens of the pass in flight consumed
    mark_at: int | None = field(default=None, repr=False)       # mark(n): the tokens after which to copy the state
    marked: list | None = field(default=None, repr=False)       # per layer: its tensors copied at mark_at (or None)
    mark_host: object = field(default=None, repr=False)         # host_state() at mark_at (deepseek41: its Engram history)
    arch = "deepseek4"

    def begin(self, n_tokens: int) -> torch.Tensor:
        if self.length + n_tokens > self.max_len:
            raise InvalidRequestError(
                f"sequence of {self.length + n_tokens} tokens exceeds the cache of {self.max_len} tokens")
        self._pending = n_tokens
        self.fed = [0] * self.n_layers
        return torch.arange(self.length, self.length + n_tokens, device=self.device)

    def begin_static(self) -> torch.Tensor:
        """A one-token pass in the static form: the position in a device tensor [1] (`pos`) updated in place."""
        if self.length + 1 > self.max_len:
            raise InvalidRequestError(f"sequence of {self.length + 1} tokens exceeds the cache of {self.max_len} tokens")
        if self.pos is None:
            self.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.pos.fill_(self.length)
        self._pending = 1
        return self.pos

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
        self.fed = []

    def truncate(self, n: int) -> None:
        """Only a no-op or a full reset: compressed state cannot be rewound to an arbitrary prefix."""
        if n == self.length:
            self._pending = 0
            return
        raise UnsupportedError(f"a {self.arch} cache cannot be truncated from {self.length} to {n} tokens")

    def reset(self) -> None:
        """Back to a fresh state's bits (every tensor zero: prefill writes only closed windows' entries, the rest must
        be a fresh state's zeros; no token, no mark) in the same tensors, `pos` and uid: a released state recycled for
        a new sequence replays the decode graphs captured over it (worker/runner.py new_cache)."""
        torch._foreach_zero_(self.tensors())
        self.length, self._pending, self.fed = 0, 0, []
        self.mark_at = self.marked = self.mark_host = None

    def host_state(self):
        """Host-side state a snapshot carries besides the layers' tensors (None: none)."""
        return None

    def set_host_state(self, host) -> None:
        assert host is None, "a snapshot of another architecture"

    def snapshot_nbytes(self, n: int) -> int:
        """Device bytes of a snapshot after n prefilled tokens (known before the pass that would take it)."""
        return sum(t.numel() * t.element_size() for l in range(self.n_layers) for t in self.used(l, n))

    def snapshot_layer(self, l: int, n: int) -> tuple[torch.Tensor, ...]:
        """A copy of layer l's state after n prefilled tokens (StateSnapshot.layers' item)."""
        return tuple(t.clone() for t in self.used(l, n))

    def chunk_done(self, l: int, start: int, T: int) -> None:
        """Layer l consumed a prefill chunk of T tokens from `start`: count it; keep its state if the mark is there."""
        self.fed[l] += T
        if self.mark_at == start + T:
            self.marked[l] = self.snapshot_layer(l, self.mark_at)

    def mark(self, n: int) -> None:
        """Keep a copy of the state as it stands after n tokens (n > length: taken by the pass whose chunk ends
        there; n == length: now)."""
        assert n >= self.length and self._pending == 0, (n, self.length, self._pending)
        self.mark_at, self.marked, self.mark_host = n, [None] * self.n_layers, None
        if n == self.length:
            self.marked = [self.snapshot_layer(l, n) for l in range(self.n_layers)]
            self.mark_host = self.host_state()

    def take_mark(self):
        """The StateSnapshot mark() asked for, once every layer has passed it (else None: not yet, or no chunk
        ended there); the mark is dropped when it is taken."""
        from betelgeuse.model.interface import StateSnapshot
        if self.mark_at is None or self.length < self.mark_at:
            return None
        snap = (StateSnapshot(self.mark_at, self.marked, self.mark_host)
                if all(m is not None for m in self.marked) else None)
        self.mark_at = self.marked = self.mark_host = None
        return snap


@dataclass(slots=True)
class DS4Cache(CompressedCache):
    """A sequence's deepseek4 state in fixed shapes (model/interface.py SequenceState): nothing changes shape per
    token, so a decode step is graph-capturable; `pos` is the static decode's position on the device. Chunked
    prefill (`fed`) and the prefix cache's mark: CompressedCache."""
    layers: list[LayerState]
    max_len: int                     # tokens
    length: int = 0                  # tokens every layer has consumed

    @property
    def device(self) -> torch.device:
        return self.layers[0].swa.device

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def used(self, l: int, n: int) -> list[torch.Tensor]:
        """Views of layer l's state tensors holding something after n prefilled tokens: the window ring, each
        compressor's open-window rows and its n // ratio closed entries (the rest of a prefilled state is zeros, as
        a fresh one's: prefill writes only closed windows' entries)."""
        s = self.layers[l]
        ts = [s.swa]
        for c in (s.comp, s.idx):
            if c is not None:
                ts += [c.kv, c.gate, c.entries[:n // c.ratio]]
        return ts

    def tensors(self) -> list[torch.Tensor]:
        ts = []
        for s in self.layers:
            ts.append(s.swa)
            for c in (s.comp, s.idx):
                if c is not None:
                    ts += [c.kv, c.gate, c.entries]
        return ts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class _RopeTables:
    """Both RoPE tables at a pass's positions (float32 [T, rope_dim] cos/sin each), computed once per positions
    tensor (every layer of a pass, and every lane graph of a batched decode, passes the same one); reset() per pass.
    cos_sin(positions, dtype) -> ((cos, sin) main, (cos, sin) compressed); the dtype is unused (RoPE in float32)."""

    __slots__ = ("main", "comp", "_memo")

    def __init__(self, main: InterleavedRope, comp: InterleavedRope):
        self.main, self.comp, self._memo = main, comp, {}

    def reset(self):
        self._memo = {}

    def cos_sin(self, positions: torch.Tensor, dtype=None, out: torch.Tensor | None = None):
        """out [4, T, rope_dim] float32: the tables written there (main cos, sin, compressed cos, sin: the batched
        decode lanes' table buffer, worker/lanes.py, so they need no stacking)."""
        hit = self._memo.get(id(positions))
        if hit is not None and hit[0] is positions and (out is None or hit[1][0][0].data_ptr() == out.data_ptr()):
            return hit[1]
        if out is None:
            out = torch.empty((4, positions.shape[0], 2 * self.main.inv_freq.shape[0]), dtype=torch.float32,
                              device=self.main.inv_freq.device)
        out = (self.main.cos_sin(positions, out[:2]), self.comp.cos_sin(positions, out[2:]))
        self._memo[id(positions)] = (positions, out)
        return out


# ---- the model ------------------------------------------------------------------------------------

@dataclass(slots=True)
class GuessStack:
    """The per-layer tensors a decode guess reads (worker/guess.py), each stacked over all layers in one contiguous
    tensor [n_layer, ...], so that layers l+1..l+D are one contiguous slice (one launch for all of them: the mHC mix
    rows of D layers in one partial pass, their routers in one batched matmul). The model's own per-layer names
    are views of these (stack_guess: no extra memory). bias holds zeros on hash layers (no bias); tid2eid: the hash
    layers' tables (their guess is exact: the token's row)."""
    fn: torch.Tensor            # [L, M, hc*D] hc_ffn_fn (M = (2 + hc) * hc), float32
    base: torch.Tensor          # [L, M] hc_ffn_base
    scale: torch.Tensor         # [L, 3] hc_ffn_scale
    norm: torch.Tensor          # [L, D] ffn_norm
    router: torch.Tensor        # [L, E, D] ffn_gate_inp
    bias: torch.Tensor          # [L, E] exp_probs_b (0 on hash layers)
    tid2eid: torch.Tensor       # [n_hash, V, k] int64 ffn_gate_tid2eid


def stack_guess(w: dict, n_layer: int, n_hash: int) -> GuessStack:
    """Stack the guess's per-layer tensors of w (GuessStack) and re-point w's names to views of the stacks: the same
    bytes as before (the loaded copies are dropped), so the VRAM plan's dense figure stays true. Run at load,
    before anything (a captured graph) holds the old tensors."""
    def stack(name: str, n: int = n_layer) -> torch.Tensor:
        first = w[f"blk.0.{name}"]
        st = first.new_empty((n, *first.shape))
        for l in range(n):                   # each loaded copy dropped as soon as it is in: peak one layer over
            st[l] = w[f"blk.{l}.{name}"]
            w[f"blk.{l}.{name}"] = st[l]
        return st

    E = w["blk.0.ffn_gate_inp.weight"].shape[0]
    dev = w["blk.0.ffn_gate_inp.weight"].device
    bias = torch.zeros((n_layer, E), dtype=torch.float32, device=dev)
    for l in range(n_hash, n_layer):
        b = f"blk.{l}.exp_probs_b.bias"
        bias[l] = w[b]
        w[b] = bias[l]
    st = GuessStack(fn=stack("hc_ffn_fn.weight"), base=stack("hc_ffn_base.weight"),
                    scale=stack("hc_ffn_scale.weight"), norm=stack("ffn_norm.weight"),
                    router=stack("ffn_gate_inp.weight"), bias=bias,
                    tid2eid=stack("ffn_gate_tid2eid.weight", min(n_hash, n_layer)) if n_hash else
                    torch.zeros((0, 1, 1), dtype=torch.int64, device=dev))
    if dev.type == "cuda":
        torch.cuda.empty_cache()             # the dropped per-layer copies back to the device, not the allocator's cache
    return st


class Deepseek4Model:
    # capabilities (model/interface.py). Prefill runs in position-aligned chunks, each from the layer's own length
    # (DS4Cache.fed), so a prompt resumed after a chunk boundary gets the bits of one unbroken prefill; the state is
    # not per token (compressed entries pool 4/128 tokens, a ring holds the window), so a prefix is reused whole:
    # a snapshot of every layer's state at a chunk boundary or after the whole prompt. Decode has the static
    # form (the state in fixed shapes, the position on the device; every one-token pass runs it, eager or captured),
    # and batched decode runs the row-wise part over fixed lanes (worker/lanes.py)
    chunked_prefill = True
    prefix_reuse = "snapshots"
    static_decode = True
    lane_decode = True
    state_grows = True
    # decode guesses 3 layers ahead (`prefetch_depth` auto): depths 1-3 decoded equally fast within the disk's noise
    # on ds4-flash (deploy/device/guess_ab.py), 3 the depth its serve runs were measured at
    guess_depth = 3
    # a depth's guesses are read ahead while at least 70% of them hit (`prefetch_min_hit` auto): on ds4-flash with 64
    # experts (deploy/device/guess_ab.py, gpu-run44-ds4, H100, depth 3, 2 rounds of 32 tokens) 0.5 decoded 5.47 tok/s
    # reading 55.8 MB a token ahead for nothing, 0.7 7.51 tok/s and 20.1 MB, 0.9 7.58 tok/s and 13.2 MB (recall 65% ->
    # 46%): depth 1 hits 81%, depths 2-3 44%; the logits are the same bits at every bar
    guess_min_hit = 0.7
    # prefill chunk (`prefill_chunk` auto): 256 tokens. The front runs chunk by chunk, per layer, each chunk launching
    # its kernels again: on the H200 a 600-token miss of ds4-tiny took 29.7 ms in one pass, 120.8 ms in 10 chunks of
    # 64, 458 ms in 38 of 16 (~12 ms a chunk; deepseek41 135 / 309 / 915 ms: docs/benchmarks/gpu-run38-ds4), so the
    # chunk count is the cost. The chunk is also the checkpoint grid of the snapshot cache (worker/snapshot_cache.py):
    # an agent's next turn re-prefills what its previous prompt had past its last boundary (< 256 tokens: within one
    # chunk of the pass, which costs about one chunk's launches whatever its length), and an identical prompt hits its
    # whole-prompt entry at any length. 256 = two attention query blocks (QUERY_CHUNK 128) and a multiple of the
    # compression ratios (4, 128), and max_batched_tokens' default (512) holds two chunks
    # (deploy/device/check_ds4.py --only prefix times 64 / 128 / 256 / 512 beside one pass)
    prefill_chunk = 256

    def __init__(self, cfg, dense: dict[str, torch.Tensor]):
        assert cfg.ds4 is not None, cfg.arch         # deepseek4, or deepseek41 (model/deepseek41.py subclasses)
        self.cfg, self.p = cfg, cfg.ds4
        self.w = dense
        # margins: a list to record, per discrete choice, (layer, "experts"|"indexer", min gap) between the
        # k-th and (k+1)-th candidate (tests assert choices are far from ties); None = off
        self.margins: list | None = None
        self.device = dense[ds4layout.TOKEN_EMBD].device
        self.dtype = dense[ds4layout.TOKEN_EMBD].dtype
        p = self.p
        self.rope_main = InterleavedRope.plain(p.rope_dim, cfg.rope_theta, self.device)
        if p.rope_scaling == "yarn":
            self.rope_comp = InterleavedRope.yarn(p.rope_dim, p.compress_rope_theta, p.rope_factor, p.rope_orig_ctx,
                                       p.yarn_beta_fast, p.yarn_beta_slow, self.device)
        else:
            self.rope_comp = InterleavedRope.plain(p.rope_dim, p.compress_rope_theta, self.device)
        self.rope = _RopeTables(self.rope_main, self.rope_comp)
        if len(set(p.swiglu_limit)) != 1:
            raise UnsupportedError(f"{cfg.name}: per-layer swiglu_clamp_exp values {sorted(set(p.swiglu_limit))} "
                                   "differ, which is not supported")
        for l in range(min(p.n_hash_layers, cfg.n_layer)):
            t = self.w[f"blk.{l}.ffn_gate_tid2eid.weight"]
            if int(t.min()) < 0 or int(t.max()) >= cfg.n_expert:
                raise ModelFormatError(f"{cfg.name}: blk.{l}.ffn_gate_tid2eid holds expert ids outside 0..{cfg.n_expert - 1}")
        # CUDA: the fused Triton kernels of kernels/triton_ds4.py for the per-row math (mHC, norms + RoPE, the
        # compressor's step, the static attention, the routing); the CPU keeps the torch reference below
        self.ops = ops_for(self.device)
        self.ops.prepare(self.w, cfg.n_layer)
        self.guess_stack = stack_guess(self.w, cfg.n_layer, p.n_hash_layers)
        self._hash_host = None                # hash_table's host copy, made at its first call

    @classmethod
    def load_dense(cls, f, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Every non-expert tensor dequantized on `device`: matrices in `dtype`, norms/mHC/sinks/ape/bias in
        float32, tid2eid as int64."""
        out = {}
        for name, _ in ds4layout.tensors(f.config):
            k = ds4layout.kind(name)
            if k in ds4layout.EXPERTS:
                continue
            if k == "ffn_gate_tid2eid":
                out[name] = f.load_tensor(name, device, torch.int64)
            else:
                out[name] = f.load_tensor(name, device, torch.float32 if k in ds4layout.FP32_KINDS else dtype)
        return out

    def hash_table(self) -> np.ndarray | None:
        """The hash-routed layers' tables on the host, [n_hash, V, k] int16 (an expert id per (layer, token, rank):
        3 x 129,280 x 6 x 2 bytes = 4.7 MB for V4-Flash), made once; None without hash layers. A decode step knows
        its tokens before layer 0 runs, so the worker starts these layers' disk reads at once (MoEStep.hash_ahead)."""
        t = self.guess_stack.tid2eid
        if not t.shape[0]:
            return None
        if self._hash_host is None:
            self._hash_host = t.to("cpu", torch.int16).numpy()
        return self._hash_host

    # -- the MoEModel surface (model/interface.py) --

    @property
    def expert_act(self) -> tuple[str, float | None]:
        return "swiglu", float(self.p.swiglu_limit[0])

    def new_cache(self, max_len: int) -> DS4Cache:
        """The state of one sequence of up to max_len tokens, every tensor allocated now (ds4layout.state_bytes)."""
        assert max_len > 0, max_len
        hd, dev, dt, p = self.cfg.head_dim, self.device, self.dtype, self.p

        def comp(ratio: int, d: int) -> CompState:
            rows, c = ds4layout.comp_rows(ratio), (2 if ratio == 4 else 1) * d
            return CompState(kv=torch.zeros(rows, c, device=dev, dtype=dt), gate=torch.zeros(rows, c, device=dev, dtype=dt),
                             entries=torch.zeros(-(-max_len // ratio), d, device=dev, dtype=dt), ratio=ratio)

        layers = []
        for r in p.compress_ratios:
            s = LayerState(swa=torch.zeros(p.sliding_window, hd, device=dev, dtype=dt))
            if r:
                s.comp = comp(r, hd)
                if r == 4:
                    s.idx = comp(r, p.index_head_dim)
            layers.append(s)
        return DS4Cache(layers=layers, max_len=max_len)

    def grow_cache(self, cache: DS4Cache, max_len: int, via_host: bool = False) -> DS4Cache:
        """The state of up to max_len tokens holding cache's (consumed): only the compressed entries have a length
        ([ceil(max_len / ratio), d], rows past the old ones zeros like a fresh state's; kv_cache.grow_rows); the
        window rings and the open windows' rows move over as they are. A new uid (graphs captured over the old
        tensors must not replay over these)."""
        assert max_len >= cache.max_len and cache._pending == 0, (max_len, cache.max_len, cache._pending)

        def grown(c: CompState | None, ratio: int) -> CompState | None:
            if c is None:
                return None
            box, c.entries = [c.entries], None
            return CompState(kv=c.kv, gate=c.gate, entries=grow_rows(box, 0, -(-max_len // ratio), 0, via_host),
                             ratio=ratio)

        layers = []
        for i, (s, r) in enumerate(zip(cache.layers, self.p.compress_ratios)):
            layers.append(LayerState(swa=s.swa, comp=grown(s.comp, r), idx=grown(s.idx, r)))
            cache.layers[i] = None
        return DS4Cache(layers=layers, max_len=max_len, length=cache.length)

    def snapshot(self, cache: CompressedCache):
        """A copy of the consumed state (a StateSnapshot of cache.length tokens, on its device): right after a
        prefill, before any decode step writes an open window's entry."""
        from betelgeuse.model.interface import StateSnapshot
        assert cache._pending == 0, cache._pending
        n = cache.length
        return StateSnapshot(n, [cache.snapshot_layer(l, n) for l in range(cache.n_layers)], cache.host_state())

    def restore(self, cache: CompressedCache, snap) -> None:
        """Copy a snapshot into a fresh state (length 0, room for its tokens): it then holds the snapshot's bits."""
        assert cache.length == 0 and cache._pending == 0 and snap.length <= cache.max_len, (cache.length, snap.length)
        for l, ts in zip(range(cache.n_layers), snap.layers, strict=True):
            for dst, src in zip(cache.used(l, snap.length), ts, strict=True):
                dst.copy_(src)
        cache.set_host_state(snap.host)
        cache.length = snap.length

    def check_ids(self, ids) -> torch.Tensor:
        return check_token_ids(ids, self.cfg.n_vocab, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> X [T, hc, D]: the embedding copied into each residual stream. Starts a pass (RoPE tables)."""
        self.rope.reset()
        # one gather from the table seen as [V, hc, D] (each row repeated, a view): the copy per stream in it
        e = self.w[ds4layout.TOKEN_EMBD]
        return e.unsqueeze(1).expand(-1, self.p.hc_mult, -1).index_select(0, ids.to(self.device))

    def _hc_pre(self, X: torch.Tensor, l: int, s: str):
        """X [T, hc, D] -> post [T, hc], comb [T, hc, hc] (float32), h [T, D] = RMSNorm_w(sum_j pre_j X_j) (X's
        dtype; w = the sublayer's attn_norm / ffn_norm)."""
        b = f"blk.{l}."
        fn, base, scale = (self.w[f"{b}hc_{s}_{k}.weight"] for k in ("fn", "base", "scale"))
        norm = self.w[b + ("attn_norm.weight" if s == "attn" else "ffn_norm.weight")]
        return self.ops.hc_pre(X, fn, base, scale, norm, self.p.hc_sinkhorn_iters, self.p.hc_eps, self.cfg.rms_eps)

    def attention_block(self, layer: int, x: torch.Tensor, cache: DS4Cache, positions: torch.Tensor,
                        static: bool = False) -> torch.Tensor:
        """X [T, hc, D] -> X after the attention sublayer; consumes T tokens of this layer's cache state.
        One token (T = 1, positions [1] on the device: a decode step) always runs the static form
        (attend_static: fixed shapes, graph-capturable), so eager and captured decode steps and the reference's
        decode are the same ops; longer passes run the prefill form (_attend_prefill)."""
        carry, rows = self.lane_rows(layer, x, positions)
        if x.shape[0] == 1:
            o = self.attend_static(layer, rows, cache, positions)
            if cache.fed:                                   # a prompt's one-token chunk
                cache.chunk_done(layer, cache.length + cache.fed[layer], 1)
        else:
            assert not static, "the static form is one token"
            start = cache.length + cache.fed[layer]         # this layer's chunks so far in the pass
            o = self._attend_prefill(layer, rows, cache, positions, start)
            cache.chunk_done(layer, start, x.shape[0])
        return self.attn_out(layer, carry, o)

    # -- the attention sublayer in three parts (LaneDecode: worker/lanes.py runs lane_rows / attn_out over the rows
    #    of every running sequence at once and attend_static per sequence) --

    # lane_rows' rows are all lane-first [T, ...]: the lanes copy a layer's rows in one launch per dtype (worker/lanes.py)
    LANE_ROWS_FIRST = True
    # rope.cos_sin(positions, dtype, out=[4, T, rope_dim]) writes the tables into the lanes' table buffer, and
    # lane_rows(..., out=buffers) its rows into the lanes' row buffers
    TABLES_OUT = ROWS_OUT = True

    def lane_rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor, out: tuple | None = None):
        """X [T, hc, D], positions [T] -> (carry for attn_out, rows): the row-wise part of attention (mHC mix,
        attn_norm, the projections, q/kv norms and RoPE). rows: q [T, H, hd], kv [T, hd] (both rotated), and on
        compressed layers the compressor's kv, gate [T, C]; ratio 4 adds the indexer's compressor kv, gate, its
        rotated queries [T, nh, ihd] and head weights [T, nh] (float32). out: a buffer per row (the rows' shapes and
        dtypes; each token's row contiguous): every row written there by the op that makes it (the batched decode
        lanes' buffers, worker/lanes.py: no copy), rows = out."""
        cfg, p, w, l, ops = self.cfg, self.p, self.w, layer, self.ops
        b, eps, hd, H = f"blk.{l}.", cfg.rms_eps, cfg.head_dim, cfg.n_head
        T = x.shape[0]
        o = out if out is not None else (None,) * 8
        post, comb, u = self._hc_pre(x, l, "attn")
        ratio = p.compress_ratios[l]
        main, compressed = self.rope.cos_sin(positions)
        cos, sin = compressed if ratio else main
        # every projection of u in one call (TritonOps: one launch): q_a, kv, then the compressor's kv and gate
        # (into their lane buffers), and ratio 4's indexer head weights (float32, scaled) and compressor kv and gate
        names, outs, scales = ["attn_q_a", "attn_kv"], [None, None], [None, None]
        if ratio:
            names += ["attn_compressor_kv", "attn_compressor_gate"]
            outs += [o[2], o[3]]
            scales += [None, None]
            if ratio == 4:
                names += ["indexer.proj", "indexer_compressor_kv", "indexer_compressor_gate"]
                outs += [o[7], o[4], o[5]]
                scales += [p.index_n_heads ** -0.5, None, None]
        ys = ops.linears(u, [w[f"{b}{n}.weight"] for n in names], outs, scales)
        qr = ops.rms(ys[0], w[b + "attn_q_a_norm.weight"], eps)
        # q_b and (ratio 4) the indexer's q_b, both of qr: one call
        qb = ops.linears(qr, [w[b + "attn_q_b.weight"]] + ([w[b + "indexer.attn_q_b.weight"]] if ratio == 4 else []))
        q = ops.rms_rope(qb[0].view(T, H, hd), None, cos, sin, eps, out=o[0])
        kv = ops.rms_rope(ys[1], w[b + "attn_kv_a_norm.weight"], cos, sin, eps, out=o[1])
        rows = [q, kv]
        if ratio:
            rows += ys[2:4]
            if ratio == 4:      # the lightning indexer: its compressor's inputs, queries and head weights
                nh, ihd = p.index_n_heads, p.index_head_dim
                iq = ops.rope(qb[1].view(T, nh, ihd), cos, sin, out=o[6])
                rows += [ys[5], ys[6], iq, ys[4]]
        assert out is None or len(rows) == len(out), (len(rows), len(out))
        return (x, post, comb), tuple(rows)

    @staticmethod
    def lane_row(rows: tuple, i: int) -> tuple:
        """Lane i's rows of lane_rows' output (views [1, ...])."""
        return tuple(t[i:i + 1] for t in rows)

    def attn_out(self, layer: int, carry, o: torch.Tensor) -> torch.Tensor:
        """carry = (X, post, comb) of lane_rows, o [T, H*hd] (de-rotated) -> X after the attention sublayer:
        grouped low-rank output projection, mixed back into the streams."""
        x, post, comb = carry
        p, b, T = self.p, f"blk.{layer}.", o.shape[0]
        g = p.o_groups
        wa = self.w[b + "attn_output_a.weight"].view(g, p.o_lora_rank, -1)          # [g, o_lora, H*hd/g]
        # y [T, g, o_lora] written by the grouped matmul through its [g, T, o_lora] view (the library's strided
        # batched gemm, or TritonOps' one launch, writes there: no copy to make the rows contiguous)
        y = torch.empty((T, g, p.o_lora_rank), dtype=o.dtype, device=o.device)
        self.ops.grouped_linear(o.reshape(T, g, -1).transpose(0, 1), wa, out=y.transpose(0, 1))
        out = self.ops.linears(y.view(T, -1), [self.w[b + "attn_output_b.weight"]])[0]
        return self.ops.hc_post(x, out, post, comb)

    def attend_static(self, layer: int, rows: tuple, cache: DS4Cache, pos: torch.Tensor,
                      tables: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token of one sequence (rows of lane_rows with T = 1) at the device position pos [1]: its K=V row
        into the window ring, its compressor rows into the open window and the window's entry (re)computed,
        the indexer's top-k over every visible entry, attention over the ring and the chosen entries with the
        invisible ones masked -> o [1, H*hd] (de-rotated). Fixed shapes whatever the position: graph-capturable.
        tables: the RoPE tables at pos, (main cos, sin, compressed cos, sin) [1, rope_dim] each (the lanes' tables of
        the step, this lane's row); None: self.rope's at pos (the pass's, made once by the first layer's lane_rows).
        Either way no layer recomputes them (issue 21: ~5 launches per layer). out [1, H*hd]: written there (the
        lanes' attention rows: on CUDA the kernel's own output, no copy)."""
        p, w, l, ops = self.p, self.w, layer, self.ops
        b, hd, H = f"blk.{l}.", self.cfg.head_dim, self.cfg.n_head
        st = cache.layers[l]
        ratio = p.compress_ratios[l]
        if tables is None:
            main, comp = self.rope.cos_sin(pos)
            tables = (*main, *comp)
        q, (cos, sin) = rows[0], (tables[2:] if ratio else tables[:2])
        ents = top = None
        if ratio:
            ops.compress_step(st.comp.kv, st.comp.gate, st.comp.entries, rows[2], rows[3],
                              w[b + "attn_compressor_ape.weight"], w[b + "attn_compressor_norm.weight"],
                              self.rope_comp, pos, ratio, self.cfg.rms_eps)
            ents = st.comp.entries
            if ratio == 4:
                ops.compress_step(st.idx.kv, st.idx.gate, st.idx.entries, rows[4], rows[5],
                                  w[b + "indexer_compressor_ape.weight"], w[b + "indexer_compressor_norm.weight"],
                                  self.rope_comp, pos, ratio, self.cfg.rms_eps)
                top = ops.index_topk(rows[6], rows[7], st.idx.entries, pos, min(p.index_topk, ents.shape[0]))
        o = ops.decode_attend(q, rows[1], st.swa, ents, top, pos, ratio, w[b + "attn_sinks.weight"], cos, sin,
                              None if out is None else out.view(1, H, hd))
        return o.reshape(1, H * hd)

    def _attend_prefill(self, layer: int, rows: tuple, cache: DS4Cache, positions: torch.Tensor,
                        start: int) -> torch.Tensor:
        """T > 1 tokens of one sequence from the layer's length `start` on (host): the window ring, the compressors
        (every window the chunk closes) and attention in blocks of QUERY_CHUNK queries -> o [T, H*hd] (de-rotated)."""
        cfg, p, w, l = self.cfg, self.p, self.w, layer
        b, hd, H, W = f"blk.{l}.", cfg.head_dim, cfg.n_head, p.sliding_window
        q, kv = rows[0], rows[1]
        T, dev = q.shape[0], q.device
        st = cache.layers[l]
        ratio = p.compress_ratios[l]
        n_prev = min(start, W - 1)
        # the ring's last n_prev rows in position order, then this pass's rows
        keys = torch.cat([st.swa.index_select(0, _ring_rows(start - n_prev, n_prev, W, dev)), kv])
        kpos = torch.arange(keys.shape[0], device=dev) + (start - n_prev)
        m = min(T, W)
        st.swa.index_copy_(0, _ring_rows(start + T - m, m, W, dev), kv[T - m:])
        entries = ikeys = None
        if ratio:
            entries = self._compress_prefill(st.comp, rows[2], rows[3], w[b + "attn_compressor_ape.weight"],
                                             w[b + "attn_compressor_norm.weight"], ratio, hd, start)   # [N, hd]
            if ratio == 4:      # the indexer's compressor consumes these tokens too
                ikeys = self._compress_prefill(st.idx, rows[4], rows[5], w[b + "indexer_compressor_ape.weight"],
                                               w[b + "indexer_compressor_norm.weight"], 4, p.index_head_dim, start)
                iq, iw = rows[6], rows[7]
                assert ikeys.shape[0] == entries.shape[0], (ikeys.shape, entries.shape)
        sinks = w[b + "attn_sinks.weight"]
        o = torch.empty(T, H, hd, dtype=q.dtype, device=dev)
        # queries in chunks: a chunk's window keys are its own rows plus the window-1 before them, so the
        # scores are [H, Q, Q + window - 1 + N] whatever the prompt length (not [H, T, T + N])
        for a in range(0, T, QUERY_CHUNK):
            e = min(T, a + QUERY_CHUNK)
            s0, s1 = max(0, n_prev + a - (W - 1)), n_prev + e
            qp = positions[a:e, None]
            kc, kp = keys[s0:s1], kpos[s0:s1]
            mask = (kp[None, :] <= qp) & (qp - kp[None, :] < W)          # [Q, S]
            if ratio:
                N = entries.shape[0]
                visible = torch.arange(N, device=dev)[None, :] < (qp + 1) // ratio  # [Q, N]
                if ratio == 4 and N:
                    visible = visible & self._index_select(l, iq[a:e], iw[a:e], ikeys, visible)
                kc = torch.cat([kc, entries])
                mask = torch.cat([mask, visible], dim=1)
            o[a:e] = attend_ref(q[a:e], kc, mask, sinks)
        cos, sin = (self.rope_comp if ratio else self.rope_main).cos_sin(positions)
        return apply_rope(o, cos, -sin).reshape(T, H * hd)                       # undo K=V's rotation

    def _compress_prefill(self, st: CompState, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
                          norm: torch.Tensor, ratio: int, d: int, start: int) -> torch.Tensor:
        """Feed T projected rows (kv, gate [T, C]) at positions start..; close every window they complete (entries
        written at their rows); returns the closed entries [N, d]."""
        R, T, dev = st.kv.shape[0], kv.shape[0], kv.device
        open_n, w0 = start % ratio, start // ratio          # rows of the open window fed already; its index
        if open_n:
            idx = _ring_rows(start - open_n, open_n, R, dev)
            kv, gate = torch.cat([st.kv.index_select(0, idx), kv]), torch.cat([st.gate.index_select(0, idx), gate])
        overlap = None
        if ratio == 4 and w0 >= 1:      # the previous window's first half, read before the ring is overwritten
            idx = _ring_rows(ratio * (w0 - 1), ratio, R, dev)
            overlap = (st.kv.index_select(0, idx)[:, :d], st.gate.index_select(0, idx)[:, :d] + ape[:, :d])
        n = min(T, R)
        st.kv.index_copy_(0, _ring_rows(start + T - n, n, R, dev), kv[kv.shape[0] - n:])
        st.gate.index_copy_(0, _ring_rows(start + T - n, n, R, dev), gate[gate.shape[0] - n:])
        usable = kv.shape[0] // ratio * ratio
        if usable == 0:
            return st.entries[:w0]
        nw = usable // ratio
        ck = kv[:usable].view(nw, ratio, -1)
        cg = gate[:usable].view(nw, ratio, -1) + ape
        if ratio == 4:      # overlapping windows: entry w pools window w-1's first half and window w's second
            nk = ck.new_zeros((nw, 2 * ratio, d))
            ng = cg.new_full((nw, 2 * ratio, d), float("-inf"))
            nk[:, ratio:], ng[:, ratio:] = ck[..., d:], cg[..., d:]
            if nw > 1:
                nk[1:, :ratio], ng[1:, :ratio] = ck[:-1, :, :d], cg[:-1, :, :d]
            if overlap is not None:
                nk[0, :ratio], ng[0, :ratio] = overlap[0].to(nk.dtype), overlap[1].to(ng.dtype)
            ck, cg = nk, ng
        pos = torch.arange(nw, device=dev) * ratio + w0 * ratio
        cos, sin = self.rope_comp.cos_sin(pos)
        st.entries[w0:w0 + nw] = pool_entries(ck, cg, norm, cos, sin, self.cfg.rms_eps)
        return st.entries[:w0 + nw]

    def _index_select(self, l: int, q: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
        """score(t, w) = sum_h wts[t,h] relu(q[t,h] . K[w]) / sqrt(ihd) -> the top index_topk visible entries
        of each query [Q, N] bool."""
        p, N = self.p, keys.shape[0]
        score = index_scores(q, wts, keys).masked_fill(~visible, float("-inf"))           # [Q, N]
        top = score.topk(min(p.index_topk, N), dim=-1).indices
        if self.margins is not None and N > p.index_topk:
            srt = score.sort(dim=-1, descending=True).values
            ok = torch.isfinite(srt[:, p.index_topk])            # queries with more visible entries than top_k
            if ok.any():
                gap = srt[ok, p.index_topk - 1] - srt[ok, p.index_topk]
                self.margins.append((l, "indexer", float(gap.min())))
        return torch.zeros_like(visible).scatter_(1, top, True) & visible

    def moe_input(self, layer: int, x: torch.Tensor):
        """X [T, hc, D] -> (h [T, D] = ffn_norm of the collapsed streams, aux = (post, comb))."""
        post, comb, h = self._hc_pre(x, layer, "ffn")
        return h, (post, comb)

    def guess_ids(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, n: int) -> torch.Tensor:
        """x: the residual after layer `layer`'s attention, token_ids [T] -> the expert ids [T, n, k] int64 (on the
        device, no sync) that layers layer+1 .. layer+n's moe_input and route pick on x (worker/guess.py): TorchOps
        layer by layer, TritonOps all n layers at once (GuessStack); no routing hooks, no margins."""
        X, lag = self._guess_streams(x)
        p = self.p
        return self.ops.guess_route(X, lag, self.guess_stack, layer + 1, n, token_ids.to(self.device),
                                    self.cfg.n_expert_used, p.hc_sinkhorn_iters, p.hc_eps, self.cfg.rms_eps)

    def _guess_streams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x -> (the streams X [T, hc, D], the lag of a lagged mHC [T, hc] or None: deepseek4 collapses by each
        layer's own pre)."""
        return x, None

    def route(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
              resident: Residency | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] -> (ids [T, k] int64, weights [T, k] in h's dtype).

        scores = sqrt(softplus(router h)); hash layers take ids = tid2eid[token_ids], the others the top-k of
        scores + exp_probs_b (the bias selects only); weights = scores[ids] / sum x expert_weights_scale.
        resident, a routing_approx.Residency, turns on an approximate mode: `resident` (rank 0 exact, ranks 1..
        among the resident experts first; hash layers stay exact) or `pool` (every rank among the resident experts
        first; on hash layers the table's experts rank first, then the router's scores: routing_approx.py)."""
        p, b, k = self.p, f"blk.{layer}.", self.cfg.n_expert_used
        logits = self.ops.linears(h, [self.w[b + "ffn_gate_inp.weight"]])[0]
        if layer < p.n_hash_layers:
            if token_ids is None:
                raise ValueError("hash-routed layers need the token ids")
            table, tids = self.w[b + "ffn_gate_tid2eid.weight"], token_ids.to(self.device)
            if resident is None or resident.mode != "pool":
                return self.ops.route_hash(logits, table, tids, p.weights_norm, p.routed_scale, h.dtype)
            return self.ops.route_approx(logits, None, table, tids, k, resident, p.weights_norm, p.routed_scale,
                                         h.dtype)
        bias = self.w[b + "exp_probs_b.bias"]
        if resident is None:
            ids, wts = self.ops.route_topk(logits, bias, k, p.weights_norm, p.routed_scale, h.dtype)
            if self.margins is not None and k < logits.shape[1]:
                srt = (_sqrt_softplus(logits) + bias).sort(dim=-1, descending=True).values
                self.margins.append((layer, "experts", float((srt[:, k - 1] - srt[:, k]).min())))
            return ids, wts
        return self.ops.route_approx(logits, bias, None, None, k, resident, p.weights_norm, p.routed_scale, h.dtype)

    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """routed [T, D] = sum_r w_r expert_r(h); adds the shared expert and mixes back into the streams."""
        b, w = f"blk.{layer}.", self.w
        shared = self.ops.shared_ffn(h, w.get(b + "ffn_gate_up_shexp.weight"), w[b + "ffn_gate_shexp.weight"],
                                     w[b + "ffn_up_shexp.weight"], w[b + "ffn_down_shexp.weight"],
                                     float(self.p.swiglu_limit_shexp[layer]))
        post, comb = aux
        return self.ops.hc_post(x, routed, post, comb, shared)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """X [T, hc, D] -> logits [T, n_vocab] float32."""
        fn, base, scale = (self.w[n] for n in ds4layout.HC_HEAD)
        flat = _unweighted_rms(x.flatten(1).float(), self.cfg.rms_eps)
        pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + self.p.hc_eps
        hcol = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        n = _rms(hcol, self.w[ds4layout.OUTPUT_NORM], self.cfg.rms_eps)
        return F.linear(n, self.w[ds4layout.OUTPUT]).float()


def _into(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """t, or t copied into out (same shape) and out."""
    return t if out is None else out.copy_(t)


def _ring_rows(first: int, n: int, rows: int, device) -> torch.Tensor:
    """Ring rows [n] of positions first..first+n-1 (position p at row p % rows); no host-to-device copy."""
    return (torch.arange(n, device=device) + first) % rows


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits.float()).sqrt()


def _route_weights(wts: torch.Tensor, norm: bool, scale: float, dtype) -> torch.Tensor:
    if norm:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return (wts * scale).to(dtype)


def index_scores(q: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The lightning indexer: q [Q, nh, ihd], wts [Q, nh] float32, keys [N, ihd] -> score [Q, N] float32 =
    sum_h wts[., h] relu(q[., h] . K[w]) / sqrt(ihd)."""
    sc = F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float())) * keys.shape[-1] ** -0.5   # [Q, nh, N]
    return (sc * wts.unsqueeze(-1)).sum(dim=1)


def pool_entries(ck: torch.Tensor, cg: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Windows ck, cg [nw, S, d] (gates with ape, -inf where a slot is empty) -> entries [nw, d]: softmax-gated
    sum over the slots per channel, RMSNorm, RoPE at the windows' first positions (cos/sin [nw, r])."""
    pooled = (ck * cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)).sum(dim=1)
    return apply_rope(_rms(pooled, norm, eps), cos, sin)


def hc_mix(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           eps: float):
    """A sublayer's mHC mix from the streams X [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (float32;
    comb Sinkhorn-normalised)."""
    hc, T = X.shape[1], X.shape[0]
    flat = _unweighted_rms(X.reshape(T, -1).float(), eps)
    m = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = m.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u [T, D] = sum_j pre_j X_j (X's dtype)."""
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)


def attend_ref(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """q [Q, H, hd], keys [S, hd] (K = V), mask [Q, S] bool (True = attend), sinks [H] float32 -> [Q, H, hd]:
    softmax over [q.k / sqrt(hd), sink_h] (the sink only enlarges the denominator), weighted sum of the keys."""
    H, Q = q.shape[1], q.shape[0]
    scores = torch.einsum("thd,sd->hts", q, keys) * q.shape[-1] ** -0.5                   # [H, Q, S]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    comb_l = torch.cat([scores, sinks.float().view(H, 1, 1).to(scores.dtype).expand(H, Q, 1)], dim=-1)
    comb_l = comb_l - comb_l.max(dim=-1, keepdim=True).values
    probs = F.softmax(comb_l, dim=-1, dtype=comb_l.dtype)[..., :-1]
    return torch.einsum("hts,sd->thd", probs.to(keys.dtype), keys)


class TorchOps:
    """The per-row math of a deepseek4 layer in torch: the CPU path (the exact reference against transformers) and
    what kernels/triton_ds4.py's fused kernels must equal within float noise (tests/kernels/test_ds4_kernels.py)."""

    @staticmethod
    def prepare(w: dict, n_layer: int) -> None:
        """Rearrange the dense weights for these ops once at load (TorchOps: nothing)."""

    # x [T, K] -> [x . w^T for w in ws] (scales, outs: kernels/dense.py); TritonOps: every product of decode's few rows
    # in one launch (the library's split-K gemm was two launches each at one row)
    linears = staticmethod(dense.linears)
    # x [G, T, K], w [G, N, K] -> [G, T, N] per group (torch.bmm; out: any strides)
    grouped_linear = staticmethod(dense.grouped_linear)

    @staticmethod
    def copy_rows(srcs, dsts) -> None:
        """dsts[j] = srcs[j] (lane-first [B, ...] each): the batched decode lanes' attention rows into their buffers
        (worker/lanes.py; TritonOps: one launch for all of them, any dtypes)."""
        for s, d in zip(srcs, dsts):
            d.copy_(s)

    @staticmethod
    def gather_rows(idx, ts) -> list:
        """Rows idx [n] of each of ts (lane-first [B, ...]) -> [n, ...] each (TritonOps: one launch for all)."""
        return [t.index_select(0, idx) for t in ts]

    @staticmethod
    def hc_pre(X, fn, base, scale, norm, iters: int, hc_eps: float, eps: float):
        """mHC before a sublayer: X [T, hc, D] -> post [T, hc], comb [T, hc, hc] (float32, Sinkhorn-normalised),
        h [T, D] = RMSNorm_norm(sum_j pre_j X_j) in X's dtype."""
        pre, post, comb = hc_mix(X, fn, base, scale, iters, hc_eps, eps)
        return post, comb, _rms(hc_collapse(X, pre), norm, eps)

    @staticmethod
    def hc_pre_lagged(X, lag, fn, base, scale, norm, iters: int, hc_eps: float, eps: float):
        """deepseek41's lagged mHC: X [T, hc, D], lag [T, hc] float32 (the previous sublayer's pre) -> this mix's
        pre [T, hc], post, comb (float32), h [T, D] = RMSNorm_norm(sum_j lag_j X_j) in X's dtype."""
        pre, post, comb = hc_mix(X, fn, base, scale, iters, hc_eps, eps)
        return pre, post, comb, _rms(hc_collapse(X, lag), norm, eps)

    @staticmethod
    def hc_post(X, out, post, comb, extra=None):
        """X' [T, hc, D] = post_k * (out + extra) + sum_j comb[j, k] X_j."""
        dt = X.dtype
        if extra is not None:
            out = out + extra
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), X)

    @staticmethod
    def rms(x, w, eps: float):
        return _rms(x, w, eps)

    @staticmethod
    def rms_rope(x, w, cos, sin, eps: float, out=None):
        """RMSNorm over the last dim (w None: unweighted, in x's dtype as V4's per-head q norm), then RoPE (out:
        written there, x's shape: the batched decode lanes' buffers)."""
        return _into(apply_rope(_unweighted_rms(x, eps) if w is None else _rms(x, w, eps), cos, sin), out)

    @staticmethod
    def rope(x, cos, sin, out=None):
        return _into(apply_rope(x, cos, sin), out)

    @staticmethod
    def compress_step(kv_buf, gate_buf, entries, kv, gate, ape, norm, rope, pos, ratio: int, eps: float):
        """One token's compressor rows (kv, gate [1, C]) into the open window at row pos % R, and the window's
        entry w = pos // ratio pooled from its rows (ratio 4: the previous window's first half too; window 0's
        missing half gated -inf) into entries[w]. The rows of the window not yet fed are stale: the entry is
        final, and visible, once the window's last token came (visibility: w < (t + 1) // ratio)."""
        R, d, dev = kv_buf.shape[0], entries.shape[1], pos.device
        kv_buf.index_copy_(0, pos.remainder(R), kv)
        gate_buf.index_copy_(0, pos.remainder(R), gate)
        w = torch.div(pos, ratio, rounding_mode="floor")                      # [1]
        if ratio == 4:
            j = torch.arange(4, device=dev)
            cur, prev = (w % 2) * 4 + j, ((w + 1) % 2) * 4 + j
            ck = torch.cat([kv_buf.index_select(0, prev)[:, :d], kv_buf.index_select(0, cur)[:, d:]])
            cg = torch.cat([gate_buf.index_select(0, prev)[:, :d] + ape[:, :d],
                            gate_buf.index_select(0, cur)[:, d:] + ape[:, d:]])
            cg = cg.masked_fill((w == 0) & (torch.arange(8, device=dev) < 4)[:, None], float("-inf"))
        else:
            ck, cg = kv_buf, gate_buf + ape
        cos, sin = rope.cos_sin(w * ratio)
        entries.index_copy_(0, w, pool_entries(ck[None], cg[None], norm, cos, sin, eps))

    @staticmethod
    def index_topk(iq, iw, keys, pos, k: int):
        """One query's indexer scores over the entries visible at pos -> the top rows [min(k, visible)], best
        first. Only the visible rows are scored (keys [N] is sized by the sequence's max_len, which must not
        change a bit: the CPU path is eager, so the count is read on the host)."""
        n = _visible(pos, 4)
        return index_scores(iq, iw, keys[:n]).topk(min(k, n), dim=-1).indices[0]

    @staticmethod
    def decode_attend(q, kv, ring, entries, top, pos, ratio: int, sinks, cos, sin, out=None):
        """The token's K=V row kv [1, hd] into the window ring [W, hd] at pos % W; then one query q [1, H, hd] at
        pos over the ring (its rows that hold a position >= 0) and, on compressed layers, the entries visible at
        pos (row < (pos+1) // ratio; top [k]: those of these rows, in top's order; None: every one), with the
        sinks -> [1, H, hd] de-rotated at pos (cos/sin [1, r]). Only the visible entries are keys: entries [N] is
        sized by the sequence's max_len, and masked keys would still change the CPU's reduction order (the bits
        would depend on max_len); the CPU path is eager, so the count is read on the host. out: written there."""
        W, dev = ring.shape[0], pos.device
        ring.index_copy_(0, pos.remainder(W), kv)
        keys, mask = ring, pos - (pos - torch.arange(W, device=dev)).remainder(W) >= 0
        if entries is not None:
            n = _visible(pos, ratio)
            ents = entries[:n] if top is None else entries.index_select(0, top[top < n])
            keys, mask = torch.cat([keys, ents]), torch.cat([mask, mask.new_ones(ents.shape[0])])
        o = apply_rope(attend_ref(q, keys, mask[None], sinks), cos, -sin)
        return o if out is None else out.copy_(o)

    @staticmethod
    def shared_ffn(h, gate_up, gate, up, down, limit: float):
        """The shared expert (clamped SwiGLU) on h [T, H]; gate_up (the fused gate | up rows, CUDA) unused here."""
        return expert_ffn(h, gate, up, down, limit)

    @staticmethod
    def route_topk(logits, bias, k: int, norm: bool, scale: float, dtype):
        """sqrt(softplus(logits)) [T, E]; ids = top-k of scores + bias; weights = scores[ids] renormalised x scale."""
        scores = _sqrt_softplus(logits)
        ids = torch.topk(scores + bias, k, dim=-1).indices
        return ids, _route_weights(scores.gather(1, ids), norm, scale, dtype)

    @classmethod
    def guess_route(cls, X, lag, g, first: int, n: int, token_ids, k: int, iters: int, hc_eps: float,
                    eps: float):
        """The expert ids [T, n, k] int64 layers first .. first+n-1 pick from the streams X [T, hc, D] (lag [T, hc]:
        deepseek41's lagged collapse, else None): each layer's ffn mHC + norm, router and top-k of scores + bias, as
        moe_input and route_topk compute them; hash layers the token's row of their table (exact, no router)."""
        out = []
        for t in range(first, first + n):
            if t < g.tid2eid.shape[0]:
                out.append(g.tid2eid[t][token_ids])
                continue
            if lag is None:
                h = cls.hc_pre(X, g.fn[t], g.base[t], g.scale[t], g.norm[t], iters, hc_eps, eps)[2]
            else:
                h = cls.hc_pre_lagged(X, lag, g.fn[t], g.base[t], g.scale[t], g.norm[t], iters, hc_eps, eps)[3]
            out.append(torch.topk(_sqrt_softplus(F.linear(h, g.router[t])) + g.bias[t], k, dim=-1).indices)
        return torch.stack(out, dim=1)

    @staticmethod
    def route_hash(logits, tid2eid, token_ids, norm: bool, scale: float, dtype):
        ids = tid2eid[token_ids]
        return ids, _route_weights(_sqrt_softplus(logits).gather(1, ids), norm, scale, dtype)

    @staticmethod
    def route_approx(logits, bias, tid2eid, token_ids, k: int, resident: Residency, norm: bool, scale: float, dtype):
        """An approximate routing mode's choice (routing_approx.py) over resident.mask [E] bool: a top-k layer's
        (bias [E], tid2eid None) or, in `pool`, a hash layer's (bias None, tid2eid [V, k], token_ids [T]); weights as
        route_topk's / route_hash's: scores[ids] renormalised x scale."""
        scores = _sqrt_softplus(logits)
        if tid2eid is not None:
            ids = approx_hash(tid2eid[token_ids].long(), scores, resident)
        else:
            ids = approx_topk(scores + bias, k, resident)
        return ids, _route_weights(scores.gather(1, ids), norm, scale, dtype)


def _visible(pos: torch.Tensor, ratio: int) -> int:
    """The entries visible at the device position pos [1]: (pos + 1) // ratio (a host read)."""
    return int(pos.item() + 1) // ratio


def ops_for(device: torch.device):
    """The fused Triton kernels on CUDA (kernels/triton_ds4.py) where triton is installed, else TorchOps."""
    if device.type == "cuda":
        try:
            from betelgeuse.kernels.triton_ds4 import TritonOps
            return TritonOps()
        except ImportError:
            pass
    return TorchOps()



class Deepseek4Reference(ReferenceExperts, Deepseek4Model):
    """The in-process path: experts dequantized from the file's mmap each time they are needed
    (model/reference.py)."""

    def __init__(self, f, dense: dict[str, torch.Tensor], sub_batch: int = 16, kernels: str = "auto",
                 chunk: int | str | None = AUTO):
        Deepseek4Model.__init__(self, f.config, dense)
        self._init_reference(f, sub_batch, kernels, chunk)


