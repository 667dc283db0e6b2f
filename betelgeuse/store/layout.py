"""Where every byte lives in the arena.

    [ directory | host slots, layer-major: (layer 0: slot 0..H-1) (layer 1: ...) ... | staging slots ]

Every region and slot starts on a 4 KiB boundary. An expert is three byte ranges of the GGUF file
(gate, up, down). O_DIRECT wants 4 KiB-aligned file offsets, lengths and destinations, and GGUF
tensors are only 32-byte aligned, so part k is read as its rounded-out range
[floor4k(off), ceil4k(off + n)) into `slot + part_place(k)`, and its data then starts at
`slot + part_place(k) + off % 4096` (`SlotLayout.part_data`). A slot is the same size in every layer
(the largest expert of any layer), so any staging slot can hold any expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

PAGE = 4096
N_PARTS = 3  # gate, up, down (a fused gate_up tensor is two ranges of it; the caller splits it)


# the slot directory at the arena's start (store/directory.py): a 64-byte header and a 12-byte entry per expert
DIRECTORY_HEADER_BYTES = 64
DIRECTORY_ENTRY_BYTES = 12


def directory_nbytes(n_layer: int, n_expert: int) -> int:
    return DIRECTORY_HEADER_BYTES + n_layer * n_expert * DIRECTORY_ENTRY_BYTES


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


def round_down(n: int, align: int = PAGE) -> int:
    return n - n % align


class PartLike(Protocol):  # betelgeuse.gguf.reader.ExpertPart: (kind, offset, nbytes, qtype, shape)
    offset: int
    nbytes: int


@dataclass(slots=True, frozen=True)
class SlotLayout:
    slot_bytes: int  # multiple of 4096; holds any expert of any layer
    part_capacity: tuple[int, int, int]  # bytes reserved per part (gate, up, down), multiples of 4096

    def __post_init__(self):
        assert len(self.part_capacity) == N_PARTS, self.part_capacity
        assert all(c > 0 and c % PAGE == 0 for c in self.part_capacity), self.part_capacity
        assert self.slot_bytes % PAGE == 0 and self.slot_bytes >= sum(self.part_capacity), self

    @classmethod
    def for_parts(cls, part_nbytes_max: tuple[int, int, int]) -> "SlotLayout":
        """Capacity per part = round_up(nbytes + 4095, 4096): the rounded-out range of n bytes at
        any intra-page offset r <= 4095 spans ceil((r + n) / 4096) pages, at most that."""
        assert len(part_nbytes_max) == N_PARTS and all(n > 0 for n in part_nbytes_max), part_nbytes_max
        cap = tuple(round_up(n + PAGE - 1) for n in part_nbytes_max)
        return cls(slot_bytes=sum(cap), part_capacity=cap)  # type: ignore[arg-type]

    @classmethod
    def for_experts(cls, experts: Iterable[tuple[PartLike, PartLike, PartLike]]) -> "SlotLayout":
        """The layout for the largest part of each kind over all given experts (e.g. expert 0 of
        every layer: experts of one layer share a size, layers may differ in quant type)."""
        mx = [0, 0, 0]
        for parts in experts:
            assert len(parts) == N_PARTS, parts
            for k, p in enumerate(parts):
                mx[k] = max(mx[k], p.nbytes)
        return cls.for_parts((mx[0], mx[1], mx[2]))

    def part_place(self, k: int) -> int:
        """Offset of part k inside a slot (4 KiB aligned)."""
        assert 0 <= k < N_PARTS, k
        return sum(self.part_capacity[:k])

    def part_data(self, k: int, file_offset: int) -> int:
        """Offset inside the slot of the first payload byte of part k read from `file_offset`."""
        return self.part_place(k) + file_offset % PAGE

    def read_ranges(self, parts: Iterable[PartLike], slot_offset: int) -> list[tuple[int, int, int]]:
        """(file_offset, nbytes, arena_dest) per part, for ExpertReader.read into the slot at
        arena offset `slot_offset`. Asserts that each rounded-out range fits its capacity."""
        assert slot_offset % PAGE == 0, slot_offset
        out = []
        for k, p in enumerate(parts):
            span = round_up(p.offset + p.nbytes) - round_down(p.offset)
            assert span <= self.part_capacity[k], f"part {k}: {span} bytes > capacity {self.part_capacity[k]}"
            out.append((p.offset, p.nbytes, slot_offset + self.part_place(k)))
        assert len(out) == N_PARTS, out
        return out


@dataclass(slots=True, frozen=True)
class ArenaLayout:
    n_layer: int
    n_expert: int
    host_per_layer: int  # resident host slots per layer (VRAM-tier experts keep one here too)
    n_staging: int  # shared slots for disk reads in flight / waiting to be copied
    slot: SlotLayout
    directory_offset: int = 0  # the directory lives at the start of the arena
    directory_bytes: int = 0  # 0 = computed from the directory's size (see __post_init__)
    engram_bytes: int = 0  # the Engram rows' region after the staging slots (store/engram.py), 0 = none

    def __post_init__(self):
        assert self.n_layer > 0 and self.n_expert > 0, self
        assert 0 <= self.host_per_layer <= self.n_expert and self.n_staging >= 0, self
        if self.directory_bytes == 0:
            object.__setattr__(self, "directory_bytes", round_up(directory_nbytes(self.n_layer, self.n_expert)))
        assert self.directory_offset == 0 and self.directory_bytes % PAGE == 0, self

    @property
    def host_base(self) -> int:
        return self.directory_offset + self.directory_bytes

    @property
    def staging_base(self) -> int:
        return self.host_base + self.n_layer * self.host_per_layer * self.slot.slot_bytes

    @property
    def engram_base(self) -> int:
        return self.staging_base + self.n_staging * self.slot.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.engram_base + round_up(self.engram_bytes)

    def host_slot_offset(self, layer: int, i: int) -> int:
        """Arena offset of host slot i (0 <= i < host_per_layer) of `layer`."""
        assert 0 <= layer < self.n_layer and 0 <= i < self.host_per_layer, (layer, i)
        return self.host_base + (layer * self.host_per_layer + i) * self.slot.slot_bytes

    def staging_slot_offset(self, i: int) -> int:
        assert 0 <= i < self.n_staging, i
        return self.staging_base + i * self.slot.slot_bytes

    def to_dict(self) -> dict:
        """JSON-able, for the header sent with the arena fd; from_dict(to_dict()) == self."""
        return {
            "n_layer": self.n_layer, "n_expert": self.n_expert, "host_per_layer": self.host_per_layer,
            "n_staging": self.n_staging, "slot_bytes": self.slot.slot_bytes,
            "part_capacity": list(self.slot.part_capacity), "directory_bytes": self.directory_bytes,
            "engram_bytes": self.engram_bytes,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> "ArenaLayout":
        slot = SlotLayout(slot_bytes=d["slot_bytes"], part_capacity=tuple(d["part_capacity"]))
        return cls(d["n_layer"], d["n_expert"], d["host_per_layer"], d["n_staging"], slot,
                   directory_bytes=d["directory_bytes"], engram_bytes=d.get("engram_bytes", 0))  # fmt: skip
