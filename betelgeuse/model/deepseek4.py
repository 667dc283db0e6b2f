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

Cache state per layer (`DS4Cache`): the last window-1 K=V rows, and per compressor (attention's and the
indexer's) the tokens of the open window, the compressed entries emitted so far and (CSA) the previous
window's first-half rows; so decode and chunked prefill equal a whole-prompt prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from betelgeuse.config import PREFILL_CHUNK
from betelgeuse.errors import InvalidRequestError, ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds4layout
from betelgeuse.kernels.torch_moe import expert_ffn
from betelgeuse.model.layers import check_token_ids
from betelgeuse.model.reference import ReferenceExperts

QUERY_CHUNK = ds4layout.QUERY_CHUNK   # attention queries per block (bounds the score tensor; attention_block)

# tensors kept in float32 whatever the compute dtype (transformers' _keep_in_fp32_modules_strict)
_FP32_KINDS = ("attn_norm", "ffn_norm", "output_norm", "attn_sinks", "attn_q_a_norm", "attn_kv_a_norm",
               "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
               "output_hc_fn", "output_hc_base", "output_hc_scale", "attn_compressor_ape", "attn_compressor_norm",
               "indexer_compressor_ape", "indexer_compressor_norm", "exp_probs_b")


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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope_dim] float32 (each angle repeated for its pair)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d] with cos/sin [T, r] -> x with its last r dims rotated (in float32, as HF)."""
    r = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-r], x[..., -r:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + rot.float() * sin).to(x.dtype)], dim=-1)


# ---- per-sequence state ---------------------------------------------------------------------------

@dataclass(slots=True)
class CompState:
    """One compressor's state (attention's or the indexer's) in one layer."""
    buf_kv: torch.Tensor            # [n, C] projected rows of the open window (n < ratio)
    buf_gate: torch.Tensor          # [n, C]
    entries: torch.Tensor           # [N, d] compressed entries so far (entry w covers tokens w*ratio..)
    overlap_kv: torch.Tensor | None = None     # [ratio, d] CSA: the last closed window's first half
    overlap_gate: torch.Tensor | None = None


@dataclass(slots=True)
class LayerState:
    swa: torch.Tensor                # [n, head_dim] the last <= window-1 K=V rows (positions length-n..length-1)
    comp: CompState | None = None
    idx: CompState | None = None


@dataclass(slots=True)
class DS4Cache:
    layers: list[LayerState]
    max_len: int                     # tokens
    length: int = 0                  # tokens every layer has consumed
    _pending: int = field(default=0, repr=False)

    def begin(self, n_tokens: int) -> torch.Tensor:
        if self.length + n_tokens > self.max_len:
            raise InvalidRequestError(
                f"sequence of {self.length + n_tokens} tokens exceeds the cache of {self.max_len} tokens")
        self._pending = n_tokens
        return torch.arange(self.length, self.length + n_tokens, device=self.layers[0].swa.device)

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def truncate(self, n: int) -> None:
        """Only a no-op or a full reset: compressed state cannot be rewound to an arbitrary prefix."""
        if n == self.length:
            self._pending = 0
            return
        raise UnsupportedError(f"a deepseek4 cache cannot be truncated from {self.length} to {n} tokens")

    def nbytes(self) -> int:
        ts = []
        for s in self.layers:
            ts.append(s.swa)
            for c in (s.comp, s.idx):
                if c is not None:
                    ts += [c.buf_kv, c.buf_gate, c.entries] + [t for t in (c.overlap_kv, c.overlap_gate) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


# ---- the model ------------------------------------------------------------------------------------

class Deepseek4Model:
    # capabilities (model/interface.py). The compressed entries are built from whole blocks of 4/128 tokens inside
    # one pass: prefill runs as one chunk and the state is not cut into prefix-cache blocks. No graph-capturable
    # decode form yet: the compressed entries and open windows change shape per token, so the runner decodes
    # deepseek4 eagerly on CUDA too (and without the lanes)
    chunked_prefill = False
    static_decode = False
    lane_decode = False

    def __init__(self, cfg, dense: dict[str, torch.Tensor]):
        assert cfg.arch == "deepseek4" and cfg.ds4 is not None, cfg.arch
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
        if len(set(p.swiglu_limit)) != 1:
            raise UnsupportedError(f"{cfg.name}: per-layer swiglu_clamp_exp values {sorted(set(p.swiglu_limit))} "
                                   "differ, which is not supported")
        for l in range(min(p.n_hash_layers, cfg.n_layer)):
            t = self.w[f"blk.{l}.ffn_gate_tid2eid.weight"]
            if int(t.min()) < 0 or int(t.max()) >= cfg.n_expert:
                raise ModelFormatError(f"{cfg.name}: blk.{l}.ffn_gate_tid2eid holds expert ids outside 0..{cfg.n_expert - 1}")

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
                out[name] = f.load_tensor(name, device, torch.float32 if k in _FP32_KINDS else dtype)
        return out

    # -- the MoEModel surface (model/interface.py) --

    @property
    def expert_act(self) -> tuple[str, float | None]:
        return "swiglu", float(self.p.swiglu_limit[0])

    def new_cache(self, max_len: int) -> DS4Cache:
        assert max_len > 0, max_len
        hd, dev, dt = self.cfg.head_dim, self.device, self.dtype

        def comp(ratio: int, d: int) -> CompState:
            c = (2 if ratio == 4 else 1) * d
            e = torch.zeros(0, c, device=dev, dtype=dt)
            return CompState(buf_kv=e, buf_gate=e, entries=torch.zeros(0, d, device=dev, dtype=dt))

        layers = []
        for r in self.p.compress_ratios:
            s = LayerState(swa=torch.zeros(0, hd, device=dev, dtype=dt))
            if r:
                s.comp = comp(r, hd)
                if r == 4:
                    s.idx = comp(r, self.p.index_head_dim)
            layers.append(s)
        return DS4Cache(layers=layers, max_len=max_len)

    def check_ids(self, ids) -> torch.Tensor:
        return check_token_ids(ids, self.cfg.n_vocab, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> X [T, hc, D]: the embedding copied into each residual stream."""
        e = F.embedding(ids.to(self.device), self.w[ds4layout.TOKEN_EMBD])
        return e.unsqueeze(1).expand(-1, self.p.hc_mult, -1).contiguous()

    def _hc_pre(self, X: torch.Tensor, l: int, s: str):
        """X [T, hc, D] -> post [T, hc], comb [T, hc, hc] (float32), u [T, D] (X's dtype)."""
        p, hc = self.p, self.p.hc_mult
        fn, base, scale = (self.w[f"blk.{l}.hc_{s}_{k}.weight"] for k in ("fn", "base", "scale"))
        T = X.shape[0]
        flat = _unweighted_rms(X.reshape(T, -1).float(), self.cfg.rms_eps)
        m = F.linear(flat, fn.float())
        pre_w, post_w, comb_w = m.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + p.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + p.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + p.hc_eps)
        for _ in range(p.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + p.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + p.hc_eps)
        u = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
        return post, comb, u

    @staticmethod
    def _hc_post(X: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X' [T, hc, D] = post_k * out + sum_j comb[j, k] X_j."""
        dt = X.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), X)

    def _compress(self, st: CompState, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
                  norm: torch.Tensor, ratio: int, d: int) -> torch.Tensor:
        """Feed T projected rows (kv, gate [T, C]); close every full window; returns all entries [N, d]."""
        kv, gate = torch.cat([st.buf_kv, kv]), torch.cat([st.buf_gate, gate])
        usable = kv.shape[0] // ratio * ratio
        st.buf_kv, st.buf_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return st.entries
        nw, first = usable // ratio, st.entries.shape[0] * ratio
        ck = kv[:usable].view(nw, ratio, -1)
        cg = gate[:usable].view(nw, ratio, -1) + ape
        if ratio == 4:      # overlapping windows: entry w pools window w-1's first half and window w's second
            nk = ck.new_zeros((nw, 2 * ratio, d))
            ng = cg.new_full((nw, 2 * ratio, d), float("-inf"))
            nk[:, ratio:], ng[:, ratio:] = ck[..., d:], cg[..., d:]
            if nw > 1:
                nk[1:, :ratio], ng[1:, :ratio] = ck[:-1, :, :d], cg[:-1, :, :d]
            if st.overlap_kv is not None:
                nk[0, :ratio], ng[0, :ratio] = st.overlap_kv.to(nk.dtype), st.overlap_gate.to(ng.dtype)
            st.overlap_kv, st.overlap_gate = ck[-1, :, :d].clone(), cg[-1, :, :d].clone()
            ck, cg = nk, ng
        pooled = (ck * cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)).sum(dim=1)
        comp = _rms(pooled, norm, self.cfg.rms_eps)
        pos = torch.arange(nw, device=comp.device) * ratio + first
        cos, sin = self.rope_comp.cos_sin(pos)
        comp = apply_rope(comp, cos, sin)
        st.entries = torch.cat([st.entries, comp])
        return st.entries

    def attention_block(self, layer: int, x: torch.Tensor, cache: DS4Cache, positions: torch.Tensor,
                        static: bool = False) -> torch.Tensor:
        """X [T, hc, D] -> X after the attention sublayer; consumes T tokens of this layer's cache state.
        static (the graph-capturable decode form) is not supported: static_decode = False."""
        assert not static, "deepseek4 has no static decode form"
        cfg, p, w, l = self.cfg, self.p, self.w, layer
        b, eps, hd, H = f"blk.{l}.", cfg.rms_eps, cfg.head_dim, cfg.n_head
        T = x.shape[0]
        post, comb, u = self._hc_pre(x, l, "attn")
        u = _rms(u, w[b + "attn_norm.weight"], eps)
        ratio = p.compress_ratios[l]
        rope = self.rope_comp if ratio else self.rope_main
        cos, sin = rope.cos_sin(positions)
        qr = _rms(F.linear(u, w[b + "attn_q_a.weight"]), w[b + "attn_q_a_norm.weight"], eps)
        q = _unweighted_rms(F.linear(qr, w[b + "attn_q_b.weight"]).view(T, H, hd), eps)
        q = apply_rope(q, cos, sin)                                           # [T, H, hd]
        kv = apply_rope(_rms(F.linear(u, w[b + "attn_kv.weight"]), w[b + "attn_kv_a_norm.weight"], eps), cos, sin)
        st = cache.layers[l]
        n_prev = st.swa.shape[0]
        keys = torch.cat([st.swa, kv])                    # [n_prev + T, hd]: positions positions[0]-n_prev ..
        kpos = torch.arange(keys.shape[0], device=x.device) + (positions[0] - n_prev)
        st.swa = keys[max(0, keys.shape[0] - (p.sliding_window - 1)):]
        entries = ikeys = None
        if ratio:
            entries = self._compress(st.comp, F.linear(u, w[b + "attn_compressor_kv.weight"]),
                                     F.linear(u, w[b + "attn_compressor_gate.weight"]),
                                     w[b + "attn_compressor_ape.weight"], w[b + "attn_compressor_norm.weight"],
                                     ratio, hd)                                    # [N, hd]
            if ratio == 4:      # always: the indexer's compressor consumes these tokens too
                ikeys, iq, iw = self._indexer_inputs(l, u, qr, positions, st.idx)
                assert ikeys.shape[0] == entries.shape[0], (ikeys.shape, entries.shape)
        sinks = w[b + "attn_sinks.weight"].float().view(H, 1, 1)
        o = torch.empty(T, H, hd, dtype=x.dtype, device=x.device)
        # queries in chunks: a chunk's window keys are its own rows plus the window-1 before them, so the
        # scores are [H, Q, Q + window - 1 + N] whatever the prompt length (not [H, T, T + N])
        for a in range(0, T, QUERY_CHUNK):
            e = min(T, a + QUERY_CHUNK)
            s0, s1 = max(0, n_prev + a - (p.sliding_window - 1)), n_prev + e
            qp = positions[a:e, None]
            kc, kp = keys[s0:s1], kpos[s0:s1]
            mask = (kp[None, :] <= qp) & (qp - kp[None, :] < p.sliding_window)          # [Q, S]
            if ratio:
                N = entries.shape[0]
                visible = torch.arange(N, device=x.device)[None, :] < (qp + 1) // ratio  # [Q, N]
                if ratio == 4 and N:
                    visible = visible & self._index_select(l, iq[a:e], iw[a:e], ikeys, visible)
                kc = torch.cat([kc, entries])
                mask = torch.cat([mask, visible], dim=1)
            scores = torch.einsum("thd,sd->hts", q[a:e], kc) * hd ** -0.5               # [H, Q, S+N]
            scores = scores.masked_fill(~mask[None], float("-inf"))
            comb_l = torch.cat([scores, sinks.to(scores.dtype).expand(H, e - a, 1)], dim=-1)
            comb_l = comb_l - comb_l.max(dim=-1, keepdim=True).values
            probs = F.softmax(comb_l, dim=-1, dtype=comb_l.dtype)[..., :-1]
            o[a:e] = torch.einsum("hts,sd->thd", probs.to(kc.dtype), kc)
        o = apply_rope(o, cos, -sin)                                              # undo K=V's rotation
        g = p.o_groups
        wa = w[b + "attn_output_a.weight"].view(g, p.o_lora_rank, -1)          # [g, o_lora, H*hd/g]
        y = torch.bmm(o.reshape(T, g, -1).transpose(0, 1), wa.transpose(1, 2)).transpose(0, 1)   # [T, g, o_lora]
        out = F.linear(y.reshape(T, -1), w[b + "attn_output_b.weight"])
        return self._hc_post(x, out, post, comb)

    def _indexer_inputs(self, l: int, u: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, st: CompState):
        """A CSA layer's lightning indexer: feeds its compressor -> (keys [N, ihd], q [T, nh, ihd], weights [T, nh])."""
        p, w, b = self.p, self.w, f"blk.{l}."
        ihd, nh, T = p.index_head_dim, p.index_n_heads, u.shape[0]
        keys = self._compress(st, F.linear(u, w[b + "indexer_compressor_kv.weight"]),
                              F.linear(u, w[b + "indexer_compressor_gate.weight"]),
                              w[b + "indexer_compressor_ape.weight"], w[b + "indexer_compressor_norm.weight"], 4, ihd)
        cos, sin = self.rope_comp.cos_sin(positions)
        q = apply_rope(F.linear(qr, w[b + "indexer.attn_q_b.weight"]).view(T, nh, ihd), cos, sin)
        wts = F.linear(u, w[b + "indexer.proj.weight"]).float() * nh ** -0.5
        return keys, q, wts

    def _index_select(self, l: int, q: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
        """score(t, w) = sum_h wts[t,h] relu(q[t,h] . K[w]) / sqrt(ihd) -> the top index_topk visible entries
        of each query [Q, N] bool."""
        p, N = self.p, keys.shape[0]
        sc = F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float())) * p.index_head_dim ** -0.5   # [Q, nh, N]
        score = (sc * wts.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))           # [Q, N]
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
        post, comb, u = self._hc_pre(x, layer, "ffn")
        return _rms(u, self.w[f"blk.{layer}.ffn_norm.weight"], self.cfg.rms_eps), (post, comb)

    def route(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
              resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] -> (ids [T, k] int64, weights [T, k] in h's dtype).

        scores = sqrt(softplus(router h)); hash layers take ids = tid2eid[token_ids], the others the top-k of
        scores + exp_probs_b (the bias selects only); weights = scores[ids] / sum x expert_weights_scale.
        resident [n_expert] bool: the approximate `resident` mode (rank 0 exact, ranks 1.. among resident
        experts first); hash layers ignore it (their choice is static)."""
        p, b, k = self.p, f"blk.{layer}.", self.cfg.n_expert_used
        scores = F.softplus(F.linear(h, self.w[b + "ffn_gate_inp.weight"]).float()).sqrt()   # [T, E]
        if layer < p.n_hash_layers:
            if token_ids is None:
                raise ValueError("hash-routed layers need the token ids")
            ids = self.w[b + "ffn_gate_tid2eid.weight"][token_ids.to(self.device)]
        else:
            sel = scores + self.w[b + "exp_probs_b.bias"]
            if resident is None:
                ids = torch.topk(sel, k, dim=-1).indices
                if self.margins is not None and k < sel.shape[1]:
                    srt = sel.sort(dim=-1, descending=True).values
                    self.margins.append((layer, "experts", float((srt[:, k - 1] - srt[:, k]).min())))
            else:
                first = sel.argmax(dim=-1, keepdim=True)
                boost = (sel.max() - sel.min() + 1.0) * resident.to(sel.dtype)[None, :]
                rest = (sel + boost).scatter(1, first, float("-inf"))
                ids = torch.cat([first, torch.topk(rest, k - 1, dim=-1).indices], dim=-1)
        wts = scores.gather(1, ids)
        if p.weights_norm:
            wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (wts * p.routed_scale).to(h.dtype)

    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """routed [T, D] = sum_r w_r expert_r(h); adds the shared expert and mixes back into the streams."""
        b = f"blk.{layer}."
        shared = expert_ffn(h, self.w[b + "ffn_gate_shexp.weight"], self.w[b + "ffn_up_shexp.weight"],
                            self.w[b + "ffn_down_shexp.weight"], float(self.p.swiglu_limit_shexp[layer]))
        post, comb = aux
        return self._hc_post(x, routed + shared, post, comb)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """X [T, hc, D] -> logits [T, n_vocab] float32."""
        fn, base, scale = (self.w[n] for n in ds4layout.HC_HEAD)
        flat = _unweighted_rms(x.flatten(1).float(), self.cfg.rms_eps)
        pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + self.p.hc_eps
        hcol = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        n = _rms(hcol, self.w[ds4layout.OUTPUT_NORM], self.cfg.rms_eps)
        return F.linear(n, self.w[ds4layout.OUTPUT]).float()


class Deepseek4Reference(ReferenceExperts, Deepseek4Model):
    """The in-process path: experts dequantized from the file's mmap each time they are needed
    (model/reference.py)."""

    def __init__(self, f, dense: dict[str, torch.Tensor], sub_batch: int = 16, kernels: str = "auto",
                 chunk: int | None = PREFILL_CHUNK):
        Deepseek4Model.__init__(self, f.config, dense)
        self._init_reference(f, sub_batch, kernels, chunk)


