"""The layout of the prefix cache's host tier: the memfd the store holds and the worker writes
(worker/prefix_host.py), and the store reads to save it to disk (store/prefix_disk.py). numpy only: the store never
imports torch.

    header  (4 KiB): magic u64, version u32, n_slots u32, slot_bytes u64, clock u64, geometry tag (16 bytes),
                     entry_bytes u32 (one entry's size: the store finds the slots without knowing the block)
    entries [n_slots] of (seq u64, stamp u64, digest 16 B, parent digest 16 B, n_tok i32, whole i32, tokens i32[block])
    slots   [n_slots] x slot_bytes, 4 KiB aligned (what a slot holds: worker/prefix_host.py)

Every tier's entries (worker/prefix_host.py's K/V blocks, worker/snapshot_host.py's snapshots) start with seq u64,
stamp u64, digest 16 B; the rest is the tier's. An entry is valid when its seq is even and n_tok > 0 (seq is odd
while its slot is being written; a formatted entry has seq 0, a written one an even seq >= 2).
"""

from __future__ import annotations

import numpy as np

from betelgeuse.store.layout import PAGE, round_up

MAGIC = int.from_bytes(b"BTLGPFX1", "little")
VERSION = 2
HEADER_BYTES = PAGE
HEADER_DTYPE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("n_slots", "<u4"), ("slot_bytes", "<u8"),
                         ("clock", "<u8"), ("tag", "V16"), ("entry_bytes", "<u4")])


def entry_dtype(block: int) -> np.dtype:
    # digests are raw 16 bytes (V16): numpy's S16 would drop a digest's trailing zero bytes when read back
    return np.dtype([("seq", "<u8"), ("stamp", "<u8"), ("digest", "V16"), ("pdigest", "V16"), ("n_tok", "<i4"),
                     ("whole", "<i4"), ("tokens", "<i4", (block,))])


def record_dtype(entry_bytes: int) -> np.dtype | None:
    """What the store reads of any tier's entry of `entry_bytes` bytes: seq, stamp, digest, then opaque bytes; None
    where no entry has that size."""
    if entry_bytes < 40 or entry_bytes % 4:
        return None
    return np.dtype([("seq", "<u8"), ("stamp", "<u8"), ("digest", "V16"), ("rest", f"V{entry_bytes - 32}")])


def written(ent: np.ndarray) -> np.ndarray:
    """bool [n]: the entries a worker finished writing (seq even and not 0), read from the fields every tier has."""
    return (ent["seq"] % 2 == 0) & (ent["seq"] > 0)


def fit(nbytes: int, slot_bytes: int, entry_bytes: int) -> tuple[int, int]:
    """(n_slots, offset of slot 0) of a region of `nbytes`: as many entries and slots as fit after the header."""
    n = max(0, (nbytes - HEADER_BYTES) // (slot_bytes + entry_bytes))
    while n and HEADER_BYTES + round_up(n * entry_bytes) + n * slot_bytes > nbytes:
        n -= 1
    return n, HEADER_BYTES + round_up(n * entry_bytes)


def valid(ent: np.ndarray) -> np.ndarray:
    """bool [n]: the entries that hold a whole block (even seq, a key)."""
    return (ent["seq"] % 2 == 0) & (ent["n_tok"] > 0)
