"""The slot directory: which tier and host slot holds each (layer, expert), in shared memory.

It lives at the start of the arena, so the worker reads it without a round trip to the store.
Only the store writes it. Layout (little endian, numpy structured arrays over the arena bytes):

    header  (64 bytes): magic u64, version u32, pass_active u32, epoch u64, store_pid i64,
                        n_layer i32, n_expert i32, host_per_layer i32, filling u32, reserved
    entries [n_layer, n_expert] of (tier i1, host_slot i4, generation u4), 12 bytes each

`epoch` is a sequence lock: the store makes it odd while it writes and even again after, so every
change bumps it by 2. A reader copies the entries between two equal, even reads of it (snapshot).
`filling` is 1 while a planned consolidation fills its slots (the worker keeps a decode's store pass open
until it is 0, then reopens it to apply the placement, without asking the store each token; a store that
never sets it reads as 0: the worker then asks at every token, as before).
`generation` of an entry is bumped whenever the bytes behind it may have changed (new host slot, or
rewritten in place), so the worker can tell that a slot it copied from was reused (invariant 5).
VRAM-tier experts keep a host backing slot (host_slot >= 0), so a restarted worker can refill VRAM
from host memory without touching the disk.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from betelgeuse.store.layout import DIRECTORY_ENTRY_BYTES, DIRECTORY_HEADER_BYTES, ArenaLayout, directory_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from betelgeuse.store.arena import Arena

TIER_DISK, TIER_HOST, TIER_VRAM = 0, 1, 2     # an entry's tier: where the expert's bytes are (the one definition)
TIER_NAMES = {TIER_VRAM: "vram", TIER_HOST: "host", TIER_DISK: "disk"}
MAGIC = int.from_bytes(b"BTLGSLOT", "little")
VERSION = 1

HEADER_DTYPE = np.dtype(
    [("magic", "<u8"), ("version", "<u4"), ("pass_active", "<u4"), ("epoch", "<u8"), ("store_pid", "<i8"),
     ("n_layer", "<i4"), ("n_expert", "<i4"), ("host_per_layer", "<i4"), ("filling", "<u4"),
     ("reserved", "<u1", (16,))]
)  # fmt: skip
ENTRY_DTYPE = np.dtype([("tier", "i1"), ("host_slot", "<i4"), ("generation", "<u4")], align=True)
assert HEADER_DTYPE.itemsize == DIRECTORY_HEADER_BYTES and ENTRY_DTYPE.itemsize == DIRECTORY_ENTRY_BYTES


class _HeaderFlag:
    """A u32 header field read as a bool: either process reads it, only the store (the writer) sets it."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name                      # the header field of the same name

    def __get__(self, d: SlotDirectory | None, owner: type | None = None) -> bool:
        return self if d is None else bool(d._hdr[self.name][0])

    def __set__(self, d: SlotDirectory, value: bool) -> None:
        assert d._writer, "only the store writes the directory"
        d._hdr[self.name] = 1 if value else 0


class SlotDirectory:
    __slots__ = ("layout", "_hdr", "_ent", "_tier", "_slot", "_gen", "_writer")

    def __init__(self, arena: "Arena", layout: ArenaLayout, create: bool):
        """create=True (the store): initialise every entry to disk tier, no slot, generation 0.
        create=False (the worker): attach to a directory the store wrote; checks that it matches."""
        self.layout = layout
        need = directory_nbytes(layout.n_layer, layout.n_expert)
        assert need <= layout.directory_bytes, (need, layout.directory_bytes)
        off = layout.directory_offset
        self._hdr = arena.numpy(off, HEADER_DTYPE.itemsize, dtype=HEADER_DTYPE)[0:1]
        ent = arena.numpy(off + HEADER_DTYPE.itemsize, need - HEADER_DTYPE.itemsize, dtype=ENTRY_DTYPE)
        self._ent = ent.reshape(layout.n_layer, layout.n_expert)
        # the fields as views [n_layer, n_expert] made once: set() runs per move of a consolidation (hundreds at
        # ds4-flash's shape, in the BeginPass the worker waits on: issue 21), and `_ent[name]` makes a view each time
        self._tier, self._slot, self._gen = self._ent["tier"], self._ent["host_slot"], self._ent["generation"]
        self._writer = create
        h = self._hdr[0]
        if create:
            self._ent["tier"] = TIER_DISK
            self._ent["host_slot"] = -1
            self._ent["generation"] = 0
            h["version"], h["pass_active"], h["epoch"] = VERSION, 0, 0
            h["store_pid"] = os.getpid()
            h["n_layer"], h["n_expert"], h["host_per_layer"] = layout.n_layer, layout.n_expert, layout.host_per_layer
            h["magic"] = MAGIC  # last: a directory with the magic set is fully initialised
        else:
            assert int(h["magic"]) == MAGIC and int(h["version"]) == VERSION, "arena holds no slot directory"
            shape = (int(h["n_layer"]), int(h["n_expert"]), int(h["host_per_layer"]))
            assert shape == (layout.n_layer, layout.n_expert, layout.host_per_layer), (shape, layout)

    # -- header ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._hdr["epoch"][0])

    @property
    def store_pid(self) -> int:
        return int(self._hdr["store_pid"][0])

    pass_active = _HeaderFlag()
    filling = _HeaderFlag()

    # -- reads (either process) --------------------------------------------------------------
    def lookup(self, layer: int, expert: int) -> tuple[int, int, int]:
        """(tier, host_slot, generation) of one expert. Consistent per entry only while no update
        runs; the store updates only between passes (invariant 5)."""
        return self._ent.item(layer, expert)          # ENTRY_DTYPE's fields in order, as ints (~0.3 µs, not ~1.5)

    def snapshot(self, timeout: float = 1.0) -> np.ndarray:
        """A consistent copy of the entries [n_layer, n_expert] (ENTRY_DTYPE), taken between updates."""
        deadline = time.monotonic() + timeout
        while True:
            e1 = self.epoch
            if e1 % 2 == 0:
                copy = self._ent.copy()
                if self.epoch == e1:
                    return copy
            assert time.monotonic() < deadline, "slot directory stayed mid-update (store stuck?)"
            time.sleep(0)  # yield to the writer

    def host_slots_of(self, layer: int) -> np.ndarray:
        """Experts of `layer` by host slot: out[i] = expert in host slot i, -1 if free. A copy."""
        out = np.full(self.layout.host_per_layer, -1, dtype=np.int32)
        slots = self._ent["host_slot"][layer]
        used = np.nonzero(slots >= 0)[0]
        out[slots[used]] = used
        return out

    # -- writes (store only) -----------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self):
        """Group several set() calls into one directory change (one epoch bump of 2)."""
        assert self._writer, "only the store writes the directory"
        assert self.epoch % 2 == 0, "nested directory batch"
        self._hdr["epoch"] += 1  # odd: readers retry
        try:
            yield self
        finally:
            self._hdr["epoch"] += 1

    def set(self, layer: int, expert: int, tier: int, host_slot: int, rewritten: bool = False) -> None:
        """Place an expert. Bumps its generation if its host slot changes (or `rewritten`: the same
        slot was refilled). Never while a pass runs (invariant 5)."""
        assert self._writer, "only the store writes the directory"
        assert not self.pass_active, "the slot directory is frozen while a pass runs"
        assert tier in (TIER_DISK, TIER_HOST, TIER_VRAM), tier
        # disk: no slot; host: a slot; VRAM: its backing slot, or none when the plan keeps no backing copies
        assert (tier != TIER_DISK or host_slot < 0) and (tier != TIER_HOST or host_slot >= 0), (tier, host_slot)
        assert host_slot < self.layout.host_per_layer, (host_slot, self.layout.host_per_layer)
        slots = self._slot
        if host_slot >= 0:  # one expert per slot
            held = slots[layer] == host_slot
            if held.any():
                holders = np.nonzero(held)[0]
                assert all(int(x) == expert for x in holders), f"layer {layer} slot {host_slot} held by {holders}"
        outer = self.epoch % 2 == 1  # inside batch()
        if not outer:
            self._hdr["epoch"] += 1
        if int(slots[layer, expert]) != host_slot or rewritten:
            self._gen[layer, expert] += np.uint32(1)
        self._tier[layer, expert] = tier
        slots[layer, expert] = host_slot
        if not outer:
            self._hdr["epoch"] += 1
