"""The flex expert cache: copies of recently read experts in the VRAM the plan reserves for sequences not running.

The slot plan (store/plan.py) reserves VRAM for `max_running` sequences' full-context KV and decode graphs before it
sizes the VRAM tier; a running sequence holds only its state's bytes of it (sized to its request, grown when full:
worker/kv_manager.py) and its graphs' share. The worker keeps copies of the experts it staged from disk in the rest (mixtral-offloading's LRU expert cache, in room nobody
uses), least recently used first out:

    room       in bytes: the plan's reservation for max_running sequences (`units` x `unit`: a sequence's KV at
               max_context + its decode graphs) minus what the sequences holding KV take now (their states' bytes,
               sized to what each can use, worker/kv_manager.py, + their graphs): chunks of up to
               floor(unit / slot_bytes) expert slots (the last one smaller where the room ends inside it), allocated
               when the first copy needs one
    fill       MoEStep._disk_groups: an expert staged from disk, once its ring-bank copy landed, is copied
               device-to-device into a flex slot (the same slot layout as the VRAM tier, so the same kernels read it);
               in decode (_direct_group) it is copied from its staging slot straight into the flex slot the cache
               takes for it (take), on the compute stream, and its group computes it there: no ring bank, no second copy
    use        MoEStep._partial, before the tier split: a routed host- or disk-tier expert held here is computed from
               its copy, in one launch group per chunk, like a VRAM expert: no store message, no disk read, no H2D
               copy. The bytes are the file's whatever slot holds them, so outputs keep every bit (invariant 1)
    shrink     before a sequence's state is allocated or grown (KVManager.admit / make_room -> ModelRunner.new_cache /
               grow_cache) chunks go until chunk bytes + the bytes held <= the reservation: the worker's VRAM never
               exceeds the plan's figure for max_running sequences (invariant 3). Growing back is lazy: the next
               fill after a sequence ended

The store's directory does not change (a copy is not a tier: dropping one loses nothing but a future read), and an
expert the directory moves into the VRAM tier leaves the cache at its next use (the VRAM copy serves it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from betelgeuse.logs import event
from betelgeuse.store.directory import TIER_VRAM
from betelgeuse.store.plan import GRAPHS_BYTES_PER_SEQ, SlotPlan

log = logging.getLogger("betelgeuse.worker")


@dataclass(slots=True)
class FlexStats:
    hits: int = 0               # routed experts computed from a flex copy (each a disk read or H2D copy saved)
    fills: int = 0              # experts copied in
    evictions: int = 0          # copies dropped for a newer one (LRU)
    dropped: int = 0            # copies dropped by a shrink (a sequence's KV took the room) or a move to VRAM


class FlexCache:
    def __init__(self, slot_bytes: int, unit_bytes: int, units: int, n_layer: int, n_expert: int,
                 device: torch.device):
        self.slot_bytes, self.unit_bytes, self.units, self.device = slot_bytes, unit_bytes, units, device
        self.reserved = units * unit_bytes                 # the plan's bytes for max_running sequences' KV + graphs
        self.per_chunk = unit_bytes // slot_bytes          # slots per chunk at most (one sequence's reservation)
        assert self.per_chunk > 0 and units > 0, (unit_bytes, slot_bytes, units)
        # chunk c's slots are c * per_chunk + [0, its size); twice the units' count of places, as chunks cut short
        # where the room ended may leave the whole ones fewer than the room holds
        n_places = 2 * units
        self.chunks: list[torch.Tensor | None] = [None] * n_places   # uint8 [its slots * slot_bytes] each
        # flex slot -> its bytes in its chunk (uint8 [slot_bytes] view; None: no chunk there): keep's copy targets
        # without two tensor slices per copy; its device address (0: no chunk) and its (chunk, byte offset), the
        # torch kernels' source (None: no chunk): made when its chunk is, read by index (a direct group's copy
        # targets and table offsets, the at-hand table's entries: no call a slot, issue 21, cpu-host61)
        n = n_places * self.per_chunk
        self.views: list[torch.Tensor | None] = [None] * n
        self.addresses: list[int] = [0] * n
        self.sources: list[tuple[torch.Tensor, int] | None] = [None] * n
        self._bytes = 0                                    # sum of the chunks' bytes (nbytes, read at every fill)
        self.where = np.full((n_layer, n_expert), -1, dtype=np.int64)   # (layer, expert) -> flex slot, -1 = none
        # flex slot -> (layer, expert) as Python ints, None: empty (owner: the same as an array)
        self._owner: list[tuple[int, int] | None] = [None] * (n_places * self.per_chunk)
        self.lru: OrderedDict[int, None] = OrderedDict()   # occupied flex slots, least recently used first
        # per layer the set of its experts with a copy (`where` >= 0 as sets: split and MoEStep._unflexed answer
        # "none" and read them with no numpy call)
        self.copies: list[set[int]] = [set() for _ in range(n_layer)]
        self.free: list[int] = []                          # empty slots of allocated chunks
        self.held = 0                                      # bytes the sequences holding KV take (state + graphs)
        # what _grow read when it last refused, (reserved, held, the chunks' bytes), or None: with the same it refuses
        # again (the chunks' free places change only with their bytes), so a full cache's fills do not ask it (two
        # calls, _grow and room, a decode miss layer's take: issue 21, cpu-host62; _can_fill compares)
        self._refused: tuple[int, int, int] | None = None
        self.version = 0                                   # bumped whenever `where` changes (worker/at_hand.py)
        self.forgets = 0                                   # bumped when a copy is dropped (its slot may be rewritten)
        # (layer, expert) whose `where` changed since the at-hand table last read them (worker/at_hand.py: its refresh
        # patches those entries, and takes a new set): a set, so at most one entry per table cell whatever no table
        # read meanwhile (prefills filling copies with no decode step between), added to in place by _set (no
        # call of its own: two a decode miss layer's evicting fill, issue 21, cpu-host60); logged: the
        # adds since (more than the table's cells: the refresh rebuilds it whole rather than patch, as the log's cap
        # had it)
        self.changed: set = set()
        self.logged = 0
        self.stats = FlexStats()

    @classmethod
    def for_plan(cls, plan: SlotPlan, n_expert: int, device: torch.device, graphs: bool) -> "FlexCache | None":
        """The cache for an attachment's plan: one unit = a sequence's KV reservation (vram_parts["kv"] /
        max_running) + its decode graphs where the plan counted them (CUDA graphs). None where a unit holds no
        expert slot or the plan reserved for one sequence only (a running sequence always holds it)."""
        n = plan.max_running
        unit = plan.vram_parts.get("kv", 0) // max(1, n) + (GRAPHS_BYTES_PER_SEQ if graphs else 0)
        if n < 2 or unit < plan.slot.slot_bytes:
            return None
        return cls(plan.slot.slot_bytes, unit, n, plan.n_layer, n_expert, device)

    # ---- room ----------------------------------------------------------------------------------------
    @property
    def owner(self) -> np.ndarray:
        """flex slot -> (layer, expert) [slots, 2] int64, -1: empty (a copy, made when asked: the tests' view)."""
        return np.array([(-1, -1) if o is None else o for o in self._owner], dtype=np.int64).reshape(-1, 2)

    @property
    def n_chunks(self) -> int:
        return sum(c is not None for c in self.chunks)

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds now."""
        return self._bytes

    @property
    def n_slots(self) -> int:
        return self.nbytes // self.slot_bytes

    @property
    def n_held(self) -> int:
        """Experts held."""
        return len(self.lru)

    @property
    def room(self) -> int:
        """Bytes the cache may hold now: the reservation less what the sequences holding KV take."""
        return max(0, self.reserved - self.held)

    def hold(self, nbytes: int):
        """The sequences holding KV take (or are about to take) `nbytes` of the reservation: give back chunks,
        the last allocated first, until the cache's bytes fit the room, before the caller allocates. Fewer bytes
        let later fills grow the cache again."""
        assert nbytes >= 0, nbytes
        self.held = nbytes
        for c in reversed(range(len(self.chunks))):
            if self.nbytes <= self.room:
                break
            if self.chunks[c] is not None:
                self._drop_chunk(c)

    def clear(self):
        """Give back every chunk (the worker lets go of its slot pool); the bytes held by sequences stay."""
        for c in range(len(self.chunks)):
            if self.chunks[c] is not None:
                self._drop_chunk(c)

    def _drop_chunk(self, c: int):
        lo, hi = c * self.per_chunk, (c + 1) * self.per_chunk
        for s in range(lo, hi):
            if self._owner[s] is not None:
                self._set(s, None)
                self.stats.dropped += 1
        self.free = [s for s in self.free if not lo <= s < hi]
        self._bytes -= self.chunks[c].numel()
        self.views[lo:hi] = [None] * self.per_chunk
        self.addresses[lo:hi] = [0] * self.per_chunk
        self.sources[lo:hi] = [None] * self.per_chunk
        self.chunks[c] = None          # the caching allocator reuses it for the KV (stream-ordered)
        event(log, "flex_cache_shrink", logging.DEBUG, chunks=self.n_chunks, slots=self.n_slots, bytes=self.nbytes,
              held_kv_bytes=self.held)

    def _set(self, s: int, owner: tuple[int, int] | None):
        """Slot s's copy from now on: its last one (if any) forgotten (a forget: its slot may be rewritten), then
        `owner` = (layer, expert) as Python ints, its copy queued by the caller, the LRU's newest; None: the slot left
        empty, out of the LRU. Each (layer, expert) whose `where` changed logged for the at-hand table (`changed`).
        One call for an eviction's forget and the fill that takes its slot (take, keep), where a forget and an
        assignment were two, each with its own log and LRU update (issue 21, cpu-host62)."""
        old = self._owner[s]
        self._owner[s] = owner
        if old is not None:
            l, e = old
            self.where[l, e] = -1
            self.copies[l].discard(e)
            self.changed.add(old)
            self.logged += 1
            self.forgets += 1
        self.version += 1
        self.lru.pop(s, None)                           # out of the LRU (a new copy re-enters at its newest end)
        if owner is None:
            return
        l, e = owner
        self.where[l, e] = s
        self.copies[l].add(e)
        self.changed.add(owner)
        self.logged += 1
        self.lru[s] = None
        self.stats.fills += 1

    def _grow(self) -> bool:
        """A new chunk in the room left: a whole one, or the slots the room still holds (a quarter of a whole
        one at least: a sliver is not worth a launch group) -> whether one was allocated."""
        n = min(self.per_chunk, (self.room - self._bytes) // self.slot_bytes)
        # the room test first: a full cache's fills (take's, every decode miss) ask nothing more; `None in chunks`
        # compares each chunk tensor to None through Tensor.__eq__ (~100 us a take on the CPU: cpu-host59)
        if n < max(1, self.per_chunk // 4) or None not in self.chunks:
            self._refused = (self.reserved, self.held, self._bytes)
            return False
        c = self.chunks.index(None)
        self.chunks[c] = chunk = torch.empty((n * self.slot_bytes,), dtype=torch.uint8, device=self.device)
        self._bytes += chunk.numel()
        lo, sb, base = c * self.per_chunk, self.slot_bytes, chunk.data_ptr()
        self.views[lo: lo + n] = list(chunk.split(sb))
        self.addresses[lo: lo + n] = [base + i * sb for i in range(n)]
        self.sources[lo: lo + n] = [(chunk, i * sb) for i in range(n)]
        self.free = list(range(c * self.per_chunk, c * self.per_chunk + n))
        event(log, "flex_cache_grow", logging.DEBUG, chunks=self.n_chunks, slots=self.n_slots, bytes=self.nbytes,
              held_kv_bytes=self.held)
        return True

    def _can_fill(self) -> bool:
        """A free slot now, after a new chunk if none was: _grow is not asked where it refused on what it would read
        now (_refused: a full cache's fills ask it once, not once a take or an expert)."""
        return bool(self.free) or (self._refused != (self.reserved, self.held, self._bytes) and self._grow())

    def _slot(self, owner: tuple[int, int]) -> int | None:
        """A slot for `owner`'s new copy (_set): an empty one, a new chunk's within the room, else the least recently
        used one's; None: no slot."""
        if self._can_fill():
            s = self.free.pop(0)
            self._set(s, owner)
            return s
        return self._evict(owner) if self.lru else None

    def _evict(self, owner: tuple[int, int]) -> int:
        """The least recently used slot, its copy forgotten (an eviction) and given to `owner`'s new copy (_set)."""
        s = next(iter(self.lru))
        self._set(s, owner)
        self.stats.evictions += 1
        return s

    # ---- use -----------------------------------------------------------------------------------------
    def split(self, layer: int, used: np.ndarray, tiers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """split_lists on arrays (the general path's, its dtypes kept): a layer's routed experts `used` (ascending) and
        their directory tiers -> (used, tiers) without the experts computed from a flex copy, and those experts
        (ascending). A layer holding no copy returns at once."""
        if not self.copies[layer]:
            return used, tiers, used[:0]
        u, t, h = self.split_lists(layer, used.tolist(), tiers.tolist())
        return (np.asarray(u, dtype=used.dtype), np.asarray(t, dtype=tiers.dtype), np.asarray(h, dtype=used.dtype))

    def split_lists(self, layer: int, used: list[int], tiers: list[int]) -> tuple[list, list, list]:
        """A layer's routed experts `used` (ascending Python ints: the decode short paths' lists, MoEStep._partial)
        and their tiers -> (used, tiers) less the experts computed from a flex copy, and those experts: a copy of an
        expert now in the VRAM tier goes (counted dropped), the held others hit (moved to the LRU's end)."""
        cp = self.copies[layer]
        if cp.isdisjoint(used):                 # no routed expert has a copy: no numpy call
            return used, tiers, []
        where, lru = self.where[layer], self.lru
        # one pass making the three lists (no index lists and comprehensions after it: four calls less a layer with
        # a hit, issue 21, cpu-host62); the hits' LRU moves in the experts' order, as before
        rest, rest_tiers, hit = [], [], []
        for e, t in zip(used, tiers):
            s = int(where[e]) if e in cp else -1
            if s >= 0 and t != TIER_VRAM:
                hit.append(e)
                lru.move_to_end(s)
                continue
            if s >= 0:                          # a copy of an expert now in VRAM goes; the VRAM slot computes it
                self._set(s, None)
                self.stats.dropped += 1
            rest.append(e)
            rest_tiers.append(t)
        if not hit:
            return used, tiers, []
        self.stats.hits += len(hit)
        return rest, rest_tiers, hit

    def held_mask(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """bool per expert of `layer`: a copy is held (a read ahead of it would be wasted)."""
        return self.where[layer, experts] >= 0

    def groups(self, layer: int, experts: np.ndarray):
        """Flex-held experts of a layer -> [(chunk tensor, experts, byte offsets in the chunk)], one per chunk."""
        slots = self.where[layer, experts]
        assert (slots >= 0).all(), (layer, experts, slots)
        chunk = slots // self.per_chunk
        out = []
        for c in np.unique(chunk):
            m = chunk == c
            out.append((self.chunks[int(c)], experts[m], (slots[m] - c * self.per_chunk) * self.slot_bytes))
        return out

    # ---- fill ----------------------------------------------------------------------------------------
    def keep(self, layer: int, experts, pool: torch.Tensor, offs, views: list[torch.Tensor] | None = None):
        """Copies of experts just staged (pool bytes [off, off + slot_bytes) each, e.g. a ring bank), on the current
        stream: ordered after what wrote the bank and before what rewrites it once the caller's bank_done follows.
        views: those bytes as [slot_bytes] views made once (ExpertCache.ring_views), instead of a slice each.
        The bookkeeping (slots taken, evictions, the LRU) goes expert by expert in the order given; the copies are one
        torch._foreach_copy_ at the end (one call instead of two slices and a copy_ per expert; on CUDA one fused
        kernel on the same stream, at the point the first copy_ was). A slot taken twice in one call (a copy of this
        call evicted for a later one: fewer slots than experts) is copied once, the later expert's bytes: what the
        per-expert copies in order left there."""
        layer = int(layer)
        sb, where, lru, slot_views = self.slot_bytes, self.where[layer], self.lru, self.views
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        slots: list[int] = []
        for n, (e, off) in enumerate(zip(experts, offs)):
            e = int(e)
            s = int(where[e])
            if s >= 0:
                lru.move_to_end(s)
                continue
            s = self._slot((layer, e))         # taken for it (the bookkeeping; the copy below)
            if s is None:
                break
            if s in slots:                      # rewritten by a later expert of this call: its copy alone
                i = slots.index(s)
                del dsts[i], srcs[i], slots[i]
            dsts.append(slot_views[s])
            srcs.append(pool[int(off): int(off) + sb] if views is None else views[n])
            slots.append(s)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def take(self, layer: int, experts, mine=()) -> list[int | None]:
        """keep's bookkeeping for experts about to be staged (a decode miss layer's disk experts, MoEStep._direct_group)
        without its copy: the caller copies each expert's bytes into its slot (views[s]) itself and computes its group
        from there, instead of from a ring bank copied out after the group (keep: one device-to-device copy less).
        -> per expert its flex slot, or None: already held (the bytes are there; the LRU touched, as keep does), or no
        slot for it: none free, no room to grow and the least recently used one taken by this call (the caller's
        group reads every slot it took: a slot is never given twice in one call, where keep keeps the later expert's
        bytes). The caller orders the copy after every read of the slot's last copy (a group that may still read an
        evicted copy) and before any read of the new one. mine: the slots the same group took in earlier calls (engine.
        disk_copy_early: a miss layer's experts taken as they land, one group after the last), never given again
        either: calls over parts of a batch give what one call over it gives."""
        layer = int(layer)
        where, lru, out = self.where[layer], self.lru, []
        for e in experts:
            e = int(e)
            s = int(where[e])               # read here: an eviction earlier in this call may have dropped it
            if s >= 0:
                lru.move_to_end(s)
                out.append(None)
                continue
            # _slot's order: a free slot, a new chunk, else the LRU's
            if self._can_fill():
                s = self.free.pop(0)
                self._set(s, (layer, e))
            elif not lru or next(iter(lru)) in out or next(iter(lru)) in mine:
                out.append(None)            # nothing free and the LRU slot is this call's: through the bank
                continue
            else:
                s = self._evict((layer, e))
            out.append(s)
        return out

    def describe(self) -> dict:
        return {"units": self.units, "unit_bytes": self.unit_bytes, "slots_per_unit": self.per_chunk,
                "reserved_bytes": self.reserved, "held_kv_bytes": self.held, "slots": self.n_slots,
                "experts": self.n_held, "bytes": self.nbytes,
                "hits": self.stats.hits, "fills": self.stats.fills, "evictions": self.stats.evictions}
