"""The torch expert math: the SwiGLU expert FFN and the reference MoE (plan -> per-expert compute ->
fixed-order combine). It is the reference models' MoE (model/reference.py) and the torch backend of the
slot kernels (kernels/moe.py).

The MoE is split so that the out-of-core engine can reuse it with experts coming from slots: it
computes experts in whatever order their bytes arrive (resident first), yet gets the same bits as
this reference, because (1) each expert's tokens are processed in the same ascending order and the
same sub-batch chunks (matmul results can depend on the row count), (2) results land in y[t, r]
rather than being accumulated, and (3) `moe_combine` reduces over ranks in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F

ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # gate [F,H], up [F,H], down [H,F]


class Rows(Protocol):
    """Rows [a, b) of a pass: one position-aligned chunk (model.chunks.Chunk)."""
    a: int
    b: int


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               limit: float | None = None) -> torch.Tensor:
    """SwiGLU expert: x [n,H], gate/up [F,H], down [H,F] -> [n,H] = down(silu(gate x) * up x).
    limit (DeepSeek-V4's swiglu_limit): gate x is clamped to <= limit and up x to [-limit, limit] first."""
    g, u = F.linear(x, gate), F.linear(x, up)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.linear(F.silu(g) * u, down)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T,k,H] expert outputs by rank, weights [T,k] -> [T,H]. Reduced rank 0, 1, ..., k-1 in that
    order, so the bits do not depend on which expert was computed first."""
    T, k, H = y.shape
    assert weights.shape == (T, k), (weights.shape, y.shape)
    w = weights.to(y.dtype)
    out = y[:, 0] * w[:, 0, None]
    for r in range(1, k):
        out = out + y[:, r] * w[:, r, None]
    return out


@dataclass(slots=True)
class ExpertWork:
    """The rows one expert must process in a layer: token t at rank r, tokens ascending."""
    expert: int
    tokens: torch.Tensor            # [n] int64, ascending
    ranks: torch.Tensor             # [n] int64, the rank (0..k-1) at which token t chose `expert`
    segments: list[int] | None = None   # rows per pass chunk (sum n); sub-batches never cross a chunk boundary


def plan_experts(ids: torch.Tensor, chunks: Sequence[Rows] | None = None) -> dict[int, ExpertWork]:
    """ids [T,k] (top-k expert ids per token) -> {expert: ExpertWork}, keys ascending. With several pass chunks,
    each expert's rows are also split by chunk (ExpertWork.segments), so that a row's sub-batch holds only rows
    of its own chunk: its bits then do not depend on the tokens outside that chunk (model.chunks.pass_chunks).

    The row indices stay on ids' device, so applying an expert needs no host->device copy (on CUDA a
    copy from pageable memory would synchronise the stream and serialise copies with compute); the
    per-expert counts are the one host sync, and routing needs it anyway (it decides the loads)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    # a stable sort by expert keeps (token, rank) row-major order, so tokens stay ascending
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat).tolist()
    tokens, ranks = order // k, order % k
    seg = None
    if chunks is not None and len(chunks) > 1:
        # rows per (expert, chunk): the chunk of a row is that of its token (one sync, with the counts')
        of = torch.zeros(T, dtype=torch.int64, device=ids.device)
        for i, c in enumerate(chunks[1:], 1):
            of[c.a:] = i
        nc = len(chunks)
        per = torch.bincount(flat * nc + of[:, None].expand(T, k).reshape(-1), minlength=len(counts) * nc)
        seg = per.view(-1, nc).tolist()
    plan: dict[int, ExpertWork] = {}
    start = 0
    for e, n in enumerate(counts):
        if n:
            plan[e] = ExpertWork(expert=e, tokens=tokens[start:start + n], ranks=ranks[start:start + n],
                                 segments=[m for m in seg[e] if m] if seg is not None else None)
            start += n
    return plan


def run_expert(h: torch.Tensor, y: torch.Tensor, work: ExpertWork, weights: ExpertWeights,
               sub_batch: int = 16, limit: float | None = None) -> None:
    """Apply one expert to its tokens in chunks of `sub_batch` rows, writing y[t, r] in place.
    h [T,H] (ffn-normed), y [T,k,H]. The chunking is part of the bit-exact contract."""
    assert sub_batch > 0
    gate, up, down = weights
    tokens, ranks = work.tokens, work.ranks         # on h's device already (plan_experts)
    lo = 0
    for n in work.segments or [tokens.numel()]:
        for s in range(lo, lo + n, sub_batch):
            e = min(s + sub_batch, lo + n)
            t, r = tokens[s:e], ranks[s:e]
            y[t, r] = expert_ffn(h[t], gate, up, down, limit)
        lo += n


def apply_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  get_expert: Callable[[int], ExpertWeights], sub_batch: int = 16,
                  order: Sequence[int] | Iterable[int] | None = None, limit: float | None = None,
                  chunks: Sequence[Rows] | None = None) -> torch.Tensor:
    """The reference MoE: h [T,H], ids/weights [T,k] -> [T,H].

    Experts are computed in `order` (default: ascending id; must list each needed expert exactly
    once), each over its tokens in ascending order in chunks of `sub_batch`; the result does not
    depend on `order`, bit for bit. limit: the SwiGLU clamp (expert_ffn), None for qwen3moe.
    """
    T, k = ids.shape
    plan = plan_experts(ids, chunks)
    order = list(plan) if order is None else list(order)
    assert sorted(order) == list(plan), "order must list each routed expert exactly once"
    y = torch.zeros(T, k, h.shape[-1], dtype=h.dtype, device=h.device)
    for e in order:
        run_expert(h, y, plan[e], get_expert(e), sub_batch, limit)
    return moe_combine(y, weights)
