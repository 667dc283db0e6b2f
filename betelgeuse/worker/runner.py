"""The model runner: one pass (prefill or decode) through the out-of-core experts.

Two schedules over the same slots, ring and kernels:
  layer_major  the whole chunk goes through layer L before L+1. Per layer (the MoE step):
                 1. route all tokens; rows sorted by expert on the device (kernels.moe.route)
                 2. if the layer is not wholly VRAM-resident: ONE host sync for the per-expert row counts
                    (the loads depend on them); demand loads for disk experts, read-ahead of layer L+1
                 3. all VRAM experts of the layer in one launch group (slot table on the device)
                 4. host-tier experts in batches: a batch is copied into one ring bank while the previous
                    bank computes, then the batch is one launch group
                 5. disk experts in batches as they land in staging slots (same path as 4)
                 6. ranks combined in order
               No Python loop over experts or tokens on the triton backend; the torch backend (CPU, the
               reference) loops over a group's experts.
  standard     token-major micro-batches of `micro_batch` tokens; each expert is fetched on demand and
               waited for (copy, sync, compute): the baseline the reference report compares against.
Expert outputs land in y[token * k + rank] and are reduced in rank order, and each row is computed by the
same kernel whatever group it is in, so neither the tier an expert came from nor the order of groups
changes a bit (invariant 1).

Passes and the store: the directory is frozen from begin_pass to end_pass. A prefill opens a store pass
and closes it with consolidation; decode steps keep the store pass open across tokens (no round trip per
token; usage is counted on the device and sent once at the close) until the request ends or every
`decode_consolidate_every` tokens, when the decode's own usage is consolidated (its working set moves into
the resident tiers). A decode pass does not wait for a consolidation still filling its slots (the store applies
it at a later BeginPass; while it fills, the runner reopens the store pass each token to pick it up).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.kernels.moe import Group, MoEKernels, triton_available
from betelgeuse.model import engine_model
from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.layers import Chunk, layer_back, layer_front, pass_chunks
from betelgeuse.store.client import StoreClient
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_NAMES, TIER_VRAM, SlotDirectory
from betelgeuse.worker.expert_cache import ExpertCache
from betelgeuse.worker.graphs import capture
from betelgeuse.worker.lanes import Lanes



@dataclass(slots=True)
class LayerStats:
    attn_s: float = 0.0         # attention + routing, wall (host enqueue time; the GPU may still be busy)
    moe_s: float = 0.0          # wall from routing to the last expert group enqueued
    disk_wait_s: float = 0.0    # blocked waiting for the store to land an expert
    copy_ms: float = 0.0        # host->device copy time (CUDA events on the copy stream; CPU: memcpy wall)
    compute_ms: float = 0.0     # MoE compute time of the layer (CUDA events when timing; CPU: wall)
    copy_events: list = field(default_factory=list, repr=False)   # per bank copy: (start, end) CUDA events or CPU ms
    vram: int = 0
    host: int = 0
    disk: int = 0
    synced: bool = True         # the layer needed the host sync (not wholly VRAM-resident)
    groups: int = 0             # expert launch groups


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
    open_s: float = 0.0         # opening the store pass: BeginPass (it waits for a pending consolidation) + VRAM fills
    host_s: float = 0.0         # wall minus the time the host was blocked (syncs on the GPU, the disk)
    blocked_s: float = 0.0      # host blocked: routing syncs, waits for disk reads and copies, the end sync
    store_calls: int = 0        # round trips to the store during this pass
    layers: list = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def disk_share(self) -> float:
        n = sum(self.reads.values())
        return self.reads["disk"] / n if n else 0.0

    @property
    def applications(self) -> int:
        """Expert applications (one expert applied to its rows of one layer)."""
        return sum(self.reads.values())


class ModelRunner:
    def __init__(self, cfg: EngineConfig, store: StoreClient):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # the caching allocator's reserve, not live tensors, went over the VRAM budget (gpu-agents1: 11.8 GB
            # allocated at most, 16.6 GB reserved): expandable segments grow and reuse one mapping instead of
            # keeping fragmented blocks per size (read when the allocator starts; an operator's setting wins)
            if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
                try:                                # the allocator may have started already (the bench measured)
                    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
                except (AttributeError, RuntimeError):
                    pass
        self.dtype = cfg.torch_dtype()
        self.file = GGUFModelFile.open(cfg.model_path)
        self.mcfg = self.file.config
        self.model = engine_model(self.file, self.device, self.dtype)     # qwen3moe or deepseek4: one interface
        # position-aligned prefill chunks (layers.pass_chunks): prefix hits and pieces of a prompt give the same bits
        self.chunk = cfg.prefill_chunk if getattr(self.model, "chunked_prefill", False) else None
        if self.device.type == "cuda":
            # loading dequantizes through float32 temporaries (1.2 GB for a 151936 x 2048 embedding);
            # give them back so the caching allocator does not keep them reserved beside the VRAM slots
            torch.cuda.empty_cache()
        self.store = store
        self.cache: ExpertCache | None = None
        self.timing = False                 # per-layer CUDA events (the bench turns it on)
        self._masks = None                  # (directory snapshot, [n_layer, n_expert] resident mask on the device)
        self._pass_open = False
        self._decode_since = 0              # decode passes since the store pass was opened
        self._resume_since = 0              # carried over a close/reopen while a consolidation fills
        self._calls = 0                     # store round trips (all time)
        self._lanes: Lanes | None = None    # batched decode in the static form (worker/lanes.py), made on first use
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
        self.kern = self._kernels()
        L, E = self.mcfg.n_layer, self.mcfg.n_expert
        self._counts = torch.zeros((L, E), dtype=torch.int64, device=self.device)   # rows per expert, this pass
        self._graphs = OrderedDict()        # (kv uid, all-VRAM pattern) -> "warm" | captured decode graphs
        # decode in the static (graph-capturable) form: always on CUDA in exact routing, so that whether a step
        # was replayed from a graph never changes its bits
        # (a model whose state is not fixed-shape, deepseek4's compressed entries, says static_decode = False)
        self._static_decode = (self.device.type == "cuda" and self.cfg.routing == "exact"
                               and getattr(self.model, "static_decode", True))
        self._pass_open = False
        self._usage = np.zeros((self.mcfg.n_layer, self.mcfg.n_expert), dtype=np.int64)
        self._lanes = None                  # its graphs captured the old _counts: recaptured on the next decode

    def _kernels(self) -> MoEKernels:
        qts = self.cache.qtypes
        want = self.cfg.kernels
        ok = MoEKernels.supports(qts) and triton_available()
        if want == "triton" and not ok:
            raise BetelgeuseError("kernels = 'triton' needs the triton package and Q8_0/F16/BF16/F32/MXFP4 experts "
                                  f"(this model's expert types: {sorted({q for p in qts for q in p})})")
        backend = "triton" if want == "triton" or (want == "auto" and self.device.type == "cuda" and ok) else "torch"
        return MoEKernels(backend, self.mcfg.n_expert, self.mcfg.n_ff_exp, self.cache.starts, qts, self.cfg.sub_batch,
                          weights_fn=self.cache.weights, act_limit=self.model.expert_act[1])

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """The model's per-sequence state (qwen3moe: KVCache; deepseek4: DS4Cache, same begin/commit)."""
        return self.model.new_cache(max_len or self.cfg.max_context)

    def _call(self, fn, *args):
        self._calls += 1
        return fn(*args)

    # ---- store passes -------------------------------------------------------------------------
    def _open_pass(self, stats: PassStats):
        """A decode pass does not wait for a consolidation still reading its slots (the store applies it at a
        later pass; the bits never depend on placement): at ~1-3 s of disk reads per consolidation on the
        benchmark geometry, waiting stalled the token after every prefill. A prefill waits (its experts are
        what the consolidation is placing)."""
        if self._pass_open:
            return
        t = time.perf_counter()
        self._call(self.store.begin_pass, stats.kind != "decode")
        self._pass_open = True
        self._decode_since, self._resume_since = self._resume_since, 0
        self._snap = self.directory.snapshot()
        stats.vram_filled = self._sync_vram(self._snap, self.directory.epoch, stats)
        stats.open_s = time.perf_counter() - t

    def close_pass(self, consolidate: bool):
        """End the store pass (if one is open) with the usage counted since it opened."""
        if not self._pass_open:
            return
        self._pass_open = False
        usage, self._usage = self._usage, np.zeros_like(self._usage)
        self._call(self.store.end_pass, usage, consolidate)

    def _empty_pass(self, consolidate: bool, wait: bool):
        """A store pass with no work: begin_pass applies a pending consolidation (wait: also one still filling);
        end_pass may plan a new one."""
        self._call(self.store.begin_pass, wait)
        self._call(self.store.end_pass, np.zeros_like(self._usage), consolidate)

    def consolidate(self):
        """End-of-request consolidation (with the decode usage of the open pass, if any). Never waits for one still
        filling (its usage then goes into the next): waiting held the engine thread for its disk reads, ~1.4 s
        before a repeated prompt's cached first token on the benchmark geometry (gpu-agents12-loop)."""
        if self._pass_open:
            self.close_pass(True)
        else:
            self._empty_pass(True, wait=False)

    def settle(self):
        """Wait until a pending consolidation is applied (begin_pass waits for it)."""
        self.close_pass(False)
        self._empty_pass(False, wait=True)

    # ---- one pass ---------------------------------------------------------------------------
    def forward(self, ids: list[int], kv: KVCache, all_logits: bool = False, consolidate: bool = True,
                schedule: str | None = None, should_stop=None) -> tuple[torch.Tensor, PassStats]:
        """ids [T] -> logits [T or 1, n_vocab] float32 and the pass's stats; appends to kv.
        consolidate=True closes the store pass with consolidation (a prefill); False keeps it open (decode).
        should_stop() is called between layers and may raise (cancellation): the pass is abandoned,
        the KV cache is left uncommitted and the store's pass is closed without consolidation."""
        schedule = schedule or self.cfg.schedule
        if schedule == "standard" and len(ids) > 1:
            ids_t = self.model.check_ids(ids)
            logits, stats = self._pass(PassStats("prefill", schedule, len(ids)), consolidate, should_stop,
                                       lambda snap, stats: [self._standard(ids_t, kv, snap, stats, all_logits)])
        else:
            logits, stats = self.prefill_batch([(ids, kv)], all_logits, consolidate, should_stop, schedule)
        return logits[0], stats

    def prefill_batch(self, parts: list[tuple[list[int], KVCache]], all_logits: bool = False, consolidate: bool = True,
                      should_stop=None, schedule: str = "layer_major") -> tuple[list[torch.Tensor], PassStats]:
        """Prompt pieces of several sequences in ONE layer-major pass [(ids [T_i], kv_i)] -> each piece's logits
        ([T_i or 1, n_vocab] float32) and the shared pass's stats. Every expert of a layer is loaded once for the
        rows of all the pieces (on the benchmark geometry a 128-token prompt already uses nearly every expert, so
        eight prompts cost about one prefill's disk reads, not eight). Each piece runs in its own position-aligned
        chunks (pass_chunks) with its own cache, and an expert's rows stay within their chunk: a piece's logits are
        bit-identical to its forward() alone. consolidate / should_stop: as forward()."""
        assert parts
        n_tok = sum(len(ids) for ids, _ in parts)
        stats = PassStats("prefill" if n_tok > len(parts) else "decode", schedule, n_tok)
        idss = [self.model.check_ids(ids) for ids, _ in parts]
        return self._pass(stats, consolidate, should_stop,
                          lambda snap, stats: self._layer_major(idss, [kv for _, kv in parts], snap, stats, all_logits))

    def _pass(self, stats: PassStats, consolidate: bool, should_stop, work):
        """One store-backed pass: open (or go on with) the store pass, work(snap, stats) -> a list of logits (made
        float32), the end sync, the usage; an exception closes the store pass first."""
        self.should_stop = should_stop or (lambda: None)
        start = self._start_forward()
        try:
            snap = self._begin_work(stats)
            logits = work(snap, stats)
            logits = [x.float() for x in logits]
            counts = self._end_sync()
        except BaseException:
            self._abandon()
            raise
        self._end_forward(stats, counts, consolidate, *start)
        return logits, stats

    def _start_forward(self) -> tuple[float, int, int]:
        """(t0, h2d bytes, store calls) at the start of a forward; resets its blocked time and CUDA events."""
        self._blocked = 0.0
        self._events = []
        return time.perf_counter(), self.cache.h2d_bytes, self._calls

    def _begin_work(self, stats: PassStats):
        """Open the store pass if needed (snapshot, VRAM sync), reset the per-pass tables; -> the snapshot."""
        self._open_pass(stats)
        self.cache.pass_begin()
        self._counts.zero_()
        return self._snap

    def _end_sync(self) -> np.ndarray:
        """The pass's one end-of-pass sync: rows per expert [n_layer, n_expert] to the host (blocked time)."""
        tb = time.perf_counter()
        counts = self._counts.cpu().numpy()
        self._blocked += time.perf_counter() - tb
        return counts

    def _end_forward(self, stats: PassStats, counts: np.ndarray, consolidate: bool, t0: float, h2d0: int, calls0: int):
        """After a forward's end sync: usage, the VRAM reads of wholly resident layers (known only now), the store
        pass (closed with consolidation after a prefill, and every `decode_consolidate_every` decode passes) and
        the pass's timing figures."""
        self._usage += counts
        for l, ls in enumerate(stats.layers):
            if not ls.synced:
                ls.vram = int((counts[l] > 0).sum())
                stats.reads["vram"] += ls.vram
        if consolidate:
            self.close_pass(True)
        else:
            self._decode_since += 1
            every = self.cfg.decode_consolidate_every
            if every and self._decode_since >= every:
                self.close_pass(True)                    # the decode working set moves into resident tiers
            elif self._pass_open and self.store.consolidating:
                # the open pass did not wait for a consolidation still filling its slots: close it (its usage
                # counted, no new consolidation) so that the next token's BeginPass applies it once it landed
                self._resume_since = self._decode_since      # the decode consolidation's count goes on
                self.close_pass(False)
        stats.seconds = time.perf_counter() - t0
        stats.blocked_s = self._blocked
        stats.host_s = max(0.0, stats.seconds - self._blocked)
        stats.store_calls = self._calls - calls0
        stats.h2d_bytes = self.cache.h2d_bytes - h2d0
        stats.disk_wait_s += sum(x.disk_wait_s for x in stats.layers)
        self._collect_times(stats)

    def decode_batch(self, tokens: list[int], kvs: list[KVCache]) -> tuple[torch.Tensor, PassStats]:
        """One decode token for each of several sequences in ONE pass (continuous batching): attention, routing
        and the output head per sequence, the MoE step over all their rows at once (each expert loaded once per
        layer for every sequence that chose it). Returns logits [n, n_vocab] float32 and the shared pass's stats.

        A sequence's logits do not depend on its batch (invariant 6). In the static form (CUDA; worker/lanes.py) the
        dense part runs once per layer over max_running fixed lanes, the same row-wise ops on the same shapes
        whoever fills the other lanes, and attention per sequence; a lone sequence decodes through here too (the
        engine's solo decode), so it gets the same bits. Otherwise each sequence's dense part runs alone with the ops
        of a solo decode. The Triton expert kernels are row-invariant; the torch backend applies experts one row at a
        time here (a solo decode step has one row per expert anyway)."""
        n = len(tokens)
        assert n == len(kvs) and n >= 1
        ids_t = self.model.check_ids(tokens)
        stats = PassStats("decode", "layer_major", n)
        L = self.mcfg.n_layer
        start = self._start_forward()
        static = self._static_decode
        sb = self.kern.sub_batch
        try:
            snap = self._begin_work(stats)
            self.kern.sub_batch = 1
            if static:                              # CUDA: row-batched dense part over fixed lanes (worker/lanes.py)
                ln = self._lane_set()
                idx = ln.join(kvs)
                for kv in kvs:
                    kv.begin_static()
                ln.begin(ids_t, kvs, idx)
            else:
                pos = [kv.begin(1) for kv in kvs]
                xs = [self.model.embed(ids_t[i:i + 1]) for i in range(n)]
            for l in range(L):
                ls = LayerStats()
                if static:
                    self._lane_layer(ln, l, kvs, snap, stats, ls)
                else:
                    xs = self._rows_layer(l, xs, ids_t, kvs, pos, snap, stats, ls)
                stats.layers.append(ls)
            for kv in kvs:
                kv.commit()
            logits = (ln.head(kvs, self.kern.combine) if static
                      else torch.cat([self.model.logits(x) for x in xs])).float()
            counts = self._end_sync()
        except BaseException:
            self._abandon()
            raise
        finally:
            self.kern.sub_batch = sb
        self._end_forward(stats, counts, False, *start)
        return logits, stats

    def _lane_layer(self, ln: Lanes, l: int, kvs, snap, stats, ls: LayerStats):
        """Layer l of a batched decode on the lanes: the dense part, the routing of the running rows and the previous
        layer's combine in the lane graphs; then the experts (a wholly VRAM layer in one group, else the host-synced
        partial path), eagerly."""
        t = time.perf_counter()
        r = ln.front(l, kvs, self._route_rows, self.kern.combine)
        t1 = time.perf_counter()
        ls.attn_s = t1 - t
        ev = self._timing_start()
        if self.cache.all_vram[l]:
            self._vram_layer(l, r, ls)
        else:
            self._moe_partial(l, r, snap, stats, ls, False)
        self._timing_end(ev, ls)
        ls.moe_s = time.perf_counter() - t1

    def _rows_layer(self, l: int, xs, ids_t, kvs, pos, snap, stats, ls: LayerStats):
        """Layer l of a batched decode, each sequence's dense part alone (the ops of its solo decode), the MoE over
        all rows -> the sequences' residuals [1,H] each."""
        t = time.perf_counter()
        hs, auxs, tids, tws = [], [], [], []
        for i in range(len(kvs)):
            xs[i] = self.model.attention_block(l, xs[i], kvs[i], pos[i])
            h, aux = self.model.moe_input(l, xs[i])
            ti, tw = self.model.route(l, h, ids_t[i:i + 1], self._resident_mask(snap, l))
            hs.append(h), auxs.append(aux), tids.append(ti), tws.append(tw)
        t1 = time.perf_counter()
        ls.attn_s = t1 - t
        routed = self._moe_layer(l, torch.cat(hs), torch.cat(tids), torch.cat(tws), snap, stats, ls, False)
        ls.moe_s = time.perf_counter() - t1
        return [self.model.moe_output(l, xs[i], auxs[i], hs[i], routed[i:i + 1]) for i in range(len(kvs))]

    @property
    def decodes_in_lanes(self) -> bool:
        """decode_batch runs the static form's lanes (worker/lanes.py), whose bits differ from forward()'s one-row
        decode: the engine then decodes a lone sequence with decode_batch as well."""
        return self._static_decode

    def _lane_set(self) -> Lanes:
        """The batched decode lanes (max_running of them; their graphs are captured once per runner)."""
        if self._lanes is None:
            if not getattr(self.model, "lane_decode", False):
                raise BetelgeuseError(f"{self.mcfg.arch}: no row-batched decode (lane_decode) for the static form")
            self._lanes = Lanes(self.model, self.mcfg.n_layer, max(1, self.cfg.max_running),
                                self.cache.is_cuda and self.cfg.cuda_graphs)
        return self._lanes

    def _abandon(self):
        """Close the store's pass after an exception; a dead store is the caller's problem already."""
        self._events = []
        try:
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.device)
            self.close_pass(False)
        except Exception:
            self._pass_open = False

    # ---- layer-major --------------------------------------------------------------------------
    def _layer_major(self, idss, kvs, snap, stats, all_logits) -> list[torch.Tensor]:
        """Pieces idss [T_i] of sequences kvs in one pass -> each piece's logits (all rows or its last)."""
        if len(idss) == 1 and idss[0].numel() == 1 and self._static_decode:
            return [self._decode_static(idss[0], kvs[0], snap, stats)]
        chunks, ends = [], []                       # every piece's chunks, rows offset into the pass; piece ends
        for ids, kv in zip(idss, kvs):
            a, start = (ends[-1] if ends else 0), kv.length
            positions = kv.begin(ids.numel())
            chunks += [Chunk(a + c.a, a + c.b, c.positions, kv) for c in pass_chunks(positions, start, self.chunk)]
            ends.append(a + ids.numel())
        ids = idss[0] if len(idss) == 1 else torch.cat(idss)
        x = self.model.embed(ids)
        T = ids.numel()
        k, E = self.mcfg.n_expert_used, self.mcfg.n_expert
        # read ahead the next layer only when most of its experts will be needed: P(used) = 1-(1-k/E)^T
        readahead = self.cfg.prefetch and T > 1 and 1.0 - (1.0 - k / E) ** T >= 0.5
        for l in range(self.mcfg.n_layer):
            self.should_stop()
            ls = LayerStats()
            t = time.perf_counter()
            x, h, auxs, top_ids, top_w = layer_front(self.model, l, x, kvs[0], chunks, ids,
                                                     self._resident_mask(snap, l))
            t1 = time.perf_counter()
            ls.attn_s = t1 - t
            routed = self._moe_layer(l, h, top_ids, top_w, snap, stats, ls, readahead, chunks)
            x = layer_back(self.model, l, x, auxs, h, routed, chunks)
            ls.moe_s = time.perf_counter() - t1
            stats.layers.append(ls)
        for kv in kvs:
            kv.commit()
        # the head per piece (its own rows only: a matmul's bits may depend on its row count)
        return [self.model.logits(x[a:b] if all_logits else x[b - 1:b]) for a, b in zip([0] + ends[:-1], ends)]

    def _sync_vram(self, snap, epoch, stats) -> int:
        """VRAM hot slots = the directory's VRAM tier: copies from host backing slots, and disk reads through
        the store for VRAM experts that have no backing copy (vram_backing = false). Returns experts filled."""
        copied, missing = self.cache.sync_vram(snap, epoch)
        self._blocked += self.cache.fill_wait_s
        if missing:
            # after a consolidation without backing copies, often hundreds: the reads run in parallel in the store,
            # each landed expert is copied at once, and the staging slots go back a batch at a time, after one
            # sync for the batch's copies (not one sync and one store round trip per expert)
            where = {(l, e): j for l, e, j in missing}
            limit = max(1, self.plan.n_staging // 2)   # staging slots held at once: the store keeps reading
            held: list[int] = []
            t = time.perf_counter()
            for got in self._call(self.store.load, list(where)):
                self.cache.fill_vram(got.layer, got.expert, where[(got.layer, got.expert)],
                                     self.cache.staging_slot(got.slot), snap)
                stats.disk_bytes += got.disk_bytes
                stats.reads["disk"] += 1
                held.append(got.slot)
                if len(held) >= limit:
                    self._sync()                       # the copies are done before their staging slots go back
                    self._call(self.store.release, held)
                    held = []
            self._sync()
            if held:
                self._call(self.store.release, held)
            self.cache.fill_done()
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

    def _group(self, experts, offs) -> Group:
        host, dev = self.cache.table(list(experts), list(offs))
        return Group(np.asarray(experts, dtype=np.int64), host, dev)

    def _vram_group(self, l: int, experts=None) -> Group:
        c = self.cache
        return Group(experts, c.vram_base[l], c.vram_base_dev[l])

    def _apply(self, r, l: int, g: Group, ls: LayerStats):
        self.kern.apply(r, l, self.cache.pool, g, self.cache.slot_bytes)
        ls.groups += 1

    def _moe_layer(self, l, h, ids, w, snap, stats, ls, readahead, chunks=None) -> torch.Tensor:
        """sum_r w_r expert_r(h) [T,H] for layer l, experts from whatever tier holds them."""
        ev = self._timing_start()
        r = self._route(l, h, ids, w, ls, chunks)
        if ls.synced:
            self._moe_partial(l, r, snap, stats, ls, readahead)
        out = self.kern.combine(r)
        self._timing_end(ev, ls)
        return out

    def _route(self, l, h, ids, w, ls, chunks=None):
        """Rows sorted by expert and counted (device, no sync). A layer wholly in VRAM is computed here in one
        group (ls.synced = False); otherwise ls.synced stays True: the caller runs _moe_partial (host sync)."""
        r = self._route_rows(l, h, ids, w, chunks)
        if self.cache.all_vram[l]:
            self._vram_layer(l, r, ls)
        return r

    def _vram_layer(self, l, r, ls):
        """A layer wholly in VRAM: all its experts in one group, no host sync (ls.synced = False)."""
        ls.synced = False
        self._apply(r, l, self._vram_group(l), ls)

    def _route_rows(self, l, h, ids, w, chunks=None):
        """kernels.moe.route, its rows per expert added to the pass's counts (device only: graph-capturable)."""
        r = self.kern.route(h, ids, w, chunks)
        self._counts[l] += r.counts
        return r

    def _moe_partial(self, l, r, snap, stats, ls, readahead):
        """The experts of a layer that is not wholly VRAM-resident: one host sync for the row counts, demand
        loads and read-ahead, then the VRAM group, host batches and disk batches (writes r.y)."""
        cache = self.cache
        tb = time.perf_counter()
        counts = r.counts.cpu().numpy()                  # host sync: routing decides the loads
        self._blocked += time.perf_counter() - tb
        used = np.nonzero(counts)[0]
        tiers = snap["tier"][l][used]
        by_tier = {t: used[tiers == t] for t in (TIER_VRAM, TIER_HOST, TIER_DISK)}
        ls.vram, ls.host, ls.disk = (len(by_tier[t]) for t in (TIER_VRAM, TIER_HOST, TIER_DISK))
        for t, n in ((TIER_VRAM, ls.vram), (TIER_HOST, ls.host), (TIER_DISK, ls.disk)):
            stats.reads[TIER_NAMES[t]] += n
        # 1. demand loads first, so the disk starts now; 2. read-ahead of the next layer behind them
        disk = [int(e) for e in by_tier[TIER_DISK]]
        loads = self._call(self.store.load, [(l, e) for e in disk]) if disk else iter(())
        if readahead and l + 1 < self.mcfg.n_layer:
            nxt = snap["tier"][l + 1]
            stats.prefetched += self._call(self.store.prefetch, [(l + 1, int(e)) for e in np.nonzero(nxt == TIER_DISK)[0]])
        timing = ls.copy_events if self.timing or not cache.is_cuda else None
        B = cache.bank_size
        hslots = snap["host_slot"][l]
        host = [int(e) for e in by_tier[TIER_HOST]]
        batches = [host[i:i + B] for i in range(0, len(host), B)]
        # 3. the first host batch's copy starts, the VRAM group computes meanwhile, 4. host batches follow
        staged = [self._to_bank(b, [cache.host_slot(l, int(hslots[e])) for e in b], timing) for b in batches[:1]]
        if ls.vram:
            self._apply(r, l, self._vram_group(l, by_tier[TIER_VRAM]), ls)
        for i, b in enumerate(batches):
            bank, g = staged[0] if i == 0 else self._to_bank(b, [cache.host_slot(l, int(hslots[e])) for e in b], timing)
            self._apply(r, l, g, ls)
            cache.bank_done(bank)
        # 5. disk experts in batches as they land; a staging slot goes back once its copy is done
        self._disk_groups(l, r, loads, len(disk), stats, ls, timing)

    # ---- decode in the static form (CUDA graphs) ------------------------------------------------------
    def _decode_ops(self, ids, kv, pos, lstats, out: dict):
        """One decode token as a generator: runs the capturable work and yields (layer, routing) where a
        layer's experts need the host (a layer not wholly in VRAM); the caller does that part eagerly."""
        x = self.model.embed(ids)
        for l in range(self.mcfg.n_layer):
            x = self.model.attention_block(l, x, kv, pos, static=True)
            h, aux = self.model.moe_input(l, x)
            top_ids, top_w = self.model.route(l, h, ids, None)
            r = self._route(l, h, top_ids, top_w, lstats[l])
            if lstats[l].synced:
                yield l, r
            x = self.model.moe_output(l, x, aux, h, self.kern.combine(r))
        out["logits"] = self.model.logits(x)

    def _decode_static(self, ids, kv, snap, stats):
        """A decode token on CUDA. The first step of a (sequence, residency pattern) runs eagerly (it also warms
        up the kernels); the second captures the capturable runs between host-dependent layers as CUDA graphs;
        later steps replay them: a wholly VRAM-resident model decodes a token in one graph launch. Eager and
        replayed steps run the same kernels on the same shapes, so the bits do not depend on which it was."""
        pos = kv.begin_static()
        lstats = [LayerStats() for _ in range(self.mcfg.n_layer)]
        graphs_on = self.cache.is_cuda and self.cfg.cuda_graphs
        key = (kv.uid, self.cache.all_vram.tobytes())
        ent = self._graphs.get(key) if graphs_on else None

        def eager_part(item):
            l, r = item
            self._moe_partial(l, r, snap, stats, lstats[l], False)

        out: dict = {}
        if ent is None:
            for item in self._decode_ops(ids, kv, pos, lstats, out):
                eager_part(item)
            if graphs_on:
                self._remember(key, "warm")
            logits = out["logits"]
        elif ent == "warm":
            static_ids = ids.clone()
            gen = self._decode_ops(static_ids, kv, pos, lstats, out)
            graphs, eager, pool = [], [], None
            while True:
                g, item = capture(pool, lambda: next(gen, None))      # captured, then replayed once
                pool = g.pool()
                graphs.append(g)
                if item is None:
                    break
                eager.append(item)
                eager_part(item)
            self._remember(key, (graphs, eager, static_ids, out["logits"]))
            logits = out["logits"]
        else:
            graphs, eager, static_ids, logits = ent
            static_ids.copy_(ids)
            for i, g in enumerate(graphs):
                g.replay()
                if i < len(eager):
                    eager_part(eager[i])
        kv.commit()
        stats.layers = lstats
        return logits.clone()

    def release(self, kv):
        """A sequence is done: drop its captured decode graphs (solo, and its batched-decode lane with its attention
        graphs) and their memory pools now, not when an LRU bound reaches them (the slot plan counts graphs for
        max_running sequences)."""
        for key in [k for k in self._graphs if k[0] == kv.uid]:
            del self._graphs[key]
        if self._lanes is not None:
            self._lanes.leave(kv.uid)

    def _remember(self, key, value):
        """Captured decode graphs, least recently used first; a few sequences' worth (each holds its own
        small activation pool)."""
        self._graphs.pop(key, None)
        self._graphs[key] = value
        while len(self._graphs) > 2 * max(1, self.cfg.max_running):
            self._graphs.pop(next(iter(self._graphs)))

    def _to_bank(self, experts, srcs, timing) -> tuple[int, Group]:
        bank, offs = self.cache.to_bank(srcs, timing)
        return bank, self._group(experts, offs)

    def _disk_groups(self, l, r, loads, n_disk, stats, ls, timing):
        cache = self.cache
        B = cache.bank_size
        limit = max(1, min(B, self.plan.n_staging // 2))   # staging slots this layer may hold at once
        held: list[tuple[int, list[int]]] = []               # (bank, staging slots) whose copies may be in flight
        batch = []

        def flush():
            nonlocal batch
            if batch:
                bank, g = self._to_bank([x.expert for x in batch], [cache.staging_slot(x.slot) for x in batch], timing)
                self._apply(r, l, g, ls)
                cache.bank_done(bank)
                held.append((bank, [x.slot for x in batch]))
                batch = []

        for _ in range(n_disk):
            if batch and len(batch) + sum(len(s) for _, s in held) >= limit:
                flush()
            held = self._release(held, keep=limit - 1 - len(batch))   # never hold many slots while blocking
            tw = time.perf_counter()
            got = next(loads)
            dt = time.perf_counter() - tw
            ls.disk_wait_s += dt
            self._blocked += dt
            stats.disk_bytes += got.disk_bytes
            batch.append(got)
            if len(batch) == B:
                flush()
        flush()
        self._release(held, keep=0)

    def _release(self, held, keep: int):
        """Release staging slots whose bank copies finished (CUDA: event query, no sync); while more than
        `keep` slots remain held, wait for the oldest copies. Returns what is still held."""
        if not held:
            return held
        if self.cache.is_cuda:
            done = [hb for hb in held if self.cache.bank_ready_event(hb[0]).query()]
            rest = [hb for hb in held if hb not in done]
            while rest and sum(len(s) for _, s in rest) > max(keep, 0):
                tb = time.perf_counter()
                self.cache.bank_ready_event(rest[0][0]).synchronize()
                self._blocked += time.perf_counter() - tb
                done.append(rest.pop(0))
        else:
            done, rest = held, []             # CPU copies are synchronous
        if done:
            self._call(self.store.release, [s for _, slots in done for s in slots])
        return rest

    # ---- timing (the bench) -------------------------------------------------------------------------
    def _timing_start(self):
        if not self.timing:
            return time.perf_counter() if not self.cache.is_cuda else None
        if self.cache.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _timing_end(self, ev, ls):
        if ev is None:
            return
        if isinstance(ev, float):
            ls.compute_ms += (time.perf_counter() - ev) * 1e3
            return
        ev1 = torch.cuda.Event(enable_timing=True)
        ev1.record()
        self._events.append((ls, ev, ev1))

    def _collect_times(self, stats):
        for ls, ev0, ev1 in self._events:
            ls.compute_ms += ev0.elapsed_time(ev1)
        self._events = []
        for ls in stats.layers:
            if ls.copy_events and not isinstance(ls.copy_events[0], float):
                ls.copy_ms = sum(ev0.elapsed_time(ev1) for ev0, ev1 in ls.copy_events)
            else:
                ls.copy_ms = sum(ls.copy_events)
            ls.copy_events = []

    # ---- standard (baseline) -------------------------------------------------------------------
    def _standard(self, ids, kv, snap, stats, all_logits):
        outs = []
        mb = self.cfg.micro_batch
        cache = self.cache
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
                h, aux = self.model.moe_input(l, x)
                top_ids, top_w = self.model.route(l, h, chunk, self._resident_mask(snap, l))
                r = self.kern.route(h, top_ids, top_w)
                self._counts[l] += r.counts
                used = np.nonzero(r.counts.cpu().numpy())[0]
                t1 = time.perf_counter()
                ls.attn_s += t1 - t
                tiers, hslots = snap["tier"][l], snap["host_slot"][l]
                for e in used:                         # ascending id, each fetched and waited for
                    e = int(e)
                    tier = int(tiers[e])
                    stats.reads[TIER_NAMES[tier]] += 1
                    if tier == TIER_VRAM:
                        ls.vram += 1
                        g = self._group([e], [int(cache.vram_base[l, e])])
                    elif tier == TIER_HOST:
                        ls.host += 1
                        _, g = self._to_bank([e], [cache.host_slot(l, int(hslots[e]))], None)
                    else:
                        ls.disk += 1
                        tw = time.perf_counter()
                        (got,) = list(self._call(self.store.load, [(l, e)]))
                        ls.disk_wait_s += time.perf_counter() - tw
                        stats.disk_bytes += got.disk_bytes
                        _, g = self._to_bank([e], [cache.staging_slot(got.slot)], None)
                        self._sync()
                        self._call(self.store.release, [got.slot])
                    self._sync()                       # no overlap: the copy is waited for
                    tc = time.perf_counter()
                    self._apply(r, l, g, ls)
                    self._sync()
                    ls.compute_ms += (time.perf_counter() - tc) * 1e3
                x = self.model.moe_output(l, x, aux, h, self.kern.combine(r))
                ls.moe_s += time.perf_counter() - t1
            kv.commit()
            outs.append(x if all_logits else x[-1:])
        stats.layers = layer_stats
        return self.model.logits(torch.cat(outs) if all_logits else outs[-1])

    def _sync(self):
        if self.cache.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self):
        """Close the expert cache and the file, and drop every view of the store's arena (slot views, directory,
        its snapshot and mask) and the captured graphs, so the arena's memfd is unmapped once the caller lets go."""
        if self.cache is not None:
            self.cache.close()
        self.file.close()
        self.cache = self.directory = self._snap = self._masks = None
        self._graphs = OrderedDict()
        self._lanes = None
        if self.device.type == "cuda":
            self.model = None
            torch.cuda.empty_cache()
