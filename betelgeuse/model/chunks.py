"""A pass's position-aligned chunks, and one layer's steps around its experts: the front (attention, MoE input,
routing) and the back (the residual), chunk by chunk.

This is pass orchestration, not model math: the runner's layer-major pass (worker/runner.py) and the in-process
reference forward (model/reference.py) both drive a model's per-layer surface (model/interface.py) through it, so
they cut a pass the same way and get the same bits. It imports nothing of model/ (the bottom of the room).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Chunk:
    """Rows [a, b) of a pass: one position-aligned chunk (absolute positions [start + a, start + b))."""
    a: int
    b: int
    positions: torch.Tensor         # [b - a] int64 on the device (the same tensor for every layer of the pass)
    cache: object = None            # the chunk's sequence cache when a pass holds several sequences (None: the pass's)


def pass_chunks(positions: torch.Tensor, start: int, chunk: int | None) -> list[Chunk]:
    """Split a pass of T tokens starting at absolute position `start` at the multiples of `chunk` (None: one chunk).

    Why: a matmul's bits can depend on its row count, so dense ops run chunk by chunk on fixed absolute
    boundaries; a token's row then never depends on how many tokens share its pass, and a prompt prefilled
    after a cached prefix (which ends on a boundary) or in several passes gets the same bits as in one pass."""
    bounds = chunk_bounds(start, positions.numel(), chunk)
    if len(bounds) == 1:
        return [Chunk(0, bounds[0][1], positions)]
    return [Chunk(a, b, positions[a:b]) for a, b in bounds]


def chunk_bounds(start: int, T: int, chunk: int | None) -> list[tuple[int, int]]:
    """Rows [a, b) of each chunk of pass_chunks (the host's arithmetic alone: worker/engram_feed.py plans by it)."""
    if chunk is None or T <= chunk and start // chunk == (start + T - 1) // chunk:
        return [(0, T)]
    out, a = [], 0
    while a < T:
        b = min(T, (start + a) // chunk * chunk + chunk - start)
        out.append((a, b))
        a = b
    return out


def layer_front(model, layer: int, x: torch.Tensor, cache, chunks: list[Chunk], ids: torch.Tensor, resident=None,
                after_attn=None):
    """Attention, MoE input and routing of one layer, chunk by chunk: x [T,H] -> (x [T,H], h [T,H], auxs (one per
    chunk), top ids [T,k], top weights [T,k]). The experts then run over all T rows at once (row-invariant).
    after_attn(): called once the attention of a lone chunk is enqueued (decode's PassStats.gpu_marks), or None."""
    if len(chunks) == 1:
        x = model.attention_block(layer, x, cache if chunks[0].cache is None else chunks[0].cache, chunks[0].positions)
        if after_attn is not None:
            after_attn()
        h, aux = model.moe_input(layer, x)
        ti, tw = model.route(layer, h, ids, resident)
        return x, h, [aux], ti, tw
    xs, hs, auxs, tis, tws = [], [], [], [], []
    for c in chunks:
        xc = model.attention_block(layer, x[c.a:c.b], cache if c.cache is None else c.cache, c.positions)
        h, aux = model.moe_input(layer, xc)
        ti, tw = model.route(layer, h, ids[c.a:c.b], resident)
        xs.append(xc), hs.append(h), auxs.append(aux), tis.append(ti), tws.append(tw)
    return torch.cat(xs), torch.cat(hs), auxs, torch.cat(tis), torch.cat(tws)


def layer_back(model, layer: int, x, auxs, h, routed, chunks: list[Chunk]) -> torch.Tensor:
    """The residual after the MoE block, chunk by chunk (a shared expert is a dense op too)."""
    if len(chunks) == 1:
        return model.moe_output(layer, x, auxs[0], h, routed)
    return torch.cat([model.moe_output(layer, x[c.a:c.b], aux, h[c.a:c.b], routed[c.a:c.b])
                      for c, aux in zip(chunks, auxs)])
