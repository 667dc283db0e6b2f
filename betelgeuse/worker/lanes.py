"""Batched decode in the static form: the dense work of all running sequences as row-batched ops over fixed lanes.

A batched decode step (runner.decode_batch) runs, per layer: attention, the MoE input norm and routing (the dense
part), then the MoE over every sequence's rows at once. Run one sequence at a time, the dense part was ~70 kernels
per layer and sequence: at 8 sequences ~75 ms of an 8-sequence pass's ~84 ms of GPU time, and 16 graph launches
per layer (deploy/device/profile_batch.py). Here it runs ONCE per layer over B = max_running rows ("lanes"):

    pre[l]     the previous layer's MoE rows combined (kernels.moe.combine) into their lanes of `routed`, the
               residual x + routed (the embedding at l = 0); the row-wise part of attention (model.lane_rows:
               qwen3moe's attn_norm, q/k/v projections, q/k norms, RoPE; deepseek4's mHC mix, projections, norms,
               RoPE, compressor and indexer inputs) at each lane's position, into the shared lane buffers; at l = 0
               also the step's RoPE tables of every lane (model.rope), which every layer's attention reads
                                                                                        (one graph, all lanes)
    attend     per sequence, on its own lane's rows (model.attend_static): its state written (K/V; deepseek4's
               window ring, open compressor windows and entries), attention over it   (one graph per sequence)
    post[l]    the output projection + residual, the MoE input, routing (all lanes); the running lanes' rows
               (idx[:n]) routed and counted (kernels.moe.route: sorted by expert, device only); with decode
               guesses on, layers l+1 .. l+D's routers on the residual guess their next experts (worker/guess.py)
                                                                                                    (one graph)
    MoE        the experts of those rows, eagerly as in any pass (a wholly VRAM layer one group, else the
               host-synced loads and groups): the only host work of a layer; with the at-hand table the sync's
               start (a host part) and the at-hand group (a lane part "hand" of its own) before the misses, or with
               engine.decode_fold (MoEStep.hand_fold) both at the end of post[l] (front's tail: one replay and one
               host part a layer fewer; the step's variant then holds the all-VRAM pattern, which says which
               layers have the tail)
    head       the last combine and residual, output norm, logits of every lane (one graph); the running lanes'
               rows [n, n_vocab] gathered from them (a fresh tensor)

pre, post and head depend on n (the routing's shapes) and on the routing variant (post routes every lane with the
runner's router: MoEStep.route_static; the variant, MoEStep.static_variant, is the mode and which layers route
approximately over resident sets the host refreshes in place, so a graph holds each layer's one selection), so they
are captured per variant (n, routing variant) (the last MAX_VARIANTS are kept); the attention graphs do not, and are
captured once per sequence.

Why the bits do not depend on the batch (invariant 6): every op of pre / post / head is row-wise (a matmul row's
reduction never mixes rows) and always runs on the same shapes, [B, ...], whoever occupies the other lanes (a
fixed M, so the library picks the same kernel; measured row-position-invariant on CPU and CUDA, checked on both:
tests/worker/test_batched_decode.py, deploy/device/check_cuda.py). Attention is per sequence. A lane that is free holds
whatever its last token left (finite: the embedding is recomputed for every lane each step) and is never read
into a running row. A sequence keeps its lane while it runs (its attention graph has the lane's row baked in);
one decoding alone runs the same B-row ops, so the engine decodes a lone sequence through here too.

Graphs: the lane graphs of a batch size are eager on its first step, captured on its second and replayed after
(which sequences fill the lanes does not matter); a sequence's attention graphs likewise, from its own first step.
An attention graph bakes in its lane's row and its state's tensors (and the state's `pos`): it belongs to the pair
(lane, state), keyed by the state's uid. A state the runner recycles (worker/runner.py new_cache: a released state
kept with its uid, reset to a fresh state's bits, handed to the next sequence of its size) keeps its graphs here:
park(uid) at its release keeps them and claims its lane for it (a newcomer takes an unclaimed free lane first),
and its next sequence's join takes them back with the lane, so it replays from its first step (issue 21: no eager
step, no capture per request). Eager, captured and replayed steps run the same kernels on the same shapes, so the
bits never depend on which it was (invariant 1). On the CPU (tests force this form there) everything runs eagerly.
"""

from __future__ import annotations

import torch

from betelgeuse.errors import BetelgeuseError
from betelgeuse.worker.graphs import CAPTURE, EAGER, REPLAY, capture
from betelgeuse.worker.guess import guess_ahead


def _flat(t) -> list:
    """Nested tuples of tensors (a model's RoPE tables) -> their tensors in order."""
    return [t] if isinstance(t, torch.Tensor) else [x for u in t for x in _flat(u)]


class _SeqAttn:
    """One state's attention graphs (one per layer) and its lane: a sequence's, or a parked state's (Lanes.park)."""

    __slots__ = ("lane", "mode", "pool", "graphs", "kv", "last")

    def __init__(self, lane: int, kv, n_layer: int):
        self.lane, self.kv = lane, kv
        self.mode = EAGER
        self.pool = None
        self.graphs: list = [None] * n_layer
        self.last = 0                       # the step it last ran (a free lane for a newcomer: least recent first)


class _Part:
    """One lane graph (a layer's pre or post part, or the head) for one number of running rows n: eager on its first
    step, captured on its second, replayed after; `out` is what the part returned (static once captured)."""

    __slots__ = ("mode", "graph", "out")

    def __init__(self):
        self.mode, self.graph, self.out = EAGER, None, None


class Lanes:
    # the lane graphs of at most this many batch sizes n are kept (each holds its outputs: ~2 MB per layer and n at
    # the benchmark geometry's n = 8; the slot plan counts GRAPHS_BYTES_PER_SEQ per running sequence for all graphs)
    MAX_VARIANTS = 4

    def __init__(self, model, n_layer: int, n_lanes: int, graphs: bool, guess: int = 0, router=None,
                 guess_route=None):
        m = model
        self.m, self.L, self.B = m, n_layer, n_lanes
        # the post part of a layer l < L-1 also guesses the experts of the running rows in layers l+1 .. l+guess
        # (worker/guess.py; 0: no guesses): always, whatever the residency (a lane graph must not depend on it); the
        # MoE step uses them where worth it
        self.guess = guess
        # an approximate mode's guess: its own selection per guessed layer (MoEStep.guess_route over the fixed
        # resident buffers route_static reads; part of the variant every lane graph is keyed by); None: exact's
        self.guess_route = guess_route
        dev, H = m.device, m.cfg.n_embd
        self.graphs_on = graphs
        # router(model, l, h, token_ids) -> (ids, weights) of every lane in the graphs (MoEStep.route_static: the
        # routing mode's choice over its fixed resident buffers); the model's exact routing by default
        self.router = router or (lambda m_, l, h, t: m_.route(l, h, t, None))
        self.mode = "exact"                         # this step's routing variant: part of every lane graph's key
        self.ids = torch.zeros(n_lanes, dtype=torch.int64, device=dev)       # each lane's token this step
        self.pos = torch.zeros(n_lanes, dtype=torch.int64, device=dev)       # each lane's position this step
        self.idx = torch.zeros(n_lanes, dtype=torch.int64, device=dev)       # [:n] the running rows' lanes
        self.routed = torch.zeros((n_lanes, H), dtype=m.dtype, device=dev)   # the MoE output rows of the layer
        c = m.cfg
        self.attn = torch.zeros((n_lanes, c.n_head * c.head_dim), dtype=m.dtype, device=dev)
        # the layer's attention inputs of every lane (model.lane_rows: qwen3moe's q/k/v heads-first, deepseek4's
        # q, K=V and compressor rows), where each sequence's attention graph reads its row: one set per shape of
        # the rows, shared by every layer of that shape and every n (an attention graph must not depend on how many
        # rows run); made on the first (eager) step of a shape, before any capture reads them
        self.rows: dict = {}
        # [k, B, ...] the step's RoPE tables of every lane (model.rope.cos_sin flattened: k tables of one shape)
        self.tables = None
        self.layer_rows: list = [None] * n_layer      # layer -> its buffers in self.rows (set by its pre part)
        self.pool = None                            # one private pool for every lane graph (they run in turn)
        # a variant v = (n running rows, routing variant): the lane graphs are captured per variant
        self.parts: dict = {}                       # ("pre" | "post", layer, v) or ("head", v) -> _Part
        self.recent: list = []                      # variants, most recent last (MAX_VARIANTS kept)
        self.keep: dict = {}                        # v -> tensors lane graphs read across parts (RoPE tables): alive
        self.seqs: dict = {}                        # kv uid -> _SeqAttn
        # kv uid -> _SeqAttn of a released state the runner keeps for reuse (park): its graphs and its lane's claim
        self.parked: dict = {}
        self.step_no = 0
        self._idx: dict = {}                        # tuple of lanes -> LongTensor of them on the device
        self._r = None                              # this step's routing of the previous layer (its combine is next)
        self._ran: set = set()                      # the parts run this step (only they move on to capture/replay)
        # called before any launch that is not a graph replay (an eager or captured part, an attention graph's eager
        # or capture step): decode_gate's host catches up with the gates launched ahead first (worker/gate.py)
        self.before_host = None

    # ---- lanes ------------------------------------------------------------------------------------------
    def join(self, kvs) -> torch.Tensor:
        """The lane of each sequence (a newcomer takes a free lane, else the one idle longest) -> lanes [n]."""
        self.step_no += 1
        busy = {kv.uid for kv in kvs}
        for kv in kvs:
            s = self.seqs.get(kv.uid)
            if s is None:
                used = {x.lane for x in self.seqs.values()}
                s = self.parked.pop(kv.uid, None)
                if s is not None and s.lane in used:      # its lane was taken meanwhile: its graphs go
                    s = None
                if s is not None:                         # a recycled state: its lane and graphs (module doc)
                    assert s.kv is kv, "a parked state's graphs are over its own tensors"
                    self.seqs[kv.uid] = s
                else:
                    free = [i for i in range(self.B) if i not in used]
                    if not free:
                        idle = [x for u, x in self.seqs.items() if u not in busy]
                        if not idle:
                            raise BetelgeuseError(f"batched decode of {len(kvs)} sequences: only {self.B} lanes "
                                                  "(max_running)")
                        old = min(idle, key=lambda x: x.last)
                        self.leave(old.kv.uid)
                        free = [old.lane]
                    # a lane no parked state claims first, else the one parked longest ago (its graphs go)
                    claims = {x.lane: u for u, x in self.parked.items()}
                    lane = next((i for i in free if i not in claims), None)
                    if lane is None:
                        lane = min(free, key=lambda i: self.parked[claims[i]].last)
                        self.parked.pop(claims[lane])
                    s = self.seqs[kv.uid] = _SeqAttn(lane, kv, self.L)
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
        self.parked.pop(uid, None)

    def park(self, uid):
        """A sequence is done and the runner keeps its state for the next sequence of its size (module doc): its lane
        is free, claimed for the state (a newcomer takes an unclaimed lane first), its attention graphs stay."""
        s = self.seqs.pop(uid, None)
        if s is not None:
            self.parked[uid] = s

    def rebind(self, uid, kv):
        """The sequence's state `uid` was replaced by kv (grown: runner.grow_cache): it keeps its lane; its attention
        graphs (over the old state's tensors) and their pool go, eager again from its next step."""
        s = self.seqs.pop(uid, None)
        if s is not None:
            fresh = self.seqs[kv.uid] = _SeqAttn(s.lane, kv, self.L)
            fresh.last = s.last

    # ---- the parts, as plain functions of the static buffers (eager and captured: the same code) ---------
    # v = (n, mode): n running rows, idx[:n] their lanes; route(l, h, ids, w) -> the layer's Routing of those rows
    # (kernels.moe.route, device only); combine(r) -> their MoE output rows [n,H]
    def _pre(self, l: int, v: tuple, combine):
        m = self.m
        if l == 0:
            x = m.embed(self.ids)
        else:
            x = self._residual(l - 1, v, combine)
        if l == 0:
            # the step's RoPE tables, read by every layer's pre part (memoized) and, from the shared table buffer
            # (like the rows: the attention graphs must not depend on n), by every layer's attention: made once per
            # step, not per layer and sequence; a rope taking out= (model.TABLES_OUT) writes them there itself
            if self.tables is None:
                tabs = _flat(m.rope.cos_sin(self.pos, self.attn.dtype))
                self.tables = torch.zeros((len(tabs), *tabs[0].shape), dtype=tabs[0].dtype, device=tabs[0].device)
                m.rope.reset()
            if getattr(m, "TABLES_OUT", False):
                self.keep[v] = m.rope.cos_sin(self.pos, self.attn.dtype, out=self.tables)
            else:
                self.keep[v] = m.rope.cos_sin(self.pos, self.attn.dtype)
                torch.stack(_flat(self.keep[v]), out=self.tables)
        if getattr(m, "ROWS_OUT", False):
            # deepseek4: every row written into its lane buffer by the op that makes it; the buffers are shaped
            # after the layer's rows on its first (eager) step, which then makes them again into the buffers
            if self.layer_rows[l] is None:
                self.layer_rows[l] = self._rows(m.lane_rows(l, x, self.pos)[1])
            return (m.lane_rows(l, x, self.pos, out=self.layer_rows[l])[0],)
        carry, rows = m.lane_rows(l, x, self.pos)
        bufs = self.layer_rows[l] = self._rows(rows)
        copy_rows = getattr(getattr(m, "ops", None), "copy_rows", None)
        if copy_rows is not None:
            copy_rows(rows, bufs)           # deepseek4's: every row into its buffer (TritonOps: one launch in all)
        else:
            for buf, t in zip(bufs, rows):
                buf.copy_(t)
        return (carry,)

    def _rows(self, rows: tuple) -> list:
        """The lane buffers for rows of these shapes, one per row. A model whose rows are lane-first ([B, ...],
        model.LANE_ROWS_FIRST) gets one flat [B, sum of a row's elements] buffer per dtype, the rows' buffers views of
        its column ranges (a lane's row of each stays contiguous: the layout its CUDA checks ran on); otherwise a
        buffer per row."""
        key = tuple((tuple(t.shape), t.dtype) for t in rows)
        bufs = self.rows.get(key)
        if bufs is not None:
            return bufs
        if not getattr(self.m, "LANE_ROWS_FIRST", False):
            bufs = self.rows[key] = [torch.zeros_like(t) for t in rows]
            return bufs
        B = rows[0].shape[0]
        assert all(t.shape[0] == B for t in rows), [tuple(t.shape) for t in rows]
        bufs = [None] * len(rows)
        for dt in dict.fromkeys(t.dtype for t in rows):
            members = [j for j, t in enumerate(rows) if t.dtype == dt]
            widths = [rows[j][0].numel() for j in members]
            flat = torch.zeros((B, sum(widths)), dtype=dt, device=rows[members[0]].device)
            a = 0
            for j, w in zip(members, widths):
                bufs[j] = flat[:, a:a + w].view(rows[j].shape)
                a += w
        self.rows[key] = bufs
        return bufs

    def _residual(self, l: int, v: tuple, combine):
        """Layer l's MoE output rows into their lanes, then the residual x + routed for every lane."""
        xa, h, aux, r, _ = self.parts["post", l, v].out
        combine(r, out=self.routed, rows=self.idx[:v[0]])        # the kernel writes the rows into their lanes
        return self.m.moe_output(l, xa, aux, h, self.routed)

    def _attend(self, l: int, s: _SeqAttn):
        i, m = s.lane, self.m
        rows, tables = m.lane_row(self.layer_rows[l], i), m.lane_row(self.tables.unbind(0), i)
        m.attend_static(l, rows, s.kv, s.kv.pos, tables, out=self.attn[i:i + 1])       # written in place

    def _post(self, l: int, v: tuple, route, tail=None):
        m = self.m
        xa = m.attn_out(l, self.parts["pre", l, v].out[0], self.attn)
        h, aux = m.moe_input(l, xa)
        ti, tw = self.router(m, l, h, self.ids)
        guess = guess_ahead(m, l, xa, self.ids, self.guess, self.L, self.guess_route)     # [B, D, k] or None
        ts = [h, ti, tw] + ([guess] if guess is not None else [])
        i = self.idx[:v[0]]
        gather = getattr(getattr(m, "ops", None), "gather_rows", None)      # deepseek4's: TritonOps one launch
        run = gather(i, ts) if gather is not None else [t.index_select(0, i) for t in ts]     # the running rows
        r, g = route(l, *run[:3]), (run[3] if len(run) > 3 else None)
        if tail is not None:            # the fold (front's doc): the sync's start and the at-hand group, in this part
            tail(l, r, g)
        return xa, h, aux, r, g

    def _head(self, v: tuple, combine):
        return self.m.logits(self._residual(self.L - 1, v, combine))

    def _run(self, key, fn, *args):
        """Part `key` = fn(*args) in its mode (eager, capture, replay) -> its output."""
        p = self.parts.get(key)
        if p is None:
            p = self.parts[key] = _Part()
        self._ran.add(key)
        if p.mode == REPLAY:
            p.graph.replay()
            return p.out
        self._host()
        if p.mode == CAPTURE:
            p.graph, p.out = capture(self.pool, lambda: fn(*args))
            self.pool = p.graph.pool()
        else:
            p.out = fn(*args)
        return p.out

    # ---- one step ---------------------------------------------------------------------------------------
    def begin(self, ids: torch.Tensor, kvs, idx: torch.Tensor, mode="exact"):
        """ids [n] on the device, the sequences' caches (kv.begin_static() done), their lanes idx [n] and the step's
        routing variant (hashable: MoEStep.static_variant; its resident sets are refreshed by the caller)."""
        n = len(kvs)
        self.mode = mode
        self._ran.clear()
        copy_rows = getattr(getattr(self.m, "ops", None), "copy_rows", None)
        if copy_rows is not None:
            # deepseek4's (TritonOps: one launch for all): each sequence's token and position into its lane (the
            # lanes known on the host: one-row views), the lanes into idx
            assert ids.dtype == idx.dtype == self.ids.dtype, (ids.dtype, idx.dtype)     # bytes moved as they are
            lanes = [self.seqs[kv.uid].lane for kv in kvs]
            copy_rows([idx.view(1, n)] + [ids[j:j + 1] for j in range(n)] + [kv.pos for kv in kvs],
                      [self.idx[:n].view(1, n)] + [self.ids[i:i + 1] for i in lanes] + [self.pos[i:i + 1] for i in lanes])
            return
        self.idx[:n].copy_(idx)
        self.ids.index_copy_(0, idx, ids)
        self.pos.index_copy_(0, idx, torch.cat([kv.pos for kv in kvs]))

    def front(self, l: int, kvs, route, combine, after_attn=None, tail=None):
        """Layer l for every lane up to its routing: the previous layer's MoE rows combined into the residual, the
        dense part, attention per sequence -> (the Routing of the running rows (their expert work: the caller's),
        layers l+1 .. l+D's guessed experts of those rows [n,D,k] or None). after_attn(): called between the
        sequences' attention and the post part (its output projection, MoE input and routing), outside any capture
        (PassStats.gpu_marks), or None. tail(l, routing, guess): run at the end of the post part, in its graph
        (MoEStep.hand_front: the fold, issue 21), or None; whether a layer has one must be keyed by the step's
        routing variant (begin's mode), as every part's content is: a captured part holds the one it saw."""
        v = (len(kvs), self.mode)
        self._run(("pre", l, v), self._pre, l, v, combine)
        for kv in kvs:
            s = self.seqs[kv.uid]
            if s.mode == REPLAY:
                s.graphs[l].replay()
                continue
            self._host()
            if s.mode == CAPTURE:
                s.graphs[l], _ = capture(s.pool, lambda: self._attend(l, s))
                s.pool = s.graphs[l].pool()
            else:
                self._attend(l, s)
        if after_attn is not None:
            after_attn()
        return self._run(("post", l, v), self._post, l, v, route, tail)[3:]

    def _host(self):
        if self.before_host is not None:
            self.before_host()

    def replays(self, name: str, l: int, kvs) -> bool:
        """Whether part(name, l, kvs, ...) will replay its graph this step (else it runs eagerly or is captured)."""
        p = self.parts.get((name, l, (len(kvs), self.mode)))
        return p is not None and p.mode == REPLAY

    def part(self, name: str, l: int, kvs, fn, *args):
        """An extra lane part of layer l (fn(l, *args), e.g. MoEStep.hand_group: decode's at-hand expert group) in
        the step's mode; captured and replayed like the others, only once it ran eagerly (a layer may skip it)."""
        return self._run((name, l, (len(kvs), self.mode)), fn, l, *args)

    def head(self, kvs, combine) -> torch.Tensor:
        """-> logits [n, n_vocab] float32 of the running lanes (a fresh tensor); ends the step."""
        v = (len(kvs), self.mode)
        # the running lanes' rows, gathered after the part (a captured part's output is static): a fresh tensor
        out = self._run(("head", v), self._head, v, combine).index_select(0, self.idx[:v[0]])
        if v in self.recent:
            self.recent.remove(v)
        self.recent.append(v)
        while len(self.recent) > self.MAX_VARIANTS:       # the variant seen least recently lets its graphs go
            old = self.recent.pop(0)
            for key in [k for k in self.parts if k[-1] == old]:
                del self.parts[key]
            self.keep.pop(old, None)
            if all(p.graph is None for p in self.parts.values()):
                # the pool's last graph went: PyTorch frees a pool whose graphs are all gone and asserts
                # (use_count > 0) on a capture into its old id, so the next capture opens a new one
                self.pool = None
        if self.graphs_on:                                  # eager -> capture -> replay
            for key, p in self.parts.items():
                if key[-1] == v and key in self._ran:
                    p.mode = CAPTURE if p.mode == EAGER else REPLAY
            for kv in kvs:
                s = self.seqs[kv.uid]
                s.mode = CAPTURE if s.mode == EAGER else REPLAY
        self._ran.clear()
        return out
