"""The worker's session with the expert store: attachment, store passes and all of the worker's consolidation policy.

  attach     map the store's arena (registered as pinned on CUDA), the worker's device slot pool (ExpertCache) and
             the slot directory, and the prefix cache's host tier (`prefix_arena`, writable, pinned on CUDA: the
             KV manager formats or adopts it); a re-attach (the store restarted) drops the old mappings first
  passes     the directory is frozen from begin_pass to end_pass. A prefill opens a store pass and closes it with
             consolidation. Decode steps keep the store pass open across tokens (no round trip per token: usage is
             counted on the device and sent once at the close) until the request ends or every
             `decode_consolidate_every` decode passes, when the decode's own usage is consolidated (its working set
             moves into the resident tiers).
  no waits   a decode pass does not wait for a consolidation still filling its slots (the store applies it at a
             later begin_pass; once the directory's header says the fill is done, the session reopens the store
             pass to pick it up: no message per token while it fills), and
             neither does the end-of-request consolidation: waiting for its disk reads stalled the next token or
             the next request's first token for seconds (docs/benchmarks)
  request    a request that decoded ends with a consolidation of its usage only when no other sequence runs: while
             others run, their periodic decode consolidation counts its usage instead (one consolidation per request
             end stalled the batch's next pass on its disk reads, over and over as requests came and went)
  VRAM       at the start of a store pass the VRAM hot slots are made to match the directory's VRAM tier: copies
             from the host backing slots, and disk reads through the store for VRAM experts without a backing copy

The session also counts the expert rows of each pass on the device ([n_layer, n_expert], the routing adds into it;
one sync at the pass's end) and the store round trips, and holds deepseek41's Engram feed (worker/engram_feed.py: Engram rows
from the store through the same arena), made at each attach.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned
from betelgeuse.store.client import StoreClient, TrackedLoads
from betelgeuse.store.directory import SlotDirectory
from betelgeuse.store.plan import SlotPlan
from betelgeuse.worker.engram_feed import EngramFeed
from betelgeuse.worker.expert_cache import ExpertCache
from betelgeuse.worker.stats import PassClock, PassStats


class StoreSession:
    def __init__(self, cfg: EngineConfig, store: StoreClient, file: GGUFModelFile, device: torch.device,
                 dtype: torch.dtype, clock: PassClock):
        self.cfg, self.store, self.file, self.device, self.dtype, self.clock = cfg, store, file, device, dtype, clock
        self.cache: ExpertCache | None = None
        self.plan: SlotPlan | None = None
        self.directory: SlotDirectory | None = None
        self.engram: EngramFeed | None = None     # deepseek41's Engram rows through the store (engram_feed.py)
        self.counts: torch.Tensor | None = None   # [n_layer, n_expert] int64 on the device: rows per expert, this pass
        self.snap = None                          # the directory snapshot of the open store pass
        self.pass_open = False
        self.decode_since = 0                     # decode passes since the store pass was opened
        self._resume_since = 0                    # carried over a close/reopen while a consolidation fills
        self.calls = 0                            # store round trips (all time)
        self._usage: np.ndarray | None = None     # rows per expert since the store pass opened (host)
        self._give: list[int] = []                # staging slots to hand back with the next message (release)
        self._give_after: list = []               # (CUDA event, staging slots): the same, once the event completed
        self._streams: list[LoadStream] = []      # this engine pass's load streams (closed if it is abandoned)
        self.prefix_arena: Arena | None = None    # the prefix cache's host tier, held by the store (None: none)
        self._prefix_pinned = False

    # ---- attachment ------------------------------------------------------------------------------------
    def attach(self):
        """(Re)attach to the store: map its arena, register it as pinned; the VRAM slots refill on the next pass."""
        if self.cache is not None:
            self.cache.close()
        self._close_prefix()
        arena, plan = self.store.attach()
        self.prefix_arena = self.store.take_prefix_arena()
        if self.prefix_arena is not None and self.device.type == "cuda":
            self._prefix_pinned = register_pinned(self.prefix_arena)
        self.plan = plan
        # engine.disk_flush_early: up to a group per disk expert of a decode layer (its rows' top-k), each a table row
        c = self.file.config
        flush = min(c.n_expert, max(1, plan.max_running) * c.n_expert_used) if self.cfg.disk_flush_early else 0
        self.cache = ExpertCache(plan, arena, self.file, self.device, self.dtype, self.cfg.ring_slots, flush,
                                 stream_points=self.cfg.stream_points)
        self.directory = SlotDirectory(arena, plan.layout, create=False)
        lay = plan.engram_layout
        self.engram = EngramFeed(self.store, arena, lay, self.device, self.dtype) if lay is not None else None
        L, E = self.file.config.n_layer, self.file.config.n_expert
        self.counts = torch.zeros((L, E), dtype=torch.int64, device=self.device)
        self.pass_open = False
        self._give, self._give_after = [], []     # the new session holds no staging slot
        self._usage = np.zeros((L, E), dtype=np.int64)

    # the messages whose reply waits on the store's work (a consolidation applied or planned): their wall less the
    # thread's CPU time is blocked time (PassClock.reply), not host time
    REPLY_KINDS = frozenset({"begin_pass", "end_pass"})

    def call(self, kind: str, fn, *args):
        """One message to the store (counted, its host time in the pass clock by kind: stats.py)."""
        self.calls += 1
        if kind in self.REPLY_KINDS:
            return self.clock.reply(kind, fn, *args)
        return self.clock.message(kind, fn, *args)

    def load(self, keys, ahead=(), drop=()) -> "LoadStream":
        """Demand loads in ONE message with the staging slots waiting to go back, (decode) the next layers' guessed
        experts to read ahead once the loads' reads have started and this layer's guesses it did not use (`drop`: the
        store forgets those not started) -> the experts as they land (a wait for the next is the store delivering:
        store_wait)."""
        stream = LoadStream(self.call("load", self.store.load, keys, self._handing(), ahead, drop))
        self._streams.append(stream)
        return stream

    def prefetch(self, keys) -> int:
        return self.call("prefetch", self.store.prefetch, keys, self._handing())

    def prefetch_start(self, keys, drop=()):
        """prefetch (and drop, as load) without waiting for the store's answer -> a function that waits for it (reads
        started)."""
        answer = self.call("prefetch", self.store.prefetch_start, keys, self._handing(), drop)

        def queued() -> int:
            t = time.perf_counter()
            try:
                return answer()
            finally:
                self.clock.add_message("prefetch", time.perf_counter() - t)
        return queued

    def release(self, slots, later: bool = False, event=None):
        """Hand staging slots back (their copies are done, or: done once the CUDA `event` has completed). later: with
        the next message to the store (a load, a read ahead, the pass's end), which hands them back before anything
        else; else now (the store needs them to go on reading this layer's loads)."""
        if event is not None:
            self._give_after.append((event, list(slots)))
        else:
            self._give += slots
        if not later:
            self.flush_releases()

    def flush_releases(self):
        if self._give or self._give_after:
            self.call("release", self.store.release, self._handing())

    def _handing(self) -> list[int]:
        """The staging slots to hand back with a message now: their copies done (a copy still running is waited
        for: blocked; by the next layer's message it has long finished)."""
        for ev, slots in self._give_after:
            self.clock.wait(ev.synchronize)
            self._give += slots
        out, self._give, self._give_after = self._give, [], []
        return out

    # ---- one pass ----------------------------------------------------------------------------------------
    def begin(self, stats: PassStats):
        """Open the store pass if needed (snapshot, VRAM sync), reset the per-pass tables -> the snapshot."""
        self._streams = []                       # the last pass's loads were all read (or it was abandoned)
        self._open(stats)
        self.cache.pass_begin()
        self.counts.zero_()
        return self.snap

    def _open(self, stats: PassStats):
        """A prefill waits for a pending consolidation (its experts are what the consolidation is placing); a decode
        does not (module doc)."""
        if self.pass_open:
            return
        t = time.perf_counter()
        self.call("begin_pass", self.store.begin_pass, stats.kind != "decode")
        self.pass_open = True
        self.decode_since, self._resume_since = self._resume_since, 0
        self.snap = self.directory.snapshot()
        stats.vram_filled = self._sync_vram(self.snap, self.directory.epoch, stats)
        stats.open_s = time.perf_counter() - t

    def end_counts(self) -> np.ndarray:
        """The pass's one end-of-pass sync: rows per expert [n_layer, n_expert] to the host (blocked time). The copy
        runs behind everything queued on the compute stream: the stream's points made before it are done with it
        (ExpertCache.pass_points: the step's last miss layer's staging slots go back with the next step's first
        message, hash_ahead's, without a wait of their own)."""
        made = self.cache.points
        out = self.clock.wait(lambda: self.counts.cpu().numpy())
        self.cache.pass_points(made)
        return out

    def end(self, counts: np.ndarray, consolidate: bool):
        """After a pass's end sync: its usage, then the store pass closed with consolidation after a prefill and every
        `decode_consolidate_every` decode passes, or closed and reopened while a consolidation fills."""
        self._usage += counts
        if consolidate:
            self.close_pass(True)
            return
        self.decode_since += 1
        every = self.cfg.decode_consolidate_every
        if every and self.decode_since >= every:
            self.close_pass(True)                    # the decode working set moves into resident tiers
        elif self.pass_open and self.store.consolidating and not self.directory.filling:
            # the open pass did not wait for a consolidation still filling its slots: once the fill is done (the
            # directory's header says so, no message), close it (its usage counted, no new consolidation) so that
            # the next token's BeginPass applies it once it landed
            self._resume_since = self.decode_since      # the decode consolidation's count goes on
            self.close_pass(False)

    def abandon(self):
        """Close the store's pass after an exception in a pass; a dead store is the caller's problem already. A load
        stream the failed pass left with experts still coming is closed first (over gRPC: a cancel on the session's
        stream, the store stops reading for it and hands it nothing more); the slots it had handed are the store's to take back
        (ExpertStore._reclaim)."""
        streams, self._streams = self._streams, []
        for s in streams:
            s.close()
        try:
            self.clock.sync()
            self.close_pass(False)
        except Exception:                            # noqa: BLE001
            self.pass_open = False

    def close_pass(self, consolidate: bool):
        """End the store pass (if one is open) with the usage counted since it opened."""
        if not self.pass_open:
            self.flush_releases()                    # no staging slot stays held by an idle worker
            return
        self.pass_open = False
        usage, self._usage = self._usage, np.zeros_like(self._usage)
        self.call("end_pass", self.store.end_pass, usage, consolidate, self._handing())

    def _empty_pass(self, consolidate: bool, wait: bool):
        """A store pass with no work: begin_pass applies a pending consolidation (wait: also one still filling);
        end_pass may plan a new one."""
        self.call("begin_pass", self.store.begin_pass, wait)
        self.call("end_pass", self.store.end_pass, np.zeros_like(self._usage), consolidate, self._handing())

    # ---- consolidation -------------------------------------------------------------------------------
    def consolidate(self):
        """Consolidate now, with the decode usage of the open pass if any; never waits for one still filling (its
        usage then goes into the next)."""
        if self.pass_open:
            self.close_pass(True)
        else:
            self._empty_pass(True, wait=False)

    def request_done(self, others_running: bool, decoded: bool = True):
        """A request ended. decoded: it ended normally after decode passes (a cancelled or failed request, or one whose
        only token came from its prefill, has nothing of its own left to consolidate: its prefill did). Its
        working set is consolidated only when no other sequence runs (module doc). When none runs, the store pass
        closes either way: an idle worker never holds the directory frozen (a pending consolidation could not apply)."""
        if others_running:
            return
        if decoded:
            self.consolidate()
        else:
            self.close_pass(False)

    def settle(self, timeout: float | None = None) -> float:
        """Wait until the store is quiet -> seconds waited: a pending consolidation applied (begin_pass waits for its
        fill), the VRAM tier it placed filled here (copies from host slots, and disk reads for experts without a
        backing copy: the consolidation's, not the next pass's), and no store read in flight (read-ahead of an
        earlier pass still landing). The next pass then finds every expert the directory calls resident in its slot:
        it reads from disk only what it routes to the disk tier. timeout: seconds, then BetelgeuseError."""
        t = time.perf_counter()
        self.close_pass(False)
        self._open(PassStats("prefill", "settle", 0))          # not a decode: begin_pass waits; VRAM filled
        self.close_pass(False)
        while True:
            st = self.call("status", self.store.status)
            if not st.get("consolidation_pending") and not st.get("reads_in_flight"):
                return time.perf_counter() - t
            if timeout is not None and time.perf_counter() - t > timeout:
                raise BetelgeuseError(f"the store did not settle within {timeout:.0f} s (consolidation pending: "
                                      f"{st.get('consolidation_pending')}, reads in flight: {st.get('reads_in_flight')})")
            time.sleep(0.005)                                     # polled: the store has no wait call for its reads

    def settle_step(self) -> str:
        """One bounded step of idle settling (the engine calls it while no request runs or waits) -> "step": one
        layer's VRAM slots were made to match the directory (copies from host slots, disk reads for experts without a
        backing copy), more may remain; "wait": nothing to do but a consolidation still filling in the store (a
        later step applies it); "done": the store is settled for this worker (the next pass fills nothing).
        Each step is one short store pass that never waits for a consolidation's reads: begin_pass applies one
        whose reads have landed, and a request arriving meanwhile waits for at most this step (one layer's fills).
        The filled layers are what the next pass's VRAM sync then skips; its reads are the consolidation's, not a
        request's (PassStats of kind "settle", not reported as a pass)."""
        self.close_pass(False)                       # idle: none is open (request_done closed it)
        self.call("begin_pass", self.store.begin_pass, False)
        self.pass_open = True
        try:
            snap, epoch = self.directory.snapshot(), self.directory.epoch
            todo = self.cache.unsynced_layers(snap, epoch)
            if todo:
                _, missing = self.cache.sync_vram_layer(todo[0], snap)
                self._fill_missing(missing, snap, PassStats("prefill", "settle", 0))
            if len(todo) <= 1:
                self.cache.mark_synced(epoch)
        finally:
            self.close_pass(False)
        if todo:
            return "step"
        return "wait" if self.store.consolidating else "done"

    # ---- VRAM hot slots --------------------------------------------------------------------------------
    def _sync_vram(self, snap, epoch, stats: PassStats) -> int:
        """VRAM hot slots = the directory's VRAM tier: copies from host backing slots, and disk reads through the
        store for VRAM experts that have no backing copy (vram_backing = false). Returns experts filled."""
        cache = self.cache
        copied, missing = cache.sync_vram(snap, epoch)
        self.clock.blocked += cache.fill_wait_s
        self._fill_missing(missing, snap, stats)
        return copied + len(missing)

    def _fill_missing(self, missing: list[tuple[int, int, int]], snap, stats: PassStats):
        """Read the VRAM-tier experts without a backing copy, [(layer, expert, vram slot)], through the store into
        their VRAM slots. After a consolidation without backing copies, often hundreds: the reads run in parallel in
        the store, each landed expert is copied at once, and the staging slots go back a batch at a time, after one
        sync for the batch's copies (not one sync and one store round trip per expert)."""
        if not missing:
            return
        cache = self.cache
        where = {(l, e): j for l, e, j in missing}
        limit = max(1, self.plan.n_staging // 2)   # staging slots held at once: the store keeps reading
        held: list[int] = []
        t = time.perf_counter()
        loads = self.load(list(where))
        for got in iter(lambda: self.clock.wait_store(next, loads, None), None):
            cache.fill_vram(got.layer, got.expert, where[(got.layer, got.expert)], cache.staging_slot(got.staging_slot),
                            snap)
            stats.disk_bytes += got.disk_bytes      # the pass waits for them: its bound counts their bytes
            stats.fill_disk += 1                    # not a use: the pass's route counts the expert as VRAM
            held.append(got.staging_slot)
            if len(held) >= limit:
                self.clock.wait(self.clock.sync)   # the copies are done before their staging slots go back
                self.release(held)
                held = []
        self.clock.wait(self.clock.sync)
        self.release(held, later=True)
        cache.fill_done()
        stats.disk_wait_s += time.perf_counter() - t

    def _close_prefix(self):
        """Unregister and unmap the prefix host tier (the store keeps it; the next attach maps it again)."""
        if self.prefix_arena is None:
            return
        if self._prefix_pinned:
            unregister_pinned(self.prefix_arena)
            self._prefix_pinned = False
        self.prefix_arena.close()
        self.prefix_arena = None

    def close(self):
        """Close the device slot pool and drop every view of the arena (directory, snapshot) and the prefix tier."""
        if self.cache is not None:
            self.cache.close()
        self._close_prefix()
        self.cache = self.directory = self.snap = self.engram = None


class LoadStream:
    """A load's experts as they land (Loaded, completion order). `it`: the client's stream itself (the clients' load
    streams: services/grpc/store_client.py _Landed, store/client.py _Landed), which keeps the last landed expert's
    ahead_queued; a bare iterator (an empty load's, a test's) goes through TrackedLoads, which does. MoEStep's loops over a
    decode layer's disk experts call next(stream.it): no wrapper call a landed expert (issue 21, cpu-host61)."""

    __slots__ = ("it",)

    def __init__(self, it):
        self.it = it if hasattr(type(it), "ahead_queued") else TrackedLoads(it)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def ready(self) -> bool:
        """Whether the next expert has landed already (next() returns it without a wait for the store), asked without
        blocking: the iterator's own ready() (the clients' streams: services/grpc/store_client.py _Landed, store/
        client.py InProcessStoreClient.load), True where it has none (it cannot say: the caller batches as though it
        had; MoEStep._disk_groups' early flush never happens on such a stream)."""
        ready = getattr(self.it, "ready", None)
        return True if ready is None else ready()

    def close(self):
        """Stop reading it: the stream is closed (the gRPC client's sends the store a cancel of the load)."""
        self.it.close()

    def queued(self) -> int:
        """The reads ahead its message started (final once the stream is consumed)."""
        return self.it.ahead_queued
