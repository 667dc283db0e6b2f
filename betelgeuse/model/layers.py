"""Stateless building blocks of a qwen3moe forward pass: RMSNorm, NEOX RoPE, causal attention (whole and static).
The expert FFN and the reference MoE are the kernels' torch backend (kernels/torch_moe.py); a pass's chunks and the
per-layer steps around the experts are model/chunks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from betelgeuse.errors import InvalidRequestError

_FUSED_NORM = None


def check_token_ids(ids, n_vocab: int, device) -> torch.Tensor:
    """Token ids (list or tensor) -> LongTensor [T] on `device`; InvalidRequestError naming a bad one."""
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        # Python ints (every pass's ids, a decode step's one token): checked in Python and one tensor made, not the
        # seven torch calls below (as_tensor, reshape, numel, min, max, two reads back; issue 21: per decode token)
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= n_vocab:
            raise InvalidRequestError(f"token id {lo if lo < 0 else hi} is out of range [0, {n_vocab})")
        return torch.tensor(ids, dtype=torch.long, device=device)
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InvalidRequestError("no input tokens")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n_vocab:
        raise InvalidRequestError(f"token id {lo if lo < 0 else hi} is out of range [0, {n_vocab})")
    return ids.to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]; statistics in float32 (as HF and llama.cpp), result in x's dtype.
    On CUDA one fused Triton launch (kernels/triton_norm.py), elsewhere these torch ops."""
    global _FUSED_NORM
    if x.is_cuda:
        if _FUSED_NORM is None:
            try:
                from betelgeuse.kernels.triton_norm import rms_norm as fused
                _FUSED_NORM = fused
            except Exception:            # no triton: the torch ops below
                _FUSED_NORM = False
        if _FUSED_NORM:
            return _FUSED_NORM(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(slots=True)
class NeoxRope:
    """NEOX-style rotary embedding (rotate-half over two halves of head_dim), as HF and llama.cpp's
    LLAMA_ROPE_TYPE_NEOX for qwen3moe. GGUF stores qwen3moe q/k weights unpermuted, so no
    interleaving is needed."""
    inv_freq: torch.Tensor          # [head_dim/2] float32

    @classmethod
    def create(cls, head_dim: int, theta: float, device) -> "NeoxRope":
        assert head_dim % 2 == 0, head_dim
        # same expression (and so the same float32 bits) as transformers' default rope init
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return cls(inv_freq=inv.to(device))

    # id(positions) -> (positions tensor, dtype, cos, sin): every layer of a pass passes the same positions tensor
    # (one per chunk), so the tables are computed once per pass and chunk; reset() starts a pass
    _memo: dict = field(default_factory=dict)

    def reset(self):
        self._memo = {}

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype`; computed once per positions tensor, not per layer."""
        hit = self._memo.get(id(positions))
        if hit is not None and hit[0] is positions and hit[1] == dtype:
            return hit[2], hit[3]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._memo[id(positions)] = (positions, dtype, cos, sin)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n_heads, T, head_dim]; cos/sin [T, head_dim] -> rotated x (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_pos: torch.Tensor) -> torch.Tensor:
    """Grouped-query causal attention for one sequence.

    q [n_head, T, D], k/v [n_head_kv, S, D] (keys of positions 0..S-1), q_pos [T] absolute positions.
    Returns [T, n_head * D]. Query head h reads kv head h // (n_head / n_head_kv), as HF's repeat_kv.
    """
    n_head, T, D = q.shape
    n_kv, S, _ = k.shape
    assert n_head % n_kv == 0, (n_head, n_kv)
    rep = n_head // n_kv
    # fold the heads that share a kv head into the query-row axis: [n_kv, rep*T, D]
    qg = q.reshape(n_kv, rep * T, D)
    if T == 1:
        # decode: the cache is append-only, so the one query is the newest position (S - 1) and every
        # cached key is visible (not checked here: reading q_pos would sync a CUDA stream every layer)
        mask = None
    else:
        key_pos = torch.arange(S, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]            # [T, S] bool, True = attend
        mask = mask.repeat(rep, 1)                           # [rep*T, S], rows ordered (rep, t)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=D ** -0.5)
    # [n_kv, rep*T, D] -> [n_head, T, D] -> [T, n_head*D]
    return out.reshape(n_head, T, D).transpose(0, 1).reshape(T, n_head * D)


def static_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One query at the device position pos [1] over the whole cache k/v [n_head_kv, S, D], keys > pos masked:
    shapes never depend on the sequence length, so a CUDA graph captures it once. q [n_head, 1, D] -> [1, n_head*D]."""
    n_head, T, D = q.shape
    n_kv, S, _ = k.shape
    rep = n_head // n_kv
    qg = q.reshape(n_kv, rep * T, D)
    mask = (torch.arange(S, device=q.device)[None, :] <= pos[:, None]).expand(rep * T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=D ** -0.5)
    return out.reshape(n_head, T, D).transpose(0, 1).reshape(T, n_head * D)
