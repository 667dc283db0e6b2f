"""Batched decode in the static form: the dense work of all running sequences as row-batched ops over fixed lanes.

A batched decode step (runner.decode_batch) runs, per layer: attention, the MoE input norm and routing (the dense
part), then the MoE over every sequence's rows at once. Run one sequence at a time, the dense part was ~70 kernels
per layer and sequence: at 8 sequences ~75 ms of an 8-sequence pass's ~84 ms of GPU time, and 16 graph launches
per layer (deploy/device/profile_batch.py). Here it runs ONCE per layer over B = max_running rows ("lanes"):

    pre[l]     lanes [B]: the residual of layer l-1 (x + routed; the embedding at l = 0), attn_norm, q/k/v
               projections, q/k norms, RoPE at each lane's position                       (one graph, all lanes)
    attend     per sequence, on its own lane's q/k/v row: K/V written into its cache, attention over it
                                                                                      (one graph per sequence)
    post[l]    lanes [B]: wo projection + residual, ffn_norm, router softmax / top-k      (one graph, all lanes)
    MoE        the running lanes' rows (index_select), eager as before; their output rows go back into `routed`
    head       the last residual, output norm, logits [B, n_vocab]                         (one graph, all lanes)

Why the bits do not depend on the batch (invariant 6): every op of pre / post / head is row-wise (a matmul row's
reduction never mixes rows) and always runs on the same shapes, [B, ...], whoever occupies the other lanes (a
fixed M, so the library picks the same kernel; measured row-position-invariant on CPU and CUDA, checked on both:
tests/test_batched_decode.py, deploy/device/check_cuda.py). Attention is per sequence. A lane that is free holds
whatever its last token left (finite: the embedding is recomputed for every lane each step) and is never read
into a running row. A sequence keeps its lane while it runs (its attention graph has the lane's row baked in);
one decoding alone runs the same B-row ops, so the engine decodes a lone sequence through here too.

Graphs: the lane graphs are eager on their first step, captured on their second and replayed after (they do not
depend on which sequences run: captured once); a sequence's attention graphs likewise, from its own first step.
Eager, captured and replayed steps run the same kernels on the same shapes, so the bits never depend on which it
was (invariant 1). On the CPU (tests force this form there) everything runs eagerly.
"""

from __future__ import annotations

import torch

from betelgeuse.errors import BetelgeuseError
from betelgeuse.worker.graphs import CAPTURE, EAGER, REPLAY, capture


class _SeqAttn:
    """One sequence's attention graphs (one per layer) and its lane."""

    __slots__ = ("lane", "mode", "pool", "graphs", "kv", "last")

    def __init__(self, lane: int, kv, n_layer: int):
        self.lane, self.kv = lane, kv
        self.mode = EAGER
        self.pool = None
        self.graphs: list = [None] * n_layer
        self.last = 0                       # the step it last ran (a free lane for a newcomer: least recent first)


class Lanes:
    def __init__(self, model, n_layer: int, n_lanes: int, graphs: bool):
        m = model
        self.m, self.L, self.B = m, n_layer, n_lanes
        dev, H = m.device, m.dense.token_embd.shape[1]
        self.graphs_on = graphs
        self.ids = torch.zeros(n_lanes, dtype=torch.int64, device=dev)       # each lane's token this step
        self.pos = torch.zeros(n_lanes, dtype=torch.int64, device=dev)       # each lane's position this step
        self.routed = torch.zeros((n_lanes, H), dtype=m.dtype, device=dev)   # the MoE output rows of the layer
        self.attn = torch.zeros((n_lanes, m.cfg.n_head * m.cfg.head_dim), dtype=m.dtype, device=dev)
        self.mode = EAGER
        self.pool = None
        self.g_pre: list = [None] * n_layer
        self.g_post: list = [None] * n_layer
        self.g_head = None
        self.out_pre: list = [None] * n_layer      # (x, q, k, v) of layer l
        self.out_post: list = [None] * n_layer     # (x after attention, h, aux, expert ids, weights) of layer l
        self.out_head = None
        self.seqs: dict = {}                        # kv uid -> _SeqAttn
        self.step_no = 0
        self._idx: dict = {}                        # tuple of lanes -> LongTensor of them on the device

    # ---- lanes ------------------------------------------------------------------------------------------
    def join(self, kvs) -> torch.Tensor:
        """The lane of each sequence (a newcomer takes a free lane, else the one idle longest) -> lanes [n]."""
        self.step_no += 1
        busy = {kv.uid for kv in kvs}
        for kv in kvs:
            s = self.seqs.get(kv.uid)
            if s is None:
                used = {x.lane for x in self.seqs.values()}
                free = [i for i in range(self.B) if i not in used]
                if not free:
                    idle = [x for u, x in self.seqs.items() if u not in busy]
                    if not idle:
                        raise BetelgeuseError(f"batched decode of {len(kvs)} sequences: only {self.B} lanes "
                                              "(max_running)")
                    old = min(idle, key=lambda x: x.last)
                    self.leave(old.kv.uid)
                    free = [old.lane]
                s = self.seqs[kv.uid] = _SeqAttn(free[0], kv, self.L)
            s.last = self.step_no
        key = tuple(self.seqs[kv.uid].lane for kv in kvs)
        idx = self._idx.get(key)
        if idx is None:
            if len(self._idx) > 64:
                self._idx.clear()
            idx = self._idx[key] = torch.tensor(key, dtype=torch.int64, device=self.ids.device)
        return idx

    def leave(self, uid):
        """A sequence is done: its lane is free, its attention graphs and their pool go."""
        self.seqs.pop(uid, None)

    # ---- the parts, as plain functions of the static buffers (eager and captured: the same code) ---------
    def _pre(self, l: int):
        m = self.m
        if l == 0:
            x = m.embed(self.ids)
        else:
            xa, h, aux = self.out_post[l - 1][:3]
            x = m.moe_output(l - 1, xa, aux, h, self.routed)
        return (x, *m.qkv(l, x, self.pos))

    def _attend(self, l: int, s: _SeqAttn):
        _, q, k, v = self.out_pre[l]
        i = s.lane
        a = self.m.attend_static(l, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], s.kv, s.kv.pos)
        self.attn[i:i + 1].copy_(a)

    def _post(self, l: int):
        m = self.m
        xa = m.attn_out(l, self.out_pre[l][0], self.attn)
        h, aux = m.moe_input(l, xa)
        ti, tw = m.route(l, h, self.ids, None)
        return xa, h, aux, ti, tw

    def _head(self):
        m, L = self.m, self.L
        xa, h, aux = self.out_post[L - 1][:3]
        return m.logits(m.moe_output(L - 1, xa, aux, h, self.routed))

    def _run(self, mode, pool, fn, *args):
        """fn(*args) in `mode` -> (graph or None, pool, result)."""
        if mode == CAPTURE:
            g, out = capture(pool, lambda: fn(*args))
            return g, g.pool(), out
        return None, pool, fn(*args)

    # ---- one step ---------------------------------------------------------------------------------------
    def begin(self, ids: torch.Tensor, kvs, idx: torch.Tensor):
        """ids [n] on the device, the sequences' caches (kv.begin_static() done) and their lanes idx [n]."""
        self.ids.index_copy_(0, idx, ids)
        self.pos.index_copy_(0, idx, torch.cat([kv.pos for kv in kvs]))

    def front(self, l: int, kvs, idx: torch.Tensor):
        """Layer l's dense part for every lane, attention per sequence -> (h [n,H], expert ids [n,k], weights [n,k])
        of the running rows, for the MoE."""
        if self.mode == REPLAY:
            self.g_pre[l].replay()
        else:
            self.g_pre[l], self.pool, self.out_pre[l] = self._run(self.mode, self.pool, self._pre, l)
        for kv in kvs:
            s = self.seqs[kv.uid]
            if s.mode == REPLAY:
                s.graphs[l].replay()
            else:
                s.graphs[l], s.pool, _ = self._run(s.mode, s.pool, self._attend, l, s)
        if self.mode == REPLAY:
            self.g_post[l].replay()
        else:
            self.g_post[l], self.pool, self.out_post[l] = self._run(self.mode, self.pool, self._post, l)
        _, h, _, ti, tw = self.out_post[l]
        return h.index_select(0, idx), ti.index_select(0, idx), tw.index_select(0, idx)

    def back(self, routed: torch.Tensor, idx: torch.Tensor):
        """routed [n,H]: the layer's MoE output rows of the running lanes."""
        self.routed.index_copy_(0, idx, routed)

    def head(self, kvs, idx: torch.Tensor) -> torch.Tensor:
        """-> logits [n, n_vocab] float32 of the running lanes (a fresh tensor); ends the step."""
        if self.mode == REPLAY:
            self.g_head.replay()
        else:
            self.g_head, self.pool, self.out_head = self._run(self.mode, self.pool, self._head)
        out = self.out_head.index_select(0, idx)
        if self.graphs_on:                                  # eager -> capture -> replay
            self.mode = CAPTURE if self.mode == EAGER else REPLAY
            for kv in kvs:
                s = self.seqs[kv.uid]
                s.mode = CAPTURE if s.mode == EAGER else REPLAY
        assert self.mode != REPLAY or self.g_head is not None, "replay without captured lane graphs"
        return out
