"""The DeepSeek-V4.1 (`deepseek41`) forward pass: V4's model (model/deepseek4.py) with V4.1's deltas, through the
same engine interface (embed / attention_block / moe_input / route / moe_output / logits, new_cache, check_ids).

Deltas from V4 (research note §0, §4, §7-B; NeMo AutoModel 0.7.0 `deepseek_v41`, llama.cpp `deepseek41.cpp`):
  lagged mHC   a sublayer's mix (pre, post, comb) is computed from the streams it receives, but the streams are
               collapsed with the PREVIOUS sublayer's pre (layer 0's attention: a one-hot on stream 0; the head:
               the last FFN's pre; no output_hc_* tensors). The carried pre [T, hc] float32 rides in the residual
               tensor x [T, hc + 1, D] as an extra row (`_pack`: its bits, so bf16 streams carry it exactly), so
               the engine passes one tensor between sublayers as for V4.
  attention    no per-head q norm; CSA2: compressed KV only on KV-source layers (ratio 2: softmax-gated pairs,
               ratio 1: one normed projection per token; no ape), shared by the compressed layers after them;
               indexer keys derived from that latent (`indexer.attn_k` + `k_norm`) by key owners; index sources
               score them and keep the top-k, the layers after them reuse that selection; from the candidate layer
               on, a two-level filter (the top candidate_blocks blocks of candidate_block_size entries, always the
               latest visible block) restricts what later index sources may pick.
  MoE          no hash-routed layers; `exp_probs_b_vl` (the vision routing bias) is ignored for text.
  Engram       before the attention mix of its layers (model/engram.py): rows of a hashed n-gram table, read by the
               store from disk in the engine and from the file's map in the reference.
  rms eps from the file (1e-20 in V4.1-Flash).
Not mirrored: the release's fake-quantized caches (FP8 window KV, NVFP4 compressed KV, MXFP4 indexer q/k; NeMo
`quantize_cache`): this engine computes them in the compute dtype, as it does V4's (the oracle test turns NeMo's
off).

Per-sequence state (DS41Cache), in fixed shapes sized for max_len as deepseek4's: per layer the K=V window ring, per
KV source its open window's rows (a ring of `ratio` rows, float32) and its entries (and indexer keys) at their
window's row, one spare row past the last (the static top-k's "nothing chosen"); the Engram n-gram history (host).
Prefill runs in position-aligned chunks (model/chunks.py), each layer chunk after chunk from its own length
(CompressedCache.fed), the Engram rows ENGRAM_TOKENS at a time from each chunk's start. Cross-layer state within a
pass: the top-k mask of a chunk's tokens (`sel`; the static form: each index layer's chosen rows, `tops`) and the
candidate mask (`cands`; the static form: `cand`) go from an index layer to the layers after it, per chunk (keyed
by its first position). None of it outlives the pass, so the state after a chunk boundary is the layers' tensors and
the Engram history: a prefill resumed there from a snapshot (snapshot / restore, CompressedCache.mark) gets the bits
of an unbroken one (tests/model/test_deepseek41_resume.py), the prefix cache's ground (worker/snapshot_cache.py).

Decode: a one-token pass always runs the static form (as deepseek4's): the position on the device, every shape fixed
(the indexer scores every entry with the invisible ones -inf; on the CPU, TorchOps, only the visible ones, counted on
the host, so the bits never depend on max_len), the Engram rows read from a fixed buffer staged before the layers
(engram_stage), so the step is graph-capturable (worker/decode_graphs.py) and row-batched over lanes (worker/lanes.py).
Attention over the window ring and the chosen entries goes through ops.decode_attend (TorchOps on the CPU,
deepseek4's fused Triton kernel on CUDA); the rest of the step is plain torch in fixed shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from betelgeuse.gguf import ds41layout
from betelgeuse.model.deepseek4 import (CompressedCache, Deepseek4Model, TorchOps, _ring_rows, _rms, _visible,
                                        apply_rope, hc_collapse)
from betelgeuse.errors import UnsupportedError
from betelgeuse.gguf.ds41layout import ENGRAM_TOKENS
from betelgeuse.model.engram import EngramState, FileRows, NgramHasher, engram_residual
from betelgeuse.model.reference import ReferenceExperts
from betelgeuse.settings import AUTO

QUERY_CHUNK = ds41layout.QUERY_CHUNK


# ---- per-sequence state ---------------------------------------------------------------------------

@dataclass(slots=True)
class SourceState:
    """A KV-source layer's compressed stream, in fixed shapes: entry w (tokens w*ratio..) at row w."""
    buf_kv: torch.Tensor            # [ratio, hd] float32: the open window's projected rows, position p at row p % ratio
    buf_gate: torch.Tensor          # [ratio, hd] float32 (ratio 1: no rows)
    entries: torch.Tensor           # [ceil(max_len / ratio) + 1, hd] rotated latent entries; the rows of windows not
                                    # yet closed are scratch (the static decode writes the open one each step), the
                                    # last row never holds an entry (a static top-k's "nothing chosen")
    ikeys: torch.Tensor | None      # [same rows, index_head_dim] rotated indexer keys (key owners)
    ratio: int                      # tokens per entry (1 or 2)


@dataclass(slots=True)
class DS41Cache(CompressedCache):
    """A sequence's deepseek41 state in fixed shapes (module doc): nothing changes shape per token. Chunked
    prefill (`fed`) and the prefix cache's mark: CompressedCache; the mark's host state is the Engram history."""
    swa: list[torch.Tensor]          # per layer [window, head_dim] K=V ring: position p at row p % window
    src: dict[int, SourceState]      # per KV-source layer
    max_len: int                     # tokens
    engram: EngramState | None = None
    length: int = 0                  # tokens every layer has consumed
    # prefill form, per chunk of the pass (key: the chunk's first position; the layers run chunk after chunk):
    sel: dict = field(default_factory=dict)     # -> [T, N] bool: the last index layer's top-k for its tokens
    cands: dict = field(default_factory=dict)   # -> [T, N] bool: the candidate layer's blocks for its tokens
    cand: torch.Tensor | None = None # static form: [1, N] bool, the candidate layer's blocks for the token
    tops: dict | None = None         # static form: index layer -> its chosen entry rows [k] (the spare row: none)
    arch = "deepseek41"

    @property
    def device(self):
        return self.swa[0].device

    @property
    def n_layers(self) -> int:
        return len(self.swa)

    def used(self, l: int, n: int) -> list[torch.Tensor]:
        """Views of layer l's tensors holding something after n prefilled tokens: the window ring; a KV source's
        open-window rows, its n // ratio closed entries and their indexer keys (prefill writes only closed
        windows' rows: the rest is zeros, as in a fresh state)."""
        ts = [self.swa[l]]
        s = self.src.get(l)
        if s is not None:
            ts += [s.buf_kv, s.buf_gate, s.entries[:n // s.ratio]]
            if s.ikeys is not None:
                ts.append(s.ikeys[:n // s.ratio])
        return ts

    def host_state(self):
        return None if self.engram is None else self.engram.hist.copy()

    def set_host_state(self, host) -> None:
        assert (host is None) == (self.engram is None), "a snapshot of another model"
        if host is not None:
            self.engram.hist = host.copy()

    def begin(self, n_tokens: int) -> torch.Tensor:
        positions = CompressedCache.begin(self, n_tokens)
        self.sel, self.cands = {}, {}
        return positions

    def commit(self) -> None:
        CompressedCache.commit(self)
        self.sel, self.cands, self.cand, self.tops = {}, {}, None, None
        g = self.engram
        if g is not None and g.new is not None:
            g.hist = _history(g.hist, g.new, g.keep)
            g.pending = g.new = None
            g.staged = False

    def reset(self) -> None:
        """CompressedCache.reset, and the static form's chosen rows and the Engram history as a fresh state's."""
        CompressedCache.reset(self)
        self.sel, self.cands, self.cand, self.tops = {}, {}, None, None
        g = self.engram
        if g is not None:
            g.hist, g.pending, g.new, g.source, g.staged = np.zeros(0, dtype=np.int64), None, None, None, False

    def tensors(self) -> list[torch.Tensor]:
        ts = list(self.swa)
        for s in self.src.values():
            ts += [s.buf_kv, s.buf_gate, s.entries] + ([s.ikeys] if s.ikeys is not None else [])
        if self.engram is not None and self.engram.vals is not None:
            ts.append(self.engram.vals)
        return ts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _history(hist: np.ndarray, new: np.ndarray, keep: int) -> np.ndarray:
    """The Engram history after `new` compressed ids follow `hist`: the last `keep`."""
    return np.concatenate([hist, new])[max(0, len(hist) + len(new) - keep):]


def select_candidate_blocks(scores: torch.Tensor, lengths: torch.Tensor, blocks: int, block_size: int,
                            margins: list | None = None, layer: int = -1) -> torch.Tensor:
    """scores [Q, N] (causally masked), lengths [Q] visible entries -> [Q, N] bool: the top `blocks` blocks of
    `block_size` entries by their best score, always the latest visible block (NeMo `_select_candidate_blocks`)."""
    Q, N = scores.shape
    bs = F.pad(scores, (0, -N % block_size), value=float("-inf")).view(Q, -1, block_size).amax(dim=-1)
    last = torch.div(lengths - 1, block_size, rounding_mode="floor")
    nb = bs.shape[1]
    bs = bs.masked_fill(torch.arange(nb, device=scores.device)[None, :] == last[:, None], float("inf"))
    k = min(blocks, nb)
    top = bs.topk(k, dim=-1)
    if margins is not None and nb > k:
        srt = bs.sort(dim=-1, descending=True).values
        a, b = srt[:, k - 1], srt[:, k]
        ok = torch.isfinite(a) & torch.isfinite(b)
        if ok.any():
            margins.append((layer, "candidates", float((a[ok] - b[ok]).min())))
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter(1, top.indices, top.values > float("-inf"))
    return keep[:, :, None].expand(Q, nb, block_size).reshape(Q, nb * block_size)[:, :N]   # no host sync


# ---- the model ------------------------------------------------------------------------------------

class Deepseek41Model(Deepseek4Model):
    # capabilities (model/interface.py): prefill in position-aligned chunks, each layer from its own length (the
    # cross-layer masks kept per chunk), so a prompt resumed at a chunk boundary gets the bits of an unbroken
    # prefill and the prefix cache keeps whole-state snapshots (deepseek4's, plus the Engram history); decode has
    # the static form (DS41Cache in fixed shapes, the position on the device, the Engram rows staged: module doc)
    # and runs row-batched over lanes (worker/lanes.py), as deepseek4's
    chunked_prefill = True
    prefix_reuse = "snapshots"
    prefill_chunk = 256         # deepseek4's, for its reasons (model/deepseek4.py): the chunk count is the cost
    static_decode = True
    lane_decode = True
    # its entries' spare last row is a static top-k's "nothing chosen" (SourceState): its index moves with max_len,
    # so a state is allocated whole for what its request may use and does not grow
    state_grows = False
    ROWS_OUT = False        # its lane_rows makes its rows itself (the lanes copy them into their buffers)

    def __init__(self, cfg, dense: dict[str, torch.Tensor]):
        assert cfg.arch == "deepseek41" and cfg.ds41 is not None, cfg.arch
        super().__init__(cfg, dense)
        self.q = cfg.ds41
        g = self.q.engram
        self.hasher = NgramHasher(g) if g is not None else None
        # the lanes' Engram rows [n_eng, lanes, n_cols * key_length] (engram_stage with lanes; lane_rows reads them)
        self._lane_emb: torch.Tensor | None = None

    @classmethod
    def load_dense(cls, f, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Every non-expert tensor except the Engram tables (read row by row) dequantized on `device`: matrices in
        `dtype`, norms / mHC / sinks / bias / the compressor in float32."""
        out = {}
        for name, _ in ds41layout.tensors(f.config):
            k = ds41layout.kind(name)
            if k in ds41layout.EXPERTS or k == ds41layout.ENGRAM_TABLE:
                continue
            out[name] = f.load_tensor(name, device, torch.float32 if k in ds41layout.FP32_KINDS else dtype)
        return out

    # -- the carried pre-mix (module doc) --

    def _hc_pre(self, X: torch.Tensor, lag: torch.Tensor, l: int, s: str):
        """X [T, hc, D], lag [T, hc] (the previous sublayer's pre) -> the sublayer's mix: pre [T, hc], post [T, hc],
        comb [T, hc, hc] (float32), and h [T, D] = its norm (attn_norm / ffn_norm) of the streams collapsed by lag."""
        b = f"blk.{l}."
        fn, base, scale = (self.w[f"{b}hc_{s}_{k}.weight"] for k in ("fn", "base", "scale"))
        norm = self.w[b + ("attn_norm.weight" if s == "attn" else "ffn_norm.weight")]
        return self.ops.hc_pre_lagged(X, lag, fn, base, scale, norm, self.p.hc_sinkhorn_iters, self.p.hc_eps,
                                      self.cfg.rms_eps)

    @property
    def _pre_width(self) -> int:
        """Elements of the residual's dtype holding the float32 pre [hc] (2 per float32 in bf16/fp16)."""
        return self.p.hc_mult * 4 // torch.empty((), dtype=self.dtype).element_size()

    def _pack(self, X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """X [T, hc, D], pre [T, hc] float32 -> x [T, hc + 1, D] (pre's bits in the extra row)."""
        T, hc, D = X.shape
        assert self._pre_width <= D, (self._pre_width, D)
        row = X.new_zeros(T, 1, D)
        row[:, 0, :self._pre_width] = pre.float().contiguous().view(X.dtype)
        return torch.cat([X, row], dim=1)

    def _unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hc = self.p.hc_mult
        assert x.shape[1] == hc + 1, x.shape
        return x[:, :hc], x[:, hc, :self._pre_width].contiguous().view(torch.float32)

    # -- surface shared with the other architectures --

    def new_cache(self, max_len: int) -> DS41Cache:
        """The state of one sequence of up to max_len tokens, every tensor allocated now (ds41layout.state_bytes)."""
        assert max_len > 0, max_len
        hd, dev, dt, p = self.cfg.head_dim, self.device, self.dtype, self.p
        src = {}
        for l in sorted(self.q.kv_sources):
            r = p.compress_ratios[l]
            n = -(-max_len // r) + 1
            src[l] = SourceState(buf_kv=torch.zeros(r if r > 1 else 0, hd, device=dev, dtype=torch.float32),
                                 buf_gate=torch.zeros(r if r > 1 else 0, hd, device=dev, dtype=torch.float32),
                                 entries=torch.zeros(n, hd, device=dev, dtype=dt),
                                 ikeys=(torch.zeros(n, p.index_head_dim, device=dev, dtype=dt)
                                        if l in self.q.key_owners else None), ratio=r)
        eng = None
        if self.hasher is not None:
            g = self.q.engram
            eng = EngramState(hist=np.zeros(0, dtype=np.int64), keep=g.max_ngram - 1,
                              vals=torch.zeros(len(g.layer_ids), 1, g.n_cols * g.key_length, device=dev, dtype=dt))
        return DS41Cache(swa=[torch.zeros(p.sliding_window, hd, device=dev, dtype=dt) for _ in range(self.cfg.n_layer)],
                         src=src, max_len=max_len, engram=eng)

    def grow_cache(self, cache: DS41Cache, max_len: int, via_host: bool = False) -> DS41Cache:
        raise UnsupportedError("a deepseek41 state does not grow (state_grows = False)")

    def engram_begin(self, cache: DS41Cache, ids, source) -> None:
        """The pending tokens' Engram rows (hashed with the sequence's history) and where their values come from
        (`source.rows(engram index, rows [n, n_cols])`); call after cache.begin, before the layers."""
        if self.hasher is None:
            return
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        g = cache.engram
        g.pending, g.new, g.source = self.hasher.rows(g.hist, ids), self.hasher.compress(ids), source
        g.staged = False
        if cache.mark_at is not None and cache.length < cache.mark_at <= cache.length + len(ids):
            cache.mark_host = _history(g.hist, g.new[:cache.mark_at - cache.length], g.keep)

    def engram_stage(self, caches: list[DS41Cache], lanes: torch.Tensor | None = None, n_lanes: int = 0) -> None:
        """One-token passes (engram_begin done): each cache's Engram rows into its fixed buffer (engram.vals), asked
        of the source table by table, cache by cache (the order the source planned them: worker/engram_feed.py), so
        a decode step's layers read device buffers only (capturable). lanes [n] (the caches' lanes of n_lanes,
        worker/lanes.py): the rows also into those lanes of the buffer lane_rows reads."""
        if self.hasher is None:
            return
        g = self.q.engram
        if lanes is not None and (self._lane_emb is None or self._lane_emb.shape[1] != n_lanes):
            self._lane_emb = torch.zeros(len(g.layer_ids), n_lanes, g.n_cols * g.key_length, device=self.device,
                                         dtype=self.dtype)
        for e in range(len(g.layer_ids)):
            for kv in caches:
                st = kv.engram
                assert st.pending is not None and st.pending.shape[0] == 1, "engram_stage is for one-token passes"
                st.vals[e].copy_(st.source.rows(e, st.pending[:, e]).reshape(1, -1))
            if lanes is not None:
                self._lane_emb[e].index_copy_(0, lanes, torch.cat([kv.engram.vals[e] for kv in caches]))
        for kv in caches:
            kv.engram.staged = True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> x [T, hc + 1, D]: the embedding in each stream, and the one-hot pre of layer 0's attention."""
        X = super().embed(ids)
        pre = torch.zeros(X.shape[0], self.p.hc_mult, device=X.device, dtype=torch.float32)
        pre[:, 0] = 1.0
        return self._pack(X, pre)

    def attention_block(self, layer: int, x: torch.Tensor, cache: DS41Cache, positions: torch.Tensor,
                        static: bool = False) -> torch.Tensor:
        """x [T, hc + 1, D] -> x after (Engram and) the attention sublayer; consumes T tokens of the cache. One token
        (positions [1] on the device) always runs the static form (lane_rows' math, attend_static, attn_out), so
        eager and captured decode steps and the reference's decode are the same ops; a chunk of a longer pass (one
        token too: the cross-layer masks are per chunk) the prefill form, from this layer's own length."""
        T = x.shape[0]
        if T == 1 and cache._pending == 1:
            emb = self._engram_row(layer, cache)
            carry, rows = self._rows(layer, x, positions, emb)
            return self.attn_out(layer, carry, self.attend_static(layer, rows, cache, positions))
        assert not static, "the static form is one token"
        fed = cache.fed[layer]                              # this layer's chunks so far in the pass
        start = cache.length + fed
        X, pre = self._unpack(x)
        g = self.q.engram
        if g is not None and layer in g.layer_ids:
            X = self._engram(layer, X, cache, fed)
        pre_a, post, comb, u = self._hc_pre(X, pre, layer, "attn")
        out = self._attention(layer, u, cache, positions, start)
        cache.chunk_done(layer, start, T)
        return self._pack(self.ops.hc_post(X, out, post, comb), pre_a)

    # -- the static form in three parts (LaneDecode, model/interface.py: worker/lanes.py runs lane_rows / attn_out
    #    over the rows of every running sequence at once and attend_static per sequence) --

    def lane_rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """x [B, hc + 1, D] (a row per lane), positions [B] -> (carry, rows) of _rows, the Engram rows from the
        lanes' buffer (engram_stage)."""
        g = self.q.engram
        emb = None
        if g is not None and layer in g.layer_ids:
            assert self._lane_emb is not None and self._lane_emb.shape[1] == x.shape[0], "engram_stage(lanes) first"
            emb = self._lane_emb[g.index(layer)]
        return self._rows(layer, x, positions, emb)

    def _rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor, emb: torch.Tensor | None):
        """The row-wise part of attention: Engram (emb [T, n_cols * key_length]: the rows' values), the lagged mHC
        mix, attn_norm, the projections, norms and RoPE -> (carry = (X, post, comb, pre) for attn_out, rows):
        q [T, H, hd], kv [T, hd] (both rotated); a KV source adds its compressor's input (ratio 1: the normed latent
        [T, hd]; ratio 2: kv, gate [T, hd] float32), an index source its rotated queries [T, nh, ihd] and head
        weights [T, nh] (float32, scaled)."""
        cfg, p, q, w, l = self.cfg, self.p, self.q, self.w, layer
        b, eps, hd, H, T = f"blk.{l}.", cfg.rms_eps, cfg.head_dim, cfg.n_head, x.shape[0]
        X, pre = self._unpack(x)
        if emb is not None:
            X = engram_residual(X, emb, w[b + "engram_wkv.weight"], w[b + "engram_q.weight"],
                                w[b + "engram_k.weight"], eps)
        pre_a, post, comb, u = self._hc_pre(X, pre, l, "attn")
        ratio = p.compress_ratios[l]
        main, compressed = self.rope.cos_sin(positions)
        cos, sin = compressed if ratio else main
        ops = self.ops                              # TorchOps: the prefill form's functions, the same bits
        qr = ops.rms(F.linear(u, w[b + "attn_q_a.weight"]), w[b + "attn_q_a_norm.weight"], eps)
        rows = [ops.rope(F.linear(qr, w[b + "attn_q_b.weight"]).view(T, H, hd), cos, sin),      # no per-head norm
                ops.rms_rope(F.linear(u, w[b + "attn_kv.weight"]), w[b + "attn_kv_a_norm.weight"], cos, sin, eps)]
        if l in q.kv_sources:
            if ratio == 1:
                rows.append(ops.rms(F.linear(u, w[b + "attn_compressor_kv.weight"].to(u.dtype)),
                                    w[b + "attn_compressor_norm.weight"], eps))
            else:
                rows += [F.linear(u.float(), w[b + "attn_compressor_kv.weight"]),
                         F.linear(u.float(), w[b + "attn_compressor_gate.weight"])]
        if l in q.index_sources:
            nh, ihd = p.index_n_heads, p.index_head_dim
            rows += [ops.rope(F.linear(qr, w[b + "indexer.attn_q_b.weight"]).view(T, nh, ihd), cos, sin),
                     F.linear(u, w[b + "indexer.proj.weight"]).float() * (ihd ** -0.5 * nh ** -0.5)]
        return (X, post, comb, pre_a), tuple(rows)

    def attend_static(self, layer: int, rows: tuple, cache: DS41Cache, pos: torch.Tensor,
                      tables: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token of one sequence (rows of _rows with T = 1) at the device position pos [1]: a KV source's
        compressor step (the open window's entry (re)computed, and its indexer key), an index source's top-k over
        the visible entries (the candidate layer's blocks; the candidate filter after it), attention over the window
        ring and the chosen entries (ops.decode_attend) -> o [1, H*hd] (de-rotated). Fixed shapes: graph-capturable.
        tables: the RoPE tables at pos as deepseek4's attend_static takes them (the lanes' step tables, this lane's
        row; None: self.rope's, made once per pass). out [1, H*hd]: written there (deepseek4's)."""
        p, q, w, l = self.p, self.q, self.w, layer
        b, hd, H = f"blk.{l}.", self.cfg.head_dim, self.cfg.n_head
        ratio = p.compress_ratios[l]
        if tables is None:
            main, comp = self.rope.cos_sin(pos)
            tables = (*main, *comp)
        cos, sin = tables[2:] if ratio else tables[:2]
        ents = top = None
        if ratio:
            i = 2
            if l in q.kv_sources:
                n_in = 1 if ratio == 1 else 2
                self._compress_static(l, rows[i:i + n_in], cache.src[l], pos, (cos, sin))
                i += n_in
            ents = cache.src[q.kv_source[l]].entries
            if cache.tops is None:
                cache.tops = {}
            if l in q.index_sources:
                top = cache.tops[l] = self._index_static(l, rows[i], rows[i + 1], cache, pos)
            else:
                top = cache.tops.get(q.topk_source[l])
                assert top is not None, "a reuse layer before its index layer"
        o = self.ops.decode_attend(rows[0], rows[1], cache.swa[l], ents, top, pos, ratio, w[b + "attn_sinks.weight"],
                                   cos, sin, None if out is None else out.view(1, H, hd))
        return o.reshape(1, H * hd)

    def attn_out(self, layer: int, carry, o: torch.Tensor) -> torch.Tensor:
        """carry of _rows, o [T, H*hd] (de-rotated) -> x [T, hc + 1, D] after the attention sublayer."""
        X, post, comb, pre_a = carry
        return self._pack(self.ops.hc_post(X, self._out_proj(layer, o), post, comb), pre_a)

    def _out_proj(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """o [T, H*hd] -> [T, D]: the grouped low-rank output projection."""
        p, b, T = self.p, f"blk.{layer}.", o.shape[0]
        g = p.o_groups
        wa = self.w[b + "attn_output_a.weight"].view(g, p.o_lora_rank, -1)
        y = torch.bmm(o.reshape(T, g, -1).transpose(0, 1), wa.transpose(1, 2)).transpose(0, 1)
        return F.linear(y.reshape(T, -1), self.w[b + "attn_output_b.weight"])

    def _compress_static(self, l: int, rows: tuple, st: SourceState, pos: torch.Tensor, tables) -> None:
        """One token of a KV source: its compressor row into the open window (ratio 2) and the window's entry
        w = pos // ratio pooled from the window's rows (the row not yet fed is stale: the entry is final, and
        visible, once the window's last token came), normed, rotated at w * ratio, into entries[w]; a key owner's
        indexer key from it into ikeys[w]. tables: the compressed RoPE tables at pos (ratio 1: the entry's)."""
        w, b, eps, r = self.w, f"blk.{l}.", self.cfg.rms_eps, self.p.compress_ratios[l]
        if r == 1:
            latent, win, (cos, sin) = rows[0], pos, tables
        else:
            st.buf_kv.index_copy_(0, pos.remainder(r), rows[0])
            st.buf_gate.index_copy_(0, pos.remainder(r), rows[1])
            pooled = (st.buf_kv.view(1, r, -1) * st.buf_gate.view(1, r, -1).softmax(dim=1)).sum(dim=1)
            latent = _rms(pooled.to(self.dtype), w[b + "attn_compressor_norm.weight"], eps)
            win = torch.div(pos, r, rounding_mode="floor")
            cos, sin = self.rope_comp.cos_sin(win * r)
        st.entries.index_copy_(0, win, apply_rope(latent, cos, sin))
        if st.ikeys is not None:
            k = _rms(F.linear(latent, w[b + "indexer.attn_k.weight"]), w[b + "indexer.k_norm.weight"], eps)
            st.ikeys.index_copy_(0, win, apply_rope(k, cos, sin))

    def _index_static(self, l: int, iq: torch.Tensor, wts: torch.Tensor, cache: DS41Cache,
                      pos: torch.Tensor) -> torch.Tensor:
        """One query's selection over the shared stream's visible entries -> the chosen rows [k], best first, the
        spare row (never visible) where fewer than k were allowed; the candidate layer leaves its blocks in
        cache.cand. TorchOps (the CPU): only the visible entries are scored, their count read on the host (the bits
        must not depend on max_len); else every row, the invisible ones -inf (fixed shapes)."""
        p, q = self.p, self.q
        keys = cache.src[q.key_source[l]].ikeys
        spare, r = keys.shape[0] - 1, p.compress_ratios[l]
        lengths = torch.div(pos + 1, r, rounding_mode="floor")                          # [1] visible entries
        if isinstance(self.ops, TorchOps):
            n, allowed = _visible(pos, r), None
        else:
            n = spare
            allowed = torch.arange(n, device=pos.device)[None, :] < lengths[:, None]
        sc = torch.einsum("thd,nd->thn", iq.float(), keys[:n].float())
        score = (sc.relu() * wts.unsqueeze(-1)).sum(dim=1)                                # [1, n]
        if allowed is not None:
            score = score.masked_fill(~allowed, float("-inf"))
        if l == q.candidate_layer:
            cand = select_candidate_blocks(score, lengths, q.candidate_blocks, q.candidate_block_size)
            cache.cand = cand if allowed is None else cand & allowed
        elif 0 <= q.candidate_layer < l:
            assert cache.cand is not None and cache.cand.shape == score.shape, "candidate mask of another stream"
            score = score.masked_fill(~cache.cand, float("-inf"))
        top = score.topk(min(p.index_topk, n), dim=-1)
        return torch.where(torch.isfinite(top.values), top.indices, spare)[0]

    def _guess_streams(self, x: torch.Tensor):
        """x -> (X [T, hc, D], the attention's pre [T, hc]: every layer's ffn collapses the streams by this lag)."""
        return self._unpack(x)

    def moe_input(self, layer: int, x: torch.Tensor):
        """x -> (h [T, D] = ffn_norm of the streams collapsed with the attention's pre, aux = the FFN's mix)."""
        X, pre_a = self._unpack(x)
        pre_f, post, comb, h = self._hc_pre(X, pre_a, layer, "ffn")
        return h, (pre_f, post, comb)

    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        b = f"blk.{layer}."
        w = self.w
        shared = self.ops.shared_ffn(h, w.get(b + "ffn_gate_up_shexp.weight"), w[b + "ffn_gate_shexp.weight"],
                                     w[b + "ffn_up_shexp.weight"], w[b + "ffn_down_shexp.weight"],
                                     float(self.p.swiglu_limit_shexp[layer]))
        X, _ = self._unpack(x)
        pre_f, post, comb = aux
        return self._pack(self.ops.hc_post(X, routed, post, comb, shared), pre_f)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hc + 1, D] -> logits [T, n_vocab] float32: the streams collapsed with the last FFN's pre."""
        X, pre = self._unpack(x)
        n = _rms(hc_collapse(X, pre), self.w[ds41layout.OUTPUT_NORM], self.cfg.rms_eps)
        return F.linear(n, self.w[ds41layout.OUTPUT]).float()

    # -- Engram --

    def _engram_row(self, layer: int, cache: DS41Cache) -> torch.Tensor | None:
        """A one-token pass's Engram values at `layer` [1, n_cols * key_length] (None: not an Engram layer): the
        staged buffer (engram_stage), or, in an eager pass nobody staged, the source's rows now (in layer order,
        as the prefill form asks)."""
        g = self.q.engram
        if g is None or layer not in g.layer_ids:
            return None
        st, e = cache.engram, g.index(layer)
        if st.staged:
            return st.vals[e]
        assert st.pending is not None and st.source is not None, "engram_begin must run before the layers"
        return st.source.rows(e, st.pending[:, e]).reshape(1, -1)

    def _engram(self, layer: int, X: torch.Tensor, cache: DS41Cache, off: int) -> torch.Tensor:
        """The layer's Engram on the streams of a chunk of the pending tokens (rows off.. of the pass),
        ENGRAM_TOKENS at a time from the chunk's start (worker/engram_feed.py plans the same units)."""
        g, st = self.q.engram, cache.engram
        assert st is not None and st.pending is not None and st.source is not None, \
            "engram_begin must run before the layers"
        T = X.shape[0]
        assert st.pending.shape[0] >= off + T, (st.pending.shape, off, T)
        e, b = g.index(layer), f"blk.{layer}."
        outs = []
        for a in range(0, T, ENGRAM_TOKENS):
            z = min(T, a + ENGRAM_TOKENS)
            emb = st.source.rows(e, st.pending[off + a:off + z, e]).reshape(z - a, -1)
            outs.append(engram_residual(X[a:z], emb, self.w[b + "engram_wkv.weight"], self.w[b + "engram_q.weight"],
                                        self.w[b + "engram_k.weight"], self.cfg.rms_eps))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- CSA2 attention --

    def _compress(self, l: int, u: torch.Tensor, st: SourceState, start: int) -> int:
        """A KV source consumes T tokens from position `start` on: every window they close becomes a rotated entry
        (and an indexer key) at its row; the open window's rows stay in the buffer -> the closed entries now."""
        w, b, eps, r = self.w, f"blk.{l}.", self.cfg.rms_eps, self.p.compress_ratios[l]
        first = start // r                                      # entries closed before this pass
        if r == 1:
            latent = _rms(F.linear(u, w[b + "attn_compressor_kv.weight"].to(u.dtype)),
                          w[b + "attn_compressor_norm.weight"], eps)
        else:
            open_n = start % r                                  # rows of the open window fed already: rows 0..open_n-1
            kv = torch.cat([st.buf_kv[:open_n], F.linear(u.float(), w[b + "attn_compressor_kv.weight"])])
            gate = torch.cat([st.buf_gate[:open_n], F.linear(u.float(), w[b + "attn_compressor_gate.weight"])])
            usable = kv.shape[0] // r * r
            rest = kv.shape[0] - usable
            st.buf_kv[:rest], st.buf_gate[:rest] = kv[usable:], gate[usable:]
            if usable == 0:
                return first
            nw = usable // r
            pooled = (kv[:usable].view(nw, r, -1) * gate[:usable].view(nw, r, -1).softmax(dim=1)).sum(dim=1)
            latent = _rms(pooled.to(u.dtype), w[b + "attn_compressor_norm.weight"], eps)
        nw = latent.shape[0]
        pos = (torch.arange(nw, device=u.device) + first) * r
        cos, sin = self.rope_comp.cos_sin(pos)
        st.entries[first:first + nw] = apply_rope(latent, cos, sin)
        if st.ikeys is not None:
            k = _rms(F.linear(latent, w[b + "indexer.attn_k.weight"]), w[b + "indexer.k_norm.weight"], eps)
            st.ikeys[first:first + nw] = apply_rope(k, cos, sin)
        return first + nw

    def _index(self, l: int, u: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cache: DS41Cache,
               n: int, start: int) -> torch.Tensor:
        """An index source's selection for a chunk's T queries (from position start) over the shared stream's n
        entries -> [T, n] bool; the candidate layer also leaves its blocks in cache.cands[start] for the index
        layers after it."""
        p, q, w, b = self.p, self.q, self.w, f"blk.{l}."
        T, r = u.shape[0], p.compress_ratios[l]
        keys = cache.src[q.key_source[l]].ikeys[:n]
        lengths = torch.div(positions + 1, r, rounding_mode="floor")                 # visible entries per query
        if n == 0:
            sel = torch.zeros(T, 0, dtype=torch.bool, device=u.device)
            if l == q.candidate_layer:
                cache.cands[start] = sel
            return sel
        nh, ihd = p.index_n_heads, p.index_head_dim
        cos, sin = self.rope_comp.cos_sin(positions)
        iq = apply_rope(F.linear(qr, w[b + "indexer.attn_q_b.weight"]).view(T, nh, ihd), cos, sin)
        wts = F.linear(u, w[b + "indexer.proj.weight"]).float() * (ihd ** -0.5 * nh ** -0.5)
        uses_cand = 0 <= q.candidate_layer < l
        cand = cache.cands.get(start) if uses_cand else None
        if uses_cand:
            assert cand is not None and cand.shape == (T, n), "candidate mask of another stream"
        sels, cands = [], []
        for a in range(0, T, QUERY_CHUNK):
            e = min(T, a + QUERY_CHUNK)
            sc = torch.einsum("thd,nd->thn", iq[a:e].float(), keys.float())
            score = (sc.relu() * wts[a:e].unsqueeze(-1)).sum(dim=1)                     # [Q, n]
            allowed = torch.arange(n, device=u.device)[None, :] < lengths[a:e, None]
            score = score.masked_fill(~allowed, float("-inf"))
            if l == q.candidate_layer:
                cands.append(select_candidate_blocks(score, lengths[a:e], q.candidate_blocks, q.candidate_block_size,
                                                     self.margins, l) & allowed)
            elif uses_cand:
                score = score.masked_fill(~cand[a:e], float("-inf"))
            k = min(p.index_topk, n)
            top = score.topk(k, dim=-1)
            if self.margins is not None and n > k:
                srt = score.sort(dim=-1, descending=True).values
                ok = torch.isfinite(srt[:, k])
                if ok.any():
                    self.margins.append((l, "indexer", float((srt[ok, k - 1] - srt[ok, k]).min())))
            sels.append(torch.zeros(e - a, n, dtype=torch.bool, device=u.device)
                        .scatter(1, top.indices, torch.isfinite(top.values)))
        if cands:
            cache.cands[start] = torch.cat(cands)
        return torch.cat(sels)

    def _attention(self, l: int, u: torch.Tensor, cache: DS41Cache, positions: torch.Tensor,
                   start: int) -> torch.Tensor:
        """u [T, D] (attn-normed) of a chunk from position start -> the attention output [T, D]."""
        cfg, p, q, w = self.cfg, self.p, self.q, self.w
        b, eps, hd, H, T = f"blk.{l}.", cfg.rms_eps, cfg.head_dim, cfg.n_head, u.shape[0]
        ratio = p.compress_ratios[l]
        cos, sin = (self.rope_comp if ratio else self.rope_main).cos_sin(positions)
        qr = _rms(F.linear(u, w[b + "attn_q_a.weight"]), w[b + "attn_q_a_norm.weight"], eps)
        qh = apply_rope(F.linear(qr, w[b + "attn_q_b.weight"]).view(T, H, hd), cos, sin)        # no per-head norm
        kv = apply_rope(_rms(F.linear(u, w[b + "attn_kv.weight"]), w[b + "attn_kv_a_norm.weight"], eps), cos, sin)
        W, ring = p.sliding_window, cache.swa[l]
        n_prev = min(start, W - 1)
        # the ring's last n_prev rows in position order, then this pass's rows
        keys = torch.cat([ring.index_select(0, _ring_rows(start - n_prev, n_prev, W, u.device)), kv])
        kpos = torch.arange(keys.shape[0], device=u.device) + (start - n_prev)
        m = min(T, W)
        ring.index_copy_(0, _ring_rows(start + T - m, m, W, u.device), kv[T - m:])
        entries = sel = None
        if ratio:
            if l in q.kv_sources:
                self._compress(l, u, cache.src[l], start)
            N = (start + T) // ratio                                                          # closed entries
            entries = cache.src[q.kv_source[l]].entries[:N]                                  # [N, hd]
            if l in q.index_sources:
                sel = cache.sel[start] = self._index(l, u, qr, positions, cache, N, start)
            else:
                sel = cache.sel.get(start)
                assert sel is not None and sel.shape == (T, N), "a reuse layer before its index layer"
        sinks = w[b + "attn_sinks.weight"].float().view(H, 1, 1)
        o = torch.empty(T, H, hd, dtype=u.dtype, device=u.device)
        for a in range(0, T, QUERY_CHUNK):
            e = min(T, a + QUERY_CHUNK)
            s0, s1 = max(0, n_prev + a - (p.sliding_window - 1)), n_prev + e
            qp = positions[a:e, None]
            kc, kp = keys[s0:s1], kpos[s0:s1]
            mask = (kp[None, :] <= qp) & (qp - kp[None, :] < p.sliding_window)
            if ratio:
                kc = torch.cat([kc, entries])
                mask = torch.cat([mask, sel[a:e]], dim=1)
            scores = torch.einsum("thd,sd->hts", qh[a:e].float(), kc.float()) * hd ** -0.5
            scores = scores.masked_fill(~mask[None], float("-inf"))
            sc = torch.cat([scores, sinks.expand(H, e - a, 1)], dim=-1)
            sc = sc - sc.max(dim=-1, keepdim=True).values
            probs = F.softmax(sc, dim=-1)[..., :-1]
            o[a:e] = torch.einsum("hts,sd->thd", probs, kc.float()).to(u.dtype)
        o = apply_rope(o, cos, -sin)                                                       # undo K=V's rotation
        return self._out_proj(l, o.reshape(T, -1))


class Deepseek41Reference(ReferenceExperts, Deepseek41Model):
    """The in-process path: experts dequantized from the file's map when needed, Engram rows read from the map."""

    def __init__(self, f, dense: dict[str, torch.Tensor], sub_batch: int = 16, kernels: str = "auto",
                 chunk: int | str | None = AUTO):
        Deepseek41Model.__init__(self, f.config, dense)
        self._init_reference(f, sub_batch, kernels, chunk)
        g = self.q.engram
        self.engram_rows = FileRows(f, g, self.device, self.dtype) if g is not None else None

    @torch.inference_mode()
    def forward(self, ids, cache) -> torch.Tensor:
        ids = self.check_ids(ids)
        self.engram_begin(cache, ids, self.engram_rows)
        return ReferenceExperts.forward(self, ids, cache)
