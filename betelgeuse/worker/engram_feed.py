"""The worker's side of the Engram tier (deepseek41): rows from the store, through a bounded VRAM staging buffer.

A token's Engram rows depend on the token ids alone, so at the start of a pass (`begin`) every row the pass will
need is known: the model hashes each piece with its sequence's history (Deepseek41Model.engram_begin), and the feed
plans the pass's units (one per Engram layer, piece and sub-batch of ENGRAM_TOKENS tokens, in the order the layers
will ask for them), packs consecutive units into jobs of at most a bank's rows (a decode step's two layers share
one), and asks the store for the first `n_banks` jobs at once: their disk reads run under the layers before the
first Engram layer. Each time a layer asks (`rows`), the feed waits for its job (the time counted as Engram wait),
copies the job's compact rows (at most bank_rows x row_bytes, ~100 KB for V4.1-Flash) into the VRAM staging buffer
in one copy, dequantizes them there, gives the bank back and starts the next job. A unit's values are the stored
rows dequantized, exactly what the reference reads from the file's map, so the bits never depend on the fetching.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from betelgeuse.gguf.ds41layout import ENGRAM_TOKENS
from betelgeuse.gguf.quants import dequantize
from betelgeuse.model.chunks import chunk_bounds

_KEY = 40                      # key = table << 40 | row (tables hold < 2^40 rows)


@dataclass(slots=True)
class EngramStats:
    """Engram work of one pass (PassStats.engram_*)."""
    rows: int = 0              # rows the tokens asked for (tokens x columns x layers)
    unique_rows: int = 0       # rows requested from the store (deduplicated per job)
    disk_rows: int = 0         # of them read from disk
    cache_rows: int = 0        # of them from the store's row cache
    disk_bytes: int = 0        # device bytes read (4 KiB pages)
    requests: int = 0          # jobs (store round trips: EngramRead + EngramWait)
    unplanned: int = 0         # asks the plan did not foresee (read on their own: a layer cut its tokens otherwise)
    wait_s: float = 0.0        # blocked waiting for rows to land
    seconds: float = 0.0       # in the feed in all: waits, copies into VRAM, dequantization

    def add(self, o: "EngramStats") -> "EngramStats":
        for f in self.__slots__:
            setattr(self, f, getattr(self, f) + getattr(o, f))
        return self

    def record(self, n_tokens: int, seconds: float) -> dict:
        """The bench's figures for a pass (or a decode run) of n_tokens tokens that took `seconds`."""
        per = 1 / max(n_tokens, 1)
        return {"rows": self.rows, "unique_rows": self.unique_rows, "disk_rows": self.disk_rows,
                "cache_rows": self.cache_rows, "disk_bytes": self.disk_bytes, "requests": self.requests,
                "rows_per_token": self.rows * per, "disk_bytes_per_token": self.disk_bytes * per,
                "wait_ms": self.wait_s * 1e3, "feed_ms": self.seconds * 1e3,
                "wait_share": self.wait_s / seconds if seconds > 0 else None,
                "feed_share": self.seconds / seconds if seconds > 0 else None}


@dataclass(slots=True)
class _Job:
    units: list
    keys: np.ndarray = None                    # unique (table, row) keys, sorted (table-major)
    inverse: np.ndarray = None                 # per unit row (concatenated): index into keys
    bank: int = -1
    values: torch.Tensor | None = None         # [len(keys), key_length] dequantized, once landed
    consumed: int = 0


@dataclass(slots=True)
class _Unit:
    e: int                                     # Engram table index
    rows: np.ndarray                           # [n, n_cols] int64
    job: _Job | None = None
    start: int = 0                             # offset of its rows in the job's concatenation
    stop: int = 0


class EngramFeed:
    def __init__(self, store, arena, layout, device, dtype):
        self.store, self.arena, self.L = store, arena, layout
        self.device, self.dtype = torch.device(device), dtype
        self.key_length = None
        # the bounded VRAM (device) staging buffer: one bank's compact rows
        self.staging = torch.empty(layout.bank_rows * layout.stride, dtype=torch.uint8, device=self.device)
        self.units: deque[_Unit] = deque()
        self.pending: deque[_Job] = deque()        # planned, not yet asked of the store
        self.inflight: list[_Job] = []             # asked of the store, not yet landed
        self.release: list[int] = []               # banks copied out, handed back with the next EngramRead
        self.stats = EngramStats()

    # ---- planning ----------------------------------------------------------------------------------
    def begin(self, model, pieces, chunk: int | None = None) -> None:
        """A pass starts: pieces [(cache, ids)] (after cache.begin), each prefilled in position-aligned chunks of
        `chunk` tokens (model/chunks.py; None: whole). Hash them, plan the units (per Engram layer and piece, chunk
        by chunk, ENGRAM_TOKENS at a time from each chunk's start: as the model asks), the jobs, start reads."""
        self.abandon()
        for kv, ids in pieces:
            model.engram_begin(kv, ids, self)
        g = model.q.engram
        self.key_length = g.key_length
        units = []
        for e in range(len(g.layer_ids)):
            for kv, _ in pieces:
                pend = kv.engram.pending
                for a, b in chunk_bounds(kv.length, pend.shape[0], chunk):
                    for s in range(a, b, ENGRAM_TOKENS):
                        units.append(_Unit(e, pend[s:min(b, s + ENGRAM_TOKENS), e]))
        job, n = None, 0
        for u in units:
            k = u.rows.size
            if job is None or n + k > self.L.bank_rows:
                job, n = _Job([]), 0
                self.pending.append(job)
            job.units.append(u)
            u.job = job
            n += k
        for job in self.pending:
            self._plan(job)
        self.units.extend(units)
        self._fill()

    def _plan(self, job: _Job) -> None:
        parts, pos = [], 0
        for u in job.units:
            keys = (np.int64(u.e) << _KEY) | u.rows.reshape(-1)
            parts.append(keys)
            u.start, u.stop = pos, pos + keys.size
            pos += keys.size
        job.keys, job.inverse = np.unique(np.concatenate(parts), return_inverse=True)

    def _fill(self) -> None:
        """Keep n_banks jobs in flight."""
        while self.pending and len(self.inflight) < self.L.n_banks:
            job = self.pending.popleft()
            job.bank = self.store.engram_read(job.keys >> _KEY, job.keys & ((1 << _KEY) - 1), self.release)
            self.release = []
            self.inflight.append(job)
            self.stats.requests += 1
            self.stats.unique_rows += job.keys.size

    def abandon(self) -> None:
        """Drop what an earlier (abandoned) pass planned; its banks in flight go back (freed once they land)."""
        self.release += [j.bank for j in self.inflight]
        self.inflight, self.pending, self.units = [], deque(), deque()

    # ---- serving the model -----------------------------------------------------------------------
    def rows(self, e: int, ids: np.ndarray) -> torch.Tensor:
        """Engram table e's rows ids [n, n_cols] -> values [n, n_cols, key_length] on the device, in the compute dtype."""
        t0 = time.perf_counter()
        unit = self.units.popleft() if self.units else None
        if unit is None or unit.e != e or not np.array_equal(unit.rows, ids):
            # not what the plan expected (a caller outside begin/rows order): read these rows on their own
            self.stats.unplanned += 1
            self.abandon()
            unit = _Unit(e, np.asarray(ids, dtype=np.int64))
            unit.job = _Job([unit])
            self._plan(unit.job)
            self.pending.appendleft(unit.job)
            self._fill()
        job = unit.job
        if job.values is None:
            self._land(job)
        n, c = ids.shape
        out = job.values[torch.from_numpy(job.inverse[unit.start:unit.stop]).to(self.device)].view(n, c, -1)
        job.consumed += 1
        if job.consumed == len(job.units):
            job.values = None
        self.stats.rows += ids.size
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _land(self, job: _Job) -> None:
        """Wait for a job's rows, copy them into the staging buffer, dequantize, hand the bank back, start more."""
        assert job in self.inflight, "a job waited for before it was asked"
        tw = time.perf_counter()
        got = self.store.engram_wait(job.bank)
        self.stats.wait_s += time.perf_counter() - tw
        self.inflight.remove(job)
        L, n = self.L, job.keys.size
        assert got.rows == n, (got.rows, n)
        st = self.staging[:n * L.stride]
        st.copy_(self.arena.torch(L.bank_rows_offset(job.bank), n * L.stride))    # synchronous: the bank is free after
        self.release.append(job.bank)
        self.stats.disk_rows += got.disk_rows
        self.stats.cache_rows += got.cache_rows
        self.stats.disk_bytes += got.disk_bytes
        rows = st.view(n, L.stride)
        tables = job.keys >> _KEY
        vals = []
        for t in np.unique(tables):                              # keys are table-major: one run per table
            a, b = np.searchsorted(tables, [t, t + 1])
            tab = L.tables[int(t)]
            raw = rows[a:b, :tab.row_bytes].contiguous()
            vals.append(dequantize(raw, tab.qtype, (b - a, self.key_length), self.dtype))
        job.values = vals[0] if len(vals) == 1 else torch.cat(vals)
        self._fill()

    def take_stats(self) -> EngramStats:
        s, self.stats = self.stats, EngramStats()
        return s
