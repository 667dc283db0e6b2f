"""A lone sequence's decode token in the static form, with CUDA graphs per (sequence, residency pattern).

The first step of a (sequence, residency pattern) runs eagerly (it also warms up the kernels); the second captures
the capturable runs between host-dependent layers as CUDA graphs; later steps replay them: a wholly VRAM-resident
model decodes a token in one graph launch. A layer that is not wholly in VRAM yields to the host (MoEStep.partial)
between two graphs; with decode's at-hand group (worker/at_hand.py) the sync's copies to the host, their event and
the at-hand group are the end of the layer's graph (the event a captured node: MoEStep.hand_fold), the host waits
on it and runs the misses, and the next graph goes on with the layer's output (issue 21: one replay and one host
part a layer, not two of each; with gpu_marks, or a torch with no external events, the at-hand group is a graph of
its own between the sync's copies and the wait), and with decode_gate (worker/gate.py) nothing yields once
captured: the step is one graph (each gated layer's at-hand group, gate and misses' group in it), its gates armed,
and the host drains the gated layers after launching it (the eager first step drains each gated layer where its gate
stands, disarmed, before its misses' group is launched: its launches block the host in ways a spinning gate must
not meet).
Eager and replayed steps run the same kernels on the same shapes, so the bits do not depend on which it was
(invariant 1).

A graph bakes in the state's tensors and its `pos` (the uid names them: a grown state is a new uid); a state the
runner recycles (worker/runner.py new_cache: released, parked with its uid, reset to a fresh state's bits in the same
tensors and handed to the next sequence of its size) keeps its entries here, so that sequence replays from its first
step; release(uid) drops them when the runner drops the state.

The engine decodes a lone sequence through the batched lanes (worker/lanes.py) in the static form; this path is
the runner's forward() of one token (and what the tests force on the CPU, eagerly).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from betelgeuse.worker.graphs import capture
from betelgeuse.worker.guess import guess_ahead
from betelgeuse.worker.moe_step import MoEStep
from betelgeuse.worker.stats import LayerStats, PassStats


class SoloDecode:
    """The static-form decode of one attachment (its graphs read the slot pool and the pass counts)."""

    def __init__(self, model, moe: MoEStep, graphs: bool, keep: int):
        self.model, self.moe = model, moe
        self.graphs_on = graphs
        self.keep = keep                    # (sequence, pattern) entries kept, least recently used dropped first
        # (kv uid: its tensors, kept by a recycled state; all-VRAM pattern; routing variant: MoEStep.static_variant)
        # -> "warm" | captured graphs
        self._graphs: OrderedDict = OrderedDict()

    def _ops(self, ids, kv, pos, lstats, out: dict, ahead: bool = False):
        """One decode token as a generator: runs the capturable work and yields (kind, layer, routing, guess) where a
        layer's experts need the host (a layer not wholly in VRAM); the caller does that part eagerly: "partial" (the
        partial path), or with the at-hand table (MoEStep.hand_layer) "folded" (wait, then the misses) after the
        sync's copies and event and the at-hand group, all three in the layer's graph (MoEStep.hand_fold: one graph
        and one host part a layer), else "start" (the sync's copies enqueued) before the at-hand group and "misses"
        after it, the group a graph of its own (gpu_marks: the route mark between them). guess: the
        next layers' guessed experts [T,D,k] from this layer's residual after attention (worker/guess.py), or None;
        whether there is one depends only on the residency pattern, which keys the graphs. ahead (decode_gate on CUDA,
        a step captured whole or replayed): a gated layer does not yield, it is drained after the step's launch;
        else (an eager step, the CPU) it yields "gated" and is drained where its gate stands (worker/gate.py)."""
        m, moe = self.model, self.moe
        marks = moe.clock.marks
        fold = moe.hand_fold()          # not with marks, which key the graphs: the same for a key's every step
        x = m.embed(ids)
        for l in range(moe.n_layer):
            x = m.attention_block(l, x, kv, pos, static=True)
            if marks:       # PassStats.gpu_marks: the step's graph is cut here (a mark records no time in a capture)
                yield "attn", l, None, None
            h, aux = m.moe_input(l, x)
            top_ids, top_w = moe.route_static(m, l, h, ids)
            r = moe.route(l, h, top_ids, top_w, lstats[l])
            if lstats[l].synced:
                guess = (guess_ahead(m, l, x, ids, moe.depth, moe.n_layer, moe.guess_route(m))
                         if moe.wants_guess(l) else None)
                if moe.gate is not None:        # gated on the device (worker/gate.py), the misses' group after
                    moe.gate_layer(l, r, guess)
                    if ahead:
                        out.setdefault("gated", []).append((l, r, moe.guess_shape(l, guess)))
                    else:
                        yield "gated", l, r, guess
                    moe.gate_misses(l, r)
                elif moe.hand_layer(l) and fold:    # the sync's copies and event, the at-hand group: this graph
                    moe.hand_start(l, r, guess, graphs=True)
                    moe.hand_group(l, r)
                    yield "folded", l, r, guess
                elif moe.hand_layer(l):         # the sync's copies, the at-hand group (its own graph), the misses
                    yield "start", l, r, guess
                    moe.hand_group(l, r)
                    yield "misses", l, r, guess
                else:
                    yield "partial", l, r, guess
            x = m.moe_output(l, x, aux, h, moe.kern.combine(r))
        out["logits"] = m.logits(x)

    def decode(self, ids, kv, snap, stats: PassStats) -> torch.Tensor:
        """ids [1] on the device -> logits [1, n_vocab]; appends the token to kv (commits)."""
        pos = kv.begin_static()
        lstats = [LayerStats() for _ in range(self.moe.n_layer)]
        self.moe.refresh_static(snap)
        self.moe.hand_refresh(snap, len(ids))
        # gpu_marks: the step's graphs cut at each layer's attention (their own entry, not the plain step's)
        key = (kv.uid, self.moe.cache.all_vram.tobytes(), self.moe.static_variant(), self.moe.clock.marks)
        ent = self._graphs.get(key) if self.graphs_on else None

        def eager_part(item):
            kind, l, r, guess = item
            if kind == "attn":
                self.moe.clock.mark("attn", l)
            elif kind == "start":
                self.moe.hand_start(l, r, guess)
            elif kind == "gated":               # an eager step or the CPU: drained where its gate stands (disarmed)
                self.moe.gate_drain(l, r, self.moe.guess_shape(l, guess), snap, stats, lstats[l], armed=False)
            elif kind == "misses":
                self.moe.hand_misses(l, r, snap, stats, lstats[l])
            elif kind == "folded":              # the start ran in the graph just replayed (or eagerly before it)
                self.moe.hand_misses(l, r, snap, stats, lstats[l], guess=guess, graphs=True)
            else:
                self.moe.partial(l, r, snap, stats, lstats[l], False, guess)

        out: dict = {}
        gate = self.moe.gate
        ahead = gate is not None and gate.cuda and ent is not None    # captured whole or replayed: one launch
        self.moe.gate_begin()
        if ahead:
            gate.set_ahead(True)
        if ent is None:
            for item in self._ops(ids, kv, pos, lstats, out):
                eager_part(item)
            if self.graphs_on:
                self._remember(key, "warm")
            logits = out["logits"]
        elif ent == "warm":
            static_ids = ids.clone()
            gen = self._ops(static_ids, kv, pos, lstats, out, ahead)
            graphs, eager, pool = [], [], None
            while True:
                g, item = capture(pool, lambda: next(gen, None))      # captured, then replayed once
                pool = g.pool()
                graphs.append(g)
                if item is None:
                    break
                eager.append(item)
                eager_part(item)
            self._remember(key, (graphs, eager, static_ids, out["logits"], out.get("gated", [])))
            logits = out["logits"]
        else:
            graphs, eager, static_ids, logits, gated = ent
            out["gated"] = gated
            static_ids.copy_(ids)
            for i, g in enumerate(graphs):
                g.replay()
                if i < len(eager):
                    eager_part(eager[i])
        for l, r, shape in out.get("gated", ()):   # decode_gate ahead: the whole step is launched; misses now
            self.moe.gate_drain(l, r, shape, snap, stats, lstats[l], armed=True)
        if self.moe.gate is not None:
            self.moe.gate_end()
        kv.commit()
        stats.layers = lstats
        return logits.clone()

    def release(self, uid):
        """A state is dropped (or grown): its captured graphs and their memory pools go now, not when the LRU bound
        reaches them (the slot plan counts graphs for max_running sequences)."""
        for key in [k for k in self._graphs if k[0] == uid]:
            del self._graphs[key]

    def _remember(self, key, value):
        self._graphs.pop(key, None)
        self._graphs[key] = value
        while len(self._graphs) > self.keep:
            self._graphs.pop(next(iter(self._graphs)))
