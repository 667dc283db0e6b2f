"""The worker's side of the expert tiers: VRAM hot slots, the execution ring, and the slot tables.

Expert bytes stay quantized everywhere (disk, host slot, staging slot, VRAM slot, ring buffer); they are
dequantized on the compute device inside the expert kernels, so where an expert came from cannot change
its values (invariant 1).

  arena (host, shared with the store; registered as pinned on CUDA)
     │ copy stream: a batch of host / staging slots ──► ring bank b   (non_blocking, event bank_ready[b])
     ▼
  pool uint8 on device = [ vram: n_layer x n_vram slots | ring: 2 banks x bank_size slots ]
     ▲ kernels address an expert by its byte offset in the pool: vram_base_dev[layer, expert] for the
       VRAM tier (uploaded when the directory changes), one table per ring batch otherwise

A layer's VRAM slots may hold their parts in another layout than GGUF order (set_layouts: the one "VRAM layout"
hook), relaid on the device as each slot fills (_own), their offsets flagged by bit 0, which the layer's kernels read
per expert: PACKED (engine.pack_experts) kernels/mma_pack's layout for gluon_mmq's PK 2, TILED (engine.tile_experts)
kernels/tile_layout's 64-row tiles for triton_moe's float kernels (`tiled`). Every other slot (host, staging, ring,
flex) stays GGUF order; nothing copies a VRAM slot's bytes out (eviction drops them). The same values either way
(invariant 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from betelgeuse.gguf.quants import dequantize, dequantize_q8_0_parts
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.kernels import mma_pack, tile_layout
from betelgeuse.kernels.streams import current_stream
from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned
from betelgeuse.store.directory import TIER_VRAM
from betelgeuse.store.plan import SlotPlan

# a layer's VRAM slots' layout (ExpertCache.set_layouts): GGUF order, mma_pack's (engine.pack_experts), tile_layout's
# (engine.tile_experts)
GGUF, PACKED, TILED = 0, 1, 2


class StreamPoint:
    """A point of the compute stream: the work queued on it when ExpertCache.mark() made it (a decode miss layer's
    direct flex copies, an at-hand table upload), with a CUDA event's query() / synchronize(), but recorded as no
    event (issue 21, cpu-host60: an event's record and its stream lookup, then its synchronize at the next store
    message, 3 torch calls a decode miss layer). It is done once the host has synchronized on an event recorded on
    the compute stream after it: decode's routing sync (moe_step.RoutingSync.finish, every partial layer) names how
    many points were made before its event (ExpertCache.pass_points); the next layer's finish thus passes a miss
    layer's points long before its staging slots go back with the next message. A point not passed yet: query()
    False (nothing asked of the device), synchronize() waits for the whole device (every stream: whichever is current
    at the call), and with it every point made so far (longer than an event of its own would have waited: never
    shorter; the rare case: a miss layer's slots asked back before any later layer synced, an early flush's)."""

    __slots__ = ("cache", "n")

    def __init__(self, cache: "ExpertCache", n: int):
        self.cache, self.n = cache, n

    def query(self) -> bool:
        return self.n <= self.cache.passed

    def synchronize(self):
        c = self.cache
        if self.n > c.passed:
            n = c.points                          # every point made so far: queued before the wait below
            torch.cuda.synchronize(c._index)
            c.pass_points(n)


@dataclass(slots=True)
class PartMeta:
    start: int              # byte offset of the part's data inside a slot
    nbytes: int
    qtype: int
    shape: tuple[int, int]


class ExpertCache:
    def __init__(self, plan: SlotPlan, arena: Arena, model: GGUFModelFile, device: torch.device, dtype: torch.dtype,
                 ring_slots: int, flush_groups: int = 0, stream_points: bool = False):
        """flush_groups: per layer, the groups engine.disk_flush_early may add to a pass beyond its bank batches (at
        most one per disk expert: MoEStep._disk_groups), counted into the slot tables' rows (n_tables).
        stream_points (engine.stream_points): mark() makes a StreamPoint (no CUDA call) instead of recording one of
        a ring of CUDA events."""
        self.plan, self.arena, self.device, self.dtype = plan, arena, device, dtype
        self.layout = plan.layout
        self.is_cuda = device.type == "cuda"
        L, E, V = plan.n_layer, plan.n_expert, plan.n_vram
        self.slot_bytes = sb = self.layout.slot.slot_bytes
        # where each part of each expert sits inside a slot: 4 KiB-aligned place + the file offset's page remainder
        self.parts = [[tuple(PartMeta(self.layout.slot.part_place(k) + p.offset % 4096, p.nbytes, p.qtype, tuple(p.shape))
                             for k, p in enumerate(model.expert_parts(l, e)))
                       for e in range(E)] for l in range(L)]
        # fused dequantization where an expert's three parts are Q8_0 of one size: their byte offsets in a
        # slot, [n_layer, n_expert, 3] on the device, so one gather serves all three (see dequantize_q8_0_parts)
        self.fused = [all(m.qtype == GGMLQuantizationType.Q8_0 and m.shape[0] * m.shape[1] == ps[0].shape[0] * ps[0].shape[1]
                          for ps in layer for m in ps) for layer in self.parts]
        self.starts = torch.tensor([[[m.start for m in ps] for ps in layer] for layer in self.parts],
                                   dtype=torch.int64, device=device)
        # (gate/up, down) GGML type per layer: what the batched kernels dispatch on
        self.qtypes = [(layer[0][0].qtype, layer[0][2].qtype) for layer in self.parts]
        self.host = arena.torch(0, arena.nbytes)                  # uint8 [arena bytes], zero copy
        self.pinned = register_pinned(arena) if self.is_cuda else False
        # ONE device pool: [L*V VRAM hot slots | ring_slots execution ring], so a kernel addresses any
        # resident or in-flight expert by a byte offset (the device-side slot tables below)
        self.n_ring = ring_slots
        self.pool = torch.empty(((L * V + ring_slots) * sb,), dtype=torch.uint8, device=device)
        self.vram = self.pool[: L * V * sb].view(L, V, sb)
        self.ring = self.pool[L * V * sb:].view(ring_slots, sb)
        self.ring_offset = L * V * sb
        # the pool's address, read once: the pool is never reallocated (a re-attach makes a new cache), and the decode
        # step's direct groups and at-hand patches read it every miss layer (a torch call each: issue 21)
        self.pool_addr = self.pool.data_ptr()
        self._ring_slots = list(self.ring.unbind(0)) if ring_slots else []   # ring[i] made once, not per copy
        # which expert each VRAM slot holds: (expert, host_slot, generation); -1 = empty
        self.vram_owner = np.full((L, max(V, 1), 3), -1, dtype=np.int64)
        self.vram_index = np.full((L, E), -1, dtype=np.int64)     # expert -> VRAM slot
        # expert -> byte offset of its VRAM slot in the pool (-1 = not in VRAM), host copy and device copy
        self.vram_base = np.full((L, E), -1, dtype=np.int64)
        self.vram_base_dev = torch.full((L, E), -1, dtype=torch.int64, device=device)
        self.all_vram = np.zeros(L, dtype=bool)                    # every expert of the layer is in VRAM
        self.vram_version = 0                                       # bumped at every upload of the VRAM table
        self._synced_epoch = None                                   # directory epoch the VRAM slots match
        self.fill_wait_s = 0.0                                      # the last sync_vram's wait for its copies
        # the ring as two banks: a batch of experts is copied into one bank while the other computes
        self.bank_size = max(1, ring_slots // 2)
        self.n_banks = max(1, ring_slots // self.bank_size)
        self._bank = 0
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        # the compute stream is the current stream of the pool's device (kernels/streams.py: no per-call device
        # lookup). Its index read from the pool: the engine's device is "cuda", no index, and current_stream(None)
        # asked torch.cuda.current_device() at every lookup (mark, bank_done, bank_copy: a Python call and a torch
        # call each, a decode miss layer's few; issue 21, cpu-host60), the device the pool was allocated on
        self._index = self.pool.device.index if self.is_cuda else None
        self._copy_index = self.copy_stream.device_index if self.is_cuda else None
        # per bank: its copies landed / the computes that read it are enqueued
        self._bank_ready = [torch.cuda.Event() for _ in range(self.n_banks)] if self.is_cuda else []
        self._bank_free = [torch.cuda.Event() for _ in range(self.n_banks)] if self.is_cuda else []
        # compute-stream points (mark: StreamPoint): after a decode miss layer's direct flex copies (MoEStep.
        # _direct_group), for their staging slots' release, and after an at-hand table's upload, for its buffer's
        # reuse. points: made so far; passed: of them, known done (pass_points)
        self.points = self.passed = 0
        # off (engine.stream_points): mark() records a CUDA event of this ring instead (reused in turn: a re-recorded
        # event is a later point, so a release it gates only waits longer; the session synchronizes at every message,
        # long before a reuse)
        self.stream_points = stream_points
        self._marks = [torch.cuda.Event() for _ in range(8)] if self.is_cuda and not stream_points else []
        self._mark_at = 0
        # per-batch slot tables (pool offsets) for ring groups: a pinned host row per batch of a pass, copied to
        # the device on the compute stream (so a row is never rewritten before its copy ran: one pass's rows
        # are distinct, and a pass ends with a sync); a layer may also take one per flex cache chunk (at most
        # max_running of them: worker/flex_cache.py), and with early disk flushes (flush_groups) a group per disk expert
        self.n_tables = L * (-(-E // self.bank_size) + 2 + plan.max_running + flush_groups) + 4
        self.tables_host = torch.full((self.n_tables, E), -1, dtype=torch.int64, pin_memory=self.is_cuda)
        self.tables_dev = torch.full((self.n_tables, E), -1, dtype=torch.int64, device=device)
        self._tables_np = self.tables_host.numpy()   # the same memory
        self._table_rows: list = [None] * self.n_tables   # (host row, device row) views, made at a row's first use
        self._table_src: dict = {}                   # id(device row) -> its host row (bank_copy's table=)
        self._table = 0
        # arena views of host slots, made at their first use: a decode miss layer takes a few, and a tensor view
        # (with the layout's offset arithmetic) costs more than the dict lookup; of the staging slots (a few dozen),
        # made here: a landed expert's is an index into the list (MoEStep._disk_groups: no call a landed expert)
        self._host_views: dict = {}
        self.staging_views: list[torch.Tensor] = [
            self.host[o: o + self.slot_bytes]
            for o in (self.layout.staging_slot_offset(i) for i in range(self.layout.n_staging))]
        self.h2d_bytes = 0
        self.copy_seconds = 0.0    # CPU path: time spent copying
        # engine.pack_experts / tile_experts (set_layouts): per layer, the layout its VRAM slots hold their parts in
        # (GGUF, PACKED, TILED; None: every slot GGUF order); the relayout's slot-sized scratch and mma_pack's tile
        # index per (K, type code) on the device (the plan counts both: store/plan.py relayout_bytes)
        self.layouts: np.ndarray | None = None
        self._scratch: torch.Tensor | None = None
        self._pack_index: dict[tuple[int, int], torch.Tensor] = {}

    # ---- host views -------------------------------------------------------------------------
    def host_slot(self, layer: int, i: int) -> torch.Tensor:
        v = self._host_views.get((layer, i))
        if v is None:
            off = self.layout.host_slot_offset(layer, i)          # asserts the range
            v = self._host_views[layer, i] = self.host[off: off + self.slot_bytes]
        return v

    def staging_slot(self, i: int) -> torch.Tensor:
        assert 0 <= i < len(self.staging_views), i                # the layout's range
        return self.staging_views[i]

    # ---- VRAM hot slots ---------------------------------------------------------------------
    def sync_vram(self, snap: np.ndarray, epoch: int | None = None) -> tuple[int, list[tuple[int, int, int]]]:
        """Make the VRAM slots hold exactly the VRAM-tier experts of the directory snapshot. Experts with a
        host backing slot are copied from it here; returns (copied, [(layer, expert, vram slot)] of the
        VRAM-tier experts without a backing copy, which the caller must load through the store).
        Nothing to do (no Python loop) when the directory epoch is the one already synced."""
        self.fill_wait_s = 0.0                 # blocked on the copy engine (the runner counts it as blocked)
        if epoch is not None and epoch == self._synced_epoch:
            return 0, []
        copied, missing = 0, []
        for l in range(self.plan.n_layer):
            copied += self._sync_layer(l, snap, missing)
        self._wait_copies(copied)
        self._synced_epoch = epoch if not missing else None
        self._upload_vram_table()
        return copied, missing

    def _sync_layer(self, l: int, snap: np.ndarray, missing: list[tuple[int, int, int]]) -> int:
        """Layer l's VRAM slots = its VRAM-tier experts of the snapshot: copies from host backing slots (enqueued),
        experts without a backing copy appended to `missing` as (layer, expert, vram slot) -> experts copied."""
        tiers, hslots = snap["tier"], snap["host_slot"]
        V = self.plan.n_vram
        copied = 0
        want = np.nonzero(tiers[l] == TIER_VRAM)[0]
        assert len(want) <= V, (l, len(want), V)
        keep = set()
        for j in range(V):
            e = int(self.vram_owner[l, j, 0])
            # an expert's bytes never change (they are the file's): a VRAM copy stays valid while the
            # expert stays VRAM-tier, whatever happens to its host backing slot
            if e >= 0 and tiers[l, e] == TIER_VRAM:
                keep.add(e)
            elif e >= 0:
                self.vram_owner[l, j] = -1
                self.vram_index[l, e] = -1
                self.vram_base[l, e] = -1
        free = [j for j in range(V) if self.vram_owner[l, j, 0] < 0]
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
            self._own(l, int(e), j, snap)
            copied += 1
        return copied

    def unsynced_layers(self, snap: np.ndarray, epoch: int) -> list[int]:
        """The layers whose VRAM slots do not hold exactly their VRAM-tier experts of the snapshot (none when
        `epoch` is the one already synced)."""
        if epoch == self._synced_epoch:
            return []
        differ = (snap["tier"] == TIER_VRAM) != (self.vram_index >= 0)        # [n_layer, n_expert]
        return [int(l) for l in np.nonzero(differ.any(axis=1))[0]]

    def sync_vram_layer(self, l: int, snap: np.ndarray) -> tuple[int, list[tuple[int, int, int]]]:
        """sync_vram for layer l alone (idle settling: one layer a step) -> (copied, missing) as sync_vram; the
        copies are waited for here. The caller fills `missing` (fill_vram, fill_done) and, once unsynced_layers is
        empty, calls mark_synced."""
        self.fill_wait_s = 0.0
        missing: list[tuple[int, int, int]] = []
        copied = self._sync_layer(l, snap, missing)
        self._wait_copies(copied)
        self._synced_epoch = None
        self._upload_vram_table()
        return copied, missing

    def _wait_copies(self, copied: int):
        """Wait for the enqueued host -> VRAM copies (fill_wait_s: the time blocked on the copy engine)."""
        if self.is_cuda and copied:
            t = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            self.fill_wait_s = time.perf_counter() - t

    def mark_synced(self, epoch: int):
        """Every layer's VRAM slots match the directory at `epoch`: the next sync_vram of that epoch does nothing."""
        self._synced_epoch = epoch

    def _own(self, layer: int, expert: int, j: int, snap: np.ndarray):
        """VRAM slot j of `layer` now holds `expert` (its bytes just copied in, GGUF order): in a layer of another
        layout (set_layouts) its parts are relaid here, on the copy's stream, and its base offset gets bit 0 (the
        kernels' per-expert flag: gluon_mmq._pk_of, triton_moe's tiled bodies)."""
        self.vram_owner[layer, j] = (expert, snap["host_slot"][layer, expert], snap["generation"][layer, expert])
        self.vram_index[layer, expert] = j
        base = (layer * self.plan.n_vram + j) * self.slot_bytes
        if self.layouts is not None and self.layouts[layer]:
            self._relayout(layer, expert, self.vram[layer, j])
            base |= 1
        self.vram_base[layer, expert] = base

    def set_layouts(self, layouts):
        """engine.pack_experts / tile_experts: from now on the VRAM slots of layer l hold their parts in layouts[l]'s
        layout: PACKED mma_pack's (every part Q8_0, MXFP4 or Q4_K and mma_pack.usable), TILED tile_layout's (every
        part tile_layout.usable), GGUF as filled (the caller checked: MoEStep._vram_layouts); filled in GGUF order and
        relaid at once (_own); host slots and the ring stay GGUF. Before any VRAM slot is filled (a fresh attachment's
        cache)."""
        assert not (self.vram_owner[:, :, 0] >= 0).any(), "set the layouts before the VRAM slots fill"
        self.layouts = np.asarray(layouts, dtype=np.int8)
        assert self.layouts.shape == (self.plan.n_layer,), self.layouts.shape
        assert set(self.layouts.tolist()) <= {GGUF, PACKED, TILED}, self.layouts
        parts = {k: [m for l in np.nonzero(self.layouts == k)[0] for ps in self.parts[l] for m in ps]
                 for k in (PACKED, TILED)}
        assert all(int(m.qtype) in mma_pack.GGML and mma_pack.usable(*m.shape, mma_pack.GGML[int(m.qtype)])
                   for m in parts[PACKED]), "Q8_0 / MXFP4 / Q4_K parts"
        assert all(tile_layout.usable(*m.shape, int(m.qtype)) for m in parts[TILED]), "whole 64-row tiles"
        Ks = {(m.shape[1], mma_pack.GGML[int(m.qtype)]) for m in parts[PACKED]}         # (K, type code)
        self._pack_index = {k: torch.as_tensor(mma_pack.tile_index(*k), device=self.device) for k in sorted(Ks)}
        self._scratch = (torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                         if self.layouts.any() else None)

    def _relayout(self, layer: int, expert: int, slot: torch.Tensor):
        """A VRAM slot's parts (GGUF order) -> its layer's layout in place, on the current stream: the slot through the
        scratch (one copy), then each part back into the slot: PACKED its 64-row tiles gathered by mma_pack's tile
        index (index_select), TILED tile_layout.tile's permute-copy. Two reads and two writes of a slot in VRAM; fills
        happen only when the directory's VRAM tier changes."""
        sc = self._scratch
        sc.copy_(slot)
        packed = self.layouts[layer] == PACKED
        for m in self.parts[layer][expert]:
            src, dst = sc[m.start: m.start + m.nbytes], slot[m.start: m.start + m.nbytes]
            rows, K = m.shape
            if packed:
                idx = self._pack_index[K, mma_pack.GGML[int(m.qtype)]]
                torch.index_select(src.view(rows // mma_pack.TR, -1), 1, idx, out=dst.view(rows // mma_pack.TR, -1))
            else:
                tile_layout.tile(src, rows, K, int(m.qtype), out=dst)

    def _upload_vram_table(self):
        self.vram_base_dev.copy_(torch.from_numpy(self.vram_base))
        self.vram_version += 1
        self.all_vram = (self.vram_base >= 0).all(axis=1)

    def fill_vram(self, layer: int, expert: int, j: int, src: torch.Tensor, snap: np.ndarray):
        """Put an expert without a host backing copy into VRAM slot j (src: its staging slot)."""
        self.vram[layer, j].copy_(src, non_blocking=self.pinned)
        self.h2d_bytes += src.numel()
        self._own(layer, expert, j, snap)

    def fill_done(self):
        """After fill_vram calls: the device tables follow."""
        self._upload_vram_table()

    # ---- the execution ring -------------------------------------------------------------------
    def to_bank(self, srcs: list[torch.Tensor], timing: list | None = None) -> tuple[int, list[int]]:
        """Copy up to bank_size slots into the next ring bank on the copy stream; the compute stream waits
        for them. The copies into a bank wait, on the GPU, for the computes that last read it (bank_done).
        Returns (bank, pool byte offset of each copied slot). `timing` collects (start, end) CUDA events."""
        b = self.bank_next()
        return b, self.bank_copy(b, 0, srcs, timing)

    def bank_next(self) -> int:
        """Take the next ring bank for a group (to_bank, or bank_copy calls that fill it in parts): the copies into it
        wait, on the GPU, for the computes that last read it (bank_done)."""
        b = self._bank
        self._bank = (b + 1) % self.n_banks
        if self.is_cuda:
            self.copy_stream.wait_event(self._bank_free[b])
        return b

    def bank_offsets(self, b: int, at: int, n: int) -> list[int]:
        """The pool byte offsets of bank b's slots at .. at+n-1 (where bank_copy puts n slots from `at`)."""
        first = self.ring_offset + (b * self.bank_size + at) * self.slot_bytes
        return [first + i * self.slot_bytes for i in range(n)]

    def ring_views(self, offs) -> list[torch.Tensor]:
        """The ring slots at these pool byte offsets (bank_offsets' or bank_copy's), as the [slot_bytes] views made
        once: what a reader of a bank's bytes (FlexCache.keep) takes without a slice each."""
        first, sb = self.ring_offset, self.slot_bytes
        return [self._ring_slots[(o - first) // sb] for o in offs]

    def bank_copy(self, b: int, at: int, srcs: list[torch.Tensor], timing: list | None = None,
                  wait: bool = True, table: torch.Tensor | None = None, offs: list[int] | None = None) -> list[int]:
        """Copy slots `srcs` into bank b's slots at, at+1, .. (b taken by bank_next; a group may fill its bank in
        several parts: a decode miss layer's banked host experts first, its disk experts as they land) on the copy
        stream. wait: the compute stream waits for every copy into b so far (the bank's ready event is recorded after
        each part: the last one covers them all). table: a group's device table row (table(copy=False)) copied in the
        same call, on the copy stream, before the ready event (with wait, the compute stream's wait covers it: no
        copy of its own on the compute stream). offs: bank_offsets(b, at, len(srcs)) where the caller made them already
        (its group's table names them: not made twice a group). Returns the pool byte offset of each copied slot."""
        # no slots with a table: the table alone, the bank's copies so far waited for (a copy ahead's hits:
        # MoEStep._ahead_group)
        assert (0 < len(srcs) or table is not None) and 0 <= at and at + len(srcs) <= self.bank_size, \
            (at, len(srcs), self.bank_size)
        assert table is None or wait, "a table copied with the slots is ready with them: the compute stream waits"
        first = b * self.bank_size + at
        if offs is None:
            offs = self.bank_offsets(b, at, len(srcs))
        assert len(offs) == len(srcs), (len(offs), len(srcs))
        if table is not None:
            dsts = self._ring_slots[first:first + len(srcs)] + [table]
            srcs = list(srcs) + [self.table_source(table)]
        else:
            dsts = self._ring_slots[first:first + len(srcs)]
        if self.is_cuda:
            if torch.cuda.current_device() == self._copy_index:
                # torch.cuda.stream(copy_stream)'s switch and back without its lookups (the copy stream is on the
                # current device: nothing else to restore)
                prev = current_stream(self._copy_index)
                torch.cuda.set_stream(self.copy_stream)
                try:
                    self._copies(b, dsts, srcs, timing)
                finally:
                    torch.cuda.set_stream(prev)
            else:
                with torch.cuda.stream(self.copy_stream):
                    self._copies(b, dsts, srcs, timing)
            if wait:
                self.bank_wait(b)
        else:
            t = time.perf_counter()
            torch._foreach_copy_(dsts, srcs)     # each a copy_, one call
            dt = time.perf_counter() - t
            self.copy_seconds += dt
            if timing is not None:
                timing.append(dt * 1e3)
        self.h2d_bytes += len(offs) * self.slot_bytes       # each src a slot (copy_ into a ring slot checks its size)
        return offs

    def _copies(self, b: int, dsts: list[torch.Tensor], srcs: list[torch.Tensor], timing: list | None):
        """CUDA, on the copy stream (current): srcs into dsts (ring slots, a table row), then bank b's ready event."""
        cs = self.copy_stream
        if timing is not None:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(cs)
        # one call for the batch: foreach's CUDA kernel takes host sources through its per-tensor path (copy_ each,
        # non_blocking, on the current stream), without a Python call per slot
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        self._bank_ready[b].record(cs)
        if timing is not None:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record(cs)
            timing.append((ev0, ev1))

    def mark(self) -> StreamPoint | torch.cuda.Event | None:
        """A point of the compute stream now (the copies queued there so far done once it is): a StreamPoint (no CUDA
        call) with stream_points, else a CUDA event recorded there; None on the CPU (copies are synchronous). Either
        has query() / synchronize()."""
        if not self.is_cuda:
            return None
        self.points += 1
        if self.stream_points:
            return StreamPoint(self, self.points)
        ev = self._marks[self._mark_at]
        self._mark_at = (self._mark_at + 1) % len(self._marks)
        ev.record(current_stream(self._index))
        return ev

    def pass_points(self, n: int):
        """The host synchronized on an event recorded on the compute stream once `n` points had been made (mark): those
        n are done (points are made in stream order: a later one is never passed by an earlier sync)."""
        if n > self.passed:
            self.passed = n

    def table_source(self, dev: torch.Tensor) -> torch.Tensor:
        """The pinned host row of a device table row table(copy=False) gave: what a copy of it reads."""
        return self._table_src[id(dev)]

    def bank_wait(self, b: int):
        """The compute stream waits for every copy into bank b so far (bank_copy(wait=False) parts: the ready event
        recorded after the last), as bank_copy's wait does, with no copy of its own (CPU: copies are synchronous)."""
        if self.is_cuda:
            current_stream(self._index).wait_event(self._bank_ready[b])

    def bank_ready_event(self, b: int):
        return self._bank_ready[b] if self.is_cuda else None

    def bank_done(self, b: int):
        """Record that every compute reading bank b is enqueued; the next copies into it wait for this point."""
        if self.is_cuda:
            self._bank_free[b].record(current_stream(self._index))

    def table(self, experts, offs, copy: bool = True) -> tuple[np.ndarray, torch.Tensor]:
        """A slot table for one group: [E] int64, offs for `experts`, -1 elsewhere (lists or arrays of ints: a decode
        group's are lists, a flex chunk's arrays); host view and device copy. copy False: the device row is left to
        the bank copy that names it (bank_copy(table=)), on the copy stream with its slots."""
        i = self._table
        self._table = (i + 1) % self.n_tables
        host = self._tables_np[i]                    # filled in numpy: no torch op per entry list
        host.fill(-1)
        if len(experts) <= 8:                        # decode's few: item assignment costs less than index arrays
            assert len(experts) == len(offs), (experts, offs)
            for e, o in zip(experts, offs):
                host[e] = o
        else:
            host[experts] = offs
        rows = self._table_rows[i]
        if rows is None:
            rows = self._table_rows[i] = (self.tables_host[i], self.tables_dev[i])
            self._table_src[id(rows[1])] = rows[0]
        if copy:
            rows[1].copy_(rows[0], non_blocking=self.is_cuda)
        return host, rows[1]

    def pass_begin(self):
        self._table = 0

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

    def close(self):
        """Unregister and unmap this process's view of the arena (a re-attach maps the new store's arena;
        the old memfd must not stay charged to the cgroup beside it)."""
        if self.pinned:
            unregister_pinned(self.arena)
            self.pinned = False
        self.host = None
        self._host_views, self.staging_views = {}, []
        self.arena.close()
