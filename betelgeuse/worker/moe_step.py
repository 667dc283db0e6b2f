"""One layer's routed experts over the three tiers, in the order their bytes become ready.

    route      rows sorted by expert and counted on the device (kernels.moe.route; graph-capturable). A layer wholly
               in VRAM is computed right there in one launch group, with no host sync
    partial    otherwise ONE host sync for the per-expert row counts (the loads depend on them; in decode the next
               `prefetch_depth` layers' guessed experts ride along: worker/guess.py), then:
                 1. demand loads for the disk experts, so the disk starts now; read-ahead behind them (prefill: all
                    of layer l+1's disk experts; decode: the guessed ones of layers l+1 .. l+D, nearest first, in the
                    same message as the loads, started by the store once this layer's reads have: a decode layer with
                    a miss sends the store ONE message, one with none sends none, or one read ahead of guesses)
                 2. the first host batch's copy into a ring bank starts, the VRAM group computes meanwhile
                 3. host-tier experts in batches: a batch is copied into one bank while the other bank computes
                 (2+3 in decode with no disk expert and the host ones in one bank: ONE group over the VRAM slots and
                 the bank, one gate_up + one down launch: the launches' host time outweighs the overlap)
                 4. disk experts in batches as they land in staging slots (the same path as 3); a staging slot goes
                    back to the store once its copy is done, and the layer never holds more than half the
                    staging slots while it blocks (the store keeps reading into the rest); the layer's last ones
                    go back with the next message (StoreSession.release later=True)
    serial     the standard schedule's baseline: each expert fetched on demand and waited for (copy, sync, compute)
    at hand    decode in the static form (decode_at_hand; worker/at_hand.py): right after routing the sync's copies are
               enqueued (hand_start), then ONE group computes every routed row whose expert is at hand (VRAM slot,
               flex copy, host slot read in place over PCIe where the step's host rule says so: host_in_place) inside
               the decode graphs (hand_group), then the host waits and runs partial(hand=True): the tier counts as
               above, read-ahead, and steps 1-4 for the misses only (disk experts, and host ones only where this
               step does not read them in place: through ring banks). A layer with no miss (decode's common case)
               takes a short path with the same counts and messages and nothing else (_hand_all); one with a miss a
               short path on lists (_hand_misses) where the banked host experts share the first disk group's bank
               (their copies issued at once, the disk ones appended as they land): one table and one apply for both
    copy ahead decode in the static form, not gated (prefetch_host; auto: pool routing): at the end of layer l's host
               step, layer l+1's guessed host-tier experts that the step banks (the guess rode on l's sync: worker/
               guess.py; in pool routing the pool choice over l+1's resident set) are copied into the next ring bank
               on the copy stream (_ahead_start), so their PCIe transfer overlaps layer l's compute and l+1's
               attention and routing instead of starting after l+1's sync; layer l+1 computes the banked experts
               it routed to and finds there from that bank (_ahead_group), the others copied after its routing as
               before. The guess only moves bytes earlier: a wrong one costs its copy, never a bit of the output
    gated      decode_gate (worker/gate.py): the same, with no per-layer sync: the step's replayed parts are launched
               ahead, each layer's at-hand group followed by a device-side publish + gate (gate_layer) and the misses'
               group (gate_misses: the missed experts read in place from the staging / host slots the host's miss
               table names); the host drains the layers in order afterwards (gate_drain: its row polled from pinned
               memory, the tier counts, read-ahead and loads as partial(hand=True), the landed slots written into the
               miss table, then the gate opened: no CUDA call); an eager or captured part's gate passes and is
               drained at once

This is mixtral-offloading's load_experts(unordered=True) over three tiers. Expert outputs land in
y[token * k + rank] and are reduced in rank order, and each row is computed by the same kernel whatever group it is
in, so neither the tier an expert came from nor the order of the groups changes a bit (invariant 1).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError
from betelgeuse.gguf.qtypes import qtype_name
from betelgeuse.kernels.kinds import TRITON_QTYPES
from betelgeuse.kernels.moe import Group, MoEKernels, triton_available
from betelgeuse.kernels.streams import current_stream
from betelgeuse.logs import event
from betelgeuse.routing_approx import Residency
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_NAMES, TIER_VRAM
from betelgeuse.worker.at_hand import AtHand
from betelgeuse.worker.expert_cache import PACKED, TILED
from betelgeuse.worker.flex_cache import FlexCache
from betelgeuse.worker.gate import DecodeGate
from betelgeuse.worker.group_graphs import GroupGraphs
from betelgeuse.worker.guess import Guesser, Marks
from betelgeuse.worker.stats import LayerStats, PassClock, PassStats
from betelgeuse.worker.store_session import StoreSession

log = logging.getLogger("betelgeuse.worker")


class RoutingSync:
    """A partial layer's one host sync: its rows per expert [E] and the next layers' guessed ids [T, D, k] (decode)
    copied, non-blocking, into one pinned buffer made once, then one event wait (no per-layer allocation, gather or
    cat on the device); the guesses' marks (guess.Marks: the rows that guessed each expert [D, E]) are made on the
    host (T*D*k ids, a few dozen in decode). start() enqueues the copies, finish() waits: decode's at-hand group is
    enqueued between them, so the wait does not include it.

    cap (the solo decode graphs' own sync, MoEStep.graph_sync): start() may run inside a graph capture, its copies
    and event captured in the layer's graph before its at-hand group (decode_graphs.py: one graph a layer, not two),
    so that a replay writes the buffer and records the event with no host call; the host then names what it waits
    for (expect) and finish()es as before. So the buffer is made at init, `cap` elements, and never remade (a
    captured graph writes into the one it saw, and no pinned allocation may run inside a capture; a larger start is a
    bug: it raises), and the event is external (a captured record is a node a replay runs, not a dependency inside
    the capture; CUDA's cudaEventRecordExternal). What orders the buffer's reuse: finish() copies the counts out and
    Marks.from_ids the guesses (lists) before it returns, and the next write is a later layer's start, queued (or
    its graph launched) by the host after that, in program order."""

    __slots__ = ("cuda", "index", "buf", "host", "event", "cap", "points", "_dst", "_pending")

    def __init__(self, device: torch.device, cap: int | None = None, points=None):
        self.cuda = device.type == "cuda"
        # the compute stream's points (ExpertCache: mark / pass_points; CUDA) or None: the points made before a start
        # (or an expect: its start ran in the graph launched before it) are passed by its finish, whose event comes
        # after them on the compute stream (the current stream a start records on, and the one a replayed graph
        # runs on)
        self.points = points if self.cuda else None
        # the device's index, resolved once (the engine's device is "cuda", no index: current_stream(None) asked
        # torch.cuda.current_device() at every start, a Python call and a torch call a layer; issue 21, cpu-host60)
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self.cap = cap
        self.buf = None                              # int64 pinned [>= E + T*D*k]
        self.host = None                             # its numpy view
        # external only where asked (cap): a torch without the keyword keeps the plain event (capturable() guards cap)
        self.event = None
        if self.cuda:
            self.event = torch.cuda.Event(external=True) if cap is not None else torch.cuda.Event()
        # (counts' shape, the guesses' shape or None) -> _Sizes: made once a shape (a decode layer's are always the
        # same), not read again with numel() / views / reshape each layer (~5 torch calls a layer: issue 21, cpu-host59)
        self._dst: dict = {}
        self._pending = None
        if self.cuda and cap is not None:
            self.buf = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self.host = self.buf.numpy()

    @staticmethod
    def capturable(device: torch.device) -> bool:
        """Whether a start may be captured on this device: the CPU (nothing captured), or torch's external events."""
        if device.type != "cuda":
            return True
        try:
            torch.cuda.Event(external=True)
        except TypeError:                            # a torch without them: the start stays a host part
            return False
        return True

    def _sizes(self, counts: torch.Tensor, guess: torch.Tensor | None) -> tuple:
        """-> (E, n = E + the guesses' count, on CUDA the copies' destinations [buf[:E], buf[E:n] viewed as the
        guesses' shape] and the guesses' host view [T, D, k] of the buffer, else None, None), by the two shapes: a
        miss makes the entry, growing the buffer where it is too small (no cap), which drops every entry (their views
        are of the old buffer). The cap check runs at each miss, so on every start whose shapes are new."""
        key = (counts.shape, None if guess is None else guess.shape)
        m = self._dst.get(key)
        if m is not None:
            return m
        E = counts.numel()
        n = E + (0 if guess is None else guess.numel())
        # checked on every device (the CPU tests too): a capped buffer must hold the largest start (class doc)
        assert self.cap is None or n <= self.cap, (n, self.cap)
        dst = view = None
        if self.cuda:
            if self.buf is None or self.buf.numel() < n:
                assert self.cap is None, (n, self.cap)   # made once at init (class doc): a graph writes the one it saw
                self.buf = torch.empty(max(n, 4 * E), dtype=torch.int64, pin_memory=True)
                self.host, self._dst = self.buf.numpy(), {}
            dst = [self.buf[:E]] if guess is None else [self.buf[:E], self.buf[E:n].view(guess.shape)]
            view = None if guess is None else self.host[E:n].reshape(tuple(guess.shape))
        m = self._dst[key] = (E, n, dst, view)
        return m

    def start(self, counts: torch.Tensor, guess: torch.Tensor | None):
        m = (self._dst.get((counts.shape, None if guess is None else guess.shape))   # _sizes' hit, inline
             or self._sizes(counts, guess))
        self._pending = (counts, guess, m, 0 if self.points is None else self.points.points)
        if self.cuda:
            assert guess is None or guess.dtype == counts.dtype == torch.int64, (counts.dtype, guess.dtype)
            if guess is None:
                m[2][0].copy_(counts, non_blocking=True)
            else:       # one call for both (foreach's per-tensor path: a non-blocking copy_ each, on this stream)
                torch._foreach_copy_(m[2], [counts, guess], non_blocking=True)
            self.event.record(current_stream(self.index))   # the current stream, as record() takes (kernels/streams.py)

    def expect(self, counts: torch.Tensor, guess: torch.Tensor | None):
        """A start that ran in a replayed graph (cap): what finish() reads, named with no copy (the same tensors)."""
        # the points made before now: before the launch of the graph that ran the start (no point is made between a
        # layer's graph launch and its expect: MoEStep._direct_group runs after its finish)
        self._pending = (counts, guess, self._dst.get((counts.shape, None if guess is None else guess.shape))
                         or self._sizes(counts, guess),                  # _sizes' hit inline, as start's
                         0 if self.points is None else self.points.points)

    def finish(self) -> tuple[np.ndarray, Marks | None]:
        """-> (counts [E] int64, the guesses' Marks or None)."""
        counts, guess, (E, _, _, view), made = self._pending
        self._pending = None
        if not self.cuda:
            c = counts.numpy()
            return c, None if guess is None else Marks.from_ids(guess.numpy(), E)     # numpy() keeps the shape
        self.event.synchronize()
        if self.points is not None:
            self.points.pass_points(made)
        return self.host[:E].copy(), None if guess is None else Marks.from_ids(view, E)


class Sent:
    """A decode miss layer's disk experts whose copies were issued before their group (engine.disk_copy_early,
    MoEStep._copy_ahead): the flex-taken ones' ids, pool offsets, flex slots, their views and staging slots (their
    copies on the compute stream, done at the group's own copies' mark); the banked ones' ids, pool offsets and
    staging slots (their copies in the group's bank, before its ready event: the bank is `opened`'s, grown)."""

    __slots__ = ("f_es", "f_offs", "taken", "f_views", "f_slots", "b_es", "b_offs", "b_slots")

    def __init__(self):
        self.f_es, self.f_offs, self.taken, self.f_views, self.f_slots = [], [], [], [], []
        self.b_es, self.b_offs, self.b_slots = [], [], []


class MoEStep:
    """The expert step of one attachment (its slot pool, kernels and pass counts; a re-attach makes a new one)."""

    def __init__(self, cfg: EngineConfig, session: StoreSession, clock: PassClock, act_limit: float | None,
                 flex: FlexCache | None = None, guess_depth: int = 3,
                 guess_min_hit: float = 0.5, hash_table: np.ndarray | None = None):
        self.cfg, self.session, self.clock = cfg, session, clock
        self.flex = flex                  # copies of recent disk experts in spare VRAM (worker/flex_cache.py), or None
        self.cache = session.cache
        self.counts = session.counts
        self.n_layer = session.file.config.n_layer
        self.kern = self._kernels(act_limit)
        if cfg.pack_experts or cfg.tile_experts:
            self._vram_layouts()
        self._walks = self.kern.backend == "torch"    # the kernels walk a group's experts (_group)
        # the routing mode (EngineConfig.routing); the bench sets "exact" for one untimed pass to measure an
        # approximate mode's divergence on the same state
        self.routing = cfg.routing
        # (directory snapshot, [n_layer, n_expert] resident mask on the device, [n_layer] resident counts)
        self._masks = None
        # copy ahead (prefetch_host; module doc): layer l+1's guessed banked host-tier experts copied into a ring
        # bank at layer l. auto: in pool routing, where the host tier's copies bound decode (issue 21)
        self.copy_ahead = cfg.prefetch_host == "on" or (cfg.prefetch_host == "auto" and cfg.routing == "pool")
        # decode guesses the next `depth` layers' experts (worker/guess.py): in exact routing; in pool routing with
        # its own choice over the guessed layer's resident set (guess_route), one layer ahead, for copy ahead alone
        # (a warm pool step reads no disk). Not in `resident` (its rank 0 reads the disk; not measured)
        self.guessing = cfg.prefetch_decode and (cfg.routing == "exact" or (cfg.routing == "pool" and self.copy_ahead))
        self.copy_ahead = self.copy_ahead and self.guessing
        # auto: the architecture's depth (the model's guess_depth, passed in as guess_depth); pool: 1 (copy ahead
        # uses layer l+1's guess only, and each guessed layer is a moe_input and a selection of its own)
        depth = guess_depth if cfg.prefetch_depth == "auto" else cfg.prefetch_depth
        self.depth = (1 if cfg.routing == "pool" else depth) if self.guessing else 0
        # copy ahead in flight: (layer l+1, its ring bank, the guessed experts copied, their pool offsets) or None
        self._ahead = None
        # auto: the architecture's waste budget (the model's guess_min_hit, passed in as guess_min_hit)
        min_hit = guess_min_hit if cfg.prefetch_min_hit == "auto" else cfg.prefetch_min_hit
        # deepseek4's hash-routed layers (the first n_hash) are guessed exactly: the ranks rule leaves their classes
        fc = session.file.config
        self.guesser = Guesser(session, self.n_layer, self.depth, min_hit, cfg.prefetch_batch_rule,
                               exact=fc.ds4.n_hash_layers if fc.ds4 is not None else 0)
        # hash ahead (hash_ahead): the hash-routed layers' expert ids per token on the host [n_hash, V, k] (the
        # model's hash_table), in exact routing with decode's guesses on; None: off (no hash layer, or pool routing,
        # whose hash layers choose among the resident experts: their disk reads are not the table's)
        self.hash = (hash_table[:self.n_layer] if hash_table is not None and cfg.prefetch_hash and self.guessing
                     and cfg.routing == "exact" else None)
        self._guess_memo = None             # (cache.all_vram, guess_layers of every layer) for that array
        self._tier_memo = None              # (snapshot, its tiers [n_layer, n_expert] contiguous): _tiers
        # the short paths of decode's common case: a layer with no miss (_hand_all), guesses none of which is on disk
        # (Guesser.read_ahead); False: the general paths (the tests compare the two: test_decode_host_fast.py)
        self.fast = True
        # the pool's device: its index resolved where the engine names "cuda" (RoutingSync's stream lookup)
        self.sync = RoutingSync(self.cache.pool.device, points=self.cache)
        # decode's at-hand group (worker/at_hand.py): every expert computable without the disk in one group, the
        # host path for the misses only; None = decode takes the partial path as prefill does
        self.hand = AtHand(self.cache, flex, self.kern.backend, cfg.host_in_place,
                           self.kern.qtypes, clock.wait) if self._hand_on(cfg) else None
        # the decode graphs' routing sync (hand_start(graphs=True)): its start captured in the layer's graph before
        # the at-hand group (RoutingSync's doc; the solo graphs' layer graph, the lanes' post part), its buffer
        # sized for a layer's counts [E] and the guesses of max_running rows [T <= max_running, D, k] (the lanes
        # decode T = max_running rows at most; solo one); None: the start stays a host part between two graphs
        # (engine.decode_fold off, or a torch with no external events)
        dev, fc = self.cache.pool.device, session.file.config
        guesses = max(1, session.plan.max_running) * self.depth * fc.n_expert_used    # [max_running, D, k] ids
        self.graph_sync = (RoutingSync(dev, cap=fc.n_expert + guesses, points=self.cache)
                           if cfg.decode_fold and self.hand is not None and RoutingSync.capturable(dev) else None)
        # decode with no per-layer sync (worker/gate.py): every layer launched ahead, gated on the device
        self.gate = None
        # gated drains: (layer, expert, staging slot) the misses' groups read, held until a later layer's marker; of
        # them, those the flex cache copies at gate_end
        self._held: list[tuple[int, int, int]] = []
        self._keeping: list[tuple[int, int, int]] = []
        self._keep_cap = 0
        if self.hand is not None and self._gate_on(cfg):
            self.gate = DecodeGate(self.n_layer, fc.n_expert, guesses, dev)
        # engine.disk_flush_early: a decode miss layer's disk batch flushed once the next expert is late (_disk_groups)
        self.flush_early = cfg.disk_flush_early
        # engine.disk_copy_early: a decode miss layer's landed disk experts copied once the next is late, one group
        # after the last (_disk_groups); the early flush copies (and groups) them anyway where both are on
        self.copy_early = cfg.disk_copy_early and not cfg.disk_flush_early
        # the staging slots a layer's disk experts may hold at once (_disk_groups; its first group holds min(this, the
        # layer's disk experts) of them): the attachment's ring banks and staging slots, fixed for this step's life
        # (a re-attach makes a new one), so made once, not at each miss layer
        self.disk_limit = max(1, min(self.cache.bank_size, session.plan.n_staging // 2))
        # engine.group_graphs (CUDA, triton kernels): the eager groups (_apply) replay CUDA graphs captured per group
        # (worker/group_graphs.py); None: they launch. Decode's rows only (max_running: attach resolved auto)
        self.group_graphs = (GroupGraphs(self.kern, cfg.max_running if isinstance(cfg.max_running, int) else 8)
                             if cfg.group_graphs and self.cache.is_cuda and self.kern.backend == "triton" else None)
        # the captured decode graphs' resident sets (route_static): fixed device storage that refresh_static
        # overwrites in place when residency changes, so a replayed graph reads the current set
        E, dev = session.file.config.n_expert, session.device
        self._static_mask = torch.zeros((self.n_layer, E), dtype=torch.bool, device=dev)   # resident (VRAM or host)
        self._static_on = np.zeros(self.n_layer, dtype=bool)     # 0 < resident < E: the layer routes approximately
        self._static_held = None                    # the host copy of _static_mask last uploaded

    @property
    def fast(self) -> bool:
        return self._fast

    @fast.setter
    def fast(self, on: bool):
        self._fast = self.guesser.fast = bool(on)

    def _hand_on(self, cfg: EngineConfig) -> bool:
        """decode_at_hand: auto = on, on the CPU (the torch kernels read each source) and with the triton kernels on
        CUDA (host slots read in place where the driver maps the arena, else through ring banks); the torch kernels
        on CUDA plan their rows on the host and stay on the partial path."""
        return cfg.decode_at_hand is not False and (not self.cache.is_cuda or self.kern.backend == "triton")

    def _gate_on(self, cfg: EngineConfig) -> bool:
        """decode_gate: on (CUDA: the triton gate kernels; the CPU drains each layer where its gate stands), off, or
        auto = on CUDA. The misses' group reads host and staging slots in place (the arena mapped for the kernels),
        and a gated layer holds its staging slots until a later layer's marker: a step's distinct disk experts of
        one layer (at most max_running x k, and at most the layer's disk experts) must fit in half the staging slots
        (the store reads ahead into the rest), or a drain would wait for a load that waits for a slot it holds.
        `on` refuses what cannot work, naming it; `auto` falls back to off."""
        if cfg.decode_gate == "off" or (cfg.decode_gate == "auto" and not self.cache.is_cuda):
            return False
        c, plan = self.session.file.config, self.session.plan
        rows = max(1, plan.max_running)
        need = min(rows * c.n_expert_used, max(0, c.n_expert - plan.resident_per_layer))
        have = plan.n_staging // 2
        why = ("the slot pool's host arena is not mapped for the kernels (the misses are read in place)"
               if not self.hand.zero_copy else
               f"a step may miss {need} disk experts of a layer (max_running {rows} x {c.n_expert_used} routed, "
               f"{c.n_expert - plan.resident_per_layer} on disk) and half the {plan.n_staging} staging slots hold "
               f"{have} (raise engine.staging_slots)" if need > have else None)
        if why is None:
            # staging slots the step may hold past their layer for the flex cache's copies (gate_end), within the
            # half the store leaves the loads
            self._keep_cap = have - need if self.flex is not None else 0
            return True
        if cfg.decode_gate == "on":
            raise BetelgeuseError(f"decode_gate = 'on': {why}")
        return False

    def _kernels(self, act_limit: float | None) -> MoEKernels:
        """The expert kernels: triton on CUDA where the experts' types allow (or when asked for), else torch."""
        qts, want, c = self.cache.qtypes, self.cfg.kernels, self.session.file.config
        ok = MoEKernels.supports(qts) and triton_available()
        if want == "triton" and not ok:
            raise BetelgeuseError("kernels = 'triton' needs the triton package and experts of the types the kernels "
                                  f"read ({', '.join(sorted(qtype_name(q) for q in TRITON_QTYPES))}; this model's "
                                  f"expert types: {', '.join(sorted({qtype_name(q) for p in qts for q in p}))})")
        backend = "triton" if want == "triton" or (want == "auto" and self.cache.is_cuda and ok) else "torch"
        return MoEKernels(backend, c.n_expert, c.n_ff_exp, self.cache.starts, qts, self.cfg.sub_batch,
                          weights_fn=self.cache.weights, act_limit=act_limit, act_quant=self.cfg.act_quant,
                          sort_rows=self.cfg.decode_gemv)

    def _vram_layouts(self):
        """The VRAM slots' layout per layer (ExpertCache.set_layouts), the kernels told which (MoEKernels.packed /
        tiled). engine.pack_experts: every Q8_0 / MXFP4 / Q4_K layer holds mma_pack's layout, read by the kernels' PK 2
        form -- or refuse (BetelgeuseError) where such an expert launch would be another kernel (MoEKernels.pack_check
        says which); a model with no such expert: nothing to pack (logged). Then engine.tile_experts: the layers
        MoEKernels.tile_check picks (never a packed one: packing wins) hold tile_layout's 64-row tiles, read by
        triton_moe's `tiled` launches; each other layer stays GGUF, logged with why."""
        c, k = self.cache, self.kern
        layouts = np.zeros(self.n_layer, dtype=np.int8)
        if self.cfg.pack_experts:
            try:
                layers = k.pack_check(c.parts, c.slot_bytes, c.device)
            except ValueError as e:
                raise BetelgeuseError(f"engine.pack_experts = true: {e}") from None
            if not layers.any():
                event(log, "pack_experts", layers=0,
                      why="no Q8_0, MXFP4 or Q4_K experts: nothing to pack, every slot GGUF order")
            else:
                k.packed[:] = layers
                layouts[layers] = PACKED
                event(log, "pack_experts", layers=int(layers.sum()), scratch_bytes=c.slot_bytes)
        if self.cfg.tile_experts:
            layers, why = k.tile_check(c.parts)
            assert not (layers & k.packed).any(), "a layer is packed or tiled"
            k.tiled[:] = layers
            layouts[layers] = TILED
            # the scratch is one for both layouts: counted here where packing did not take it
            event(log, "tile_experts", layers=int(layers.sum()),
                  scratch_bytes=c.slot_bytes if layers.any() and not k.packed.any() else 0)
            for w, ls in why.items():
                event(log, "tile_experts_gguf", layers=",".join(map(str, ls)), why=w)
        if layouts.any():
            c.set_layouts(layouts)

    def residency(self, snap, l: int) -> Residency | None:
        """Layer l's resident set for an approximate routing mode (routing_approx.py); None in exact mode, and
        for a layer with no resident expert (cold start) or all of them resident: that layer routes exactly.
        The set is VRAM or host slots alike (location invariance); one upload per pass (the directory is frozen
        for the pass), not one per layer."""
        if self.routing == "exact":
            return None
        if self._masks is None or self._masks[0] is not snap:
            held = snap["tier"] != TIER_DISK                                         # [n_layer, n_expert]
            self._masks = (snap, torch.from_numpy(held).to(self.session.device), held.sum(axis=1))
        n = int(self._masks[2][l])
        if n == 0 or n == self._masks[1].shape[1]:
            return None
        return Residency(self.routing, self._masks[1][l])

    def refresh_static(self, snap):
        """Before a static-form decode step: the pass's resident sets into the fixed buffers route_static reads
        (copy_ into the same storage, stream-ordered after the previous step's graphs; only when they changed)."""
        if self.routing == "exact":
            return
        held = snap["tier"] != TIER_DISK                                             # [n_layer, n_expert]
        if self._static_held is not None and np.array_equal(held, self._static_held):
            return
        n = held.sum(axis=1)
        self._static_mask.copy_(torch.from_numpy(held))
        self._static_on = (n > 0) & (n < held.shape[1])
        self._static_held = held

    def static_variant(self):
        """What the captured decode graphs' routing depends on besides the resident sets they read in place: the
        mode and which layers route approximately (refresh_static's; residency() says None for the others). A
        graph keyed by it holds each layer's ONE selection: no exact top-k beside an approximate one."""
        return "exact" if self.routing == "exact" else (self.routing, self._static_on.tobytes())

    def warm_routes(self, model):
        """An approximate mode, at attach: every layer's approximate selection run once, on one row, over the
        [n_layer, n_expert] mask storage the passes read (residency() and route_static have one layout, so each row
        has the same byte alignment there). On CUDA its Triton kernels compile at their first launch (one variant per
        layer kind and mask alignment, ~0.3 s each on the device's host): done in a pass, that is host time, and the
        first pass that routes approximately is the first warm one (a cold store routes exactly). The class's own
        route: a routing hook (recorder, replay) never sees these rows."""
        if self.routing == "exact":
            return
        c = self.session.file.config
        h = torch.zeros((1, c.n_embd), dtype=model.dtype, device=model.device)
        tok = torch.zeros(1, dtype=torch.int64)
        for l in range(self.n_layer):      # the static mask is all False here: a legal set (no expert resident)
            type(model).route(model, l, h, tok, Residency(self.routing, self._static_mask[l]))

    def warm_kernels(self, model, force: bool = False) -> dict | None:
        """At attach, on CUDA (force: anywhere, the tests): the expert kernels' variants of decode's groups compiled
        now, not in the first timed decode step (issue 21; kernels.moe.MoEKernels.warm): a group of T tokens for T = 1
        (a lone sequence) .. max_running (the batched lanes), every layer kind, both combine forms; and the fewest T
        that launch each other variant a prefill pass can (the rows-16 bucket, split-K or walked: a first long prompt
        compiled them, ~2 s of its TTFT on a cold Triton cache, gpu-run46-serve). -> {"groups",
        "seconds", "compiles": kernels/triton_launch.compiles_since} or None (the torch kernels, or the CPU)."""
        if self.kern.backend != "triton" or not (self.cache.is_cuda or force):
            return None
        from betelgeuse.kernels import triton_launch as tl_
        tl_.watch_compiles()
        mark, t = tl_.compile_mark(), time.perf_counter()
        c = self.session.file.config
        n = self.kern.warm(self.cache.pool, self.cache.slot_bytes, c.n_embd, c.n_expert_used, model.dtype,
                           range(1, max(1, int(self.cfg.max_running)) + 1),   # the lanes (attach resolved auto)
                           prefill=self.cfg.prefill_pass_tokens)              # and a pass's other variants
        if self.cache.is_cuda:
            torch.cuda.synchronize(self.cache.device)
        return {"groups": n, "seconds": time.perf_counter() - t, "compiles": tl_.compiles_since(mark)}

    def _may_use_disk(self, snap, l: int) -> bool:
        """Whether layer l can route to a disk-tier expert (its read-ahead is worth starting): not in `pool` mode
        with at least k experts resident (every rank then chooses among them: a warm pool pass reads nothing)."""
        if self.routing != "pool":
            return True
        return int((snap["tier"][l] != TIER_DISK).sum()) < self.session.file.config.n_expert_used

    def route_static(self, model, l: int, h, token_ids):
        """model.route in the captured decode graphs (device only, fixed shapes): a layer that routes approximately
        (static_variant, which keys the graphs) selects over the fixed resident buffers (refresh_static), the
        others exactly. Bit-identical to model.route(l, h, token_ids, residency(snap, l)) of the refreshed snap."""
        if self.routing == "exact" or not self._static_on[l]:
            return model.route(l, h, token_ids, None)
        return model.route(l, h, token_ids, Residency(self.routing, self._static_mask[l]))

    def guess_route(self, model, snap=None):
        """The decode guess's choice for a guessed layer (worker/guess.guess_ahead's route): None in exact routing
        (the model's fused guess_ids); in an approximate mode route(t, h, token_ids) -> ids [T, k], the mode's own
        selection over layer t's resident set, unhooked: the static form's fixed buffers (route_static; snap None),
        else the pass's snapshot (residency). Which experts a guess names only decides which bytes are copied
        ahead, never what a layer computes."""
        if self.routing == "exact":
            return None
        if snap is None:
            return lambda t, h, ids: self.route_static(model, t, h, ids)[0]
        return lambda t, h, ids: type(model).route(model, t, h, ids, self.residency(snap, t))[0]

    def hash_ahead(self, tokens: list[int], snap, stats: PassStats):
        """At a decode step's start (its tokens sampled, before layer 0's attention): the disk reads of the hash-routed
        layers' experts of these tokens (deepseek4: layers 0 .. n_hash-1 choose tid2eid[token], known now: exact), in
        one read ahead, nearest layer first, without waiting for the store's answer. Otherwise layer 0's reads wait
        for its attention and routing sync and layers 1 .. n_hash-1's for a guess made at layer 0: the disk idles
        from the last token's last read to then (issue 21; services/bench/disk_idle.py measures it). The store
        starts them in its read-ahead half of the staging slots (what does not fit is asked again by the guesses, as
        any read ahead not started: Guesser.hash_ahead) and skips what it has staged or in flight; a layer's load then
        takes them (promoted where still queued). Only when bytes arrive changes, never a bit (invariant 1). Counted:
        PassStats.hash_ahead*. tokens: the step's token ids on the host (one per running row)."""
        table = self.hash
        if table is None or not tokens or self.routing != "exact":     # (the bench flips routing for one pass)
            return
        tiers, flex = self._tiers(snap), self.flex
        keys = []
        for l in range(table.shape[0]):
            if self.cache.all_vram[l]:
                continue
            held = flex.copies[l] if flex is not None else ()
            tl = tiers[l]
            es = {int(e) for t in tokens for e in table[l, t].tolist()}
            keys += [(l, e) for e in sorted(es) if tl[e] == TIER_DISK and e not in held]
        if keys:
            stats.sends.append((time.monotonic(), -1))
            self.guesser.hash_ahead(keys, self.session.prefetch_start(keys), stats)

    # ---- a layer ---------------------------------------------------------------------------------------
    def layer(self, l, h, ids, w, snap, stats: PassStats, ls: LayerStats, readahead: bool, chunks=None,
              guess=None) -> torch.Tensor:
        """sum_r w_r expert_r(h) [T,H] for layer l, experts from whatever tier holds them. guess: layers l+1 ..
        l+D's guessed ids [T,D,k] on the device (worker/guess.guess_ahead) or None."""
        ev = self.clock.layer_start()
        r = self.route(l, h, ids, w, ls, chunks)
        if ls.synced:
            self.partial(l, r, snap, stats, ls, readahead, guess)
        out = self.kern.combine(r)
        self.clock.layer_end(ev, ls)
        return out

    def route(self, l, h, ids, w, ls: LayerStats, chunks=None):
        """Rows sorted by expert and counted (device, no sync). A layer wholly in VRAM is computed here in one
        group (ls.synced = False); otherwise ls.synced stays True: the caller runs partial() (host sync)."""
        r = self.route_rows(l, h, ids, w, chunks)
        if self.cache.all_vram[l]:
            self.vram_layer(l, r, ls)
        return r

    def route_rows(self, l, h, ids, w, chunks=None):
        """kernels.moe.route, its rows per expert added to the pass's counts (device only: graph-capturable)."""
        r = self.kern.route(h, ids, w, chunks)
        self.counts[l] += r.counts
        return r

    def guess_layers(self, l: int) -> list[int]:
        """The layers whose experts are worth guessing at layer l: decode guesses on, layer l has the host sync the
        guesses ride on, and of layers l+1 .. l+depth those not wholly in VRAM (nearest first)."""
        c = self.cache
        memo = self._guess_memo
        if memo is None or memo[0] is not c.all_vram:    # every layer's, once per all-VRAM pattern (a new array each)
            a = c.all_vram
            memo = self._guess_memo = (a, [[] if not self.depth or a[x] else
                                           [t for t in range(x + 1, min(x + 1 + self.depth, self.n_layer))
                                            if not a[t]] for x in range(self.n_layer)])
        return memo[1][l]

    def wants_guess(self, l: int) -> bool:
        """Layer l guesses (guess_layers): depends only on the all-VRAM pattern, which keys the decode graphs."""
        return bool(self.guess_layers(l))

    def experts(self, l, r, snap, stats: PassStats, ls: LayerStats, guess=None):
        """The experts of a routed layer (the batched decode lanes route in their graphs): a wholly VRAM layer in one
        group, else the host-synced partial path; timed as a layer's MoE compute."""
        ev = self.clock.layer_start()
        if self.cache.all_vram[l]:
            self.vram_layer(l, r, ls)
        else:
            self.partial(l, r, snap, stats, ls, False, guess)
        self.clock.layer_end(ev, ls)

    def vram_layer(self, l, r, ls: LayerStats):
        """A layer wholly in VRAM: all its experts in one group, no host sync (ls.synced = False)."""
        ls.synced = False
        self._apply(r, l, self._vram_group(l), ls)

    def partial(self, l, r, snap, stats: PassStats, ls: LayerStats, readahead: bool, guess=None,
                hand: bool = False, synced=None, table: bool = False, sync: RoutingSync | None = None):
        """The experts of a layer that is not wholly VRAM-resident (module doc, steps 1-4; writes r.y). guess: layers
        l+1 .. l+D's guessed ids [T,D,k] on the device, or None (read ahead only for guess_layers(l)). hand: decode's
        at-hand group computed every expert at hand and the sync was started (hand_start): only the misses here.
        table (decode_gate's drain, with hand and synced: the row the gate published): the misses are not computed
        here but named in the layer's miss table for the misses' group (gate_misses), read in place; no CUDA call.
        sync: the routing sync hand waits on (hand_misses(graphs=True): graph_sync), else self.sync."""
        clock, t0 = self.clock, time.perf_counter()
        b0, s0 = clock.blocked, clock.store_s
        try:
            if not hand:
                self.sync.start(r.counts, self._guess_of(l, guess))
                if clock.marks:
                    clock.mark("route", l)          # the routing and its copies to the host enqueued (gpu_marks)
            self._partial(l, r, snap, stats, ls, readahead, hand, synced, table, sync)
        finally:             # the step's own host time: its wall less blocked waits and store messages
            stats.moe_host_s += time.perf_counter() - t0 - (clock.blocked - b0) - (clock.store_s - s0)

    def _guess_of(self, l: int, guess):
        return guess if guess is not None and self.guess_layers(l) else None       # wants_guess's test, one call less

    # ---- decode's at-hand group (worker/at_hand.py) --------------------------------------------------------
    def hand_layer(self, l: int) -> bool:
        """Layer l of a decode step takes the at-hand group + misses (else: wholly VRAM, or no at-hand table)."""
        return self.hand is not None and not self.cache.all_vram[l]

    def hand_refresh(self, snap, rows: int):
        """Before a decode step of `rows` rows: the at-hand table follows the snapshot, VRAM slots, flex copies and
        the step's host rule (host_in_place: in place or through ring banks; worker/at_hand.py)."""
        self._ahead = None                  # a copy ahead not taken by the last step's layer: its bytes only
        if self.hand is not None:
            self.hand.refresh(snap, rows)

    def hand_fold(self) -> bool:
        """Whether the solo decode graphs take each layer's sync start inside the layer's graph, before its at-hand
        group (hand_start(graphs=True)): one graph a layer and one host part (the misses), not two and two. Not
        with PassStats.gpu_marks (its route mark is an event the host records between the two; marks key the
        graphs) nor where the device's torch cannot capture the start (graph_sync None)."""
        return self.graph_sync is not None and not self.clock.marks

    def hand_start(self, l: int, r, guess, graphs: bool = False):
        """After routing, before the at-hand group: the host sync's copies enqueued (no wait). graphs (hand_fold):
        the solo decode graphs' sync, in the graph being captured (or run eagerly in the same place: the first step,
        the CPU); hand_misses(graphs=True) waits on it."""
        (self.graph_sync if graphs else self.sync).start(r.counts, self._guess_of(l, guess))
        if self.clock.marks:
            self.clock.mark("route", l)             # before the at-hand group (PassStats.gpu_marks)

    def hand_group(self, l: int, r):
        """Every routed row whose expert is at hand, one gate_up + one down (graph-capturable: the table is read in
        place on the device; the torch kernels read each expert's source)."""
        h = self.hand
        self.kern.apply(r, l, self.cache.pool, Group(None, h.host[l], h.dev[l], None if h.srcs is None else h.srcs[l]),
                        self.cache.slot_bytes)

    def hand_experts(self, l, r, snap, stats: PassStats, ls: LayerStats, guess, run_group):
        """A decode layer's experts with the at-hand table (the batched lanes; timed as a layer's MoE compute): the
        sync's copies enqueued, run_group() runs hand_group (in a lane graph), then the host sync, tier counts,
        read-ahead and the misses' loads and groups; the table follows a flex eviction this layer made (before any
        later layer's group). run_group None: the fold, the start and the group ran in the post part (hand_front)."""
        ev = self.clock.layer_start()
        if run_group is None:       # folded (hand_front ran in the layer's post part): the misses only
            self.hand_misses(l, r, snap, stats, ls, guess=guess, graphs=True)
        else:
            self.hand_start(l, r, guess)
            run_group()
            self.hand_misses(l, r, snap, stats, ls)
        self.clock.layer_end(ev, ls)

    def hand_front(self, l: int, r, guess):
        """The lanes' fold (hand_fold; worker/lanes.py post part's tail): the graph sync's start, then the at-hand
        group, at the end of the part that routed; hand_experts(run_group=None) then runs the misses only."""
        self.hand_start(l, r, guess, graphs=True)
        self.hand_group(l, r)

    def hand_misses(self, l, r, snap, stats: PassStats, ls: LayerStats, synced=None, guess=None,
                    graphs: bool = False):
        """After hand_group: the wait (or the row the gate published: synced), the tier counts, read-ahead and the
        misses (partial(hand=True)); then, where this layer's disk experts evicted a later layer's flex copy, the
        table again (that layer's group must not read the rewritten slot; stream-ordered before it). Fills into free
        slots and evictions of layers <= l wait for the next step's refresh (AtHand.stale(after=l)). graphs: the
        start was hand_start(l, r, guess, graphs=True), in the layer's graph (a replay ran it: the host names what it
        waits for, RoutingSync.expect)."""
        sync = None
        if graphs:
            sync = self.graph_sync
            sync.expect(r.counts, self._guess_of(l, guess))
        self.partial(l, r, snap, stats, ls, False, None, hand=True, synced=synced, sync=sync)
        if self.hand.stale(after=l):            # a later layer's copy evicted (earlier ones: the next step's refresh)
            self.hand.refresh(snap)             # the evicted copies' entries (AtHand._patch)

    # ---- decode with no per-layer sync (worker/gate.py) ------------------------------------------------------
    def gate_layer(self, l: int, r, guess):
        """In the step's launches (graph-capturable): the at-hand group, then the layer's publish and gate."""
        self.hand_group(l, r)
        self.gate.publish_and_gate(l, r.counts, self.hand.dev[l], self._guess_of(l, guess))

    def gate_misses(self, l: int, r):
        """After the gate (graph-capturable): ONE group over the layer's miss table (the device's copy; the torch
        kernels read the host's and its sources), each missed expert read in place where the drain found it."""
        g = self.gate
        self.kern.apply(r, l, self.cache.pool, Group(None, g.table[l], g.miss[l], None if self.cache.is_cuda
                                                     else g.srcs[l]), self.cache.slot_bytes)

    def gate_begin(self):
        """Before a gated step's launches: a new tag, the words zeroed, the gates disarmed (worker/gate.py)."""
        if self.gate is not None:
            assert not self._held and not self._keeping, (self._held, self._keeping)
            self.gate.begin()

    def gate_abandon(self):
        """A failed step: every gate opens (host writes only: the device finishes the step, its output discarded);
        the staging slots held are the store's to take back (StoreSession.abandon), not released."""
        if self.gate is not None:
            self.gate.abort()
            self._held, self._keeping = [], []

    def gate_end(self):
        """After a gated step's launches and drain: a gate that gave up is an error (the step waited for); then the
        flex cache copies the disk experts kept back for it (module doc of worker/flex_cache.py: here after the step,
        as a copy made inside it could evict a flex slot a later layer's graph reads), and the staging slots go back
        with the next message to the store, once those copies ran (their event)."""
        self.gate.check()                   # raises: the caller abandons the step (gate_abandon)
        self._release_gated(self.n_layer)
        keeping, self._keeping = self._keeping, []
        if keeping:
            host = self.cache.host
            for l, e, slot in keeping:
                self.flex.keep(l, [e], host, [self.cache.staging_slot(slot).data_ptr() - host.data_ptr()])
            ev = torch.cuda.Event() if self.cache.is_cuda else None
            if ev is not None:
                ev.record()
            self.session.release([slot for _, _, slot in keeping], later=True, event=ev)

    def guess_shape(self, l: int, guess) -> tuple | None:
        """The (T, D, k) of the guess gate_layer publishes for layer l, or None."""
        g = self._guess_of(l, guess)
        return None if g is None else tuple(g.shape)

    def gate_drain(self, l: int, r, shape, snap, stats: PassStats, ls: LayerStats, armed: bool = True):
        """Layer l's row from the host buffer (polled); the staging slots of earlier layers back (their misses' groups
        ran before l's gate); the tier counts, read-ahead and loads as partial(hand=True) does, the missed experts'
        slots written into l's miss table; then its gate opens (armed: the open word; disarmed: the table copied
        into the device before the misses' group). No CUDA call where armed (module doc of worker/gate.py). A
        failure opens every gate first."""
        ev = self.clock.layer_start()
        gate = self.gate
        (gate.pos.armed if armed else gate.pos.disarmed).append(l)
        try:
            counts, marks, misses = self.clock.wait(gate.wait, l, shape)
            self._release_gated(l)
            gate.table[l].fill(-1)
            self.partial(l, r, snap, stats, ls, False, None, hand=True, synced=(counts, marks), table=True)
            found = int((gate.table[l] != -1).sum())
            if found != misses:
                raise BetelgeuseError(f"decode gate: layer {l}'s device counted {misses} missed experts, the host's "
                                      f"table names {found} (the at-hand tables differ: a bug)")
            ls.groups += found > 0                   # the misses' group (it launches either way: a graph's shape)
            gate.open(l, armed, misses)
        except BaseException:
            gate.abort()
            raise
        self.clock.layer_end(ev, ls)

    def _release_gated(self, before: int):
        """The staging slots of gated layers before `before` back to the store, with its next message; up to
        _keep_cap of them kept back for the flex cache's copies after the step (gate_end)."""
        done = [h for h in self._held if h[0] < before]
        if not done:
            return
        self._held = [h for h in self._held if h[0] >= before]
        n = max(0, min(len(done), self._keep_cap - len(self._keeping)))
        self._keeping += done[:n]
        back = [s for _, _, s in done[n:]]
        if back:
            self.session.release(back, later=True)

    def _miss_slot(self, l: int, e: int, slot: torch.Tensor):
        """Expert e of layer l read in place from `slot` (a view of the arena: a staging or host slot) by the misses'
        group: its offset relative to the pool in the miss table, its source for the torch kernels."""
        off = int(slot.data_ptr() - self.cache.host.data_ptr())
        self.gate.table[l, e] = self.hand.arena_addr + off - self.cache.pool_addr
        self.gate.srcs[l][e] = (self.cache.host, off)

    def _partial(self, l, r, snap, stats: PassStats, ls: LayerStats, readahead: bool, hand: bool = False,
                 synced=None, table: bool = False, sync: RoutingSync | None = None):
        cache = self.cache
        # host sync: routing decides the loads (with the next layer's guess in the same transfer); decode_gate: the
        # layer's row published by the device
        counts, marks = self.clock.wait((sync or self.sync).finish) if synced is None else synced
        stats.routed.append((time.monotonic(), l))     # the routing on the host: the chain to the load (PassStats)
        if hand and self._fast:
            # the short paths on the routed experts' lists, made once for both (a decode layer routes a few)
            used = counts.nonzero()[0].tolist()           # counts [E]: one C call (flatnonzero's ravel, three)
            trow = self._tiers(snap)[l]
            tiers = list(map(trow.item, used))            # Python ints: C calls (no comprehension: a call less)
            flexed = []
            if self.flex is not None:     # experts held in the flex cache are computed from their copies (step 2)
                used, tiers, flexed = self.flex.split_lists(l, used, tiers)
            # copy ahead only where it is on (off: _ahead is never set, nothing to clear; a call less a layer). A disk
            # expert is a miss (never at hand): its layer skips _hand_all (a call and its walk, issue 21, cpu-host62)
            if TIER_DISK not in tiers and self._hand_all(l, counts, marks, used, tiers, flexed, snap, stats, ls):
                if self.copy_ahead:
                    self._ahead_start(l, marks, snap, stats)
                return
            if not table and not readahead:
                self._hand_misses(l, r, counts, marks, used, tiers, flexed, snap, stats, ls)
                if self.copy_ahead:
                    self._ahead_start(l, marks, snap, stats)
                return
            # the general path below on arrays (decode_gate's table): the split is done (its counts, LRU moves)
            used, flexed = np.asarray(used, dtype=np.int64), np.asarray(flexed, dtype=np.int64)
            tiers = np.asarray(tiers, dtype=trow.dtype)
        else:
            used = np.nonzero(counts)[0]
            tiers = self._tiers(snap)[l][used]
            flexed = used[:0]
            if self.flex is not None:     # experts held in the flex cache are computed from their copies (step 2)
                used, tiers, flexed = self.flex.split(l, used, tiers)
        # a copy ahead of this layer's guessed host experts (_ahead_start at l-1) is taken by _hand_misses alone;
        # the general paths leave it (as _hand_all does: every routed expert at hand), its bytes copied for nothing
        self._ahead = None
        by_tier = {t: used[tiers == t] for t in (TIER_VRAM, TIER_HOST, TIER_DISK)}
        ls.vram, ls.host, ls.disk = (len(by_tier[t]) for t in (TIER_VRAM, TIER_HOST, TIER_DISK))
        for t, n in ((TIER_VRAM, ls.vram), (TIER_HOST, ls.host), (TIER_DISK, ls.disk)):
            stats.reads[TIER_NAMES[t]] += n
        # 1. demand loads first, so the disk starts now; read-ahead behind them (_send_loads)
        disk = [int(e) for e in by_tier[TIER_DISK]]
        loads = self._send_loads(l, disk, marks, snap, stats, lazy_flex=False)
        if readahead and l + 1 < self.n_layer and self._may_use_disk(snap, l + 1):
            nxt = snap["tier"][l + 1]
            ahead = np.nonzero(nxt == TIER_DISK)[0]
            if self.flex is not None:
                ahead = ahead[~self.flex.held_mask(l + 1, ahead)]
            stats.prefetched += self.session.prefetch([(l + 1, int(e)) for e in ahead])
        timing = self.clock.copy_timing(ls)
        B = cache.bank_size
        hslots = snap["host_slot"][l]

        def host_srcs(es):                      # host-tier experts' slots in the arena, for a bank copy
            return [cache.host_slot(l, int(hslots[e])) for e in es]
        host = [int(e) for e in by_tier[TIER_HOST]]
        if hand:            # the at-hand group computed the VRAM, flex and in-place host experts: the misses remain
            at = self.hand.host[l]
            assert (at[by_tier[TIER_VRAM]] != -1).all() and (at[flexed] != -1).all(), (l, by_tier[TIER_VRAM], flexed)
            assert (at[by_tier[TIER_DISK]] == -1).all(), (l, by_tier[TIER_DISK])
            ls.groups += 1
            self._flex_count(len(flexed), stats, ls)
            if self.hand.in_place:      # the bytes the group's kernels read over PCIe (worker/at_hand.py)
                read = [e for e in host if at[e] != -1]
                self._read_in_place(l, counts, read, stats)
            host = [e for e in host if at[e] == -1]
            if table and host:      # decode_gate: read in place from their host slots by the misses' group
                for e in host:
                    self._miss_slot(l, e, cache.host_slot(l, int(hslots[e])))
                self._read_in_place(l, counts, host, stats)
                host = []
            by_tier, flexed = {**by_tier, TIER_VRAM: used[:0]}, used[:0]
        batches = [host[i:i + B] for i in range(0, len(host), B)]
        if (ls.vram and not hand and len(batches) == 1 and not disk and not len(flexed)
                and r.ids.numel() <= r.counts.numel()):
            # decode, every byte at hand (no disk wait) and the host experts in one bank: ONE group over the VRAM
            # slots and the bank (one gate_up + one down instead of two of each; the same kernel for every row)
            vram = [int(e) for e in by_tier[TIER_VRAM]]
            bank, offs = cache.to_bank(host_srcs(host), timing)
            order = sorted(zip(vram + host, [int(cache.vram_base[l, e]) for e in vram] + offs))
            self._apply(r, l, self._group([e for e, _ in order], [o for _, o in order]), ls)
            cache.bank_done(bank)
        else:   # 2. the first host batch's copy starts, the VRAM group computes meanwhile, 3. host batches follow
            staged = [self._to_bank(b, host_srcs(b), timing) for b in batches[:1]]
            if len(by_tier[TIER_VRAM]):
                self._apply(r, l, self._vram_group(l, by_tier[TIER_VRAM]), ls)
            if len(flexed):
                self._flex_groups(l, r, flexed, stats, ls)
            for i, b in enumerate(batches):
                bank, g = staged[0] if i == 0 else self._to_bank(b, host_srcs(b), timing)
                self._apply(r, l, g, ls)
                cache.bank_done(bank)
        # 4. disk experts in batches as they land; a staging slot goes back once its copy is done (decode_gate: named
        # in the miss table where they landed, the slots held until a later layer's marker)
        if not disk:
            ahead_used = 0
        elif table:
            ahead_used = self._disk_table(l, loads, disk, counts, stats, ls)
        else:
            ahead_used = self._disk_groups(l, r, loads, len(disk), stats, ls, timing, direct=snap if hand else None)
        self.guesser.check(l, disk, ahead_used, stats)       # its disk experts as Python ints (step 1's)

    def _read_in_place(self, l: int, counts: np.ndarray, experts: list[int], stats: PassStats):
        """The bytes a group's kernels read over PCIe for these experts of layer l read in place (host or staging
        slots; worker/at_hand.py): their slot once per row block of the step's rows."""
        # their rows as a list: a decode layer reads a few experts in place (weight_reads' sums in Python)
        # (np.add.reduce: ndarray.sum less numpy's Python wrapper around it)
        stats.in_place_bytes += self.cache.slot_bytes * self.kern.weight_reads(l, list(map(counts.item, experts)),
                                                                                int(np.add.reduce(counts)))

    def _tiers(self, snap) -> np.ndarray:
        """The snapshot's tiers [n_layer, n_expert] int8, one contiguous copy per snapshot (a decode's store pass keeps
        one across steps) rather than a strided field view per layer."""
        m = self._tier_memo
        if m is None or m[0] is not snap:
            m = self._tier_memo = (snap, np.ascontiguousarray(snap["tier"]))
        return m[1]

    def _hand_all(self, l, counts, marks, used, tiers, flexed, snap, stats: PassStats, ls: LayerStats) -> bool:
        """partial(hand=True) where the at-hand group computed every routed expert of layer l (no disk expert, every
        host one read in place: decode's common case) -> True, the layer done; False (nothing done): a miss remains,
        the general path runs. `tiers` holds no disk tier (_partial tests that first: a disk expert is a miss). The
        general path's observables with nothing of it that has no work: the tier counts, the read-ahead of the guesses
        and the drop of this layer's unused ones (the same messages), the in-place bytes, the guesses scored; no
        per-tier arrays, no bank or staging bookkeeping. `used`, `tiers`:
        the routed experts less the flex-held ones (`flexed`), Python lists (_partial makes them once for both)."""
        # a few experts (T rows x k at most, as lists: _partial): Python over them costs less than numpy calls
        at = self.hand.host[l]
        for e in used:
            if at[e] == -1:                          # a disk expert, or a host one this step banks: a miss
                return False
        tl = tiers                                   # no disk expert (_partial sends those layers on)
        nh = tl.count(TIER_HOST)
        if flexed:
            assert -1 not in [at[e] for e in flexed], (l, flexed)
        nv = len(tl) - nh
        ls.vram, ls.host, ls.disk = nv, nh, 0
        reads = stats.reads
        reads["vram"] += nv
        reads["host"] += nh
        # the guesses of l+1 .. l+D read ahead in a message of their own, carrying the drop of this layer's guesses
        # (it used none of its disk ones: it has none); a prefetch of no keys carries the drop where none was sent
        self._send_loads(l, [], marks, snap, stats, lazy_flex=True)
        ls.groups += 1                               # the at-hand group
        if len(flexed):
            self._flex_count(len(flexed), stats, ls)
        if nh and self.hand.in_place:   # the bytes the group's kernels read over PCIe (worker/at_hand.py)
            self._read_in_place(l, counts, [e for e, t in zip(used, tl) if t == TIER_HOST], stats)
        self.guesser.check(l, (), 0, stats)         # no disk expert
        return True

    def _send_loads(self, l: int, disk: list[int], marks, snap, stats: PassStats, lazy_flex: bool):
        """Step 1 of a partial: the layer's demand loads (`disk`, its disk experts) sent first, so the disk starts now,
        with the guessed experts of l+1 .. l+D riding on that Load (the store starts them once the loads' reads have
        started, never before); a layer with no miss sends them alone, the answer read when a guessed layer is
        scored. Either message drops this layer's guesses it does not use (a prefetch of none carries them
        otherwise). A guessed expert held in the flex cache needs no read: removed from the marks first, or
        (lazy_flex, the decode fast path) only where a guess sits on disk. -> the loads' stream (empty: no miss)."""
        keys = [(l, e) for e in disk] if disk else []      # (a comprehension is a call: none for no miss)
        drop = self.guesser.unused(l, disk)
        loads = sent = None

        def send_ahead(ahead):
            nonlocal loads, sent
            sent = True
            stats.sends.append((time.monotonic(), l))
            if not keys:
                return self.session.prefetch_start(ahead, drop)
            loads = self.session.load(keys, ahead, drop)
            return loads.queued
        if marks is not None:
            unheld = None
            if self.flex is not None:
                if lazy_flex:
                    unheld = self._unflexed             # read_ahead passes it l (no lambda: a call less a layer)
                else:
                    marks = self._unflexed(l, marks)
            self.guesser.read_ahead(l, self.guess_layers(l), marks, snap, stats, send_ahead, unheld)
        if loads is None:
            if keys:
                stats.sends.append((time.monotonic(), l))
            loads = self.session.load(keys, (), drop) if keys else iter(())
            if drop and not keys and not sent:
                self.session.prefetch_start([], drop)
        return loads

    def _hand_misses(self, l, r, counts, marks, used, tiers, flexed, snap, stats: PassStats, ls: LayerStats):
        """partial(hand=True) where a miss remains after the at-hand group (a disk expert, or a host one this step
        banks), on the experts' lists: the general path's observables and calls in its order (the tier counts, the
        read-ahead on the load message, the in-place bytes, the host batches through ring banks, the disk groups,
        the guesses scored) without its per-tier arrays, dict and array asserts (a decode layer routes a few experts:
        Python over their lists costs less than a numpy call each). One difference, on purpose: the banked host
        experts are computed in the first disk group (one bank, table and apply for both, where they fit: the general
        path's host group and its launches are saved; LayerStats.groups one lower), which cannot change a bit (module
        doc: each row's output by the same kernel whatever its group, ranks reduced in order). `used`, `tiers`: the
        routed experts less the flex-held ones (`flexed`), lists. The general path (fast = False) is what the tests
        compare it with. A copy ahead of this layer's guessed host experts (_ahead_start at l-1): the banked experts
        it holds are computed from its bank first (_ahead_group)."""
        ahead, self._ahead = self._ahead, None
        ahead = ahead if ahead is not None and ahead[0] == l else None
        at = self.hand.host[l]
        nv, read, banked, disk = 0, [], [], []      # VRAM; host read in place (at hand) / banked here; disk
        for e, t in zip(used, tiers):               # lists (_partial)
            a = at[e]
            if t == TIER_VRAM:
                assert a != -1, (l, e)               # the at-hand group computed it
                nv += 1
            elif t == TIER_HOST:
                (banked if a == -1 else read).append(e)
            elif t == TIER_DISK:
                assert a == -1, (l, e)               # a disk expert is never at hand
                disk.append(e)
        if flexed:
            assert -1 not in [at[e] for e in flexed], (l, flexed)
        ls.vram, ls.host, ls.disk = nv, len(read) + len(banked), len(disk)
        reads = stats.reads
        reads["vram"] += ls.vram
        reads["host"] += ls.host
        reads["disk"] += ls.disk
        # 1. demand loads, the guesses' read-ahead on the same message (partial's step 1)
        loads = self._send_loads(l, disk, marks, snap, stats, lazy_flex=True)
        timing = self.clock.copy_timing(ls)
        ls.groups += 1                               # the at-hand group
        if flexed:                                   # (none: it would add 0s; a call less, as _hand_all)
            self._flex_count(len(flexed), stats, ls)
        if self.hand.in_place and read:     # the bytes the group's kernels read over PCIe (none: adds 0)
            self._read_in_place(l, counts, read, stats)
        # 2-3. the banked host experts: where the layer has disk experts, in the first disk group's bank (their copies
        # issued now, they are at hand; the disk experts' appended as they land; one table, one apply for both) as
        # far as it has room beside that group's disk experts; what does not fit in groups of their own first
        cache, B = self.cache, self.cache.bank_size
        opened = None
        if banked and ahead is not None:
            banked = self._ahead_group(l, r, ahead, banked, snap, stats, ls, timing)
        if banked:
            hslots = snap["host_slot"][l]
            srcs = [cache.host_slot(l, int(hslots[e])) for e in banked]
            n = len(banked) - (min(len(banked), B - min(self.disk_limit, len(disk))) if disk else 0)
            for i in range(0, n, B):
                bank, g = self._to_bank(banked[i:i + B], srcs[i:i + B], timing)
                self._apply(r, l, g, ls)
                cache.bank_done(bank)
            if n < len(banked):
                bank = cache.bank_next()
                opened = (bank, banked[n:], cache.bank_copy(bank, 0, srcs[n:], timing, wait=False))
        # 4. the disk experts as they land
        ahead_used = self._disk_groups(l, r, loads, len(disk), stats, ls, timing, opened, snap) if disk else 0
        self.guesser.check(l, disk, ahead_used, stats)

    def _ahead_start(self, l: int, marks, snap, stats: PassStats):
        """Copy ahead (prefetch_host), at the end of decode layer l's host step (fast path, not gated: a gated step
        reads its host experts in place): layer l+1's guessed host-tier experts that the step banks (not at hand:
        not in VRAM, a flex copy or read in place) copied from their host slots into the next ring bank now, on the
        copy stream behind layer l's own copies, without a wait. They cross PCIe while the GPU computes layer l and
        layer l+1's attention and routing; otherwise they would start only once l+1's routing reached the host
        (its sync), and l+1's kernels would wait for them. Each running row's guess (marks at depth 1), rank by
        rank (every row's top-1 first), at most a bank of them. A guess never decides what is computed: layer l+1
        computes the experts it routes to, those it finds here from this bank (_ahead_group), the others copied
        after its routing as before; a wrong guess costs its bytes over PCIe (host_guessed - host_guess_hits)."""
        self._ahead = None
        t = l + 1
        if (not self.copy_ahead or marks is None or marks.ids is None or self.gate is not None
                or t >= self.n_layer or self.cache.all_vram[t]):
            return
        cache = self.cache
        at, tiers, hslots = self.hand.host[t], self._tiers(snap)[t], snap["host_slot"][t]
        es: list[int] = []
        for rank in range(len(marks.ids[0][0])):    # marks.ids [T][D][k]: depth 1 is layer l+1
            for row in marks.ids:
                e = row[0][rank]
                if tiers[e] == TIER_HOST and at[e] == -1 and hslots[e] >= 0 and e not in es:
                    es.append(e)
        es = es[:cache.bank_size]
        if not es:
            return
        bank = cache.bank_next()
        offs = cache.bank_copy(bank, 0, [cache.host_slot(t, int(hslots[e])) for e in es], wait=False)
        self._ahead = (t, bank, es, offs)
        stats.host_guessed += len(es)
        stats.host_guess_bytes += len(es) * cache.slot_bytes

    def _ahead_group(self, l, r, ahead, banked: list[int], snap, stats: PassStats, ls: LayerStats, timing) -> list:
        """Layer l's banked host experts (`banked`) with a copy ahead (layer, bank, guessed experts, offsets): those
        it holds (hits) and as many others as the bank has room for after them (copied now, into the same bank) in
        ONE group; the compute stream waits for the bank (every copy into it so far: the ones ahead and these), its
        slot table copied with them on the copy stream. -> the banked experts left (the caller's host groups, as
        before). No hit: nothing here (the bank is taken again in its turn). Each row is computed by the same kernel
        from the same bytes whichever slot holds them (module doc: invariant 1)."""
        _, bank, es, offs = ahead
        where = dict(zip(es, offs))
        hit = [e for e in banked if e in where]
        stats.host_guess_hits += len(hit)
        if not hit:
            return banked
        cache = self.cache
        miss = [e for e in banked if e not in where]
        fill = miss[:cache.bank_size - len(es)]
        hslots = snap["host_slot"][l]
        fill_offs = cache.bank_offsets(bank, len(es), len(fill))
        order = sorted(zip(hit + fill, [where[e] for e in hit] + fill_offs))
        ids = [e for e, _ in order]
        host, dev = cache.table(ids, [o for _, o in order], copy=False)
        cache.bank_copy(bank, len(es), [cache.host_slot(l, int(hslots[e])) for e in fill], timing, table=dev,
                        offs=fill_offs)
        self._apply(r, l, Group(np.asarray(ids, dtype=np.int64) if self._walks else None, host, dev), ls)
        cache.bank_done(bank)
        return miss[len(fill):]

    def serial(self, l, r, used, snap, stats: PassStats, ls: LayerStats):
        """The standard schedule: the layer's used experts in ascending id, each fetched and waited for (no overlap)."""
        cache = self.cache
        tiers, hslots = snap["tier"][l], snap["host_slot"][l]
        for e in used:
            e = int(e)
            tier = int(tiers[e])
            stats.reads[TIER_NAMES[tier]] += 1
            if tier == TIER_VRAM:
                ls.vram += 1
                g = self._group([e], [int(cache.vram_base[l, e])])
            elif tier == TIER_HOST:
                ls.host += 1
                _, g = self._to_bank([e], [cache.host_slot(l, int(hslots[e]))], None)
            else:
                ls.disk += 1
                tw = time.perf_counter()
                (got,) = list(self.session.load([(l, e)]))
                ls.disk_wait_s += time.perf_counter() - tw
                stats.disk_bytes += got.disk_bytes
                _, g = self._to_bank([e], [cache.staging_slot(got.staging_slot)], None)
                self.clock.sync()
                self.session.release([got.staging_slot], later=True)
            self.clock.sync()                          # no overlap: the copy is waited for
            tc = time.perf_counter()
            self._apply(r, l, g, ls)
            self.clock.sync()
            ls.compute_ms += (time.perf_counter() - tc) * 1e3

    # ---- groups, banks and staging slots ----------------------------------------------------------------
    def _group(self, experts, offs) -> Group:
        """A group of these experts (a list or array of ids) at these pool offsets: its slot table; the ids as an
        array for the torch kernels, which walk them (the triton ones read the device table alone: no array made)."""
        host, dev = self.cache.table(experts, offs)
        return Group(np.asarray(experts, dtype=np.int64) if self._walks else None, host, dev)

    def _vram_group(self, l: int, experts=None) -> Group:
        c = self.cache
        return Group(experts, c.vram_base[l], c.vram_base_dev[l])

    def _apply(self, r, l: int, g: Group, ls: LayerStats, pool: torch.Tensor | None = None):
        """Every eager group of a layer (the one place that decides): a graph replay under engine.group_graphs
        (worker/group_graphs.py: the same kernels on the same arguments), else the kernels' launches."""
        pool = self.cache.pool if pool is None else pool
        if self.group_graphs is not None:
            self.group_graphs.apply(r, l, pool, g, self.cache.slot_bytes)
        else:
            self.kern.apply(r, l, pool, g, self.cache.slot_bytes)
        ls.groups += 1

    def _flex_groups(self, l, r, experts, stats: PassStats, ls: LayerStats):
        """Flex cache hits: one group per chunk, computed in place like VRAM experts (counted as VRAM reads)."""
        for chunk, es, offs in self.flex.groups(l, experts):
            self._apply(r, l, self._group(es, offs), ls, chunk)
        self._flex_count(len(experts), stats, ls)

    @staticmethod
    def _flex_count(n: int, stats: PassStats, ls: LayerStats):
        """n flex hits, counted as VRAM reads."""
        ls.vram += n
        stats.reads["vram"] += n
        stats.flex_hits += n

    def _unflexed(self, l: int, marks: Marks) -> Marks:
        """Guessed marks of layers l+1 .. l+D without the experts the flex cache holds."""
        D = marks.depth
        copies = self.flex.copies[l + 1: l + 1 + D]
        if not any(copies):                        # no copy of these layers: no numpy call
            return marks
        if marks.ids and len(copies) == D:         # the ids' lists kept, the held experts as sets (Marks.without)
            return marks.without_sets(copies)
        held = self.flex.where[l + 1: l + 1 + D] >= 0
        return marks.without(held) if held.any() else marks

    def _to_bank(self, experts, srcs, timing) -> tuple[int, Group]:
        bank, _, g = self._bank_group(experts, srcs, timing)
        return bank, g

    def _bank_group(self, experts: list[int], srcs, timing, opened=None) -> tuple[int, list[int], Group]:
        """Experts' slots `srcs` copied into a ring bank, the next one (bank_next) or, opened = (bank, experts, their
        offsets) taken and partly filled (bank_copy, wait=False), after those: one group of them all. Its slot table
        is copied with the slots, on the copy stream (bank_copy(table=): no copy of its own on the compute stream,
        whose wait for the bank covers it). -> (bank, the srcs' pool offsets, the group)."""
        cache = self.cache
        if opened is None:
            bank, at, es, pre_offs = cache.bank_next(), 0, experts, []
        else:
            bank, pre, pre_offs = opened
            at, es = len(pre), pre + experts
        offs = cache.bank_offsets(bank, at, len(srcs))
        host, dev = cache.table(es, pre_offs + offs, copy=False)
        cache.bank_copy(bank, at, srcs, timing, table=dev, offs=offs)
        return bank, offs, Group(np.asarray(es, dtype=np.int64) if self._walks else None, host, dev)

    def _take_direct(self, l, es: list[int], srcs, slots: list[int], sent: Sent | None) -> tuple:
        """FlexCache.take over a batch (part) of disk experts, never a slot `sent`'s earlier calls took -> one pass over
        them (a decode layer's few): the flex-taken ones' indices, ids, pool offsets, slot views, sources, staging
        slots; the others' indices (through the bank): (fi, bi, f_es, f_offs, views, fsrcs, f_slots)."""
        flex = self.flex
        took = flex.take(l, es, sent.taken if sent is not None else ())
        pool = self.cache.pool_addr
        fi, bi, f_es, f_offs, views, fsrcs, f_slots = [], [], [], [], [], [], []
        for i, s in enumerate(took):
            if s is None:
                bi.append(i)
                continue
            fi.append(i)
            f_es.append(es[i])
            f_offs.append(flex.addresses[s] - pool)
            views.append(flex.views[s])     # its flex slot's view
            fsrcs.append(srcs[i])
            f_slots.append(slots[i])
            if sent is not None:
                sent.taken.append(s)
        return fi, bi, f_es, f_offs, views, fsrcs, f_slots

    def _flex_copy(self, dsts, srcs, n: int, timing):
        """Staging slots (and a table row, an at-hand upload) copied into flex slots on the compute stream, in one
        _foreach_copy_ (n of them a slot: h2d bytes), its time in `timing` (PassClock.copy_timing: CUDA events)."""
        cache = self.cache
        t = time.perf_counter()
        ev0 = None
        if cache.is_cuda and timing is not None:       # the copy timing (PassClock.copy_timing) on this stream
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(current_stream(cache.device.index))
        torch._foreach_copy_(dsts, srcs, non_blocking=cache.is_cuda)     # the current (compute) stream
        if ev0 is not None:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record(current_stream(cache.device.index))
            timing.append((ev0, ev1))
        elif timing is not None:
            timing.append((time.perf_counter() - t) * 1e3)
        cache.h2d_bytes += n * cache.slot_bytes

    def _copy_ahead(self, l, es: list[int], srcs, slots: list[int], timing, opened, sent: Sent, direct: bool):
        """engine.disk_copy_early: landed disk experts `es` (staged in `srcs`, staging slots `slots`) copied now, the
        next one not landed yet: where their group will read them (direct: a flex slot taken now, its copy on the
        compute stream as _direct_group's; else, and where the flex cache takes none, the next slots of the group's
        bank, `opened`'s or one taken now, on the copy stream with no wait: bank_copy(wait=False)), so the copies
        run while the disk reads the rest. Nothing is computed: the group after the layer's last (flush) computes
        them with the rest, from the same slots as one call over the batch (_direct_group / _bank_group with `sent`).
        The staging slots stay held until that group's copies are queued (their events cover these: stream order, the
        bank's ready event re-recorded after its last part). -> opened: (bank, experts, pool offsets) grown by the
        banked ones, or as it was."""
        cache = self.cache
        if direct:
            fi, bi, f_es, f_offs, views, fsrcs, f_slots = self._take_direct(l, es, srcs, slots, sent)
            if fi:
                self._flex_copy(views, fsrcs, len(fi), timing)
                sent.f_es += f_es
                sent.f_offs += f_offs
                sent.f_views += views
                sent.f_slots += f_slots
            if not bi:
                return opened
            es, srcs, slots = [es[i] for i in bi], [srcs[i] for i in bi], [slots[i] for i in bi]
        bank, pre, pre_offs = opened if opened is not None else (cache.bank_next(), [], [])
        offs = cache.bank_copy(bank, len(pre), srcs, timing, wait=False)
        sent.b_es += es
        sent.b_offs += offs
        sent.b_slots += slots
        return bank, pre + es, pre_offs + offs

    def _direct_group(self, l, r, es: list[int], srcs, slots: list[int], timing, opened, ls: LayerStats,
                      snap, sent: Sent | None = None) -> list:
        """A decode miss layer's batch of disk experts `es` (staged in `srcs`, staging slots `slots`) with the flex
        cache on: each one the cache takes (FlexCache.take) copied from its staging slot straight into its flex slot,
        the others into a ring bank (the next, or `opened`'s after its host experts: _bank_group's), and ONE group
        computes them all where they were copied to: the flex copy is the group's source, not a device-to-device copy
        out of the bank after it (keep; one copy, its launch and its slices less a disk expert). The bytes are the
        file's whichever slot holds them, and each row is computed by the same kernel (invariant 1).
        Ordering: the flex copies (and the group's table where no bank copy carries it) are queued on the compute
        stream, in one _foreach_copy_, so stream order puts them after every group that may still read a slot's
        evicted copy (the at-hand groups of this and earlier layers and steps, flex chunk groups, earlier direct
        groups: all on the compute stream; a group graph's first launch on the capture stream is joined back to it:
        on_side) and before this group; a later layer's at-hand group reads the new table: where a later layer's
        copy was evicted (AtHand.stale(after=l)) its upload is queued in the same _foreach_copy_ (refresh(defer=True):
        one call and one event for both; the at-hand table is read by no group of this layer after it, and
        hand_misses' refresh re-uploads where a later batch of the layer evicts again). The price: such a copy does
        not overlap the compute queued before it (a decode layer's at-hand group, long done by the time a disk read
        lands) nor an earlier batch's group of the layer.
        sent (engine.disk_copy_early): the batch's experts copied before (_copy_ahead: flex slots taken, copies issued,
        banked ones in `opened`); `es` the rest. The group, its table and the slots it names are those of one call
        over the whole batch (take's calls over its parts give the same slots; the bank's in landing order).
        -> [(CUDA event after their copies, staging slots)]: what _release waits for before the slots go back."""
        cache, flex = self.cache, self.flex
        fi, bi, f_es, f_offs, views, fsrcs, f_slots = self._take_direct(l, es, srcs, slots, sent)
        dsts = list(views)                  # the copies of this call: these flex slots (+ the table, an at-hand upload)
        if sent is not None and sent.f_es:  # the group computes the earlier copies too; their slots go back with these
            f_es, f_offs, views, f_slots = (sent.f_es + f_es, sent.f_offs + f_offs, sent.f_views + views,
                                            sent.f_slots + f_slots)
        bank = None
        pre, pre_offs, b_offs, b_es = [], [], [], []
        if bi or opened is not None:
            if opened is None:
                bank, at = cache.bank_next(), 0
            else:
                bank, pre, pre_offs = opened
                at = len(pre)
            b_offs = cache.bank_offsets(bank, at, len(bi))
            b_es = [es[i] for i in bi]
        ids = pre + b_es + f_es
        host, dev = cache.table(ids, pre_offs + b_offs + f_offs, copy=False)
        held = []
        if f_es:
            if not bi:      # the table with them: no bank copy of slots carries it (no bank, or `opened`'s alone)
                dsts.append(dev)
                fsrcs.append(cache.table_source(dev))
            hand = self.hand
            if hand is not None and hand.stale(after=l):   # a later layer's evicted copy: the upload with them
                hand.refresh(snap, defer=True)
                if hand.deferred is not None:
                    dsts.append(hand.deferred[0])
                    fsrcs.append(hand.deferred[1])
                else:
                    hand = None
            else:
                hand = None
            if dsts:        # none: every flex copy issued before, the table with the bank's copies
                self._flex_copy(dsts, fsrcs, len(fi), timing)
            ev = cache.mark()   # after the earlier copies too (stream order): their slots' point
            held.append((ev, f_slots))
            if hand is not None:
                hand.uploaded(ev)
        if bi:
            # the bank's copies (and the table) on the copy stream; the compute stream waits for them
            cache.bank_copy(bank, at, [srcs[i] for i in bi], timing, table=dev, offs=b_offs)
            held.append((cache.bank_ready_event(bank), [slots[i] for i in bi]))
        elif bank is not None and not f_es:
            # every expert of the group copied into `opened`'s bank before (host experts, _copy_ahead's disk ones):
            # the table alone on the copy stream, the compute stream waiting for the bank
            cache.bank_copy(bank, len(pre), [], table=dev)
        elif bank is not None:
            # `opened` with every disk expert taken by the flex cache (a ds4-flash miss layer's usual case: its host
            # experts banked): the compute stream waits for the host experts' copies, queued into the bank before,
            # and no copy-stream pass for the table alone (its stream switch, copy, record and wait: ~8 torch calls
            # a miss layer on CUDA, issue 21, cpu-host65)
            cache.bank_wait(bank)
        if sent is not None and sent.b_slots:     # the earlier banked ones: copied into this bank, before its event
            held.append((cache.bank_ready_event(bank), sent.b_slots))
        g_srcs = None
        if self._walks and f_es:                  # the torch kernels read each expert's source: pool or flex chunk
            g_srcs = [None] * len(host)
            for e, o in zip(pre + b_es, pre_offs + b_offs):
                g_srcs[e] = (cache.pool, o)
            for e, v in zip(f_es, views):  # the flex slot's own view (the bytes FlexCache.sources names)
                g_srcs[e] = (v, 0)
        self._apply(r, l, Group(np.asarray(ids, dtype=np.int64) if self._walks else None, host, dev, g_srcs), ls)
        if bank is not None:
            cache.bank_done(bank)
        return held

    def _disk_groups(self, l, r, loads, n_disk, stats: PassStats, ls: LayerStats, timing, opened=None,
                     direct=None) -> int:
        """The disk experts in batches as they land (module doc, step 4); the last staging slots go back with the next
        message to the store. opened: (bank, experts, their pool offsets) of a bank taken (bank_next) and partly filled
        (a decode miss layer's banked host experts, _hand_misses) with room for the first batch: that batch's copies
        follow them there and one group computes them all. direct (decode: the pass's snapshot; None otherwise), with
        the flex cache on: a disk expert the flex cache takes is copied from its staging slot straight into its flex
        slot and computed there (_direct_group), not through a ring bank and a device-to-device copy after its group
        (FlexCache.keep: prefill's many experts keep the ring's copy / compute overlap). Early flush (decode, engine.
        disk_flush_early): a batch is also copied and grouped once the next disk expert has not landed yet
        (loads.ready() False), so its copies and group run while the disk reads the rest; experts landed together
        still share a batch. No bit changes (module doc: each row by the same kernel whatever its group; ranks
        reduced in order); each early flush is one group more (PassStats.disk_flushes). Early copy (decode, engine.
        disk_copy_early): the landed experts' copies alone are issued then (_copy_ahead: their slots taken, their
        copies queued), and the batch is still ONE group once it is flushed as it would be (the same table, slots and
        kernels: no group, launch or bit more); the batch's first `len(sent)` experts are those copied. -> the loads
        answered from a read ahead."""
        cache = self.cache
        ahead_used = 0
        B = cache.bank_size
        early = self.flush_early and stats.kind == "decode"
        copy_early = self.copy_early and stats.kind == "decode"
        sent, n_sent = Sent(), 0                             # the batch's experts copied before its group
        limit = self.disk_limit                              # staging slots this layer may hold at once
        held: list[tuple[object, list[int]]] = []            # (CUDA event, staging slots) whose copies may be in flight
        batch = []
        snap, direct = direct, direct is not None and self.flex is not None

        marks = self.clock.marks                            # PassStats.gpu_marks: the batch's copy and group

        def staged(part):
            es, srcs, slots = [], [], []               # one pass over the batch (a decode layer's few experts)
            views = cache.staging_views                # staging_slot's views, indexed (no call an expert)
            for x in part:
                es.append(x.expert)
                srcs.append(views[x.staging_slot])
                slots.append(x.staging_slot)
            return es, srcs, slots

        def flush():
            nonlocal batch, opened, sent, n_sent
            if batch:
                es, srcs, slots = staged(batch[n_sent:] if n_sent else batch)    # those not copied yet (may be none)
                t0 = time.monotonic() if marks else 0.0
                if direct:
                    held.extend(self._direct_group(l, r, es, srcs, slots, timing, opened, ls, snap,
                                                   sent if n_sent else None))
                    if marks:
                        self.clock.mark_copy(l, timing, t0)
                        self.clock.mark("group", l)
                else:
                    # after the host experts' copies in their bank where one is opened: one table and one apply for both
                    bank, offs, g = self._bank_group(es, srcs, timing, opened)
                    if marks:
                        self.clock.mark_copy(l, timing, t0)
                    self._apply(r, l, g, ls)
                    if marks:
                        self.clock.mark("group", l)
                    if n_sent:                     # the earlier copied ones: in this bank before these
                        es, offs, slots = sent.b_es + es, sent.b_offs + offs, sent.b_slots + slots
                    if self.flex is not None:      # copies for the flex cache, before the bank may be rewritten
                        self.flex.keep(l, es, cache.pool, offs, cache.ring_views(offs))
                    cache.bank_done(bank)
                    held.append((cache.bank_ready_event(bank), slots))
                opened = None
                batch = []
                if n_sent:
                    sent, n_sent = Sent(), 0

        clock, it = self.clock, loads.it if n_disk else None
        for i in range(n_disk):
            # the slots held, summed only where some are (decode's direct groups flush at the layer's end: mostly none),
            # in a list (one call; a generator is one a step)
            if batch and len(batch) + (sum([len(s) for _, s in held]) if held else 0) >= limit:
                flush()
            if held:                                         # never many held while blocking
                held = self._release(held, keep=limit - 1 - len(batch), excess=early)
            w0 = clock.store_wait
            got = clock.wait_store(next, it)                 # the client's stream itself (LoadStream.it)
            ta = time.monotonic()                            # handed to the worker (PassStats.landed: the last)
            ls.disk_wait_s += clock.store_wait - w0          # the wait the clock counted: the layer's share of it
            ahead_used += got.prefetched
            stats.disk_bytes += got.disk_bytes
            batch.append(got)
            if len(batch) == B:
                flush()
            elif early and i + 1 < n_disk and not loads.ready():     # the next one is still on its way: these now
                flush()
                stats.disk_flushes += 1
            elif copy_early and i + 1 < n_disk and not loads.ready():    # their copies now, their group later
                t0 = time.monotonic() if marks else 0.0
                opened = self._copy_ahead(l, *staged(batch[n_sent:]), timing, opened, sent, direct)
                n_sent = len(batch)
                stats.disk_copies_early += 1
                if marks:
                    self.clock.mark_copy(l, timing, t0)
        if n_disk:
            stats.landed.append((ta, l))
        flush()
        self._release(held, keep=0, later=True)
        return ahead_used

    def _disk_table(self, l, loads, disk: list[int], counts: np.ndarray, stats: PassStats, ls: LayerStats) -> int:
        """decode_gate: the disk experts as they land, each named in layer l's miss table at its staging slot (read in
        place by the misses' group); the slots held until a later layer's marker (gate_drain). -> the loads answered
        from a read ahead."""
        ahead_used = 0
        clock, it = self.clock, loads.it if disk else None
        for _ in disk:
            w0 = clock.store_wait
            got = clock.wait_store(next, it)                 # as _disk_groups: the client's stream itself
            ta = time.monotonic()
            ls.disk_wait_s += clock.store_wait - w0
            ahead_used += got.prefetched
            stats.disk_bytes += got.disk_bytes
            self._miss_slot(l, got.expert, self.cache.staging_slot(got.staging_slot))
            self._held.append((l, got.expert, got.staging_slot))
        if disk:
            stats.landed.append((ta, l))
            self._read_in_place(l, counts, disk, stats)
        return ahead_used

    def _release(self, held, keep: int, later: bool = False, excess: bool = False):
        """Release staging slots whose copies finished (held: (CUDA event recorded after their copies, slots); CUDA:
        event query, no sync); while more than `keep` slots remain held, wait for the oldest copies. later: they go
        back with the next message to the store (the layer's last), else now (the store needs them for this layer's
        loads). excess (the early flush's, _disk_groups): only the oldest beyond `keep` go back now, the rest stay
        held (returned) and go back with the layer's last: an early flush's slot would otherwise cost a release
        message of its own (a layer holds at most disk_limit slots either way). Returns what is still held."""
        if not held:
            return held
        if self.cache.is_cuda:
            if later:      # the layer goes on without waiting: they go back once their copies are done (the event;
                for ev, slots in held:      # a bank's re-recorded later on the same copy stream is later still),
                    self.session.release(slots, later=True, event=ev)   # synchronized at the next message: no query
                return []      # now (the layer's last copies are just queued: a query here is False, for nothing)
            done = [] if excess else [hb for hb in held if hb[0].query()]
            rest = [hb for hb in held if hb not in done]
        else:       # CPU copies are synchronous: all done (excess: none yet, the oldest beyond keep below); no
            done, rest = ([], list(held)) if excess else (list(held), [])     # comprehension: a call less a layer
        while rest and sum(len(s) for _, s in rest) > max(keep, 0):
            if self.cache.is_cuda:
                self.clock.wait(rest[0][0].synchronize)
            done.append(rest.pop(0))
        if done:
            # one batch's slots as they are (release copies them): no comprehension, a decode layer's call less
            self.session.release(done[0][1] if len(done) == 1 else [s for _, slots in done for s in slots], later)
        return rest
