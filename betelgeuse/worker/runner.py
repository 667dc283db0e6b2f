"""The model runner: one pass (prefill or decode) through the out-of-core experts.

Two schedules over the same slots, ring and math:
  layer_major  the whole chunk goes through layer L before L+1; each needed expert is loaded once and
               applied to all its tokens in sub-batches; resident experts are computed first while disk
               reads land; copies run on their own CUDA stream; the next layer's experts are read ahead.
  standard     token-major micro-batches of `micro_batch` tokens; each expert is fetched on demand and
               waited for (copy, sync, compute): the baseline the reference report compares against.
Expert outputs land in y[token, rank] and are reduced in rank order, so the order experts are computed
in, and the tier they came from, never change the bits (invariant 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.layers import moe_combine, plan_experts, run_expert
from betelgeuse.model.qwen3moe import Qwen3MoeModel
from betelgeuse.model.weights import DenseWeights
from betelgeuse.store.client import StoreClient
from betelgeuse.store.directory import SlotDirectory
from betelgeuse.worker.expert_cache import TIER_DISK, TIER_HOST, TIER_VRAM, ExpertCache

TIER_NAMES = {TIER_VRAM: "vram", TIER_HOST: "host", TIER_DISK: "disk"}


@dataclass(slots=True)
class LayerStats:
    attn_s: float = 0.0         # attention + routing, wall (ends with the routing sync)
    moe_s: float = 0.0          # wall from routing to the last expert enqueued
    disk_wait_s: float = 0.0    # blocked waiting for the store to land an expert
    copy_ms: float = 0.0        # host->device copy time (CUDA events on the copy stream; CPU: memcpy wall)
    compute_ms: float = 0.0     # expert compute time (CUDA events; CPU: wall)
    copy_events: list = field(default_factory=list, repr=False)   # per copy: (start, end) CUDA events or CPU ms
    vram: int = 0
    host: int = 0
    disk: int = 0


@dataclass(slots=True)
class PassStats:
    kind: str                   # "prefill" | "decode"
    schedule: str
    n_tokens: int
    seconds: float = 0.0
    reads: dict = field(default_factory=lambda: {"vram": 0, "host": 0, "disk": 0})
    disk_bytes: int = 0         # bytes read from disk for experts this pass used (expert payload bytes)
    disk_wait_s: float = 0.0
    h2d_bytes: int = 0
    prefetched: int = 0         # experts whose disk read was issued ahead, before they were asked for
    vram_filled: int = 0        # experts copied into VRAM hot slots at the start of the pass
    layers: list = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def disk_share(self) -> float:
        n = sum(self.reads.values())
        return self.reads["disk"] / n if n else 0.0


class ModelRunner:
    def __init__(self, cfg: EngineConfig, store: StoreClient):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype()
        self.file = GGUFModelFile.open(cfg.model_path)
        self.mcfg = self.file.config
        self.model = Qwen3MoeModel(self.mcfg, DenseWeights.load(self.file, self.device, self.dtype))
        if self.device.type == "cuda":
            # loading dequantizes through float32 temporaries (1.2 GB for a 151936 x 2048 embedding);
            # give them back so the caching allocator does not keep them reserved beside the VRAM slots
            torch.cuda.empty_cache()
        self.store = store
        self.cache: ExpertCache | None = None
        self._events: list = []             # (layer stats, start, end, ring) CUDA events of this pass
        self._masks = None                  # (directory snapshot, [n_layer, n_expert] resident mask on the device)
        self.attach()

    # ---- store session --------------------------------------------------------------------
    def attach(self):
        """(Re)attach to the store: map its arena, register it as pinned, refill VRAM slots on the next pass."""
        if self.cache is not None:
            self.cache.close()
        arena, plan = self.store.attach()
        self.plan = plan
        self.cache = ExpertCache(plan, arena, self.file, self.device, self.dtype, self.cfg.ring_slots)
        self.directory = SlotDirectory(arena, plan.layout, create=False)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache.for_config(self.mcfg, max_len or self.cfg.max_context, self.device, self.dtype)

    # ---- one pass ---------------------------------------------------------------------------
    def forward(self, ids: list[int], kv: KVCache, all_logits: bool = False, consolidate: bool = True,
                schedule: str | None = None, should_stop=None) -> tuple[torch.Tensor, PassStats]:
        """ids [T] -> logits [T or 1, n_vocab] float32 and the pass's stats; appends to kv.
        should_stop() is called between layers and may raise (cancellation): the pass is abandoned,
        the KV cache is left uncommitted and the store's pass is closed without consolidation."""
        ids_t = self.model.check_ids(ids)
        schedule = schedule or self.cfg.schedule
        stats = PassStats("prefill" if len(ids) > 1 else "decode", schedule, len(ids))
        L, E = self.mcfg.n_layer, self.mcfg.n_expert
        usage = np.zeros((L, E), dtype=np.int64)
        h2d0 = self.cache.h2d_bytes
        t0 = time.perf_counter()
        self.should_stop = should_stop or (lambda: None)
        self.store.begin_pass()
        ok = False
        try:
            snap = self.directory.snapshot()
            stats.vram_filled = self._sync_vram(snap, stats)
            if schedule == "standard" and len(ids) > 1:
                logits = self._standard(ids_t, kv, snap, usage, stats, all_logits)
            else:
                logits = self._layer_major(ids_t, kv, snap, usage, stats, all_logits)
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.device)
            ok = True
        finally:
            if ok:
                self.store.end_pass(usage, consolidate)
            else:
                self._abandon(usage)
        stats.seconds = time.perf_counter() - t0
        stats.h2d_bytes = self.cache.h2d_bytes - h2d0
        stats.disk_wait_s += sum(s.disk_wait_s for s in stats.layers)
        if self.cache.is_cuda:
            self._collect_event_times(stats)
        else:
            for ls in stats.layers:
                ls.copy_ms, ls.copy_events = sum(ls.copy_events), []
        return logits.float(), stats

    def _abandon(self, usage):
        """Close the store's pass after an exception; a dead store is the caller's problem already."""
        self._events = []
        try:
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.device)
            self.store.end_pass(usage, False)
        except Exception:
            pass

    def consolidate(self):
        """End-of-request consolidation without a pass (decode passes do not consolidate)."""
        L, E = self.mcfg.n_layer, self.mcfg.n_expert
        self.store.begin_pass()
        self.store.end_pass(np.zeros((L, E), dtype=np.int64), True)

    def settle(self):
        """Wait until a pending consolidation is applied (begin_pass waits for it)."""
        L, E = self.mcfg.n_layer, self.mcfg.n_expert
        self.store.begin_pass()
        self.store.end_pass(np.zeros((L, E), dtype=np.int64), False)

    # ---- layer-major --------------------------------------------------------------------------
    def _layer_major(self, ids, kv, snap, usage, stats, all_logits):
        T = ids.numel()
        positions = kv.begin(T)
        x = self.model.embed(ids)
        k, E = self.mcfg.n_expert_used, self.mcfg.n_expert
        # read ahead the next layer only when most of its experts will be needed: P(used) = 1-(1-k/E)^T
        readahead = self.cfg.prefetch and T > 1 and 1.0 - (1.0 - k / E) ** T >= 0.5
        for l in range(self.mcfg.n_layer):
            self.should_stop()
            ls = LayerStats()
            t = time.perf_counter()
            x = self.model.attention_block(l, x, kv, positions)
            h = self.model.moe_input(l, x)
            top_ids, top_w = self.model.route(l, h, self._resident_mask(snap, l))
            work = plan_experts(top_ids)                       # host sync: routing decides the loads
            t1 = time.perf_counter()
            ls.attn_s = t1 - t
            y = torch.zeros(T, k, h.shape[-1], dtype=h.dtype, device=h.device)
            self._moe_layer(l, h, y, work, snap, usage, stats, ls, readahead)
            x = x + moe_combine(y, top_w)
            ls.moe_s = time.perf_counter() - t1
            stats.layers.append(ls)
        kv.commit()
        return self.model.logits(x if all_logits else x[-1:])

    def _sync_vram(self, snap, stats) -> int:
        """VRAM hot slots = the directory's VRAM tier: copies from host backing slots, and disk reads through
        the store for VRAM experts that have no backing copy (vram_backing = false). Returns experts filled."""
        copied, missing = self.cache.sync_vram(snap)
        if missing:
            where = {(l, e): j for l, e, j in missing}
            t = time.perf_counter()
            for got in self.store.load(list(where)):
                self.cache.fill_vram(got.layer, got.expert, where[(got.layer, got.expert)],
                                     self.cache.staging_slot(got.slot), snap)
                stats.disk_bytes += got.disk_bytes
                stats.reads["disk"] += 1
                self._sync()                           # the copy is done before the staging slot goes back
                self.store.release([got.slot])
            stats.disk_wait_s += time.perf_counter() - t
        return copied + len(missing)

    def _resident_mask(self, snap, l: int):
        """[n_expert] bool on the device for the approximate `resident` routing mode; None in exact mode.
        One upload per pass (the directory is frozen for the pass), not one per layer."""
        if self.cfg.routing != "resident":
            return None
        if self._masks is None or self._masks[0] is not snap:
            self._masks = (snap, torch.from_numpy(snap["tier"] > 0).to(self.device))
        return self._masks[1][l]

    def _moe_layer(self, l, h, y, work, snap, usage, stats, ls, readahead):
        tiers = snap["tier"][l]
        experts = list(work)
        for e in experts:
            usage[l, e] += work[e].tokens.numel()
        by_tier = {t: [e for e in experts if tiers[e] == t] for t in (TIER_VRAM, TIER_HOST, TIER_DISK)}
        ls.vram, ls.host, ls.disk = (len(by_tier[t]) for t in (TIER_VRAM, TIER_HOST, TIER_DISK))
        for t, n in ((TIER_VRAM, ls.vram), (TIER_HOST, ls.host), (TIER_DISK, ls.disk)):
            stats.reads[TIER_NAMES[t]] += n
        # 1. demand loads first, so the disk starts now; 2. read-ahead of the next layer behind them
        loads = self.store.load([(l, e) for e in by_tier[TIER_DISK]]) if by_tier[TIER_DISK] else iter(())
        if readahead and l + 1 < self.mcfg.n_layer:
            nxt = snap["tier"][l + 1]
            stats.prefetched += self.store.prefetch([(l + 1, e) for e in range(self.mcfg.n_expert) if nxt[e] == TIER_DISK])
        sb = self.cfg.sub_batch
        hslots = snap["host_slot"][l]
        depth = max(1, self.cfg.ring_slots - 1)     # copies in flight ahead of their computes
        queued: list[tuple[int, int]] = []          # (expert, ring index) copied, not yet computed
        timing = ls.copy_events

        def drain(n_left: int):
            while len(queued) > n_left:
                e, i = queued.pop(0)
                self._compute(h, y, work[e], self.cache.ring[i], l, e, ls, sb, ring=i)

        # 3. resident experts while the reads run: the first host-slot copies start, VRAM experts compute
        #    in place meanwhile, then host experts stream through the ring `depth` copies ahead
        host = by_tier[TIER_HOST]
        for e in host[:depth]:
            queued.append((e, self.cache.to_ring(self.cache.host_slot(l, int(hslots[e])), timing)))
        for e in by_tier[TIER_VRAM]:
            self._compute(h, y, work[e], self.cache.vram_slot(l, e), l, e, ls, sb)
        for e in host[depth:]:
            drain(depth - 1)
            queued.append((e, self.cache.to_ring(self.cache.host_slot(l, int(hslots[e])), timing)))
        # 4. disk experts in the order they land; a staging slot goes back once its copy is done
        pending: list[tuple[int, int]] = []          # (ring index, staging slot) whose copy may be in flight
        limit = max(1, min(self.cfg.ring_slots, self.plan.n_staging // 2))
        for _ in range(len(by_tier[TIER_DISK])):
            pending = self._release(pending, keep=limit - 1)   # never hold many slots while blocking on the store
            tw = time.perf_counter()
            got = next(loads)
            ls.disk_wait_s += time.perf_counter() - tw
            stats.disk_bytes += got.disk_bytes
            drain(depth - 1)
            i = self.cache.to_ring(self.cache.staging_slot(got.slot), timing)
            queued.append((got.expert, i))
            pending.append((i, got.slot))
        drain(0)
        self._release(pending, keep=0)

    def _release(self, pending, keep: int):
        """Release staging slots whose copies finished (CUDA: event query, no sync); if more than `keep`
        remain, wait for the oldest copies. Returns what is still pending."""
        if self.cache.is_cuda:
            done = [p for p in pending if self.cache.ring_ready_event(p[0]).query()]
            rest = [p for p in pending if p not in done]
            while len(rest) > keep:
                self.cache.ring_ready_event(rest[0][0]).synchronize()
                done.append(rest.pop(0))
        else:
            done, rest = pending, []             # CPU copies are synchronous
        if done:
            self.store.release([s for _, s in done])
        return rest

    def _compute(self, h, y, work, slot, l, e, ls, sb, ring: int | None = None):
        if self.cache.is_cuda:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev1 = torch.cuda.Event(enable_timing=True)
            ev0.record()
            run_expert(h, y, work, self.cache.weights(slot, l, e), sb)
            ev1.record()
            self._events.append((ls, ev0, ev1, ring))
        else:
            t = time.perf_counter()
            run_expert(h, y, work, self.cache.weights(slot, l, e), sb)
            ls.compute_ms += (time.perf_counter() - t) * 1e3
        if ring is not None:
            self.cache.ring_release(ring)

    def _collect_event_times(self, stats):
        for ls, ev0, ev1, ring in self._events:
            ls.compute_ms += ev0.elapsed_time(ev1)
        self._events = []
        for ls in stats.layers:
            ls.copy_ms = sum(ev0.elapsed_time(ev1) for ev0, ev1 in ls.copy_events)
            ls.copy_events = []

    # ---- standard (baseline) -------------------------------------------------------------------
    def _standard(self, ids, kv, snap, usage, stats, all_logits):
        outs = []
        mb = self.cfg.micro_batch
        k = self.mcfg.n_expert_used
        layer_stats = [LayerStats() for _ in range(self.mcfg.n_layer)]
        for s in range(0, ids.numel(), mb):
            self.should_stop()
            chunk = ids[s:s + mb]
            positions = kv.begin(chunk.numel())
            x = self.model.embed(chunk)
            for l in range(self.mcfg.n_layer):
                ls = layer_stats[l]
                t = time.perf_counter()
                x = self.model.attention_block(l, x, kv, positions)
                h = self.model.moe_input(l, x)
                top_ids, top_w = self.model.route(l, h, self._resident_mask(snap, l))
                work = plan_experts(top_ids)
                t1 = time.perf_counter()
                ls.attn_s += t1 - t
                y = torch.zeros(chunk.numel(), k, h.shape[-1], dtype=h.dtype, device=h.device)
                tiers, hslots = snap["tier"][l], snap["host_slot"][l]
                for e in work:                         # ascending id, each fetched and waited for
                    usage[l, e] += work[e].tokens.numel()
                    tier = int(tiers[e])
                    stats.reads[TIER_NAMES[tier]] += 1
                    if tier == TIER_VRAM:
                        ls.vram += 1
                        slot = self.cache.vram_slot(l, e)
                    elif tier == TIER_HOST:
                        ls.host += 1
                        slot = self.cache.ring[self.cache.to_ring(self.cache.host_slot(l, int(hslots[e])))]
                    else:
                        ls.disk += 1
                        tw = time.perf_counter()
                        (got,) = list(self.store.load([(l, e)]))
                        ls.disk_wait_s += time.perf_counter() - tw
                        stats.disk_bytes += got.disk_bytes
                        slot = self.cache.ring[self.cache.to_ring(self.cache.staging_slot(got.slot))]
                        self._sync()
                        self.store.release([got.slot])
                    self._sync()                       # no overlap: the copy is waited for
                    tc = time.perf_counter()
                    run_expert(h, y, work[e], self.cache.weights(slot, l, e), self.cfg.sub_batch)
                    self._sync()
                    ls.compute_ms += (time.perf_counter() - tc) * 1e3
                x = x + moe_combine(y, top_w)
                ls.moe_s += time.perf_counter() - t1
            kv.commit()
            outs.append(x if all_logits else x[-1:])
        stats.layers = layer_stats
        return self.model.logits(torch.cat(outs) if all_logits else outs[-1])

    def _sync(self):
        if self.cache.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self):
        if self.cache is not None:
            self.cache.close()
        self.file.close()
        if self.device.type == "cuda":
            self.model = self.cache = None
            torch.cuda.empty_cache()
