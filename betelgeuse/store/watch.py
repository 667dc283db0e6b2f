"""The model file as the store opened it, and whether it still is (the store must never serve torn weights).

    w = ModelWatch(path, data_offset)      # at open: identity (device, inode) + a digest
    w.check() -> None | "why the file cannot be served now"     # cheap when nothing changed: one stat, one fstat

The digest is SHA-256 over the GGUF header and tensor index (the file's first `data_offset` bytes, at most
HEADER_MAX) and SAMPLES pages spread evenly over the tensor data (~256 KiB read in all, dropped from the page cache
again: expert bytes come in only by the store's O_DIRECT reads). A check stats the path and the open descriptor;
only when (size, mtime, ctime) moved since the last check is the digest recomputed (ctime moves on every write and
cannot be set back, so an in-place overwrite is always seen, even one that restores the mtime). The verdict:
- the path names another file (replaced, renamed, removed): refused until it names the opened file again;
- the opened file's size or digest differs from the one at open: refused (torn or overwritten in place);
- size and digest equal again (the original put back in place, any mtime): served again.
The store checks every second and before each Load; a refusing store is NOT_SERVING and every call that would
read the file fails with the reason (the worker reports it: UNAVAILABLE / 503).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading

HEADER_MAX = 64 << 20          # bytes of header hashed at most (a GGUF header with a huge vocabulary is ~10 MiB)
SAMPLES = 64
SAMPLE_BYTES = mmap.PAGESIZE   # one page, page-aligned


class ModelWatch:
    __slots__ = ("path", "fd", "data_offset", "ino", "size", "digest", "seen", "torn", "why", "lock")

    def __init__(self, path: str, data_offset: int):
        self.path, self.data_offset = path, data_offset
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)     # no read-ahead around the sampled blocks
        st = os.fstat(self.fd)
        self.ino = (st.st_dev, st.st_ino)
        self.size = st.st_size
        self.seen = self._stamp(st)
        self.digest = self._digest(st.st_size)
        self.torn: str | None = None            # the opened file's content differs from the one at open
        self.why: str | None = None             # the last verdict: None = servable
        self.lock = threading.Lock()            # checks come from the store's RPC threads and its watch thread

    @staticmethod
    def _stamp(st) -> tuple[int, int, int]:
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def _digest(self, size: int) -> bytes:
        h = hashlib.sha256()
        h.update(os.pread(self.fd, min(self.data_offset, size, HEADER_MAX), 0))
        span = max(size - self.data_offset, 0)
        for i in range(SAMPLES if span else 0):
            off = (self.data_offset + span * i // SAMPLES) // SAMPLE_BYTES * SAMPLE_BYTES    # whole pages
            n = min(SAMPLE_BYTES, size - off)
            h.update(os.pread(self.fd, n, off))
            # the blocks are expert bytes, which only the store's O_DIRECT reads may bring in: leave no page cached
            # (DONTNEED drops whole pages only, hence the aligned blocks)
            os.posix_fadvise(self.fd, off, SAMPLE_BYTES, os.POSIX_FADV_DONTNEED)
        return h.digest()

    def stamp(self) -> tuple[int, int, int]:
        """The opened file's (size, mtime, ctime) now: one fstat."""
        return self._stamp(os.fstat(self.fd))

    def seen_stamp(self) -> tuple[int, int, int]:
        """The (size, mtime, ctime) the last check saw (no syscall): a stamp for unchanged() that vouches for no more
        than stamp()'s: unchanged() asks stamp == the last check's == now, so a write since that check fails the read
        either way, and one a check sees during the read fails it here too (a load's reads come right after its
        check: the ExpertStore's per-read fstat, ~3 µs of the store link, docs/benchmarks/cpu-store61)."""
        return self.seen

    def unchanged(self, stamp: tuple[int, int, int]) -> bool:
        """The file is servable, and was not written to since `stamp` (taken before a read) nor since the last
        check: bytes read in between are the ones the digest vouched for."""
        return self.why is None and stamp == self.seen == self.stamp()

    def check(self) -> str | None:
        """The current verdict (see the module doc): None, or why the file cannot be served now."""
        with self.lock:
            return self._check()

    def _check(self) -> str | None:
        st = os.fstat(self.fd)
        stamp = self._stamp(st)
        if stamp != self.seen:                  # the opened file was written to: compare its content again
            self.seen = stamp
            if st.st_size != self.size:
                self.torn = f"its size changed from {self.size} to {st.st_size} bytes"
            else:
                self.torn = None if self._digest(st.st_size) == self.digest else \
                    "it was modified in place (its header or tensor data differ)"
        try:
            p = os.stat(self.path)
            moved = None if (p.st_dev, p.st_ino) == self.ino else "the path now names another file"
        except OSError as e:
            moved = f"the path is gone ({e.strerror or e})"
        why = moved or self.torn
        self.why = None if why is None else (f"the model file {self.path} changed since the expert store opened it: "
                                             f"{why}; put the original back, or restart the service to serve the "
                                             "new file")
        return self.why

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
