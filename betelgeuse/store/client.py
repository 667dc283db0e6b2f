"""How the worker reaches the store: a small interface, two implementations.

`InProcessStoreClient` calls an `ExpertStore` in the same process (tests, single-process runs);
`services/grpc/store_client.py` implements the same methods over gRPC on a Unix socket and receives
the arena's file descriptor over a second socket. The engine only sees this interface.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Protocol

import numpy as np

from betelgeuse.store.arena import Arena
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.engram import EngramLanded
from betelgeuse.store.store import ExpertStore, Loaded


class StoreClient(Protocol):
    def attach(self) -> tuple[Arena, SlotPlan]: ...          # maps the arena; (re)binds a session
    def take_prefix_arena(self) -> Arena | None: ...          # the prefix host tier of the last attach, mapped
                                                              # writable (the caller owns it); None: the store has none
    def begin_pass(self, wait: bool = True) -> int: ...       # directory epoch, frozen until end_pass; wait: for
                                                              # a consolidation still reading (else applied later)
    # demand loads, in completion order; the same message first hands back the staging slots `release` and, once
    # the loads' reads have started, reads `ahead` ahead (Loaded.ahead_queued: those started): a decode layer's
    # whole store traffic in one message. `drop` (here and in prefetch_start): reads ahead no longer wanted (a
    # layer's unused guesses), forgotten where they have not started, before anything else is read
    def load(self, keys: list[tuple[int, int]], release: list[int] = (),
             ahead: list[tuple[int, int]] = (), drop: list[tuple[int, int]] = ()) -> Iterator[Loaded]: ...
    consolidating: bool                                       # the last begin_pass left a consolidation filling
    def prefetch(self, keys: list[tuple[int, int]], release: list[int] = ()) -> int: ...   # reads ahead started
    # as prefetch, without waiting for the answer (decode's guesses: a round trip per layer would cost more than a
    # read); call the result for the number of reads started
    def prefetch_start(self, keys: list[tuple[int, int]], release: list[int] = (),
                       drop: list[tuple[int, int]] = ()) -> Callable[[], int]: ...
    def release(self, slots: list[int]) -> None: ...
    # usage [n_layer, n_expert]; `release` handed back first
    def end_pass(self, usage: np.ndarray, consolidate: bool, release: list[int] = ()) -> int: ...
    # deepseek41's Engram rows (store/engram.py): start reading (table, row) pairs into a bank, releasing the
    # banks the worker is done with; then wait until they landed (compact, request order, at the bank's offset)
    def engram_read(self, tables: np.ndarray, rows: np.ndarray, release: list[int]) -> int: ...
    def engram_wait(self, bank: int) -> EngramLanded: ...
    # the worker measured its VRAM over the budget at attach: the VRAM tier keeps n_vram slots per layer (between
    # passes; ExpertStore.trim_vram) -> the new plan; `trim`: the measurement (worker/vram_fit.py VramFit.record)
    def trim_vram(self, n_vram: int, trim: dict) -> SlotPlan: ...
    # disk_gaps_since (monotonic seconds): also the disk's idle gaps since then (ExpertStore.status)
    def status(self, disk_gaps_since: float | None = None) -> dict: ...
    def close(self) -> None: ...


class InProcessStoreClient:
    def __init__(self, store: ExpertStore):
        self.store = store
        self.session = ""
        self._prefix: Arena | None = None

    def attach(self):
        self.session, plan_json = self.store.attach(os.getpid())
        p = self.store.prefix_arena
        self._prefix = None if p is None else Arena.attach(os.dup(p.fd), p.nbytes, readonly=False)
        # the same memfd, mapped a second time, exactly as the worker process would
        return Arena.attach(os.dup(self.store.arena.fd), self.store.arena.nbytes), SlotPlan.from_json(plan_json)

    def take_prefix_arena(self):
        out, self._prefix = self._prefix, None
        return out

    def begin_pass(self, wait=True):
        return self.store.begin_pass(self.session, wait)

    @property
    def consolidating(self) -> bool:
        return self.store.consolidating

    def load(self, keys, release=(), ahead=(), drop=()):
        """The reads started now, as the store process starts them when the message arrives (services/store_main.py:
        store.load's `started`) -> the experts as they land, with ready() (_Landed)."""
        it = self.store.load(self.session, keys, release, ahead, drop, started=True)
        landed = next(it, None)             # the landing queue, once the reads started; None: no key (nothing lands)
        return iter(()) if landed is None else _Landed(it, landed)

    def prefetch(self, keys, release=()):
        return self.store.prefetch(self.session, keys, release)

    def prefetch_start(self, keys, release=(), drop=()):
        n = self.store.prefetch(self.session, keys, release, drop)
        return lambda: n

    def release(self, slots):
        self.store.release(self.session, slots)

    def end_pass(self, usage, consolidate, release=()):
        return self.store.end_pass(self.session, usage, consolidate, release)

    def trim_vram(self, n_vram, trim):
        return SlotPlan.from_json(self.store.trim_vram(self.session, n_vram, trim))

    def engram_read(self, tables, rows, release):
        return self.store.engram_read(self.session, tables, rows, release)

    def engram_wait(self, bank):
        return self.store.engram_wait(self.session, bank)

    def status(self, disk_gaps_since=None):
        return self.store.status(disk_gaps_since)

    def close(self):
        pass


class TrackedLoads:
    """An iterator of Loaded as a load stream (worker/store_session.LoadStream reads `ahead_queued`: the last landed
    one's); close() closes a generator."""

    __slots__ = ("_it", "ahead_queued")

    def __init__(self, it):
        self._it = it if hasattr(type(it), "__next__") else iter(it)     # an iterator as it is (no __iter__ call)
        self.ahead_queued = 0

    def __iter__(self):
        return self

    def __next__(self) -> Loaded:
        got = next(self._it)
        self.ahead_queued = got.ahead_queued
        return got

    def close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


class _Landed(TrackedLoads):
    """An in-process load's experts as they land, and ready(): whether the next one has landed (its landing queue
    holds it: next() returns without a wait), asked without blocking (MoEStep._disk_groups' early flush)."""

    __slots__ = ("_q",)

    def __init__(self, it: Iterator[Loaded], landed):
        super().__init__(it)
        self._q = landed                        # the load's queue.Queue of landed keys (ExpertStore._deliver)

    def ready(self) -> bool:
        return self._q.qsize() > 0
