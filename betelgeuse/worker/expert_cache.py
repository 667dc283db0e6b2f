"""The worker's side of the expert tiers: VRAM hot slots, the execution ring, and dequantization.

Expert bytes stay quantized everywhere (disk, host slot, staging slot, VRAM slot, ring buffer); they are
dequantized on the compute device right before use, so where an expert came from cannot change its
values (invariant 1).

  arena (host, shared with the store; registered as pinned on CUDA)
     │ copy stream: host slot / staging slot ──► ring[i]          (non_blocking, event ring_ready[i])
     ▼
  ring [ring_slots, slot_bytes] uint8 on device   ──► dequantize ──► expert FFN on the compute stream
  vram [n_layer, n_vram, slot_bytes] uint8 on device  (hot experts, computed in place)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from betelgeuse.gguf.quants import dequantize, dequantize_q8_0_parts
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned
from betelgeuse.store.plan import SlotPlan

TIER_DISK, TIER_HOST, TIER_VRAM = 0, 1, 2


@dataclass(slots=True)
class PartMeta:
    start: int              # byte offset of the part's data inside a slot
    nbytes: int
    qtype: int
    shape: tuple[int, int]


class ExpertCache:
    def __init__(self, plan: SlotPlan, arena: Arena, model: GGUFModelFile, device: torch.device, dtype: torch.dtype,
                 ring_slots: int):
        self.plan, self.arena, self.device, self.dtype = plan, arena, device, dtype
        self.layout = plan.layout
        self.is_cuda = device.type == "cuda"
        sb = self.layout.slot.slot_bytes
        # where each part of each expert sits inside a slot: 4 KiB-aligned place + the file offset's page remainder
        self.parts = [[tuple(PartMeta(self.layout.slot.part_place(k) + p.offset % 4096, p.nbytes, p.qtype, tuple(p.shape))
                             for k, p in enumerate(model.expert_parts(l, e)))
                       for e in range(plan.n_expert)] for l in range(plan.n_layer)]
        # fused dequantization where an expert's three parts are Q8_0 of one size: their byte offsets in a
        # slot, [n_layer, n_expert, 3] on the device, so one gather serves all three (see dequantize_q8_0_parts)
        self.fused = [all(m.qtype == GGMLQuantizationType.Q8_0 and m.shape[0] * m.shape[1] == ps[0].shape[0] * ps[0].shape[1]
                          for ps in layer for m in ps) for layer in self.parts]
        self.starts = torch.tensor([[[m.start for m in ps] for ps in layer] for layer in self.parts],
                                   dtype=torch.int64, device=device)
        self.host = arena.torch(0, arena.nbytes)                  # uint8 [arena bytes], zero copy
        self.pinned = register_pinned(arena) if self.is_cuda else False
        self.vram = torch.empty((plan.n_layer, max(plan.n_vram, 1), sb), dtype=torch.uint8, device=device)
        # which expert each VRAM slot holds: (expert, host_slot, generation); -1 = empty
        self.vram_owner = np.full((plan.n_layer, max(plan.n_vram, 1), 3), -1, dtype=np.int64)
        self.vram_index = np.full((plan.n_layer, plan.n_expert), -1, dtype=np.int64)   # expert -> VRAM slot
        self.ring = torch.empty((ring_slots, sb), dtype=torch.uint8, device=device)
        self.n_ring = ring_slots
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        # per ring buffer: its copy landed / the compute that used it is enqueued
        self._ring_ready = [torch.cuda.Event() for _ in range(ring_slots)] if self.is_cuda else []
        self._ring_free = [torch.cuda.Event() for _ in range(ring_slots)] if self.is_cuda else []
        self._next = 0
        self.h2d_bytes = 0
        self.copy_seconds = 0.0    # CPU path: time spent copying

    # ---- host views -------------------------------------------------------------------------
    def host_slot(self, layer: int, i: int) -> torch.Tensor:
        off = self.layout.host_slot_offset(layer, i)
        return self.host[off: off + self.layout.slot.slot_bytes]

    def staging_slot(self, i: int) -> torch.Tensor:
        off = self.layout.staging_slot_offset(i)
        return self.host[off: off + self.layout.slot.slot_bytes]

    # ---- VRAM hot slots ---------------------------------------------------------------------
    def sync_vram(self, snap: np.ndarray) -> tuple[int, list[tuple[int, int, int]]]:
        """Make the VRAM slots hold exactly the VRAM-tier experts of the directory snapshot. Experts with a
        host backing slot are copied from it here; returns (copied, [(layer, expert, vram slot)] of the
        VRAM-tier experts without a backing copy, which the caller must load through the store)."""
        copied, missing = 0, []
        tiers, hslots, gens = snap["tier"], snap["host_slot"], snap["generation"]
        for l in range(self.plan.n_layer):
            want = np.nonzero(tiers[l] == TIER_VRAM)[0]
            assert len(want) <= self.plan.n_vram, (l, len(want), self.plan.n_vram)
            keep = set()
            for j in range(self.plan.n_vram):
                e, hs, g = self.vram_owner[l, j]
                if e >= 0 and tiers[l, e] == TIER_VRAM and hslots[l, e] == hs and gens[l, e] == g:
                    keep.add(int(e))
                elif e >= 0:
                    self.vram_owner[l, j] = -1
                    self.vram_index[l, e] = -1
            free = [j for j in range(self.plan.n_vram) if self.vram_owner[l, j, 0] < 0]
            for e in want:
                if int(e) in keep:
                    continue
                j = free.pop(0)
                if hslots[l, e] < 0:
                    missing.append((l, int(e), j))
                    continue
                src = self.host_slot(l, int(hslots[l, e]))
                self.vram[l, j].copy_(src, non_blocking=self.pinned)
                self.h2d_bytes += src.numel()
                self.vram_owner[l, j] = (e, hslots[l, e], gens[l, e])
                self.vram_index[l, e] = j
                copied += 1
        if self.is_cuda and copied:
            torch.cuda.current_stream(self.device).synchronize()
        return copied, missing

    def fill_vram(self, layer: int, expert: int, j: int, src: torch.Tensor, snap: np.ndarray):
        """Put an expert without a host backing copy into VRAM slot j (src: its staging slot)."""
        self.vram[layer, j].copy_(src, non_blocking=self.pinned)
        self.h2d_bytes += src.numel()
        self.vram_owner[layer, j] = (expert, snap["host_slot"][layer, expert], snap["generation"][layer, expert])
        self.vram_index[layer, expert] = j

    # ---- the execution ring -------------------------------------------------------------------
    def to_ring(self, src: torch.Tensor, timing: list | None = None) -> int:
        """Start copying one slot into the next ring buffer on the copy stream; the compute stream waits
        for it. The caller keeps at most ring_slots - 1 copies ahead of its computes (the copy into
        ring[i] waits, on the GPU, for the compute recorded by ring_release(i) on its last occupant).
        `timing` collects (start, end) CUDA events of this copy."""
        i = self._next
        self._next = (i + 1) % self.n_ring
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self._ring_free[i])     # the expert that used ring[i] is computed
                if timing is not None:
                    ev0 = torch.cuda.Event(enable_timing=True)
                    ev0.record(self.copy_stream)
                self.ring[i].copy_(src, non_blocking=True)
                self._ring_ready[i].record(self.copy_stream)
                if timing is not None:
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev1.record(self.copy_stream)
                    timing.append((ev0, ev1))
            torch.cuda.current_stream(self.device).wait_event(self._ring_ready[i])
        else:
            t = time.perf_counter()
            self.ring[i].copy_(src)
            dt = time.perf_counter() - t
            self.copy_seconds += dt
            if timing is not None:
                timing.append(dt * 1e3)
        self.h2d_bytes += src.numel()
        return i

    def ring_ready_event(self, i: int):
        return self._ring_ready[i] if self.is_cuda else None

    def ring_release(self, i: int):
        """Record that compute on ring[i] is enqueued; the next copy into it waits for this point."""
        if self.is_cuda:
            self._ring_free[i].record(torch.cuda.current_stream(self.device))

    # ---- dequantization -----------------------------------------------------------------------
    def weights(self, slot: torch.Tensor, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F,H], up [F,H], down [H,F]) in the compute dtype, from a slot's raw bytes on the device."""
        ps = self.parts[layer][expert]
        if self.fused[layer]:
            g, u, d = ps
            out = dequantize_q8_0_parts(slot, self.starts[layer, expert], g.shape[0] * g.shape[1] // 32, self.dtype)
            return out[0].view(g.shape), out[1].view(u.shape), out[2].view(d.shape)
        return tuple(dequantize(slot[m.start: m.start + m.nbytes], m.qtype, m.shape, self.dtype)
                     for m in self.parts[layer][expert])

    def vram_slot(self, layer: int, expert: int) -> torch.Tensor:
        j = self.vram_index[layer, expert]
        assert j >= 0, (layer, expert)
        return self.vram[layer, j]

    def close(self):
        """Unregister and unmap this process's view of the arena (a re-attach maps the new store's arena;
        the old memfd must not stay charged to the cgroup beside it)."""
        if self.pinned:
            unregister_pinned(self.arena)
            self.pinned = False
        self.host = None
        self.arena.close()
