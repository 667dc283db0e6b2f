"""The expert store: owns the host slot arena, the slot directory, the residency policy and all disk I/O.

No CUDA here. The worker reaches this class through a `StoreClient` (betelgeuse/store/client.py):
in-process for tests, over gRPC on a Unix socket in production (services/store_main.py).

Slots, per DESIGN.md §1-3:
  host slots   [n_layer, n_vram + n_host]  resident experts (the VRAM tier's backing copies too)
  staging      [n_staging]                 disk reads on their way to the worker; a staged expert
                                           stays until its slot is needed (a small victim cache); reads
                                           ahead (prefetch) hold at most half of them
Reads ahead never delay a demand read: the reader takes demand pieces first; a load of an expert whose read ahead is
still queued promotes it to demand priority; a demand read that finds no staging slot takes the slot of the newest
read ahead not yet started (cancelled: never read); and a message's `drop` forgets the reads ahead the worker no longer
wants (a layer's guesses it did not use, worker/guess.py) where they have not started (started ones finish and stay
staged as any read ahead does).
Invariant 5: the directory changes only between passes (consolidation); staging slots change only
when no one references them (a slot handed to the worker is its own until it releases it, and it releases every one
by the end of its pass: a slot still handed when a pass begins, or ends after its releases, was lost by a pass that
failed mid-layer, and is taken back: _reclaim).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from betelgeuse.errors import BetelgeuseError, StoreBusyError, StoreUnavailableError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.logs import event
from betelgeuse.store.arena import Arena
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM, SlotDirectory
from betelgeuse.store.engram import EngramLanded, EngramRows
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.prefix_disk import PrefixDisk
from betelgeuse.store.residency import fill_budget, plan_moves
from betelgeuse.store.reader import GAP_LOG, ExpertReader
from betelgeuse.store.watch import ModelWatch

log = logging.getLogger("betelgeuse.store")

DEMAND, READAHEAD = 0, 1


@dataclass(slots=True)
class Lease:
    """Who holds a store session. `key` tells one worker from another (its pid where the kernel told us,
    else the connection); `alive` goes False when the worker's fd-socket connection closes (it died)."""
    pid: int
    key: object = None
    alive: bool = True

    def __post_init__(self):
        if self.key is None:
            self.key = ("pid", self.pid)


@dataclass(slots=True)
class Loaded:
    """A landed expert of a load (its fields store.proto's Loaded's, names and order; the gRPC client makes one from
    each answer: services/grpc/store_client.py _Landed)."""
    layer: int
    expert: int
    staging_slot: int       # staging slot index
    disk_bytes: int         # bytes read from disk for this expert (0 if it was staged before this pass)
    prefetched: bool
    ahead_queued: int = 0   # reads ahead of the load's `ahead` started before this message (final in the last)


@dataclass(slots=True)
class StoreCounters:
    demand_loads: int = 0
    staged_hits: int = 0            # loads answered from a staged copy (read-ahead or an earlier pass)
    readahead_reads: int = 0
    readahead_wasted: int = 0       # read ahead, then evicted unused
    readahead_dropped: int = 0      # read ahead asked for, forgotten before it started (drop, or a demand read's slot)
    readahead_promoted: int = 0     # read ahead still queued when a load asked for it: moved to demand priority
    readahead_skipped: int = 0      # read ahead asked for but already staged, in flight, or not on disk
    readahead_bytes: int = 0        # bytes of reads ahead that landed
    readahead_used: int = 0         # of them, bytes a load took (the rest: read ahead and never used, yet)
    consolidation_reads: int = 0
    consolidation_copies: int = 0   # filled from a staged copy instead of disk
    consolidation_moves: int = 0    # placement changes planned (residency.plan_moves), all tiers
    consolidation_bytes: int = 0    # bytes of the consolidation fills' disk reads
    passes: int = 0
    consolidations: int = 0
    attaches: int = 0
    staging_reclaimed: int = 0      # staging slots taken back from a failed pass (_reclaim; 0 in a healthy run)
    extra: dict = field(default_factory=dict)


class _Fill:
    """A planned consolidation's fill, run on the store's fill thread (ExpertStore._filler): is_alive() and join() as
    the thread's own were (one thread a consolidation, its start() ~1.2 ms of the EndPass the worker waits on when
    the reader threads hold the GIL: cpu-spike56)."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = threading.Event()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None):
        self.done.wait(timeout)


class Landing(queue.SimpleQueue):
    """A load's landed keys: its reads' completions put them (under the store's cv) and the load's generator takes them
    (ExpertStore._deliver). on_land(), where set: called after each such put from the thread that put it (a reader
    thread's completion), outside the cv, so a delivery driven from there (services/store_main.py: the load's answers
    sent from the read's completion itself, no hop to a thread waiting on this queue) may run the generator (wait=False)
    at once. It must not raise or block: it runs on a reader thread. mark: the load's message log entry (read_here)."""

    __slots__ = ("on_land", "mark")

    def __init__(self, mark: list | None = None):
        super().__init__()
        self.on_land = None
        self.mark = mark


class ExpertStore:
    def __init__(self, model: GGUFModelFile, plan: SlotPlan, read_threads: int = 8, read_request_bytes: int = 4 << 20,
                 engram_read_depth: int = 32, bound_fills: bool = False, hysteresis: bool = True,
                 prefix_save_path: str = "", session_reads: bool = False):
        self.model, self.plan = model, plan
        self.layout = plan.layout
        self.arena = Arena.create(self.layout.total_bytes)
        # the prefix cache's host tier: bytes the store holds for the worker (it writes them: worker/prefix_host.py),
        # so that they outlive a worker restart as the arena does; a new store starts it empty (a new memfd), or
        # with what prefix_save_path holds: saved there when the store is idle and when it stops (store/prefix_disk.py)
        self.prefix_arena = (Arena.create(plan.prefix_host_bytes, name="betelgeuse-prefix")
                             if plan.prefix_host_bytes else None)
        self.prefix_disk = (PrefixDisk(prefix_save_path, self.prefix_arena, model.path)
                            if prefix_save_path and self.prefix_arena is not None else None)
        if self.prefix_disk is not None:
            self.prefix_disk.load()                   # before any worker can attach: no one writes the region yet
        self.directory = SlotDirectory(self.arena, self.layout, create=True)
        self.reader = ExpertReader(model.path, self.arena, threads=read_threads, request_bytes=read_request_bytes)
        # the file as opened: a read that lands after the file changed is refused, and so is all work until the
        # file is the same again (store_main checks it every second; Load checks it too)
        self.watch = ModelWatch(model.path, model.data_offset)
        # deepseek41's Engram rows: banks, row cache and a reader of their own (store/engram.py)
        lay = plan.engram_layout
        self.engram = (EngramRows(model.path, self.arena, lay, engram_read_depth, self.watch)
                       if lay is not None else None)
        L, E = plan.n_layer, plan.n_expert
        # per (layer, expert): the three parts' file ranges, for reads into any slot
        self._parts = [[model.expert_parts(l, e) for e in range(E)] for l in range(L)]
        # key -> (its read ranges into a slot at arena offset 0, its payload bytes), made at its first read (_ranges)
        self._read_plan: dict[tuple[int, int], tuple[list[tuple[int, int, int]], int]] = {}
        self.cv = threading.Condition()
        self.session: str | None = None
        self._lease: Lease | None = None              # who holds the session
        self.pass_active = False
        # staging: slot -> key while it holds (or is reading) an expert; free slots in a list
        self._free = list(range(plan.n_staging))
        self._staged: OrderedDict[tuple[int, int], int] = OrderedDict()   # key -> slot, ready, not handed out (LRU order)
        self._inflight: dict[tuple[int, int], tuple[int, object, int]] = {}  # key -> (slot, future, priority)
        self._handed: dict[int, tuple[int, int]] = {}                   # slot -> key, owned by the worker
        self._handed_at: dict[int, tuple] = {}        # slot -> (monotonic s, demand loads then): a stall's report
        self._ready_bytes: dict[tuple[int, int], int] = {}              # key -> disk bytes of its read (until handed out)
        self._readahead_keys: set[tuple[int, int]] = set()
        self._claimed: set[tuple[int, int]] = set()                        # awaited by a running load: not evictable
        self._waiters: dict[tuple[int, int], list[Landing]] = {}          # key -> loads waiting for its read
        self._failed: dict[tuple[int, int], str] = {}                     # key -> why its read failed
        self.score = np.zeros((L, E), dtype=np.float64)                  # decayed usage, for consolidation
        self._usage = np.zeros((L, E), dtype=np.int64)                   # since the last consolidation
        self._host_owner = np.full((L, plan.host_per_layer), -1, dtype=np.int64)  # host slot -> expert
        self._consolidating: _Fill | None = None                # filling the slots of a planned consolidation
        self._fills: queue.SimpleQueue = queue.SimpleQueue()      # (_Fill, moves) for the fill thread; None: stop
        self._filler: threading.Thread | None = None              # started at the first consolidation
        self._moves = None                                          # its moves, applied at a BeginPass once filled
        self._fill_stats = (0.0, 0, 0)                              # its fill: seconds, disk reads, staged copies
        self._fill_error: str | None = None                         # why its fill failed (then it is not applied)
        # the fill budget (residency.fill_budget): when the last consolidation was planned, the disk bytes and the
        # fill bytes then, and the bound it was planned under (None: none)
        self._planned_at: tuple[float, int, int] | None = None
        self.max_new: int | None = None
        self.bound_fills = bound_fills                              # the setting engine.fill_budget
        self.hysteresis = hysteresis                                # engine.placement_hysteresis
        self.session_reads = session_reads                          # engine.session_reads (read_here)
        self._filling: set[tuple[int, int]] = set()                 # staged copies being copied into host slots
        self.counters = StoreCounters()
        self.started = time.monotonic()
        # the worker's read messages (load, prefetch) as taken: [taken, first preadv start, the load's last expert
        # seen by its delivering thread] monotonic s (None: none), the last GAP_LOG; status(disk_gaps_since) hands
        # them out beside the gaps (the bench splits a gap's chain: services/bench/disk_idle.py)
        self._msgs: deque = deque(maxlen=GAP_LOG)
        self.pass_ended = self.started                # when the last pass ended (idle time: the prefix tier's saves)
        self._closing = threading.Event()
        self._saver = None
        if self.prefix_disk is not None:
            self._saver = threading.Thread(target=self._save_prefix_when_idle, name="prefix-save", daemon=True)
            self._saver.start()

    # ---- sessions and passes -------------------------------------------------------------
    def attach(self, worker_pid: int, lease=None) -> tuple[str, str]:
        """A new session for the worker `worker_pid`. One worker per store: while the current session's
        worker is alive (its `lease` — the store's end of the worker's fd-socket connection — is open, or for an
        in-process client, its pid is this process), a different worker is refused with StoreBusyError."""
        lease = lease or Lease(worker_pid)
        self._servable()
        with self.cv:
            cur = self._lease
            if self.session is not None and cur is not None and cur.alive and cur.key != lease.key:
                raise StoreBusyError(f"another worker (pid {cur.pid}) is attached to this store; one worker per "
                                     "store: stop it first")
            self._lease = lease
            # a new worker replaces the old one: what the old one held is free again
            for slot in list(self._handed):
                self._free_slot(slot)
            if self.engram is not None:
                self.engram.release_all()
            self.session = uuid.uuid4().hex
            self.pass_active = False
            self.directory.pass_active = False
            self.counters.attaches += 1
            self.cv.notify_all()
            return self.session, self.plan.to_json()

    def trim_vram(self, session: str, n_vram: int, trim: dict | None = None) -> str:
        """The worker measured its VRAM over the budget after attach (worker/vram_fit.py): the VRAM tier keeps
        `n_vram` slots per layer -> the new plan (json), which says so (vram_trim: `trim`, the worker's numbers; a
        note in `why`). Per layer the VRAM experts ranked last (score, then expert id) leave: to their host slot
        where they have one (a backing copy, or one in transit), else to disk. With backing copies the host tier
        keeps the slots the VRAM tier gave up (n_host grows by as many), without them it has the same slots: either
        way the arena's layout is unchanged. Between passes only, a pending consolidation applied first; the worker
        attaches again after it (its slot pool is sized from the plan)."""
        self._check(session)
        self._settle_consolidation(wait=True)
        with self.cv:
            p = self.plan
            if self.pass_active:
                raise BetelgeuseError("the VRAM tier can be trimmed between passes only")
            if not 0 <= n_vram < p.n_vram:
                raise BetelgeuseError(f"cannot trim the VRAM tier to {n_vram} slots per layer: the plan has {p.n_vram}")
            gave = p.n_vram - n_vram
            note = (f"VRAM tier trimmed at attach by the worker's measurement: {p.n_vram} -> {n_vram} slots per layer"
                    + (f", the host tier {p.n_host} -> {p.n_host + gave} (the backing slots)" if p.vram_backing else ""))
            new = dataclasses.replace(p, n_vram=n_vram, n_host=p.n_host + (gave if p.vram_backing else 0),
                                      notes=[*p.notes, note],
                                      vram_trim={**(trim or {}), "slots_before": p.n_vram, "slots_after": n_vram})
            assert new.layout == p.layout, (new.layout, p.layout)
            snap = self.directory.snapshot()
            moved = 0
            with self.directory.batch():
                for l in range(p.n_layer):
                    vram = [int(e) for e in np.nonzero(snap["tier"][l] == TIER_VRAM)[0]]
                    for e in sorted(vram, key=lambda e: (-self.score[l, e], e))[n_vram:]:
                        hs = int(snap["host_slot"][l, e])
                        self.directory.set(l, e, TIER_HOST if hs >= 0 else TIER_DISK, hs)
                        moved += 1
            self.plan = new
        event(log, "vram_trim", n_vram_before=p.n_vram, n_vram=n_vram, n_host=new.n_host, demoted=moved)
        return new.to_json()

    def _check(self, session: str):
        if session != self.session:
            raise StoreUnavailableError("this worker session was replaced by a newer attach; attach again")
        self._servable()

    def _servable(self):
        """Refuse work while the model file is not the one opened (see betelgeuse/store/watch.py)."""
        if self.watch.why is not None:
            raise StoreUnavailableError(self.watch.why)

    def begin_pass(self, session: str, wait: bool = True) -> int:
        """Freeze the directory for a pass. A consolidation whose reads have landed is applied first; one still
        reading is waited for (wait) or left to a later pass (wait=False: this pass runs on the placement it has,
        decode passes do not stall on a consolidation's disk reads)."""
        self._check(session)
        self._settle_consolidation(wait)
        with self.cv:
            self._reclaim("began")
            self.pass_active = True
            self.directory.pass_active = True
            self.counters.passes += 1
            return self.directory.epoch

    def _settle_consolidation(self, wait: bool):
        """A planned consolidation applied: once its reads have landed, or (wait) after waiting for them."""
        t = self._consolidating
        if t is not None and (wait or not t.is_alive()):
            t.join()
            self._commit_consolidation()

    @property
    def consolidating(self) -> bool:
        """A planned consolidation is still filling its slots (it is applied at a later begin_pass)."""
        return self._consolidating is not None

    def end_pass(self, session: str, usage: np.ndarray, consolidate: bool, release=()) -> int:
        """End the pass (after handing back `release`) with its usage; consolidate: plan the next placement."""
        self._check(session)
        assert usage.shape == self._usage.shape, (usage.shape, self._usage.shape)
        with self.cv:
            self._release(release)
            self._reclaim("ended")
            self.pass_active = False
            self.directory.pass_active = False
            self.pass_ended = time.monotonic()
            self._usage += usage
            if not consolidate or self._consolidating is not None:
                return 0                   # a consolidation still in flight: this usage waits for the next one
            self.score = 0.5 * self.score + self._usage
            self._usage[:] = 0
            tiers = self.directory.snapshot()["tier"].astype(np.int64)
            self.max_new = self._fill_budget() if self.bound_fills else None
            moves = plan_moves(self.score, tiers, self._host_owner, self.plan, self.max_new, self.hysteresis)
            if moves:
                self._vacate(moves)
                self.counters.consolidation_moves += len(moves)
        if moves:
            self._moves = moves
            self._consolidating = fill = _Fill()
            self.directory.filling = True          # the worker sees it in its mapping (directory.py)
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill_loop, name="consolidation-fill", daemon=True)
                self._filler.start()
            self._fills.put((fill, moves))
        return len(moves)

    def _fill_loop(self):
        """The fill thread: each planned consolidation's fill in turn (one at a time: a new one is planned only once
        the last was applied), until close() puts None."""
        while (job := self._fills.get()) is not None:
            fill, moves = job
            try:
                self._fill_consolidation(moves)
            except Exception as e:             # noqa: BLE001 - not applied (its slots' bytes are not known good)
                log.exception("consolidation fill failed")
                self._fill_error = f"{type(e).__name__}: {e}"
            finally:
                fill.done.set()

    def _fill_budget(self) -> int | None:
        """max_new for the consolidation planned now (under cv): what the disk can read before the next one, from
        the interval since the last one and the bytes the passes read meanwhile (residency.fill_budget); at least
        one expert per layer."""
        now, disk, fills = time.monotonic(), self.reader.stats.bytes_read, self.counters.consolidation_bytes
        last, self._planned_at = self._planned_at, (now, disk, fills)
        if last is None:
            return None
        active = self.reader.active_seconds()
        rate = disk / active if active > 0 else 0.0
        return fill_budget(rate, now - last[0], (disk - last[1]) - (fills - last[2]), self.layout.slot.slot_bytes,
                           self.plan.n_layer)

    # ---- demand loads and read-ahead -------------------------------------------------------
    def load(self, session: str, keys: list[tuple[int, int]], release=(), ahead=(), drop=(),
             alive=None, started: bool = False, wait: bool = True) -> Iterator[Loaded | None]:
        """Yields each expert as its bytes land in a staging slot, in completion order. First hands back the staging
        slots `release` and forgets the reads ahead of `drop` not started yet; once every demand read has started,
        reads `ahead` ahead (as prefetch): one message does a decode layer's store work. alive() false (the gRPC call
        was cancelled: an abandoned pass) ends it at once, without handing over what lands after (it stays staged).
        started: the first item is the load's landing queue (its qsize(): experts landed, handed over by the next items
        without a wait), yielded once the load's reads have started (and, if every demand read has, its reads ahead),
        before any wait (none with no key: the load ends there): the session stream's reader takes it, so that the
        store reads in the order the requests were sent, hands over what has landed, and the rest as it lands
        (services/store_main.py _Delivery).
        wait=False: never block; where the next expert has not landed yet, yield None instead (after the checks a
        wait's timeout makes: alive(), the session, a stall's warning): the caller calls again once the landing queue
        has a key (its on_land: Landing) or, for those checks and for reads still waiting for a staging slot, on a
        tick of its own (store_main's tick thread: every WAIT_S)."""
        mark = self._mark()
        self.watch.check()                          # checked on reads: a stat and an fstat when nothing changed
        self._check(session)
        with self.cv:                               # now, even if the stream is never read (a failed pass)
            self._release(release)
            self._drop(drop)
        return self._load(session, keys, ahead, alive, started, mark, wait)

    def read_here(self, landed: Landing) -> bool:
        """The first piece of a load's demand reads read on the calling thread, if it is still queued (no reader thread
        has it yet) -> whether it was (ExpertReader.read_first). landed: the load's `started` item. For a caller that
        would block next anyway (the session reader, services/store_main.py): the disk starts without waiting for a
        reader thread's wake-up and its GIL. Off (engine.session_reads): False, the reader threads take it."""
        return self.session_reads and landed.mark is not None and self.reader.read_first(landed.mark)

    def _mark(self) -> list:
        """A read message taken now: its entry in the message log, [now, None, None] (the reads it starts fill in [1],
        its delivery [2])."""
        m = [time.monotonic(), None, None]
        self._msgs.append(m)
        return m

    def _load(self, session, keys, ahead, alive=None, started=False, mark=None, wait=True) -> Iterator[Loaded | None]:
        if self.reader.jitter is not None:        # test-only adversarial timing: staged copies answer out of order
            keys = self.reader.jitter.shuffled(keys)
        done = Landing(mark)
        pending = []
        with self.cv:
            for key in keys:
                tier, hslot, _ = self.directory.lookup(*key)
                if tier == TIER_HOST or (tier == TIER_VRAM and hslot >= 0):
                    raise BetelgeuseError(f"expert {key} is in host slot {hslot}; read it from there")
                self.counters.demand_loads += 1
                self._claimed.add(key)
                if key in self._staged or key in self._inflight:
                    self._promote(key, mark)
                    self._watch(key, done)
                else:
                    pending.append(key)
        try:
            yield from self._deliver(session, keys, pending, done, list(ahead), alive, started, mark, wait)
        finally:
            with self.cv:
                self._claimed.difference_update(keys)

    STALL_S = 2.0       # a load with no expert landed for this long logs the staging state once (stall())
    WAIT_S = 0.05       # s: how often a waiting load checks alive, the session, a stall, and retries slot-less reads

    def _deliver(self, session, keys, pending, done, ahead, alive=None, started=False, mark=None,
                 wait=True) -> Iterator[Loaded | None]:
        delivered, queued = 0, 0
        last, told = time.monotonic(), False
        while delivered < len(keys):
            with self.cv:
                while pending:
                    slot = self._alloc_slot()
                    if slot is None:
                        slot = self._steal_slot()
                    if slot is None:
                        break
                    key = pending.pop(0)
                    self._start_read(key, slot, DEMAND, mark)
                    self._watch(key, done)
                if ahead and not pending:           # never queued before this load's own reads
                    queued, ahead = self._readahead(ahead, mark), None
            if started:                             # load's `started`: the reads are started, none waited for
                started = False
                yield done
            try:
                key = done.get(timeout=self.WAIT_S) if wait else done.get_nowait()
            except queue.Empty:
                if alive is not None and not alive():
                    return
                if self.session != session:
                    raise StoreUnavailableError("worker session replaced during a load")
                if not told and time.monotonic() - last > self.STALL_S:
                    told = True
                    log.warning("a load stalled %.1f s: %s", time.monotonic() - last,
                                self.stall(keys[delivered:], pending))
                if not wait:
                    yield None                      # nothing landed: the caller comes back (load's wait=False)
                continue
            last = time.monotonic()
            if mark is not None:                    # the message log: this load's expert seen here (the last one's
                mark[2] = last                      # stays: the worker's wait for a layer ends with it)
            if alive is not None and not alive():
                return                              # cancelled: the landed expert stays staged, for whoever asks
            with self.cv:
                if key in self._failed:
                    why = self._failed.pop(key)
                    if self.watch.check() is not None:
                        raise StoreUnavailableError(self.watch.why)
                    raise BetelgeuseError(f"reading expert {key} from {self.model.path} failed: {why}")
                slot = self._staged.pop(key)
                self._claimed.discard(key)
                self._handed[slot] = key
                self._handed_at[slot] = (time.monotonic(), self.counters.demand_loads)
                nbytes = self._ready_bytes.pop(key, 0)
                pre = key in self._readahead_keys
                self._readahead_keys.discard(key)
                if pre:
                    self.counters.readahead_used += nbytes
                if pre or nbytes == 0:
                    self.counters.staged_hits += 1
            delivered += 1
            yield Loaded(key[0], key[1], slot, nbytes, pre, queued)

    def prefetch(self, session: str, keys: list[tuple[int, int]], release=(), drop=()) -> int:
        """Read-ahead into staging slots (module doc), in the keys' order, after handing back `release` and forgetting
        the reads ahead of `drop` not started yet -> reads started."""
        mark = self._mark()
        self._check(session)
        with self.cv:
            self._release(release)
            self._drop(drop)
            return self._readahead(keys, mark)

    def _readahead(self, keys: list[tuple[int, int]], mark: list | None = None) -> int:
        """Reads ahead take a free staging slot or the least recently used staged copy (as a demand read does: once
        the staging slots have all held an expert, none is ever free again, so a read ahead that waited for a free
        one never ran), while at most half of the staging slots hold reads ahead not yet asked for: the other half
        stays for demand. mark: the message's log entry (_mark)."""
        queued = 0
        with self.cv:
            for key in keys:
                if key in self._staged or key in self._inflight or self.directory.lookup(*key)[0] != TIER_DISK:
                    self.counters.readahead_skipped += 1
                    continue
                if len(self._readahead_keys) >= self.plan.n_staging // 2:
                    break
                slot = self._alloc_slot()
                if slot is None:
                    break
                self._readahead_keys.add(key)
                self._start_read(key, slot, READAHEAD, mark)
                self.counters.readahead_reads += 1
                queued += 1
        return queued

    def release(self, session: str, slots: list[int]) -> None:
        self._check(session)
        with self.cv:
            self._release(slots)

    def _release(self, slots):
        """Staging slots the worker hands back (under cv): their bytes stay as staged copies (LRU), reused when a read
        needs the slot."""
        for slot in slots:
            key = self._handed.pop(slot, None)
            if key is None:
                continue
            if key in self._staged or key in self._inflight:
                # another copy of it is staged or landing (it was read again while the worker held this one: a
                # Release and the next Load are separate calls and may arrive in either order): one staged copy per
                # key, so this slot is free (overwriting the other's entry would lose that slot for good)
                self._free.append(slot)
                continue
            self._staged[key] = slot
            self._staged.move_to_end(key)
        if slots:
            self.cv.notify_all()

    def _reclaim(self, when: str):
        """(under cv) Staging slots still handed to the worker when a pass begins, or ends after its releases: the
        worker hands every slot back by the end of its pass (with EndPass, its Release calls answered first), so
        these were lost by a pass that failed mid-layer (a kernel raising: its Load stream dropped with experts still
        landing, the slots it held forgotten; a load of the dropped stream may land later, taken back at the next
        pass's end). Left handed, each failure kept its slots for good, until every load waited for one."""
        lost = sorted(self._handed)
        if lost:
            log.warning("took back %d staging slot(s) still handed to the worker when a pass %s (dropped by a pass "
                        "that failed): %s", len(lost), when, lost[:16])
            self.counters.staging_reclaimed += len(lost)
            self._release(lost)

    # ---- Engram rows (deepseek41) ------------------------------------------------------------
    def engram_read(self, session: str, tables, rows, release=()) -> int:
        """Start reading Engram rows (table index, row) into a free bank, after releasing `release`; -> the bank."""
        self.watch.check()                          # as load: a read of a changed file is refused
        self._check(session)
        if self.engram is None:
            raise BetelgeuseError(f"{self.model.path} has no Engram tables")
        return self.engram.read(tables, rows, release)

    def engram_wait(self, session: str, bank: int) -> EngramLanded:
        """Block until a bank's rows landed (compact, in request order, at its rows offset)."""
        self._check(session)
        if self.engram is None:
            raise BetelgeuseError(f"{self.model.path} has no Engram tables")
        return self.engram.wait(bank, timeout=120.0)

    def stall(self, waiting, pending) -> str:
        """The staging state a stalled load sees (for its warning): its keys not delivered, those with no slot yet,
        the staging slots free / staged (claimed, filling, read ahead) / handed to the worker / in flight."""
        with self.cv:
            fl = {k: (v[2], v[1].done()) for k, v in self._inflight.items()}
            lost = self.unaccounted_slots()
            by_layer: dict = {}
            for k in self._handed.values():
                by_layer[k[0]] = by_layer.get(k[0], 0) + 1
            now = time.monotonic()
            ages = sorted((round(now - t, 2), n) for sl, (t, n) in self._handed_at.items() if sl in self._handed)
            return (f"waiting {list(waiting)[:16]}, no slot yet {list(pending)[:16]}; staging {self.plan.n_staging}: "
                    f"free {len(self._free)}, staged {len(self._staged)} (claimed "
                    f"{sum(k in self._claimed for k in self._staged)}, filling {len(self._filling)}, ahead "
                    f"{len(self._readahead_keys)}), handed {len(self._handed)} (by layer {by_layer}; (age s, demand "
                    f"loads then) {ages[:8]}..{ages[-4:]} of {self.counters.demand_loads}), in none {lost}, in flight "
                    f"{len(fl)} {list(fl.items())[:16]}; waiters {list(self._waiters)[:16]}; reader queue "
                    f"{self.reader._q.qsize()}")

    def unaccounted_slots(self) -> list[int]:
        """Staging slots in none of free / staged / handed to the worker / in flight: lost for good (none should be;
        a load waits forever once all are)."""
        with self.cv:
            known = set(self._free) | set(self._staged.values()) | set(self._handed)
            known |= {v[0] for v in self._inflight.values()}
            return sorted(set(range(self.plan.n_staging)) - known)

    # ---- internals (hold self.cv) --------------------------------------------------------
    def _watch(self, key, done: Landing):
        """`done` gets `key` once its bytes are staged (now, or from the read's completion, under self.cv)."""
        if key in self._staged:
            done.put(key)
        else:
            self._waiters.setdefault(key, []).append(done)

    def _alloc_slot(self) -> int | None:
        """A staging slot for a demand read: a free one, else the least recently used unclaimed staged copy."""
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._staged if k not in self._claimed and k not in self._filling), None)
        if victim is not None:               # evict the least recently used staged copy
            key, slot = victim, self._staged.pop(victim)
            if key in self._readahead_keys:
                self._readahead_keys.discard(key)
                self.counters.readahead_wasted += 1
            self._ready_bytes.pop(key, None)
            return slot
        return None

    def _cancel_ahead(self, key) -> int | None:
        """Forget the read ahead of `key` if it has not started and no load waits for it -> its staging slot (free to
        reuse: none of its bytes will be written), else None."""
        cur = self._inflight.get(key)
        if cur is None or cur[2] != READAHEAD or key in self._claimed or key in self._waiters:
            return None
        del self._inflight[key]                      # first: the cancelled future's callback finds no read to land
        if not self.reader.cancel(cur[1]):
            self._inflight[key] = cur                # started: it lands as any read does
            return None
        self._readahead_keys.discard(key)
        self.counters.readahead_dropped += 1
        return cur[0]

    def _drop(self, keys):
        """The reads ahead of `keys` the worker no longer wants: those not started are forgotten, their slots free."""
        for key in keys:
            slot = self._cancel_ahead(tuple(key))
            if slot is not None:
                self._free.append(slot)

    def _steal_slot(self) -> int | None:
        """A staging slot for a demand read when none is free or evictable: the newest read ahead not started yet."""
        for key in reversed(list(self._inflight)):
            slot = self._cancel_ahead(key)
            if slot is not None:
                return slot
        return None

    def _promote(self, key, mark: list | None = None):
        """A load waits for `key`: a read ahead of it still queued goes ahead of every other read ahead (its start then
        counts as the load's: `mark`)."""
        cur = self._inflight.get(key)
        if cur is not None and cur[2] == READAHEAD:
            self._inflight[key] = (cur[0], cur[1], DEMAND)
            if self.reader.promote(cur[1], mark):
                self.counters.readahead_promoted += 1

    def _free_slot(self, slot: int):
        self._handed.pop(slot, None)
        self._free.append(slot)

    def _ranges(self, key: tuple[int, int], slot_offset: int) -> tuple[list[tuple[int, int, int]], int]:
        """(key's (file_offset, nbytes, arena_dest) per part into the slot at arena offset `slot_offset`, its payload
        bytes): SlotLayout.read_ranges made once a key (its checks and sums were ~5 µs of each read's start)."""
        plan = self._read_plan.get(key)
        if plan is None:
            parts = self._parts[key[0]][key[1]]
            plan = self._read_plan[key] = (self.layout.slot.read_ranges(parts, 0), sum(p.nbytes for p in parts))
        ranges, nbytes = plan
        return [(off, n, dest + slot_offset) for off, n, dest in ranges], nbytes

    def _start_read(self, key, slot: int, priority: int, mark: list | None = None):
        stamp = self.watch.seen_stamp()
        ranges, nbytes = self._ranges(key, self.layout.staging_slot_offset(slot))
        fut = self.reader.read(ranges, priority=priority, mark=mark)
        self._inflight[key] = (slot, fut, priority)

        def landed(f, key=key, slot=slot, nbytes=nbytes):
            # the bytes count only if the file was the checked one from before the read to after it landed
            err = f.exception() or (None if self.watch.unchanged(stamp) else "the model file changed during the read")
            with self.cv:
                cur = self._inflight.get(key)
                if cur is None or cur[1] is not f:       # cancelled (_cancel_ahead): its slot is no longer its own
                    return
                del self._inflight[key]
                if err is not None:
                    self._free.append(slot)
                    self._readahead_keys.discard(key)
                    self.counters.extra["read_errors"] = self.counters.extra.get("read_errors", 0) + 1
                    if key in self._waiters:
                        self._failed[key] = str(err)
                elif key in self._staged:                # a copy handed back meanwhile (_release): keep that one,
                    self._free.append(slot)              # whose bytes are the same (one staged copy per key)
                    self._ready_bytes[key] = nbytes      # the disk bytes were read all the same
                else:
                    self._staged[key] = slot
                    self._ready_bytes[key] = nbytes
                    if key in self._readahead_keys:
                        self.counters.readahead_bytes += nbytes
                told = self._waiters.pop(key, [])
                for q in told:                           # staged (or failed) before anyone is told
                    q.put(key)
                self.cv.notify_all()
            for q in told:                               # outside the cv: a delivery may send from here (Landing)
                if q.on_land is not None:
                    q.on_land()
        fut.add_done_callback(landed)

    # ---- consolidation ---------------------------------------------------------------------
    def _vacate(self, moves):
        """Consolidation, step 1 (between passes, under cv): every host slot about to change hands leaves its
        current owner in the directory now (host tier -> disk; a VRAM expert keeps its VRAM place without the
        backing slot), so no pass reads a slot while its new expert is written into it."""
        with self.directory.batch():
            for l, e, _, slot in moves:
                if slot < 0:
                    continue
                o = int(self._host_owner[l, slot])
                if o < 0 or o == e:
                    continue
                tier = self.directory.lookup(l, o)[0]
                self.directory.set(l, o, TIER_VRAM if tier == TIER_VRAM else TIER_DISK, -1)
                self._host_owner[l, slot] = -1

    def _fill_consolidation(self, moves):
        """Consolidation, step 2 (a thread; passes may run meanwhile): the vacated slots get their new experts'
        bytes (from a staged copy, else from disk at read-ahead priority)."""
        try:
            self._fill(moves)
        finally:
            self.directory.filling = False

    def _fill(self, moves):
        t0 = time.monotonic()
        reads0, copies0 = self.counters.consolidation_reads, self.counters.consolidation_copies
        stamp = self.watch.stamp()
        futures = []
        for l, e, tier, slot in moves:
            if slot < 0 or self._host_owner[l, slot] == e:
                continue
            off = self.layout.host_slot_offset(l, slot)
            with self.cv:
                staged = self._staged.get((l, e))
                if staged is not None:
                    self._filling.add((l, e))     # a demand read must not evict this copy while it is copied
            if staged is not None:
                if self.reader.jitter is not None:    # test-only: a slow fill, so passes go on beside it
                    time.sleep(self.reader.jitter.delay())
                src = self.layout.staging_slot_offset(staged)
                n = self.layout.slot.slot_bytes
                self.arena.view(off, n)[:] = self.arena.view(src, n)
                with self.cv:
                    self._filling.discard((l, e))
                self.counters.consolidation_copies += 1
            else:
                ranges, nbytes = self._ranges((l, e), off)
                futures.append(self.reader.read(ranges, priority=READAHEAD))
                self.counters.consolidation_reads += 1
                self.counters.consolidation_bytes += nbytes
        try:
            for f in futures:
                f.result()
        except Exception as e:              # noqa: BLE001 - a failed read: the placement stays as it is
            self._fill_error = f"{type(e).__name__}: {e}"
        if self._fill_error is None and not self.watch.unchanged(stamp):
            self._fill_error = "the model file changed during the consolidation's reads"
        # disk -> VRAM promotions without a host slot are read by the worker after the commit: stage what fits now
        self._readahead([(l, e) for l, e, tier, slot in moves if tier == TIER_VRAM and slot < 0])
        self._fill_stats = (time.monotonic() - t0, self.counters.consolidation_reads - reads0,
                            self.counters.consolidation_copies - copies0)

    def _commit_consolidation(self):
        """Consolidation, step 3 (at a BeginPass, once the bytes landed): the new placement in one directory change."""
        moves, self._moves, self._consolidating = self._moves, None, None
        err, self._fill_error = self._fill_error, None
        if err is not None:                  # the vacated slots stay free (host_owner -1): the next plan reuses them
            log.warning("consolidation not applied: filling its slots failed: %s", err)
            return
        if not moves:
            return
        with self.cv, self.directory.batch():       # one epoch change: a snapshot sees all of it or none
            by_layer: dict[int, list[int]] = {}
            for l, e, tier, slot in moves:          # slots given up first, so each slot has one holder
                by_layer.setdefault(l, []).append(e)
                if slot < 0:
                    self.directory.set(l, e, tier, -1)
            for l, es in by_layer.items():          # one isin a layer, not a scan a move (BeginPass: issue 21)
                owner = self._host_owner[l]
                owner[np.isin(owner, es)] = -1
            for l, e, tier, slot in moves:
                if slot >= 0:
                    self._host_owner[l, slot] = e
                    self.directory.set(l, e, tier, slot)
            self.counters.consolidations += 1
        ms, reads, copies = self._fill_stats
        by_tier = {n: sum(1 for m in moves if m[2] == tier) for n, tier in (("to_vram", TIER_VRAM), ("to_host", TIER_HOST),
                                                                                 ("evicted", TIER_DISK))}
        event(log, "consolidation", moves=len(moves), **by_tier, disk_reads=reads, staged_copies=copies,
              ms=ms * 1e3, n=self.counters.consolidations, max_new=self.max_new)

    # ---- the prefix tier on disk ---------------------------------------------------------------
    IDLE_S = 1.0        # no pass for this long (and no expert read in flight): the prefix tier's save may write

    def _busy(self) -> bool:
        """Expert work is on (a pass, a consolidation's fills, a read): a save in progress stops."""
        return (self.pass_active or self._consolidating is not None or bool(self._inflight)
                or self._closing.is_set())

    def _save_prefix_when_idle(self):
        while not self._closing.wait(0.5):
            if self._busy() or time.monotonic() - self.pass_ended < self.IDLE_S:
                continue
            self.prefix_disk.save(abort=self._busy)

    # ---- status ------------------------------------------------------------------------------
    def tier_counts(self) -> dict[str, int]:
        snap = self.directory.snapshot()
        tiers = snap["tier"]
        return {"vram": int((tiers == TIER_VRAM).sum()), "host": int((tiers == TIER_HOST).sum()),
                "host_slots": int((snap["host_slot"] >= 0).sum()), "staging": self.plan.n_staging - len(self._free)}

    def status(self, disk_gaps_since: float | None = None) -> dict:
        """The store's counters and gauges (JSON-able). disk_gaps_since (monotonic seconds): also the disk's idle gaps
        ending after it, "disk_gaps" [[start, end], ...] (store/reader.py idle_gaps; the bench's decode split), and
        "disk_gaps_complete" (False: the reader's log lost some), "disk_clock" (now, monotonic), and the read messages
        (load, prefetch) taken after it, "disk_msgs" [[taken, first preadv start, last expert delivered], ...] (None:
        none; the bench's split of a gap's chain: the message taken -> its first read started; a load's last expert
        seen by the thread that hands it to the worker)."""
        r = self.reader.stats
        c = self.counters
        gaps = {}
        if disk_gaps_since is not None:
            got, complete = self.reader.idle_gaps(disk_gaps_since)
            gaps = {"disk_gaps": [list(g) for g in got], "disk_gaps_complete": complete, "disk_clock": time.monotonic(),
                    "disk_msgs": [list(m) for m in list(self._msgs) if m[0] > disk_gaps_since]}
        return {
            "pid": os.getpid(), "session": self.session, "pass_active": self.pass_active,
            "epoch": int(self.directory.epoch), "uptime_s": time.monotonic() - self.started,
            "arena_bytes": self.layout.total_bytes, "prefix_host_bytes": self.plan.prefix_host_bytes,
            "slot_bytes": self.layout.slot.slot_bytes,
            "n_vram": self.plan.n_vram, "n_host": self.plan.n_host, "n_staging": self.plan.n_staging,
            "slots": self.tier_counts(), "read_mode": self.reader.mode,
            "disk_bytes": int(r.bytes_read), "disk_payload_bytes": int(r.payload_bytes), "disk_reads": int(r.reads),
            "disk_busy_seconds": float(r.busy_seconds), "disk_active_seconds": self.reader.active_seconds(),
            "demand_loads": c.demand_loads, "staged_hits": c.staged_hits, "readahead_reads": c.readahead_reads,
            "readahead_wasted": c.readahead_wasted, "readahead_dropped": c.readahead_dropped,
            "readahead_promoted": c.readahead_promoted, "readahead_skipped": c.readahead_skipped,
            "readahead_bytes": c.readahead_bytes, "readahead_used": c.readahead_used,
            # demand reads started and their summed wait in the reader's queue (a promoted read ahead: from the load)
            "demand_started": r.started[0], "demand_wait_s": r.wait_seconds[0],
            "consolidation_reads": c.consolidation_reads,
            "consolidation_copies": c.consolidation_copies, "consolidation_moves": c.consolidation_moves,
            "consolidation_bytes": c.consolidation_bytes, "consolidation_max_new": self.max_new,
            "passes": c.passes, "consolidations": c.consolidations,
            "attaches": c.attaches, "consolidation_pending": self._consolidating is not None,
            # disk reads started and not landed yet (demand, read-ahead): 0 with no consolidation pending = quiet
            "reads_in_flight": len(self._inflight),
            "staging_handed": len(self._handed),    # staging slots the worker holds (not yet handed back)
            "staging_reclaimed": c.staging_reclaimed,
            "refusing": self.watch.why,
            **(self.engram.status() if self.engram is not None else {}),
            **(self.prefix_disk.status() if self.prefix_disk is not None else {}),
            **gaps,
        }

    def close(self):
        self._closing.set()
        if self._saver is not None:         # then the last save, whole and at once (a clean stop: SIGTERM)
            self._saver.join()
            self._saver = None
            self.prefix_disk.save(rate=None)
            self.prefix_disk.close()
        t = self._consolidating
        if t is not None:                    # a consolidation still reading: its reads land before the reader closes
            t.join()
        if self._filler is not None:
            self._fills.put(None)
            self._filler.join()
            self._filler = None
        self.reader.close()
        if self.engram is not None:
            self.engram.close()
        self.arena.close()
        if self.prefix_arena is not None:
            self.prefix_arena.close()
        self.watch.close()
