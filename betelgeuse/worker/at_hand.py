"""Decode's at-hand table: every expert the worker can compute without the disk, per layer, as one launch group.

    at_hand[l, e]  byte offset of expert e's slot relative to the slot pool's address (kernels.moe.Group; -1 = not at
                   hand), first of:
                     VRAM slot        cache.vram_base (a pool offset)
                     flex copy        its chunk's address - the pool's + the slot's offset (worker/flex_cache.py)
                     host-tier slot   read IN PLACE over PCIe (zero copy) where the step's rule says so (below):
                                      the arena's device address (store.arena.device_address: registered mapped) -
                                      the pool's + the slot's offset; negative where the arena lies below the pool
                                      (the kernels skip only -1). Only for the triton kernels on CUDA with a device
                                      mapping, and on the CPU (the torch kernels read the arena view itself: `srcs`);
                                      else a host expert is a miss and goes through a ring bank as before
                   the same order MoEStep._partial computes them in (a flex copy of a VRAM expert is never read)

A decode layer then runs ONE gate_up + ONE down over at_hand[l] for every routed row whose expert is at hand (in the
decode graphs, right after routing), and the host's partial path only for the misses (MoEStep.misses). Every row is
computed by the same kernel whichever group holds it and written once, so no bit changes (invariant 1).

Host experts in place or banked (engine.host_in_place, decided per step by refresh(rows=...)):
  always   in place for every step
  never    banked: the table names no host slot, so partial(hand=True) copies the step's routed host experts into
           ring banks on the copy engine (~55 GB/s on the H200) and computes them there, the disk misses after them
  auto     in place when the step has at most IN_PLACE_MAX_ROWS rows (sequences) and no expert type of the model
           is one that BANKED_TYPES names (measured faster banked even at one row), banked otherwise.
  Bytes over PCIe: the expert kernels (kernels/triton_moe.py) run one program per (output block, row block of one
  expert): a program reads its BN weight rows over all of K for its block of up to BM = 16 rows (BM_MV on the mmvq
  decode schedule), so an expert's bytes cross PCIe once per row block, ceil(rows / BM) times, and a batch step
  (at most 8 rows, so at most 8 per expert) reads each routed host expert once in place: the same bytes as a bank
  copy (MoEStep counts them: PassStats.in_place_bytes beside h2d_bytes). What differs is the reader: a bank copy is
  one DMA on the copy engine, overlapped with the VRAM group's compute; in place, the SMs' loads wait on PCIe
  inside the group, whose programs then hold the SMs while the VRAM experts' programs queue behind them. A one-row
  step reads few host experts (k per layer) and saves the bank's copy + launch round; a step of several rows reads
  up to rows x k of them, where the copy engine's bandwidth is what counts. The next device run
  (deploy/device/check_gate.py --settings off,always,never,auto --lanes 1,4,8) measures where the crossover is.
Every row is computed by the same kernel in either case: no bit changes (tests/worker/test_decode_at_hand.py).

Freshness (the invariant: an expert's bytes are not rewritten while a step may read them through the table):
  - refresh() before each decode step copies the table into the same device storage (the graphs read it in place;
    stream-ordered after the previous step's kernels; a pinned, non-blocking copy: the host never waits for the
    device's queue) when the directory snapshot, the VRAM slots
    (ExpertCache.vram_version) or the flex copies (FlexCache.version) changed. The snapshot is frozen for a store
    pass, and a host slot is not rewritten while the pass is open (the same guarantee a ring bank's copy of it had:
    the pass's end sync comes after every read).
  - a flex copy may be evicted inside a step (a disk expert kept by MoEStep._disk_groups, or taken by _direct_group,
    rewrites the least recently used slot, which a later layer's table may name): MoEStep refreshes after such a
    layer, stream-ordered before any later layer's group.
"""

from __future__ import annotations

import numpy as np
import torch

from betelgeuse.store.arena import device_address
from betelgeuse.store.directory import TIER_HOST


# auto: the most rows (sequences) a decode step may have for its host experts to be read in place. 1: the lone stream
# reads in place (gpu-run35-gate: 10.4 ms a b16 step, against 15.9 on the partial path with its banks), a batch step
# copies them into ring banks: with 4 clients ~1.6 GB of host experts a step (gpu-run37-serve), bytes the copy engine
# moved at ~55 GB/s, where in place the kernels' own loads wait on PCIe inside the group. A starting point: not
# measured side by side until `deploy/device/check_gate.py --lanes 1,4,8` runs (module doc)
IN_PLACE_MAX_ROWS = 1
# auto: GGML expert types whose one-row steps are banked too. MXFP4 (39): deepseek4's ds4-flash in pool routing
# (every routed expert resident, ~60% of them in host slots) decoded at 62.0 tok/s banked against 52.6 in place, mean
# of 63 steps each (docs/benchmarks/gpu-run40-serve/README.md); Q8_0 is the other way round (in place
# 11.1 against banked 16.1 ms a b16 step, gpu-run38-ds4). Types not measured keep the row rule.
BANKED_TYPES = frozenset({39})
HOST_IN_PLACE = ("auto", "always", "never")
# pinned staging buffers of the table's uploads (AtHand._upload), reused in turn: a step uploads at its start and after
# each miss layer whose disk expert evicted a flex copy, and a buffer's last copy has run by the next layer's routing
# sync (the same stream, earlier), so its reuse almost never waits
UPLOAD_RING = 4


def host_in_place(policy: str, rows: int, types: frozenset = frozenset()) -> bool:
    """Whether a decode step of `rows` rows reads host-tier experts in place (policy: engine.host_in_place;
    types: the GGML types of the model's experts, gate/up and down of every layer)."""
    assert policy in HOST_IN_PLACE and rows >= 1, (policy, rows)
    if policy != "auto":
        return policy == "always"
    return rows <= IN_PLACE_MAX_ROWS and BANKED_TYPES.isdisjoint(types)


class AtHand:
    def __init__(self, cache, flex, backend: str, policy: str = "always", qtypes=(), wait=None):
        L, E = cache.vram_base.shape
        self.cache, self.flex, self.backend, self.policy = cache, flex, backend, policy
        # the experts' GGML types (qtypes: (gate/up, down) per layer, MoEKernels.qtypes), gathered once: the host
        # rule reads them at every step's refresh
        self.types = frozenset(q for pair in qtypes for q in pair)
        self.in_place = False                                   # this step's host experts are in the table
        self.host = np.full((L, E), -1, dtype=np.int64)        # the table on the host (the misses are read from it)
        self.dev = torch.full((L, E), -1, dtype=torch.int64, device=cache.device)   # fixed storage the graphs read
        self.srcs: list[list] | None = [[None] * E for _ in range(L)] if backend == "torch" else None
        # the arena's address as the kernels see it: the CPU view's own, or the registered mapping's on CUDA
        if not cache.is_cuda:
            self.arena_addr = cache.host.data_ptr()             # cache.host views the whole arena from offset 0
        elif backend == "triton" and cache.pinned:
            self.arena_addr = device_address(cache.arena)
        else:
            self.arena_addr = None                              # host experts stay misses (ring banks)
        self._key = None
        self.forgets = -1                                       # FlexCache.forgets at the last refresh
        if flex is not None:
            flex.changed, flex.logged = set(), 0                # its copies' changes, for refresh's patch
        self.uploads = 0                                        # table uploads (all time; decode_host.py counts them)
        # the uploads' sources: UPLOAD_RING pinned [L, E] int64 buffers made once (on the CPU plain ones), each with
        # the compute-stream point after its last copy; a reuse whose copy has not run waits in `wait` (PassClock.wait:
        # blocked time)
        self._stage = [torch.empty((L, E), dtype=torch.int64, pin_memory=cache.is_cuda) for _ in range(UPLOAD_RING)]
        self._stage_np = [b.numpy() for b in self._stage]
        # per buffer what its reuse waits for (None: nothing, the CPU): the compute-stream point after its copy
        # (ExpertCache.mark: _upload's, or after a deferred upload the caller's, made behind the copy it queued:
        # uploaded), with a CUDA event's query / synchronize
        self._stage_wait: list = [None] * UPLOAD_RING
        self.deferred = None                # (device table, pinned source) of a deferred upload not yet queued
        self._defer, self._deferred_at = False, 0
        self._stage_at = 0
        self._wait = wait if wait is not None else (lambda fn, *a: fn(*a))
        self.upload_waits = 0                                   # uploads that waited for their buffer's last copy

    @property
    def zero_copy(self) -> bool:
        """Host-tier experts can be read in place (the arena is mapped for the kernels); whether a step does:
        in_place."""
        return self.arena_addr is not None

    def refresh(self, snap, rows: int | None = None, force: bool = False, defer: bool = False) -> bool:
        """Rebuild the table where the snapshot, the VRAM slots, the flex copies or the step's host rule (rows: the
        step's rows; None inside a step: the step's rule kept) changed (force: rebuild anyway) -> whether it was
        uploaded. Vectorized over the [n_layer, n_expert] table; where only flex copies changed (a decode step that
        filled or evicted some, each logged: FlexCache.changed) their entries alone (_patch). The torch kernels'
        sources are made only on the CPU (the tests' path). defer: the upload's copy is left to the caller, who queues
        `deferred` (dst, src) with its own copies on the current stream and then calls uploaded()."""
        self._defer = defer
        if self.deferred is not None:       # a deferred upload never queued (its step failed): the device's is stale
            self.deferred, force = None, True
        c, f = self.cache, self.flex
        if rows is not None:
            self.in_place = self.zero_copy and host_in_place(self.policy, rows, self.types)
        key = (c.vram_version, -1 if f is None else f.version, self.in_place)
        if not force and self._key is not None and self._key[0] is snap and self._key[1] == key:
            return False
        if not force and f is not None and f.logged <= f.where.size and self._key is not None and \
                self._key[0] is snap and self._key[1][0] == key[0] and self._key[1][2] == key[2]:
            return self._patch(snap, key)           # only flex copies changed, each logged: their entries
        self._key = (snap, key)
        if f is not None:
            f.changed, f.logged = set(), 0          # the rebuild reads every copy as it is now; log from here
        L, E = self.host.shape
        pool = c.pool.data_ptr()
        tab = np.full((L, E), -1, dtype=np.int64)
        src = np.zeros((L, E), dtype=np.int8)          # 1 host, 2 flex, 3 VRAM: which source tab holds
        if self.in_place:
            ls, es = np.nonzero((snap["tier"] == TIER_HOST) & (snap["host_slot"] >= 0))
            lay = c.layout
            off = lay.host_base + (ls * lay.host_per_layer + snap["host_slot"][ls, es]) * lay.slot.slot_bytes
            tab[ls, es] = self.arena_addr + off - pool
            src[ls, es] = 1
        if f is not None:
            ls, es = np.nonzero(f.where >= 0)
            if len(ls):
                ch, i = np.divmod(f.where[ls, es], f.per_chunk)
                addr = np.array([0 if x is None else x.data_ptr() for x in f.chunks], dtype=np.int64)
                tab[ls, es] = addr[ch] + i * f.slot_bytes - pool
                src[ls, es] = 2
        v = c.vram_base >= 0
        tab[v] = c.vram_base[v]
        src[v] = 3
        if self.srcs is not None:
            for l, e in zip(*np.nonzero(src)):
                l, e = int(l), int(e)
                if src[l, e] == 1:
                    self.srcs[l][e] = (c.host, int(tab[l, e] - self.arena_addr + pool))
                elif src[l, e] == 2:
                    ch, i = divmod(int(f.where[l, e]), f.per_chunk)
                    self.srcs[l][e] = (f.chunks[ch], i * f.slot_bytes)
                else:                               # bit 0: a packed slot's flag (ExpertCache._own), not its address
                    self.srcs[l][e] = (c.pool, int(tab[l, e]) & ~1)
        self.host[:] = tab
        self._upload(tab)
        self.forgets = -1 if f is None else f.forgets
        return True

    def _patch(self, snap, key) -> bool:
        """refresh where only the flex copies changed since the last one (a decode step's start after a step that made
        or dropped copies; inside a step, after a miss layer's disk expert evicted one: hand_misses): the entries of
        the (layer, expert) whose copy changed (FlexCache.changed) made as the rebuild makes them (_entries), the table
        uploaded: the rebuild's table (the snapshot, the VRAM slots and the host rule are the same) for a few
        entries' Python instead of its [n_layer, n_expert] numpy passes (~32 us at ds4-flash's 8 x 256 on a 2-vCPU
        box; issue 21, docs/benchmarks/cpu-host48)."""
        f = self.flex
        changed, f.changed, f.logged = f.changed, set(), 0      # each (layer, expert) once: made from the state now
        self._entries(snap, changed, self.cache.pool_addr)
        self._key = (snap, key)
        self._upload(self.host)                     # a copy of it goes (pinned on CUDA; the CPU copies it now)
        self.forgets = f.forgets
        return True

    def _entries(self, snap, keys, pool: int):
        """The table's entries of these (layer, expert) as refresh's rebuild makes them (VRAM slot, else flex copy,
        else host slot in place, else -1), the torch kernels' sources beside them (the CPU). pool: the slot pool's
        address. One call for a patch's entries, not one an entry (~6 a miss layer's evicting fill: issue 21,
        cpu-host62)."""
        c, f, host, srcs = self.cache, self.flex, self.host, self.srcs
        for l, e in keys:
            src = None
            at = int(c.vram_base[l, e])
            if at >= 0:
                src = (c.pool, at & ~1)                 # bit 0: a packed slot's flag (ExpertCache._own)
            elif f is not None and (s := int(f.where[l, e])) >= 0:
                at = f.addresses[s] - pool              # made with its chunk (FlexCache.addresses: no call)
                if srcs is not None:
                    src = f.sources[s]
            elif self.in_place and snap["tier"][l, e] == TIER_HOST and snap["host_slot"][l, e] >= 0:
                lay = c.layout
                off = lay.host_base + (l * lay.host_per_layer + int(snap["host_slot"][l, e])) * lay.slot.slot_bytes
                at = self.arena_addr + off - pool
                src = (c.host, off)
            else:
                at = -1                                 # a miss (the rebuild leaves its source as it was)
            if srcs is not None and src is not None:
                srcs[l][e] = src
            host[l, e] = at

    def uploaded(self, ev):
        """The deferred upload's copy is queued (on the current stream, in the caller's _foreach_copy_); ev: the compute
        stream's point behind it (ExpertCache.mark; None on the CPU), which the buffer's reuse waits for."""
        self._stage_wait[self._deferred_at] = ev
        self.deferred = None

    def _upload(self, tab: np.ndarray):
        """tab [n_layer, n_expert] int64 into the device table, stream-ordered (after the kernels queued so far, before
        any later group) and without blocking the host. A copy_ from pageable memory (non_blocking False) synchronizes
        the stream on CUDA: after a miss layer whose disk expert evicted a flex copy (hand_misses), the host waited for
        that layer's bank copies and misses' group (~0.24 ms a ds4-flash disk expert's), counted as the pass's rest
        (stats.py's other_host_s; issue 21, docs/benchmarks/cpu-host48). The source is the next of UPLOAD_RING pinned
        buffers made at init (sync48: host48's tab.pin_memory() took a pinned block from torch's caching host allocator
        per upload, a cudaHostAlloc (host-synchronizing) whenever none was free); a buffer whose last copy has not run
        is waited for in the pass clock (counted as blocked, upload_waits), never overwritten under a pending copy."""
        i = self._stage_at
        self._stage_at = (i + 1) % UPLOAD_RING
        ev = self._stage_wait[i]
        if ev is not None and not ev.query():
            self.upload_waits += 1
            self._wait(ev.synchronize)
        np.copyto(self._stage_np[i], tab)
        self.uploads += 1
        if self._defer:                     # the caller queues the copy (refresh(defer=True))
            self.deferred, self._deferred_at = (self.dev, self._stage[i]), i
            return
        self.dev.copy_(self._stage[i], non_blocking=True)     # the CPU: a plain copy, done on return
        # the point after it, on the stream the copy_ above was queued on (the compute stream; None on the CPU)
        self._stage_wait[i] = self.cache.mark()

    def stale(self, after: int = -1) -> bool:
        """A flex copy the table names was dropped or rewritten since the last refresh (inside a step: a later
        layer's group must not read the slot). after (inside a decode step, layers 0 .. after done: their at-hand
        groups queued, each layer's once a step): only a change of a later layer's copy makes it stale; rows <= after
        are read again only in the next step, after its refresh (hand_refresh, which patches every change logged
        since: FlexCache.changed), and a queued group read its slot before the copy that rewrites it (the compute
        stream's order). So a miss layer whose fill evicts an earlier layer's copy uploads no table (host58: about
        half of them at ds4-flash's 8 layers, an upload and its buffer's event query each on CUDA)."""
        f = self.flex
        if f is None or f.forgets == self.forgets:
            return False
        if after < 0:                           # any change counts
            return True
        for t, _ in f.changed:                  # a loop, not any(genexpr): a call less per entry
            if t > after:
                return True
        return False
