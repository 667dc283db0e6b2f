"""The NVMe reader: expert bytes from the GGUF file straight into arena slots (invariant 4).

Reads bypass the page cache with O_DIRECT, so "disk reads" are disk reads and the page cache is
never charged to the cgroup. Each range is rounded out to 4 KiB (GGUF tensors are only 32-byte
aligned) and split into <= request_bytes `os.preadv` calls, which release the GIL, run by a pool of
threads. Requests of priority 0 (demand: a pass waits on them) are always taken before priority 1 (read-ahead); FIFO
within a priority. A read ahead that no piece of has started can be cancelled (its bytes are never read: the store
forgets a guess the layer did not use) or promoted to demand priority (a load asked for it: it no longer waits
behind the reads ahead queued before it); a started one always finishes. Where O_DIRECT is refused or meaningless
(tmpfs, ramfs: the file already is page cache) the reader falls back to buffered reads + POSIX_FADV_DONTNEED, and
says so in `mode`.

Idle gaps: the reader logs each stretch of wall time with no preadv in flight as (start, end) on CLOCK_MONOTONIC
(time.monotonic: the same clock in every process of the host, so a worker or the bench can lay its own step
boundaries over the store's gaps; the last GAP_LOG of them, one append per active stretch). idle_gaps(since) hands
out those that end after `since` (the bench's decode split, services/bench/disk_idle.py).

Test-only: `BETELGEUSE_TEST_READ_JITTER=SEED:MAX_MS` (or `jitter=`, see Jitter) slows each piece's preadv and holds
each read's completion back by seeded random delays, so bytes land late, the pieces of one read land in any order,
and expert arrivals come late and out of order (adversarial timing: the tests and the device checks set it,
production never does; off, it costs one `is None` test per read).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import heapq
import itertools
import mmap
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from betelgeuse.errors import BetelgeuseError, ModelFormatError
from betelgeuse.store.arena import Arena

PAGE = 4096
JITTER_ENV = "BETELGEUSE_TEST_READ_JITTER"
MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
GAP_LOG = 1 << 16   # idle gaps kept (16 bytes each in two floats: ~2 MB): a decode token has a few dozen


@dataclass(slots=True)
class ReaderStats:
    bytes_read: int = 0  # device bytes, including the 4 KiB rounding
    payload_bytes: int = 0  # bytes the callers asked for
    reads: int = 0  # preadv calls
    busy_seconds: float = 0.0  # summed over threads: time inside preadv
    active_seconds: float = 0.0  # wall time with at least one preadv in flight (the disk busy; <= wall, unlike busy)
    requests: list[int] = field(default_factory=lambda: [0, 0])  # read() calls per priority
    request_bytes: list[int] = field(default_factory=lambda: [0, 0])  # device bytes per priority
    cancelled: int = 0  # read() calls cancelled before any piece started (never read)
    cancelled_bytes: int = 0  # their device bytes (counted in request_bytes too)
    promoted: int = 0  # read-ahead calls promoted to demand priority while pieces were still queued
    started: list[int] = field(default_factory=lambda: [0, 0])  # read() calls whose first piece started, per priority
    wait_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # their summed queue wait: read() (or
    # promote()) to their first piece's start, per priority at the start

    def copy(self) -> "ReaderStats":
        return ReaderStats(self.bytes_read, self.payload_bytes, self.reads, self.busy_seconds, self.active_seconds,
                           list(self.requests), list(self.request_bytes), self.cancelled, self.cancelled_bytes,
                           self.promoted, list(self.started), list(self.wait_seconds))  # fmt: skip


@dataclass(slots=True)
class Jitter:
    """Adversarial timing, for tests only (production never sets it). Each draw n (a piece, a read, a delivery order,
    a consolidation copy) takes Random(seed, n): every piece's preadv starts up to max_s late in its reader thread (a
    slow disk: the bytes themselves land late, the pieces of one read in any order), a read's completion (its
    future, so the store's `landed`) is held back by a further delay() in [0, max_s), and the store hands staged
    copies out in a shuffled() order, so demand loads, read-ahead and consolidation fills land late and in an order
    unrelated to the order asked for."""
    seed: int
    max_s: float
    _draws: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def _rng(self) -> random.Random:
        return random.Random(self.seed * 1_000_003 + next(self._draws))

    def delay(self) -> float:
        return self._rng().random() * self.max_s

    def shuffled(self, items) -> list:
        out = list(items)
        self._rng().shuffle(out)
        return out

    @classmethod
    def parse(cls, text: str) -> "Jitter":
        """'SEED:MAX_MS' (e.g. '7:20') -> a Jitter; anything else -> BetelgeuseError naming the variable."""
        try:
            seed, ms = text.split(":")
            jitter = cls(int(seed), float(ms) / 1e3)
        except ValueError:
            jitter = None
        if jitter is None or not 0 <= jitter.max_s < 60:
            raise BetelgeuseError(f"{JITTER_ENV}={text!r}: expected SEED:MAX_MS (integer seed, 0 <= MAX_MS < 60000), "
                                  "e.g. 7:20")
        return jitter

    @classmethod
    def from_env(cls, environ=os.environ) -> "Jitter | None":
        """From BETELGEUSE_TEST_READ_JITTER; unset or empty -> None (off: production)."""
        text = environ.get(JITTER_ENV, "").strip()
        return cls.parse(text) if text else None


class ReadCancelled(Exception):
    """The exception of a read's future once ExpertReader.cancel took it back before any of its bytes were read."""


class ReadFuture(cf.Future):
    """A read() call's future; `job` lets the reader cancel or promote it (ExpertReader.cancel / promote)."""

    def __init__(self):
        super().__init__()
        self.job: _Job | None = None


@dataclass(slots=True)
class _Job:  # one read() call
    future: cf.Future
    pending: int  # pieces not yet done
    lock: threading.Lock
    delay: float  # seconds its completion is held back (test-only Jitter; 0 otherwise)
    error: BaseException | None = None  # the first failure; later pieces are skipped
    priority: int = 0  # now (a promoted read ahead: 0)
    queued_at: float = 0.0  # perf_counter of read() (or promote())
    started: bool = False  # a piece was taken by a reader thread: it can no longer be cancelled
    cancelled: bool = False
    device_bytes: int = 0
    pieces: list = field(default_factory=list)
    mark: list | None = None  # the message that started it: [taken, first preadv start] monotonic s (the store's
    # message log, ExpertStore.status): its first piece's start written into [1] if not set yet


@dataclass(slots=True)
class _Piece:  # one preadv: file [offset, offset+nbytes) -> arena [dest, dest+nbytes)
    job: _Job
    offset: int
    nbytes: int
    dest: int
    delay: float = 0.0  # seconds its preadv is held back in the reader thread (test-only Jitter; 0 otherwise)
    taken: bool = False  # a thread took it (or its job was cancelled): a second queue entry (promote) is skipped


class _PieceQueue:
    """The reader threads' queue of (priority, seq, piece): a heap under one lock, and one wake-up token per entry in a
    queue.SimpleQueue (C: a put wakes one waiting thread with no Python-level Condition). put_many takes the lock once
    for all of a read's pieces; queue.PriorityQueue took its Condition and ran its Python notify() once a piece (~5 µs
    each, on the session reader's thread, the store link: docs/benchmarks/cpu-store61). A get pops the smallest entry
    there is when it runs, as PriorityQueue's did: every token is put after its entry, so the heap is never empty."""

    __slots__ = ("_heap", "_lock", "_tokens")

    def __init__(self):
        self._heap: list = []
        self._lock = threading.Lock()
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()

    def put_many(self, entries: list) -> None:
        with self._lock:
            for e in entries:
                heapq.heappush(self._heap, e)
        for _ in entries:
            self._tokens.put(None)

    def get(self):
        self._tokens.get()
        with self._lock:
            return heapq.heappop(self._heap)

    def take_first(self, want) -> tuple | None:
        """The next entry, for the calling thread, if want(entry) and one of the wake-up tokens is still here (no
        reader thread has it; a woken one that has not yet had the GIL back has not taken its token: SimpleQueue.get
        takes it with the GIL), else None. The token goes with the entry, so each token still finds an entry."""
        with self._lock:
            if not self._heap or not want(self._heap[0]):
                return None
            try:
                self._tokens.get_nowait()
            except queue.Empty:
                return None
            return heapq.heappop(self._heap)

    def qsize(self) -> int:
        return len(self._heap)


def drop_page_cache(path: str) -> None:
    """Write back and drop a file's pages from the page cache (so a benchmark or test starts cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding `path` (longest mount point prefix in /proc/self/mounts)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def _direct_works(fd: int) -> bool:
    probe = mmap.mmap(-1, PAGE)  # anonymous mappings are page aligned
    try:
        os.preadv(fd, [probe], 0)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def open_direct(path: str, flags: int, direct: bool = True, perm: int = 0o600) -> tuple[int, str]:
    """(fd, "direct" | "buffered"): `path` opened with O_DIRECT where its filesystem honours it (not a memory
    filesystem, not refused with EINVAL, a page read works), else plainly; FileNotFoundError is the caller's."""
    flags |= os.O_CLOEXEC
    if direct and fs_type(path) not in MEMORY_FS:
        try:
            fd = os.open(path, flags | os.O_DIRECT, perm)
        except FileNotFoundError:
            raise
        except OSError:                              # EINVAL: this filesystem refuses O_DIRECT
            fd = -1
        if fd >= 0 and _direct_works(fd):
            return fd, "direct"
        if fd >= 0:
            os.close(fd)
    return os.open(path, flags, perm), "buffered"


class ExpertReader:
    def __init__(self, path: str, arena: Arena, threads: int = 8, request_bytes: int = 4 << 20,
                 direct: bool | None = None, jitter: Jitter | None = None):  # fmt: skip
        """direct=None: O_DIRECT where the filesystem honours it; False forces buffered.
        jitter: test-only adversarial timing (default: from BETELGEUSE_TEST_READ_JITTER, normally unset)."""
        assert threads >= 1 and request_bytes >= PAGE and request_bytes % PAGE == 0, (threads, request_bytes)
        self.path, self.arena, self.request_bytes = path, arena, request_bytes
        self.fs = fs_type(path)
        try:
            self.fd, self.mode = open_direct(path, os.O_RDONLY, direct is not False)
        except FileNotFoundError:
            raise ModelFormatError(f"model file not found: {path}") from None
        if self.mode == "buffered":
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead into the cache
        self.file_size = os.fstat(self.fd).st_size
        self.stats = ReaderStats()
        self.on_read = None  # callable(seconds) after each finished piece, from its thread (a latency histogram)
        self._stats_lock = threading.Lock()
        self._in_flight = 0         # pieces inside preadv now (under _stats_lock) and since when one was (perf_counter)
        self._active_since = 0.0
        # the idle gaps (module doc): (start, end) monotonic seconds, and when the current one began (idle now)
        self._gaps: collections.deque = collections.deque(maxlen=GAP_LOG)
        self._idle_since = time.monotonic()
        self._q = _PieceQueue()
        self._seq = itertools.count()  # FIFO within a priority
        self.jitter = Jitter.from_env() if jitter is None else jitter  # test-only; None in production
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"bg-reader-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def read(self, ranges: list[tuple[int, int, int]], priority: int = 0, mark: list | None = None) -> cf.Future:
        """Read each (file_offset, nbytes, arena_dest) as its rounded-out 4 KiB range
        [floor(off), ceil(off + n)) to arena_dest (4 KiB aligned), so byte `off` lands at
        arena_dest + off % 4096. Bytes past EOF read as zero. The future resolves to None when
        every piece is done, or to the first OSError (then only after every piece already started has
        finished, so the destination is quiet when the future resolves), or to ReadCancelled (cancel(): no byte
        of it was read). mark: [taken, None] of the message that asked (the store's message log): the first piece's
        start (monotonic s) is written into mark[1] unless an earlier read of that message set it."""
        assert not self._closed, "reader is closed"
        assert priority in (0, 1), priority
        fut = ReadFuture()
        fut.set_running_or_notify_cancel()  # running: Future.cancel() returns False (bytes may be landing)
        pieces: list[_Piece] = []
        job = _Job(fut, 0, threading.Lock(), 0.0 if self.jitter is None else self.jitter.delay(), priority=priority,
                   queued_at=time.perf_counter(), mark=mark)
        fut.job = job
        payload = device = 0
        for off, n, dest in ranges:
            assert off >= 0 and n > 0 and dest % PAGE == 0, (off, n, dest)
            if off + n > self.file_size:
                raise ModelFormatError(f"{self.path}: range [{off}, {off + n}) is past the end of the file "
                                       f"({self.file_size} bytes); truncated?")  # fmt: skip
            lo, hi = off - off % PAGE, -(-(off + n) // PAGE) * PAGE
            assert dest + (hi - lo) <= self.arena.nbytes, (dest, hi - lo, self.arena.nbytes)
            for c in range(lo, hi, self.request_bytes):
                pieces.append(_Piece(job, c, min(self.request_bytes, hi - c), dest + (c - lo),
                                     0.0 if self.jitter is None else self.jitter.delay()))
            payload, device = payload + n, device + (hi - lo)
        job.pending, job.pieces, job.device_bytes = len(pieces), pieces, device
        self._q.put_many([(priority, next(self._seq), p) for p in pieces])
        with self._stats_lock:                     # after the put: not on the way to the first preadv
            self.stats.payload_bytes += payload
            self.stats.requests[priority] += 1
            self.stats.request_bytes[priority] += device
        if not pieces:
            fut.set_result(None)
        return fut

    def cancel(self, fut: cf.Future) -> bool:
        """Take back a read none of whose pieces has started -> True (its future resolves now to ReadCancelled, its
        callbacks run in this thread, and no byte of it will be read: the destination is free now); False when one
        has started (it finishes as any read does)."""
        job = getattr(fut, "job", None)
        if job is None:
            return False
        with job.lock:
            if job.started or job.cancelled or not job.pieces:
                return False
            job.cancelled = True
            for p in job.pieces:
                p.taken = True   # the queued entries are skipped when a thread pops them
        with self._stats_lock:
            self.stats.cancelled += 1
            self.stats.cancelled_bytes += job.device_bytes
        fut.set_exception(ReadCancelled("read cancelled before it started"))
        return True

    def promote(self, fut: cf.Future, mark: list | None = None) -> bool:
        """A read ahead a demand load now waits for: its pieces not yet taken go to the queue again at demand
        priority (their old entries are skipped), so it no longer waits behind the reads ahead queued before it ->
        whether any piece was still queued. mark: the load's (read()), where none of it has started."""
        job = getattr(fut, "job", None)
        if job is None:
            return False
        with job.lock:
            if job.priority == 0 or job.cancelled:
                return False
            job.priority, rest = 0, [p for p in job.pieces if not p.taken]
            if not job.started:
                job.queued_at = time.perf_counter()     # the demand's wait starts now
                job.mark = mark if mark is not None else job.mark
            self._q.put_many([(0, next(self._seq), p) for p in rest])
        if rest:
            with self._stats_lock:
                self.stats.promoted += 1
        return bool(rest)

    # -- worker threads ------------------------------------------------------------------------
    def _take(self, piece: _Piece) -> bool:
        """A popped queue entry -> whether to read it (not a promoted piece's second entry, not a cancelled job's)."""
        job = piece.job
        with job.lock:
            if piece.taken:
                return False
            piece.taken = True
            first, job.started, prio = not job.started, True, job.priority
        if first:
            if job.mark is not None and job.mark[1] is None:   # the message's first preadv (a racing thread: the
                job.mark[1] = time.monotonic()                 # same instant to within microseconds)
            with self._stats_lock:
                self.stats.started[prio] += 1
                self.stats.wait_seconds[prio] += time.perf_counter() - job.queued_at
        return True

    def read_first(self, mark: list) -> bool:
        """Read here, on the calling thread, the next queued piece if it is the first of the demand reads started by the
        message `mark` (read()'s) and no reader thread has it yet -> whether it did (its preadv done, its read's
        completion run here if it was the read's last piece). The store's session reader calls it once a load's
        reads are queued: a reader thread woken by the queue needs the GIL before its preadv, which it gets only once
        the session thread blocks, then a wake-up later (~25 µs on a 2-vCPU VM, a third of the store link:
        docs/benchmarks/cpu-store61); the session thread would block in its socket's recv next anyway."""
        entry = self._q.take_first(lambda e: e[0] == 0 and e[2] is not None and e[2].job.mark is mark
                                   and mark[1] is None)
        if entry is None:
            return False
        self._piece(entry[2])
        return True

    def _run(self) -> None:
        while True:
            _prio, _seq, piece = self._q.get()
            if piece is None:
                return
            self._piece(piece)

    def _piece(self, piece: _Piece) -> None:
        """A queued piece taken (by a reader thread, or read_first's): read it, and finish its read if it was the last."""
        if not self._take(piece):
            return
        job = piece.job
        err = None
        if job.error is None:  # skip the rest of a failed job
            if piece.delay:    # test-only: a slow disk, the bytes land late
                time.sleep(piece.delay)
            try:
                self._read_piece(piece)
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                err = e
        with job.lock:
            job.pending -= 1
            if err is not None and job.error is None:
                job.error = err
            last = job.pending == 0
        if last:
            if job.delay:
                t = threading.Timer(job.delay, self._finish, (job,))
                t.daemon = True
                t.start()
            else:
                self._finish(job)

    @staticmethod
    def _finish(job: _Job) -> None:
        if job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(None)

    def _read_piece(self, p: _Piece) -> None:
        buf = self.arena.view(p.dest, p.nbytes)
        want = min(p.nbytes, max(0, self.file_size - p.offset))  # what the file has; the rest is zero
        with self._stats_lock:
            if self._in_flight == 0:
                self._active_since = time.perf_counter()
                self._gaps.append((self._idle_since, time.monotonic()))
            self._in_flight += 1
        t0 = time.perf_counter()
        try:
            got, calls = self._preadv(p, buf, want)
        finally:
            with self._stats_lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.stats.active_seconds += time.perf_counter() - self._active_since
                    self._idle_since = time.monotonic()
        busy = time.perf_counter() - t0
        if got < p.nbytes:
            buf[got:] = bytes(p.nbytes - got)  # the rounded-up tail past EOF
        if self.mode == "buffered":
            os.posix_fadvise(self.fd, p.offset, p.nbytes, os.POSIX_FADV_DONTNEED)
        del buf
        with self._stats_lock:
            self.stats.bytes_read += got
            self.stats.reads += calls
            self.stats.busy_seconds += busy
        if self.on_read is not None:
            self.on_read(busy)

    def _preadv(self, p: _Piece, buf, want: int) -> tuple[int, int]:
        """The piece's bytes the file has into buf -> (bytes read, preadv calls)."""
        got = calls = 0
        while got < want:
            r = os.preadv(self.fd, [buf[got:]], p.offset + got)
            calls += 1
            if r == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {p.offset + got}")
            got += r
        return got, calls

    def active_seconds(self) -> float:
        """Wall seconds the disk had at least one read in flight, up to now (the open interval included)."""
        with self._stats_lock:
            open_s = time.perf_counter() - self._active_since if self._in_flight else 0.0
            return self.stats.active_seconds + open_s

    def idle_gaps(self, since: float) -> tuple[list[tuple[float, float]], bool]:
        """The disk's idle gaps (module doc) that end after `since` (monotonic seconds), oldest first, the current one
        to now if no read is in flight -> (gaps, complete): complete is False where the log lost some (GAP_LOG)."""
        with self._stats_lock:
            gaps = list(self._gaps)
            if not self._in_flight:
                gaps.append((self._idle_since, time.monotonic()))
        full = len(self._gaps) == self._gaps.maxlen
        out = [g for g in gaps if g[1] > since]
        return out, not (full and gaps and gaps[0][1] > since)

    def close(self) -> None:
        """Stop the threads after the pieces already queued; pending futures then resolve normally."""
        if self._closed:
            return
        self._closed = True
        self._q.put_many([(9, next(self._seq), None) for _ in self._threads])  # after every queued piece
        for t in self._threads:
            t.join()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "ExpertReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
