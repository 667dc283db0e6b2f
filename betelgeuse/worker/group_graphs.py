"""Decode's eager expert groups replayed as CUDA graphs (engine.group_graphs; issue 21: the miss layers' host time).

A miss layer's groups (MoEStep._apply: the disk groups, the banked host groups, flex chunks, copy ahead) run eagerly
between the decode graphs' segments: two Triton launches a group (gate_up + down), ~36 us of host each for Triton's
dispatch alone on the device (kernels/triton_launch.py). Every tensor such a group reads or writes sits at a fixed
address once the decode graphs are captured: the captured Routing (route() is replayed in place), the slot pool or a
flex chunk, the group's slot-table row (expert_cache.table: a ring of fixed device rows), the layer's part offsets
(cache.starts) and the split-K workspace of the capture stream. So the same group on the same tensors is one graph
launch: captured at its second sighting (the first launches eagerly, as the decode graphs' eager -> capture -> replay),
replayed after.

A CUDA graph's kernel nodes hold the launches' arguments: pointers and ints; the tensors' contents (the slot offsets
in the table, the sorted rows, the activations) are read on the device when it runs. So the key is every argument the
two launches take (MoEKernels.apply):
  (layer: its types and part offsets; rows T and k; the widths; slot bytes: the alignment; the addresses of the pool,
   the table row, the Routing's h (and its q8_1 parts), rows, off, inter and y)
and a replay under an equal key runs the same kernels on the same arguments as the launches it stands for: the bits
cannot change. Whatever tensor sits at those addresses now is what the launches would read (a Routing made anew at
recycled addresses, as an eager step's are, replays too); the memo holds no tensor. Nothing else decides a launch: its
plan (grid, constexprs) is a function of the layer's types and these shapes. The split-K workspace is the capture
stream's (below) and each tile's counter is reset by its last program, so it is zero at every replay.

The graphs are captured on the decode graphs' side stream (worker/graphs.py), so they share its split-K workspace
(store/plan.py counts two: eager passes and graph captures) and, like the decode graphs, replay on the compute
stream one after another. A key's first sighting launches on that side stream too (ordered after and before the
compute stream's work): it grows the side stream's tile counters to the key's plan outside a capture, so a capture
allocates nothing that outlives it (only a q8_1 temporary of down, freed inside it), and the graphs can share one
memory pool in any replay order. A group applied while the current stream is being captured (a layer wholly in VRAM
inside a decode graph) launches: the enclosing graph captures it. Routings of more than max_rows tokens (prefill)
launch: their keys would not come back. Bounded: at most `cap` keys (graphs and first sightings), the least recently
used dropped first. A re-attach makes a new MoEStep and with it a new memo (the old pool's graphs go with the old).

CUDA and the triton kernels only: MoEStep makes none otherwise (on the CPU the setting is a no-op).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from betelgeuse.kernels.moe import Group, MoEKernels, Routing
from betelgeuse.kernels.streams import current_stream
from betelgeuse.worker.graphs import capture, side_stream

SEEN = "seen"          # a key met once: launched eagerly; its second sighting captures


def on_side(device: torch.device, fn):
    """fn()'s launches on the capture stream, ordered after the compute stream's work so far and before its next: the
    capture stream's workspace is sized for them here, outside a capture (module doc)."""
    cur = current_stream(device.index)
    side = side_stream(cur.device)
    side.wait_stream(cur)
    if torch.cuda.current_device() == cur.device_index:
        # torch.cuda.stream(side)'s switch and back without its per-call lookups (as ExpertCache.bank_copy's)
        torch.cuda.set_stream(side)
        try:
            fn()
        finally:
            torch.cuda.set_stream(cur)
    else:
        with torch.cuda.stream(side):
            fn()
    cur.wait_stream(side)


class GroupGraphs:
    """One attachment's group graphs: apply() replays the key's graph, captures it, or launches (module doc)."""

    def __init__(self, kern: MoEKernels, max_rows: int, cap: int = 512):
        assert kern.backend == "triton", kern.backend
        self.kern = kern
        self.max_rows = max_rows           # routings of more tokens (prefill) launch: their keys would not come back
        self.cap = cap
        self._memo: OrderedDict = OrderedDict()    # key (module doc) -> SEEN | its graph
        # the graphs' memory pool (shared: they replay one at a time, in order). It lives while a graph captured in
        # it does: when the LRU bound has dropped every graph (keys that never come back: the standard schedule's
        # eager prefill routings, each at new addresses) torch frees it, and a capture into its id fails an internal
        # assert of the caching allocator (gpu-run60: check_cuda's pp with group graphs). So the memo counts its
        # graphs and the next capture after the last one goes starts a new pool.
        self._pool = None
        self._graphs = 0
        self.replays = self.captures = self.launches = 0

    def apply(self, r: Routing, layer: int, pool: torch.Tensor, g: Group, slot_bytes: int) -> None:
        """kern.apply(r, layer, pool, g, slot_bytes), as a graph replay where this group was met before."""
        if r.ids.shape[0] > self.max_rows or torch.cuda.is_current_stream_capturing():
            self.launches += 1
            self.kern.apply(r, layer, pool, g, slot_bytes)
            return
        T, k = r.ids.shape
        h = r.h
        # r.hq: act_quant's prepared input (q8_1: x, d, sums; bf16: x, None, sums -- no scales, so no address)
        key = (layer, T, k, h.shape[1], slot_bytes, pool.data_ptr(), g.base_dev.data_ptr(), h.data_ptr(),
               r.rows.data_ptr(), r.off.data_ptr(), r.inter.data_ptr(), r.y.data_ptr(),
               None if r.hq is None else tuple(None if x is None else x.data_ptr() for x in r.hq))
        memo = self._memo
        ent = memo.get(key)
        if ent is not None and ent is not SEEN:
            memo.move_to_end(key)
            self.replays += 1
            ent.replay()
            return
        if ent is None:                    # first sighting: launch, remember
            memo[key] = SEEN
            self.launches += 1
            on_side(pool.device, lambda: self.kern.apply(r, layer, pool, g, slot_bytes))
        else:                              # second: capture (graphs.capture replays it once: the work is done)
            graph, _ = capture(self._pool if self._graphs else None,
                               lambda: self.kern.apply(r, layer, pool, g, slot_bytes))
            self._pool = graph.pool()
            memo[key] = graph
            memo.move_to_end(key)
            self.captures += 1
            self._graphs += 1
        while len(memo) > self.cap:
            if memo.popitem(last=False)[1] is not SEEN:
                self._graphs -= 1

    def stats(self) -> dict:
        return {"replays": self.replays, "captures": self.captures, "launches": self.launches,
                "graphs": self._graphs}
