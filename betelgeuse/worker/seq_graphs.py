"""One sequence's dense work in a batched decode step, as CUDA graphs (runner.decode_batch).

A batched decode step runs, per layer, each sequence's dense part alone (attention, MoE input norm, routing:
the "front"; the residual add after the MoE: the "back") and the MoE over all sequences' rows at once. Run
eagerly, the dense part costs ~80 ms of kernel launches per sequence and pass on the benchmark geometry
(~60 launches per layer; measured with deploy/device/profile_batch.py), so 8 sequences spent 0.66 s of a pass
launching. Here each sequence replays its own graphs instead: one per layer and part, captured on its second
step, keyed by its KV cache, so they never depend on which other sequences share the batch (joining and
leaving needs no new capture). The first step runs the same functions eagerly (it warms the kernels up); the
capture step captures then replays them: eager, captured and replayed steps run the same kernels on the same
shapes, so the bits never depend on which it was (invariant 6 with invariant 1).

Static buffers (their addresses are in the graphs): `ids` [1] int64, `x` [1,H] the residual stream between
layers, `routed` [1,H] the sequence's row of the batched MoE output (copied in before the back part), the
cache's `pos` [1] (KVCache.begin_static). Outputs of a front part (attention output, h, aux, expert ids and
weights) live in the sequence's private graph pool and are read back from the same tensors each step.
"""

from __future__ import annotations

import torch

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


def capture(pool, fn):
    """Capture fn() into a new CUDA graph in `pool` (None: a new private pool) and replay it once (capture does
    not run the work). Returns (graph, fn's result). Unlike torch.cuda.graph(), no device sync, gc.collect()
    or empty_cache() per capture: a sequence captures ~100 graphs at once."""
    g = torch.cuda.CUDAGraph()
    cur = torch.cuda.current_stream()
    side = _side_stream(cur.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            g.capture_end()
    cur.wait_stream(side)
    g.replay()
    return g, out


_SIDE: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


class SeqGraphs:
    """A sequence's embed, per-layer front/back and head for batched decode: eager, then captured, then replayed."""

    def __init__(self, model, kv, n_layer: int, graphs: bool):
        self.model, self.kv, self.L = model, kv, n_layer
        self.mode = EAGER
        self.graphs = graphs               # False: always eager (CPU, or cuda_graphs = false)
        self.pool = None
        self.ids = self.x = self.routed = None
        self.g_embed = self.g_head = None
        self.g_front: list = [None] * n_layer
        self.g_back: list = [None] * n_layer
        self.front_out: list = [None] * n_layer   # (x after attention, h, aux, expert ids, weights) per layer
        self.logits_out = None

    # ---- the four parts, as plain functions of the static buffers (eager, captured: the same code) ----------
    def _embed(self):
        self.x.copy_(self.model.embed(self.ids))

    def _front(self, l: int):
        m = self.model
        xa = m.attention_block(l, self.x, self.kv, self.kv.pos, static=True)
        h, aux = m.moe_input(l, xa)
        ti, tw = m.route(l, h, self.ids, None)
        return xa, h, aux, ti, tw

    def _back(self, l: int):
        xa, h, aux, _, _ = self.front_out[l]
        self.x.copy_(self.model.moe_output(l, xa, aux, h, self.routed))

    def _head(self):
        return self.model.logits(self.x)

    def _run(self, fn, *args):
        """fn(*args) in this step's mode -> (graph or None, result)."""
        if self.mode == CAPTURE:
            g, out = capture(self.pool, lambda: fn(*args))
            self.pool = g.pool()
            return g, out
        return None, fn(*args)

    # ---- one step --------------------------------------------------------------------------------------
    def embed(self, token: torch.Tensor):
        """token [1] int64 on the device: starts this sequence's step (the position is kv.pos, set by the caller)."""
        if self.ids is None:
            self.ids = torch.empty_like(token)
            self.x = torch.empty((1, self.model.dense.token_embd.shape[1]), dtype=self.model.dtype,
                                 device=token.device)
            self.routed = torch.empty_like(self.x)
        self.ids.copy_(token)
        if self.mode == REPLAY:
            self.g_embed.replay()
        else:
            self.g_embed, _ = self._run(self._embed)

    def front(self, l: int):
        """-> (h [1,H], expert ids [1,k], weights [1,k]) of layer l, for the batched MoE."""
        if self.mode == REPLAY:
            self.g_front[l].replay()
        else:
            self.g_front[l], self.front_out[l] = self._run(self._front, l)
        _, h, _, ti, tw = self.front_out[l]
        return h, ti, tw

    def back(self, l: int, routed_row: torch.Tensor):
        """routed_row [1,H]: this sequence's row of the layer's MoE output; updates the residual stream."""
        self.routed.copy_(routed_row)
        if self.mode == REPLAY:
            self.g_back[l].replay()
        else:
            self.g_back[l], _ = self._run(self._back, l)

    def head(self) -> torch.Tensor:
        """-> logits [1, n_vocab] float32 (a fresh tensor: the graph's output is overwritten next step)."""
        if self.mode == REPLAY:
            self.g_head.replay()
        else:
            self.g_head, self.logits_out = self._run(self._head)
        out = self.logits_out.clone()
        if self.graphs:                                     # eager -> capture -> replay
            self.mode = CAPTURE if self.mode == EAGER else REPLAY
        assert self.mode != REPLAY or self.g_embed is not None, "replay without captured graphs"
        return out
