"""The qwen3moe forward pass, split into the pieces the out-of-core engine reuses.

`Qwen3MoeModel` owns everything but the routed experts: embedding, attention blocks, the MoE input
norm, routing and the output head. `Qwen3MoeReference` adds experts dequantized on demand from the
file's mmap and runs the whole pass in-process; it is the reference the engine must match bit for
bit (same device and dtype) and the path the CLI uses today.

Math follows transformers' Qwen3MoeForCausalLM and llama.cpp's qwen3moe graph:
  x = x + o(attn(rope(k_norm(k(n))), rope(q_norm(q(n))), v(n)))   n = attn_norm(x)
  x = x + sum_r w_r * expert_{e_r}(ffn_norm(x))                     e, w = top-k of softmax(router)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.layers import (NeoxRope, apply_rope, causal_attention, check_token_ids, rms_norm,
                                     static_decode_attention)
from betelgeuse.model.reference import ReferenceExperts
from betelgeuse.model.weights import DenseWeights
from betelgeuse.routing_approx import Residency, approx_topk
from betelgeuse.settings import AUTO


class Qwen3MoeModel:
    def __init__(self, cfg, dense: DenseWeights):
        assert cfg.n_head % cfg.n_head_kv == 0, (cfg.n_head, cfg.n_head_kv)
        assert 0 < cfg.n_expert_used <= cfg.n_expert, (cfg.n_expert_used, cfg.n_expert)
        self.cfg = cfg
        self.dense = dense
        self.device = dense.token_embd.device
        self.dtype = dense.token_embd.dtype
        self.rope = NeoxRope.create(cfg.head_dim, cfg.rope_theta, self.device)
        # the decode guess's per-layer tensors stacked (layers l+1..l+D one contiguous slice: one batched matmul for
        # all of them, guess_ids); each layer's router / ffn_norm re-pointed to its view: no extra memory
        ls = dense.layers
        self._routers = ls[0].router.new_empty((len(ls), *ls[0].router.shape))            # [L, E, H]
        self._ffn_norms = ls[0].ffn_norm.new_empty((len(ls), *ls[0].ffn_norm.shape))      # [L, H]
        for l, w in enumerate(ls):           # each loaded copy dropped as soon as it is in: peak one layer over
            self._routers[l], self._ffn_norms[l] = w.router, w.ffn_norm
            w.router, w.ffn_norm = self._routers[l], self._ffn_norms[l]
        self._ones = torch.ones_like(self._ffn_norms[0])                    # an unweighted rms_norm's weight [H]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()         # the dropped per-layer copies back to the device, not the allocator's cache

    # capabilities (model/interface.py). Prefill may run in position-aligned chunks (chunks.pass_chunks) and resume
    # after a cached prefix: the per-token K/V of a block depend only on the tokens up to it. Decode has the static
    # form (attention_block(static=True)), and batched decode may run qkv / attn_out over rows of several sequences
    # (worker/lanes.py)
    chunked_prefill = True
    prefix_reuse = "blocks"       # K/V per token: position-aligned blocks (worker/prefix_cache.py)
    static_decode = True
    lane_decode = True
    state_grows = True
    # decode guesses 3 layers ahead (`prefetch_depth` auto): depths 1-3 decode equally fast within the disk's noise on
    # the bench geometry (docs/benchmarks/gpu-run27-fusedguess), 3 the depth its serve runs were measured at
    guess_depth = 3
    # a depth's guesses are read ahead while at least half of them hit (`prefetch_min_hit` auto): the budget every
    # qwen3moe serve run since gpu-run27-fusedguess was measured at
    guess_min_hit = 0.5
    # prefill chunk (`prefill_chunk` auto) = the prefix cache's block: 64 tokens, a hit's granularity (a prompt reuses
    # its cached prefix down to its last whole block), the chunk every qwen3moe measurement ran (docs/benchmarks)
    prefill_chunk = 64

    @staticmethod
    def load_dense(f, device, dtype) -> DenseWeights:
        return DenseWeights.load(f, device, dtype)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.for_config(self.cfg, max_len, self.device, self.dtype)

    def grow_cache(self, cache: KVCache, max_len: int, via_host: bool = False) -> KVCache:
        """The state of up to max_len tokens holding cache's (consumed): KVCache.grow."""
        return cache.grow(max_len, via_host)

    def check_ids(self, ids) -> torch.Tensor:
        """Token ids (list or tensor) -> LongTensor [T] on the device; InvalidRequestError if bad."""
        return check_token_ids(ids, self.cfg.n_vocab, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> x [T,H]. Starts a pass: the RoPE tables are computed again for its positions."""
        self.rope.reset()
        return F.embedding(ids.to(self.device), self.dense.token_embd)

    def attention_block(self, layer: int, x: torch.Tensor, cache: KVCache,
                        positions: torch.Tensor, static: bool = False) -> torch.Tensor:
        """x [T,H] -> x + attn(attn_norm(x)) [T,H]; appends this layer's k/v at `positions` [T].
        static: the graph-capturable decode form (T = 1, positions = cache.pos on the device)."""
        q, k, v = self.qkv(layer, x, positions)
        if static:
            return self.attn_out(layer, x, self.attend_static(layer, (q, k, v), cache, positions))
        end = cache.write(layer, k, v, positions)
        attn = causal_attention(q, cache.k[layer][:, :end], cache.v[layer][:, :end], positions)
        return self.attn_out(layer, x, attn)

    # the three parts of attention_block, also run apart by batched decode (worker/lanes.py, model/interface.py
    # LaneDecode): qkv and attn_out on the rows of all sequences at once, attend_static per sequence (its own KV cache)
    def lane_rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """x [B,H] -> (carry = x for attn_out, rows = (q, k, v) heads-first [heads, B, hd])."""
        return x, self.qkv(layer, x, positions)

    @staticmethod
    def lane_row(rows: tuple, i: int) -> tuple:
        return tuple(t[:, i:i + 1] for t in rows)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """x [T,H], positions [T] (T rows: tokens of one sequence, or one token of each of T sequences) ->
        q [n_head,T,hd], k, v [n_head_kv,T,hd]: attn_norm, projections, per-head q/k RMSNorm, RoPE."""
        cfg, w = self.cfg, self.dense.layers[layer]
        T, hd = x.shape[0], cfg.head_dim
        n = rms_norm(x, w.attn_norm, cfg.rms_eps)
        # per-head RMSNorm on q and k (before RoPE), heads-first layout [heads, T, hd]
        q = rms_norm(F.linear(n, w.wq).view(T, cfg.n_head, hd), w.q_norm, cfg.rms_eps).transpose(0, 1)
        k = rms_norm(F.linear(n, w.wk).view(T, cfg.n_head_kv, hd), w.k_norm, cfg.rms_eps).transpose(0, 1)
        v = F.linear(n, w.wv).view(T, cfg.n_head_kv, hd).transpose(0, 1)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend_static(self, layer: int, rows: tuple, cache: KVCache, pos: torch.Tensor,
                      tables: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token of one sequence: rows = q [n_head,1,hd], k/v [n_head_kv,1,hd]; k/v written at the device
        position pos [1], attention over the whole static cache -> [1, n_head*hd] (copied into out when given).
        (tables unused: q/k come rotated.)"""
        q, k, v = rows
        cache.write_static(layer, k, v, pos)
        o = static_decode_attention(q, cache.k[layer], cache.v[layer], pos)
        return o if out is None else out.copy_(o)

    def attn_out(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [T,H], attn [T, n_head*hd] -> the residual x + wo attn [T,H]."""
        return x + F.linear(attn, self.dense.layers[layer].wo)

    # the routed experts' activation: (name, clamp limit); the engine's expert kernels read it
    expert_act = ("swiglu", None)

    def moe_input(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [T,H] -> (ffn_norm(x) [T,H], the input of router and experts; aux for moe_output: none here)."""
        return rms_norm(x, self.dense.layers[layer].ffn_norm, self.cfg.rms_eps), None

    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The residual after the MoE block: x + sum_r w_r expert_r(h) (qwen3moe has no shared expert)."""
        return x + routed

    def route(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
              resident: Residency | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T,H] -> (ids [T,k] int64, weights [T,k] in h's dtype): softmax over all experts in
        float32, top-k, renormalised when norm_topk_prob (always true for llama.cpp's qwen3moe).

        resident, a routing_approx.Residency, turns on an approximate mode (DESIGN.md §3.1, off by default):
        `resident` (rank 0 exact, ranks 1.. among resident experts first) or `pool` (every rank among them
        first). Not exact: outputs depend on residency."""
        logits = F.linear(h, self.dense.layers[layer].router)                  # [T, n_expert]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if resident is None:
            top, ids = torch.topk(probs, self.cfg.n_expert_used, dim=-1)
        else:
            ids = approx_topk(probs, self.cfg.n_expert_used, resident)
            top = probs.gather(1, ids)
        if getattr(self.cfg, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(h.dtype)

    def hash_table(self) -> None:
        """No layer routes by token id (model/interface.py)."""
        return None

    def guess_ids(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, n: int) -> torch.Tensor:
        """x [T,H] (the residual after layer `layer`'s attention) -> the expert ids [T, n, k] int64 (a view; on the
        device, no sync) that layers layer+1 .. layer+n's moe_input and route pick on x (worker/guess.py), all n
        at once: one norm, each layer's ffn_norm weight (rms_norm's bits: weight x normed), one batched matmul
        against the stacked routers, one softmax and one top-k. token_ids unused (no hash layers)."""
        rows = slice(layer + 1, layer + 1 + n)
        xn = rms_norm(x, self._ones, self.cfg.rms_eps)                       # [T,H], the normed x in x's dtype
        h = self._ffn_norms[rows].unsqueeze(1) * xn                           # [n,T,H]
        probs = torch.softmax(torch.bmm(h, self._routers[rows].transpose(1, 2)), dim=-1, dtype=torch.float32)
        return torch.topk(probs, self.cfg.n_expert_used, dim=-1).indices.permute(1, 0, 2)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T,H] -> logits [T, n_vocab] (float32 whatever the compute dtype)."""
        n = rms_norm(x, self.dense.output_norm, self.cfg.rms_eps)
        return F.linear(n, self.dense.output).float()


class Qwen3MoeReference(ReferenceExperts, Qwen3MoeModel):
    """The in-process path: experts dequantized from the file's mmap each time they are needed
    (model/reference.py)."""

    def __init__(self, f, dense: DenseWeights, sub_batch: int = 16, kernels: str = "auto",
                 chunk: int | str | None = AUTO):
        Qwen3MoeModel.__init__(self, f.config, dense)
        self._init_reference(f, sub_batch, kernels, chunk)

