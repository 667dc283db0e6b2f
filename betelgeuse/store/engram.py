"""Engram rows from NVMe, in the store (DESIGN.md §3.4): the third memory tier of DeepSeek-V4.1.

The tables (hundreds of millions of rows of a few hundred bytes) stay on disk and are never mapped. For a sub-batch
the worker names the (table, row) pairs it needs; the store
  1. answers the rows its small LRU row cache holds (inside the arena, so the cgroup budget counts it),
  2. reads the 4 KiB pages holding the others with O_DIRECT (a row of 272 B is one page, or two where it straddles
     a page boundary): pages sorted and adjacent ones coalesced into one preadv, all issued at once to a pool of
     `read_depth` threads (the queue depth an NVMe wants for 4 KiB random reads),
  3. copies each row out of its page into the bank's compact area, in request order, and into the row cache.
The worker then copies the compact rows (bank_rows x row_bytes, ~100 KB) into its VRAM staging buffer in one copy.

Arena region, after the expert staging slots (EngramLayout):
    [ bank 0: pages (bank_pages x 4 KiB) | rows (bank_rows x stride) ] ... [ bank n-1 ] [ row cache: cache_rows x stride ]
A bank belongs to one request from EngramRead until the worker releases it (piggybacked on a later EngramRead);
with `n_banks` of them the worker keeps that many sub-batches in flight while it computes. Reads in flight when a
bank is released (an abandoned pass) finish before the bank is reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np

from betelgeuse.errors import BetelgeuseError
from betelgeuse.gguf.ds41layout import ENGRAM_BANKS
from betelgeuse.store.layout import PAGE, round_up
from betelgeuse.store.reader import ExpertReader


@dataclass(slots=True, frozen=True)
class EngramTable:
    layer: int                   # the decoder layer it belongs to
    offset: int                  # absolute file offset of row 0
    row_bytes: int               # one row (key_length values in the stored type)
    rows: int
    qtype: int                   # GGML type of the rows


@dataclass(slots=True, frozen=True)
class EngramLayout:
    """The Engram region of the arena (JSON-able: it travels in the slot plan)."""
    tables: tuple[EngramTable, ...]
    base: int                    # arena offset of the region (4 KiB aligned)
    n_banks: int
    bank_rows: int               # rows one request may hold (ENGRAM_TOKENS x columns)
    bank_pages: int              # pages a bank can read at once (every row may straddle two)
    stride: int                  # bytes per row slot (the largest row)
    cache_rows: int              # rows of the LRU row cache (0: off)

    @classmethod
    def for_tables(cls, tables, base: int, bank_rows: int, cache_bytes: int, n_banks: int = ENGRAM_BANKS):
        stride = max(t.row_bytes for t in tables)
        per_row = -(-(stride + PAGE - 1) // PAGE)            # pages a row can span at any offset
        return cls(tuple(tables), base, n_banks, bank_rows, bank_rows * per_row, stride,
                   max(0, cache_bytes // stride))

    @property
    def bank_bytes(self) -> int:
        return self.bank_pages * PAGE + round_up(self.bank_rows * self.stride)

    def bank_pages_offset(self, bank: int) -> int:
        assert 0 <= bank < self.n_banks, bank
        return self.base + bank * self.bank_bytes

    def bank_rows_offset(self, bank: int) -> int:
        return self.bank_pages_offset(bank) + self.bank_pages * PAGE

    @property
    def cache_offset(self) -> int:
        return self.base + self.n_banks * self.bank_bytes

    @property
    def nbytes(self) -> int:
        return self.n_banks * self.bank_bytes + round_up(self.cache_rows * self.stride)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngramLayout":
        return cls(**{**d, "tables": tuple(EngramTable(**t) for t in d["tables"])})


@dataclass(slots=True)
class EngramLanded:
    """What one request read: its rows sit compact in request order at the bank's rows offset."""
    bank: int
    rows: int                    # rows in the bank (the request's)
    disk_rows: int               # of them read from disk now
    cache_rows: int              # of them from the row cache
    disk_bytes: int              # device bytes read (whole pages)
    read_seconds: float          # first read issued -> last landed (store side)


@dataclass(slots=True)
class _Request:
    rows: int
    done: threading.Event = field(default_factory=threading.Event)
    landed: EngramLanded | None = None
    error: str | None = None
    release_on_land: bool = False


@dataclass(slots=True)
class EngramCounters:
    requests: int = 0
    rows: int = 0
    disk_rows: int = 0
    cache_rows: int = 0
    disk_bytes: int = 0
    read_errors: int = 0


class EngramRows:
    """The store's Engram tier: banks, the row cache and a reader of its own (module doc)."""

    def __init__(self, path: str, arena, layout: EngramLayout, read_depth: int = 32, watch=None):
        self.arena, self.layout = arena, layout
        self.watch = watch          # store/watch.ModelWatch: rows read while the file changed are refused
        # its own pool: 4 KiB reads at depth, never queued behind a 4 MiB expert read
        self.reader = ExpertReader(path, arena, threads=read_depth, request_bytes=16 * PAGE)
        self.lock = threading.Lock()
        self._free = list(range(layout.n_banks - 1, -1, -1))
        self._req: dict[int, _Request] = {}
        self._cache: OrderedDict[tuple[int, int], int] = OrderedDict()      # (table, row) -> cache slot, LRU order
        self._cache_free = list(range(layout.cache_rows - 1, -1, -1))
        self.counters = EngramCounters()

    @property
    def mode(self) -> str:
        return self.reader.mode

    def _cache_view(self, slot: int) -> np.ndarray:
        s = self.layout.stride
        return self.arena.numpy(self.layout.cache_offset + slot * s, s)

    def read(self, tables: np.ndarray, rows: np.ndarray, release: list[int] = ()) -> int:
        """Start reading rows[i] of tables[i] (engram table index) into a free bank; -> the bank (EngramWait)."""
        L = self.layout
        tables, rows = np.asarray(tables, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        n = rows.shape[0]
        if n == 0 or n > L.bank_rows or tables.shape != rows.shape:
            raise BetelgeuseError(f"an Engram request holds 1..{L.bank_rows} rows, got {n}")
        if tables.min() < 0 or tables.max() >= len(L.tables):
            raise BetelgeuseError(f"Engram table index out of range 0..{len(L.tables) - 1}")
        nrows = np.array([t.rows for t in L.tables], dtype=np.int64)[tables]
        if rows.min() < 0 or (rows >= nrows).any():
            raise BetelgeuseError("an Engram row id is past the end of its table")
        self.release(release)
        with self.lock:
            if not self._free:
                raise BetelgeuseError(f"no free Engram bank: all {L.n_banks} are held (release them first)")
            bank = self._free.pop()
            req = self._req[bank] = _Request(rows=n)
            compact = self.arena.numpy(L.bank_rows_offset(bank), n * L.stride).reshape(n, L.stride)
            misses = []
            for k in range(n):
                key = (int(tables[k]), int(rows[k]))
                slot = self._cache.get(key)
                if slot is None:
                    misses.append(k)
                else:
                    self._cache.move_to_end(key)
                    compact[k] = self._cache_view(slot)
            self.counters.requests += 1
            self.counters.rows += n
            self.counters.cache_rows += n - len(misses)
        jitter = self.reader.jitter               # test-only adversarial timing (store/reader.py Jitter); None: off
        if not misses:
            req.landed = EngramLanded(bank, n, 0, n, 0, 0.0)
            if jitter is None:
                req.done.set()
            else:                                 # rows from the row cache land late too
                t = threading.Timer(jitter.delay(), self._settle, (bank, req))
                t.daemon = True
                t.start()
            return bank
        # the pages holding the missed rows, sorted and coalesced into runs of adjacent pages
        starts = np.array([L.tables[tables[k]].offset + int(rows[k]) * L.tables[tables[k]].row_bytes for k in misses],
                          dtype=np.int64)
        sizes = np.array([L.tables[tables[k]].row_bytes for k in misses], dtype=np.int64)
        first, last = starts // PAGE, (starts + sizes - 1) // PAGE
        pages = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)]))
        assert pages.size <= L.bank_pages, (pages.size, L.bank_pages)
        breaks = np.nonzero(np.diff(pages) != 1)[0] + 1
        area = L.bank_pages_offset(bank)
        ranges, pos = [], 0
        fsize = self.reader.file_size
        for run in np.split(pages, breaks):
            off = int(run[0]) * PAGE
            ranges.append((off, min(run.size * PAGE, fsize - off), area + pos * PAGE))
            pos += run.size
        where = {int(p): i for i, p in enumerate(pages)}                  # file page -> its page in the area
        if jitter is not None:                    # the runs queued (so landing) in any order
            ranges = jitter.shuffled(ranges)
        stamp = self.watch.stamp() if self.watch is not None else None
        t0 = time.perf_counter()
        try:
            fut = self.reader.read(ranges, priority=0)
        except Exception as e:                   # a range past the end of the file: a truncated table
            with self.lock:
                self._free.append(bank)
                del self._req[bank]
            raise BetelgeuseError(f"reading Engram rows failed: {e}") from None
        device = sum(r[1] for r in ranges)

        def landed(f):
            with self.lock:
                err = f.exception()
                if err is None and self.watch is not None and not self.watch.unchanged(stamp):
                    err = "the model file changed during the read"
                if err is not None:
                    req.error = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
                    self.counters.read_errors += 1
                else:
                    pview = self.arena.numpy(area, pages.size * PAGE)
                    # rows copied out (and into the LRU row cache: which rows it keeps) in any order under the jitter
                    order = range(len(misses)) if jitter is None else jitter.shuffled(range(len(misses)))
                    for j in order:
                        k = misses[j]
                        a = where[int(first[j])] * PAGE + int(starts[j]) % PAGE
                        row = pview[a:a + int(sizes[j])]
                        compact[k, :row.size] = row
                        self._cache_put((int(tables[k]), int(rows[k])), compact[k])
                    self.counters.disk_rows += len(misses)
                    self.counters.disk_bytes += device
                    req.landed = EngramLanded(bank, n, len(misses), n - len(misses), device,
                                              time.perf_counter() - t0)
            self._settle(bank, req)
        fut.add_done_callback(landed)
        return bank

    def _settle(self, bank: int, req: _Request) -> None:
        """A request's rows are in its bank (or it failed): wake its waiter; a bank released meanwhile is free now."""
        with self.lock:
            req.done.set()
            if req.release_on_land:
                self._free_bank(bank)

    def _cache_put(self, key: tuple[int, int], row: np.ndarray) -> None:
        """(under lock) keep a row in the LRU cache, evicting the least recently used."""
        if self.layout.cache_rows == 0 or key in self._cache:
            return
        if self._cache_free:
            slot = self._cache_free.pop()
        else:
            _, slot = self._cache.popitem(last=False)
        self._cache_view(slot)[:] = row
        self._cache[key] = slot

    def wait(self, bank: int, timeout: float | None = None) -> EngramLanded:
        with self.lock:
            req = self._req.get(bank)
        if req is None:
            raise BetelgeuseError(f"Engram bank {bank} holds no request")
        if not req.done.wait(timeout):
            raise BetelgeuseError(f"Engram bank {bank}: its reads did not land within {timeout} s")
        if req.error is not None:
            raise BetelgeuseError(f"reading Engram rows from {self.reader.path} failed: {req.error}")
        return req.landed

    def release(self, banks) -> None:
        """The worker is done with these banks (its copies finished); reads still in flight free theirs on landing."""
        with self.lock:
            for b in banks:
                req = self._req.get(int(b))
                if req is None:
                    continue
                if req.done.is_set():
                    self._free_bank(int(b))
                else:
                    req.release_on_land = True

    def release_all(self) -> None:
        """A new worker session: every bank is free once its reads landed."""
        self.release(list(self._req))

    def _free_bank(self, bank: int) -> None:
        """(under lock)"""
        if self._req.pop(bank, None) is not None:
            self._free.append(bank)

    def status(self) -> dict:
        c = self.counters
        return {"engram_requests": c.requests, "engram_rows": c.rows, "engram_disk_rows": c.disk_rows,
                "engram_cache_rows": c.cache_rows, "engram_disk_bytes": c.disk_bytes,
                "engram_read_errors": c.read_errors, "engram_cache_capacity": self.layout.cache_rows,
                "engram_cache_used": len(self._cache), "engram_read_mode": self.reader.mode}

    def close(self) -> None:
        self.reader.close()
