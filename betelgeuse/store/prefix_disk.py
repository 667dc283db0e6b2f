"""The prefix cache's host tier on disk: the store saves the tier's valid entries to one file ([store]
prefix_save_path) and, at its next start, copies them back into the new memfd before any worker attaches, so a
restart of the whole service (an upgrade, a reboot, a store crash after a save) keeps the cached prompts.

    disk = PrefixDisk(path, region, model_path)   # region: the store's prefix host tier (Arena)
    disk.load()                                   # at start: entries copied into the region -> how many
    disk.save(abort=lambda: busy())               # when idle and at shutdown: the entries changed since the last save

File (little endian; every part 4 KiB aligned so it is written and read with O_DIRECT, straight from and into the
memfd: the saves never fill the cgroup's page cache):

    header  (4 KiB): magic u64, version u32, n_slots u32, slot_bytes u64, entry_bytes u32, clock u64, region tag
                     (16 B), model identity (16 B), crc32 of the fields before it u32
    entries [n_slots]   the region's entry records as saved (store/prefix_region.py); odd seq = not (yet) saved
    crcs    [n_slots]   u32: crc32 of the slot's bytes, then of its record after seq and stamp
    slots   [n_slots] x slot_bytes, at the region's slot indices (the file is sparse where no entry was saved)

Consistency: the worker writes the region while the store saves it. An entry's seq is odd while the worker writes
it; a save reads seq, computes the crc and writes the slot, reads seq again, and records the entry only if seq was
even and did not move (else it tries again at the next save). Before slots are rewritten the file's table marks
them unsaved, and it is written again with the new records after them: a store killed mid-save leaves a file whose
records all describe the bytes beside them. A load checks every entry's crc.

The model identity (the file's path, size, mtime and its first 64 KiB) must match the model the store opened: a
different model never adopts a file, whatever its shapes. The region tag (the worker's geometry: layers, heads, block,
dtype, vocabulary) is copied back with the entries and the worker checks it when it attaches (worker/prefix_host.py):
another geometry formats the region anew. A region of another size takes the most recently used entries that fit.
A missing, foreign, corrupt or truncated file is logged and ignored (the tier starts empty), never an error.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

from betelgeuse.logs import event
from betelgeuse.store.arena import Arena
from betelgeuse.store.layout import PAGE, round_up
from betelgeuse.store.prefix_region import HEADER_BYTES, HEADER_DTYPE, MAGIC, VERSION, fit, record_dtype, written
from betelgeuse.store.reader import open_direct

log = logging.getLogger("betelgeuse.store")

FILE_MAGIC = int.from_bytes(b"BTLGPFD1", "little")
FILE_VERSION = 1
FILE_HEADER = np.dtype([("magic", "<u8"), ("version", "<u4"), ("n_slots", "<u4"), ("slot_bytes", "<u8"),
                        ("entry_bytes", "<u4"), ("clock", "<u8"), ("tag", "V16"), ("model", "V16"), ("crc", "<u4")])
CHUNK = 1 << 20                  # bytes per write: the unit a starting pass aborts at and the rate limit paces
RATE = 256 << 20                 # bytes/s an idle-time save writes at most (the disk reads experts at >= 1.4 GB/s)
IDENTITY_BYTES = 64 << 10        # of the model file's start (the GGUF header and the start of its metadata)


def model_identity(path: str) -> bytes:
    """16 bytes naming one model file as it is: its real path, size, mtime and first 64 KiB."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(IDENTITY_BYTES)
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((os.path.realpath(path), st.st_size, st.st_mtime_ns)).encode())
    h.update(head)
    return h.digest()


def _header_crc(h: np.ndarray) -> int:
    return zlib.crc32(h.tobytes()[:FILE_HEADER.fields["crc"][1]])


@dataclass(slots=True)
class Geometry:
    """A region's format as its header says (the file's too): the file's parts' offsets follow from it."""
    n_slots: int
    slot_bytes: int
    entry_bytes: int
    tag: bytes

    @property
    def table_bytes(self) -> int:
        return round_up(self.n_slots * self.entry_bytes)

    @property
    def crc_offset(self) -> int:
        return PAGE + self.table_bytes

    @property
    def slots_offset(self) -> int:
        return self.crc_offset + round_up(4 * self.n_slots)

    @property
    def file_bytes(self) -> int:
        return self.slots_offset + self.n_slots * self.slot_bytes


@dataclass(slots=True)
class PrefixDiskStats:
    loaded_entries: int = 0          # entries the last start copied back into the region
    load_note: str = ""              # why a file was ignored at start ("" = it was not, or there was none)
    file_entries: int = 0            # entries the file holds now (saved and not gone from the region since)
    saved_entries: int = 0           # entries written, in all (since start)
    saved_bytes: int = 0             # bytes written, in all (slots and tables)
    saves: int = 0                   # save rounds that wrote something
    aborted: int = 0                 # save rounds a starting pass (or shutdown) cut short
    skipped: int = 0                 # entries the worker rewrote while they were being saved (saved next time)
    errors: int = 0                  # save rounds that failed (the disk refused a write)
    last_save_unix: float = 0.0      # wall clock of the last round that wrote something (0 = none)


class PrefixDisk:
    def __init__(self, path: str, region: Arena, model_path: str):
        self.path, self.region = path, region
        self.model = model_identity(model_path)
        self.stats = PrefixDiskStats()
        self.fd = -1
        self.mode = ""                               # "direct" (O_DIRECT) | "buffered" (+ POSIX_FADV_DONTNEED)
        self.geom: Geometry | None = None            # the file's format; None: the file is to be (re)written whole
        self._buf: mmap.mmap | None = None           # page-aligned: the file's entries and crcs as on disk
        self.ent = self.crc = None
        self._header = mmap.mmap(-1, PAGE)

    # ---- the file ----------------------------------------------------------------------------------------------
    def _open(self, create: bool):
        if self.fd >= 0:
            return
        self.fd, self.mode = open_direct(self.path, os.O_RDWR | (os.O_CREAT if create else 0))

    def _write(self, buf, offset: int):
        n = os.pwrite(self.fd, buf, offset)
        assert n == len(buf), (n, len(buf))
        self.stats.saved_bytes += n
        if self.mode == "buffered":                  # keep the cgroup's page cache out of it (counted in its memory)
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def _read(self, buf, offset: int):
        n = os.preadv(self.fd, [buf], offset)
        if n != len(buf):
            raise EOFError(f"{n} of {len(buf)} bytes at {offset}")
        if self.mode == "buffered":
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def _tables(self, g: Geometry):
        """The page-aligned buffer of the file's entries and crcs, as numpy views."""
        self._buf = mmap.mmap(-1, g.slots_offset - PAGE)
        self.ent = np.frombuffer(self._buf, dtype=record_dtype(g.entry_bytes), count=g.n_slots)
        self.crc = np.frombuffer(self._buf, dtype="<u4", count=g.n_slots, offset=g.table_bytes)

    def _write_header(self, g: Geometry, clock: int):
        h = np.frombuffer(self._header, dtype=FILE_HEADER, count=1)
        h["magic"], h["version"], h["n_slots"], h["slot_bytes"] = FILE_MAGIC, FILE_VERSION, g.n_slots, g.slot_bytes
        h["entry_bytes"], h["clock"], h["tag"], h["model"] = g.entry_bytes, clock, g.tag, self.model
        h["crc"] = _header_crc(h)
        self._write(self._header, 0)

    def _reset(self, g: Geometry):
        """Start the file anew for the region's format: empty, then sized (sparse), its table zeros, the header
        last (a store killed meanwhile leaves a file a load ignores)."""
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, g.file_bytes)
        self._tables(g)
        self._write(self._buf, PAGE)
        self._write_header(g, 0)
        self.geom = g
        self.stats.file_entries = 0

    # ---- the region --------------------------------------------------------------------------------------------
    def _region(self) -> tuple[Geometry, np.ndarray, int] | None:
        """The region's format, its entries (a view) and the offset of its slot 0; None before a worker formatted
        it."""
        h = self.region.numpy(0, HEADER_DTYPE.itemsize, dtype=HEADER_DTYPE)[0]
        eb = int(h["entry_bytes"])
        if int(h["magic"]) != MAGIC or int(h["version"]) != VERSION or record_dtype(eb) is None or not h["n_slots"]:
            return None
        g = Geometry(int(h["n_slots"]), int(h["slot_bytes"]), eb, bytes(h["tag"]))
        n, base = fit(self.region.nbytes, g.slot_bytes, eb)
        assert n == g.n_slots, (n, g)
        ent = self.region.numpy(HEADER_BYTES, n * eb, dtype=record_dtype(eb))
        return g, ent, base

    @staticmethod
    def _crc(slot: np.ndarray, record: np.ndarray) -> int:
        return zlib.crc32(record.tobytes()[16:], zlib.crc32(slot))     # the record after seq and stamp

    # ---- save --------------------------------------------------------------------------------------------------
    def save(self, abort=None, rate: float | None = RATE) -> bool:
        """Write the region's entries that changed since the last save (most recently used first), `rate` bytes/s
        at most (None: at once). abort() true (a pass began) stops it between writes; the rest waits for the next
        save. -> True when the file holds the region as it was (nothing left to write)."""
        try:
            return self._save(abort or (lambda: False), rate)
        except OSError as e:
            self.stats.errors += 1
            if self.stats.errors == 1 or self.stats.errors % 100 == 0:
                event(log, "prefix_save", logging.WARNING, status="failed", path=self.path, error=str(e),
                      errors=self.stats.errors)
            self.geom = None                         # rewritten whole next time: what is on disk is not known
            return False

    def _save(self, abort, rate) -> bool:
        got = self._region()
        if got is None:
            return True
        g, ent, base = got
        self._open(create=True)
        if self.geom != g:
            self._reset(g)
        cur = ent.copy()
        fe = self.ent
        want, have = written(cur), written(fe)
        same = want & have & (cur["seq"] == fe["seq"]) & (cur["digest"] == fe["digest"])
        write = np.nonzero(want & ~same)[0]
        drop = have & ~same
        restamp = same & (cur["stamp"] != fe["stamp"])
        if not len(write) and not drop.any() and not restamp.any():
            return True
        t0 = time.monotonic()
        fe["stamp"][restamp] = cur["stamp"][restamp]
        if drop.any():                               # first: no record describes a slot about to be rewritten
            fe["seq"][drop] = 1
            self._write(self._buf, PAGE)
        sent, done = 0, True
        for i in write[np.argsort(-cur["stamp"][write], kind="stable")]:
            s1 = int(ent["seq"][i])
            if s1 % 2 or not s1:
                continue
            record = ent[i:i + 1].copy()
            slot = self.region.numpy(base + int(i) * g.slot_bytes, g.slot_bytes)
            crc = self._crc(slot, record)
            for off in range(0, g.slot_bytes, CHUNK):
                if abort():
                    done = False
                    break
                self._write(slot[off:off + CHUNK], g.slots_offset + int(i) * g.slot_bytes + off)
                sent += min(CHUNK, g.slot_bytes - off)
                if rate:
                    time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
            if not done:
                break
            if int(ent["seq"][i]) != s1:             # the worker rewrote it meanwhile: next time
                self.stats.skipped += 1
                done = False
                continue
            fe[i], self.crc[i] = record[0], crc
            self.stats.saved_entries += 1
        self._write(self._buf, PAGE)
        self._write_header(g, int(cur["stamp"].max(initial=0)))
        if self.mode == "direct":
            os.fdatasync(self.fd)                    # the file's size and blocks (O_DIRECT wrote the data itself)
        self.stats.file_entries = int(written(fe).sum())
        self.stats.saves += 1
        self.stats.aborted += not done and abort()
        self.stats.last_save_unix = time.time()
        event(log, "prefix_save", logging.DEBUG, path=self.path, entries=self.stats.file_entries, wrote=sent,
              ms=(time.monotonic() - t0) * 1e3, complete=done)
        return done

    # ---- load --------------------------------------------------------------------------------------------------
    def load(self) -> int:
        """Copy the file's valid entries into the region (before any worker attaches) -> how many. A file that
        cannot be used is logged and ignored: the region stays empty."""
        try:
            self._open(create=False)
        except FileNotFoundError:
            event(log, "prefix_load", path=self.path, status="no saved file", entries=0)
            return 0
        try:
            n = self._load()
        except Exception as e:                       # whatever the file holds, the store starts (with the tier empty)
            n, self.stats.load_note = 0, f"unreadable: {type(e).__name__}: {e}"
        if self.stats.load_note:
            self.region.numpy(0, PAGE)[:] = 0         # what a partial copy left: nothing a worker adopts
            self.geom = None
            event(log, "prefix_load", logging.WARNING, path=self.path, status="ignored", why=self.stats.load_note,
                  entries=0)
            return 0
        self.stats.loaded_entries = n
        event(log, "prefix_load", path=self.path, status="loaded", entries=n, mode=self.mode)
        return n

    def _load(self) -> int:
        size = os.fstat(self.fd).st_size
        if size < PAGE:
            self.stats.load_note = f"truncated ({size} bytes)"
            return 0
        self._read(self._header, 0)
        h = np.frombuffer(self._header, dtype=FILE_HEADER, count=1)
        if int(h["magic"][0]) != FILE_MAGIC or int(h["version"][0]) != FILE_VERSION or int(h["crc"][0]) != _header_crc(h):
            self.stats.load_note = "not a prefix cache file of this version (or its header is corrupt)"
            return 0
        if bytes(h["model"][0]) != self.model:
            self.stats.load_note = "saved for another model file (or this one changed)"
            return 0
        g = Geometry(int(h["n_slots"][0]), int(h["slot_bytes"][0]), int(h["entry_bytes"][0]), bytes(h["tag"][0]))
        if record_dtype(g.entry_bytes) is None or not g.n_slots or g.slot_bytes % PAGE or not g.slot_bytes:
            self.stats.load_note = f"impossible geometry {g}"
            return 0
        if size < g.file_bytes:
            self.stats.load_note = f"truncated ({size} of {g.file_bytes} bytes)"
            return 0
        self._tables(g)
        self._read(self._buf, PAGE)
        fe = self.ent
        ok = written(fe)
        n_new, base = fit(self.region.nbytes, g.slot_bytes, g.entry_bytes)
        src = np.nonzero(ok)[0]
        src = src[np.argsort(-fe["stamp"][src], kind="stable")][:n_new]
        same = n_new == g.n_slots                    # the same layout: each entry to its own slot, the file stays
        dst = src if same else np.arange(len(src))
        ent = self.region.numpy(HEADER_BYTES, n_new * g.entry_bytes, dtype=fe.dtype) if n_new else fe[:0]
        loaded, bad = 0, 0
        for i, j in zip(src.tolist(), dst.tolist()):
            slot = self.region.numpy(base + j * g.slot_bytes, g.slot_bytes)
            self._read(slot, g.slots_offset + i * g.slot_bytes)
            if self._crc(slot, fe[i:i + 1]) != int(self.crc[i]):
                bad += 1
                fe["seq"][i] = 1                     # the next save drops it from the file too
                continue
            ent[j] = fe[i]
            loaded += 1
        if bad:
            event(log, "prefix_load", logging.WARNING, path=self.path, status="corrupt entries dropped", entries=bad)
        hdr = self.region.numpy(0, HEADER_DTYPE.itemsize, dtype=HEADER_DTYPE)
        hdr["version"], hdr["n_slots"], hdr["slot_bytes"] = VERSION, n_new, g.slot_bytes
        hdr["clock"], hdr["tag"], hdr["entry_bytes"] = int(h["clock"][0]), g.tag, g.entry_bytes
        hdr["magic"] = MAGIC                         # last: formatted (the worker checks the tag when it attaches)
        # the file as it stands describes the region where the layout is the same; else it is written anew
        self.geom = g if same and not bad else None
        self.stats.file_entries = loaded if same else 0
        return loaded

    def status(self) -> dict:
        s = self.stats
        return {"prefix_save_path": self.path, "prefix_save_mode": self.mode, "prefix_loaded_entries": s.loaded_entries,
                "prefix_load_note": s.load_note, "prefix_file_entries": s.file_entries,
                "prefix_saved_entries": s.saved_entries, "prefix_saved_bytes": s.saved_bytes, "prefix_saves": s.saves,
                "prefix_save_aborted": s.aborted, "prefix_save_skipped": s.skipped, "prefix_save_errors": s.errors,
                "prefix_last_save_unix": s.last_save_unix}

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
