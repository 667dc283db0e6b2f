"""The model runner: the pass drivers over the out-of-core experts, and the runner's public face for the engine.

Two schedules over the same slots, ring and kernels:
  layer_major  the whole chunk goes through layer L before L+1: per layer the dense front (attention, MoE input,
               routing: model/chunks.py), the MoE step over the three tiers (worker/moe_step.py: the VRAM group,
               host batches through the ring, disk batches as they land; one host sync per layer that is not wholly
               VRAM-resident), the back (residual). No Python loop over experts or tokens on the triton backend; the
               torch backend (CPU, the reference) loops over a group's experts.
  standard     token-major micro-batches of `micro_batch` tokens; each expert is fetched on demand and
               waited for (copy, sync, compute): the baseline the reference report compares against.
Decode: one token of several sequences in one pass (decode_batch). In the static form (CUDA; worker/lanes.py) the
dense part runs over fixed lanes; a lone forward() token in the static form replays its own graphs
(worker/decode_graphs.py). Neither the tier an expert came from, nor the order of its group, nor the batch changes
a bit (invariants 1 and 6).

Below the runner, passed in as objects: the store session (worker/store_session.py: attachment, store passes and
every consolidation rule of the worker; deepseek41's Engram feed, worker/engram_feed.py), the MoE step (worker/moe_step.py), the pass clock and stats
(worker/stats.py), the solo decode graphs (worker/decode_graphs.py) and the lanes (worker/lanes.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict
from functools import partial

import numpy as np
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError, BudgetError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.logs import event
from betelgeuse.model.chunks import Chunk, layer_back, layer_front, pass_chunks
from betelgeuse.model.interface import SequenceState, check_model
from betelgeuse.model.registry import arch_of, engine_model
from betelgeuse.store.client import StoreClient
from betelgeuse.store.plan import GRAPHS_BYTES_PER_SEQ
from betelgeuse.worker import vram_fit
from betelgeuse.worker.attach_steps import AttachSteps
from betelgeuse.worker.decode_graphs import SoloDecode
from betelgeuse.worker.flex_cache import FlexCache
from betelgeuse.worker.guess import guess_ahead
from betelgeuse.worker.lanes import Lanes
from betelgeuse.worker.moe_step import MoEStep
from betelgeuse.worker.stats import LayerStats, PassClock, PassStats
from betelgeuse.worker.store_session import StoreSession
from betelgeuse.worker.warm_decode import warm_decode

__all__ = ["LayerStats", "ModelRunner", "PassStats"]

log = logging.getLogger("betelgeuse.worker")


class ModelRunner:
    def __init__(self, cfg: EngineConfig, store: StoreClient):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and torch.get_num_threads() != 1:
            # the CPU path's bits (DESIGN.md §2) need one intra-op thread: torch's CPU GEMM with several threads
            # splits the rows by M, so a row's product depends on the batch around it (a 330-row product's rows
            # 328-329 differ from 320 + 10 rows' by ~1e-6 at 2 threads; equal at 1)
            event(log, "cpu_threads", was=torch.get_num_threads(), now=1, why="batch and chunk invariance")
            torch.set_num_threads(1)
        if self.device.type == "cuda":
            # the caching allocator's reserve, not live tensors, went over the VRAM budget (11.8 GB allocated at
            # most, 16.6 GB reserved: docs/benchmarks): expandable segments grow and reuse one mapping instead of
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
        self.model = engine_model(self.file, self.device, self.dtype)     # model/registry.py: one interface
        check_model(self.model)
        ops = getattr(self.model, "ops", None)
        if hasattr(ops, "gemv_rows"):           # TritonOps (deepseek4 on CUDA): engine.decode_gemv, per process
            from betelgeuse.kernels.triton_ds4 import GEMV_ROWS
            type(ops).gemv_rows = GEMV_ROWS if cfg.decode_gemv else 0
        # position-aligned prefill chunks (chunks.pass_chunks): prefix hits and pieces of a prompt give the same bits.
        # prefill_chunk auto = the architecture's (its class's prefill_chunk), resolved once here: the engine, its
        # scheduler and prefix cache read the runner's config and chunk (an unchunked architecture keeps "auto")
        if self.model.chunked_prefill:
            self.cfg = cfg = dataclasses.replace(cfg, prefill_chunk=cfg.chunk_for(type(self.model).prefill_chunk))
        self.chunk = cfg.prefill_chunk if self.model.chunked_prefill else None
        if self.device.type == "cuda":
            # loading dequantizes through float32 temporaries (1.2 GB for a 151936 x 2048 embedding);
            # give them back so the caching allocator does not keep them reserved beside the VRAM slots
            torch.cuda.empty_cache()
        self.clock = PassClock(self.device)
        self.session = StoreSession(cfg, store, self.file, self.device, self.dtype, self.clock)
        self._lanes: Lanes | None = None    # batched decode in the static form (worker/lanes.py), made on first use
        self._recorder = self._replayer = None   # routing hooks around the model's route() (hook_routing)
        self.flex: FlexCache | None = None  # the flex expert cache of the attachment (_flex_cache)
        # uid -> bytes of each sequence state made by new_cache / grow_cache and not released (kv_bytes adds their
        # decode graphs); the flex cache lives in the rest of the plan's reservation
        self._kv_live: dict[int, int] = {}
        # uid -> a released state kept, with its decode graphs, for the next new_cache of its size (new_cache: issue
        # 21, a new sequence replays from its first step); counted in _kv_live; oldest parked first
        self._parked: OrderedDict = OrderedDict()
        self.recycle_states = False         # park released states (attach: engine.recycle_states, on CUDA graphs)
        self.attach()
        if cfg.record_routing:
            from betelgeuse.routing.trace import Recorder, TraceWriter
            c = self.mcfg
            try:
                sink = TraceWriter(cfg.record_routing, c.n_layer, c.n_expert, c.n_expert_used,
                                   model=cfg.model_path, arch=c.arch)
            except OSError as e:
                raise BetelgeuseError(f"cannot write the routing trace {cfg.record_routing}: "
                                      f"{e.strerror or e}") from None
            self.hook_routing(recorder=Recorder(sink))

    # ---- the store -------------------------------------------------------------------------------------
    def attach(self):
        """(Re)attach to the store: map its arena, refill VRAM slots on the next pass; the expert step, the decode
        graphs and the lanes start over (their graphs read the old slot pool and pass counts).

        The compile warm-ups (issue 21; engine.warm_up, default on) run last, each guarded: one that raises is a
        warning and {"failed": error} in `warmed`, never a failed attach (its kernels compile in the first token).
        Each step's VRAM (device-wide used and torch's reserved bytes, CUDA) is measured (worker/attach_steps.py).
        Last, the VRAM budget is checked by measurement (worker/vram_fit.py, issue 21): over it, the VRAM tier is
        trimmed and the worker attaches again (_trim_vram); below the plan's floor it refuses (BudgetError).
        `warmed`: {"kernels": warm_kernels', "decode": warm_decode's, "routes": a failed warm_routes', "vram": per
        step, "warm_up": "off" when off, "vram_fit": the budget check's numbers}, None where there is nothing to say
        (the CPU, warm-ups on)."""
        self._drop_parked()         # their graphs go with the attachment: their bytes go back before the flex cache
        steps = AttachSteps(self.device)
        steps.run("session", self.session.attach)         # the slot pool: the plan's VRAM (for scale)
        if self.cfg.max_running == "auto":
            # the store's plan chose how many sequences' KV (and decode graphs) it reserved (store/plan.py
            # plan_running): the worker runs that many. It depends on the model and the VRAM side of the config
            # alone, so a re-attached store's plan gives the same number
            self.cfg = dataclasses.replace(self.cfg, max_running=self.plan.max_running)
        self.flex = steps.run("flex_cache", self._flex_cache)
        self.moe = steps.run("moe_step", lambda: MoEStep(
            self.cfg, self.session, self.clock, act_limit=self.model.expert_act[1], flex=self.flex,
            guess_depth=type(self.model).guess_depth, guess_min_hit=type(self.model).guess_min_hit,
            hash_table=self.model.hash_table() if self.cfg.prefetch_hash else None))
        warmed: dict = {}
        on = self.cfg.warm_up == "on"
        if on:
            # an approximate mode's kernels compiled now, not in a pass; decode's expert-kernel variants (issue 21)
            routes = steps.run("warm_routes", lambda: self.moe.warm_routes(self.model), guard=True)
            if routes is not None:
                warmed["routes"] = routes
            kernels = steps.run("warm_kernels", lambda: self.moe.warm_kernels(self.model), guard=True)
            if kernels is not None:
                warmed["kernels"] = kernels
        else:
            warmed["warm_up"] = "off"
        self.kern = self.moe.kern
        self._static_decode = self._static_form()
        self.solo = SoloDecode(self.model, self.moe, self.cache.is_cuda and self.cfg.cuda_graphs,
                               keep=2 * max(1, self.cfg.max_running))
        self.recycle_states = self.solo.graphs_on and self.cfg.recycle_states     # engine.recycle_states: off
        self._lanes = None
        if on:                                  # decode's dense kernels compiled now too (issue 21)
            dense = steps.run("warm_decode", self.warm_decode, guard=True)
            if dense is not None:
                warmed["decode"] = dense
        if steps.vram:
            warmed["vram"] = steps.vram
        if on and self.device.type == "cuda":
            # the warm-ups' scratch (states, activations of every T) back to the device: torch's cache would keep
            # those blocks reserved beside what serving allocates later, in sizes it may never reuse
            torch.cuda.empty_cache()
        fit = self._fit_vram()
        if fit is not None:
            warmed["vram_fit"] = fit.record()
        self.warmed = warmed or None
        comp = [(warmed.get(k) or {}).get("compiles") or {} for k in ("kernels", "decode")]
        worst = max(comp, key=lambda c: c.get("max_local") or 0)      # the most local bytes per thread (spills)
        event(log, "attach_warm", warm_up=self.cfg.warm_up, failed=",".join(steps.failed) or None,
              vram_device_torch_mib=steps.summary() or None,
              used_mib=max((v["used_mib"] for v in steps.vram.values()), default=None),
              compiles=sum(c.get("count") or 0 for c in comp), max_local_b=worst.get("max_local"),
              lmem_mib=worst.get("lmem_mib"), spilling=(worst.get("spilling") or [None])[0],
              **({} if fit is None else fit.mib("non_torch", "projected", "budget")))
        if fit is not None and fit.over > 0:
            self._trim_vram(fit)

    def _fit_vram(self) -> vram_fit.VramFit | None:
        """The worker's VRAM, measured now (after attach's warm-ups), against the plan (worker/vram_fit.py); None
        where there is no VRAM to measure (the CPU)."""
        got = vram_fit.measure(self.device)
        return None if got is None else vram_fit.check(self.plan, self.mcfg.n_expert_used, *got)

    def _trim_vram(self, fit: vram_fit.VramFit):
        """The projected peak is over the VRAM budget: the store's plan gives back VRAM slots (StoreClient.trim_vram:
        the VRAM tier's last-ranked experts leave for their host slot or disk, between passes), then the worker
        attaches again with the smaller slot pool (its warm-ups rerun, the check too: each round trims at least one
        slot per layer). Below the plan's floor the worker refuses to serve (BudgetError, the numbers)."""
        fields = dict(fit.mib(), slots_before=fit.slots_before, slots_after=fit.slots_after, floor=fit.floor)
        if fit.refused:
            event(log, "vram_refused", logging.ERROR, **fields)
            self.detach()                           # the slot pool and the store's arena let go (the model stays)
            raise BudgetError(vram_fit.refusal(fit))
        event(log, "vram_trim", logging.WARNING, **fields)
        self.store.trim_vram(fit.slots_after, fit.record())
        self.detach()                               # the old slot pool, graphs and views go before the new pool comes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.attach()

    def warm_decode(self, force: bool = False) -> dict | None:
        """Decode's dense kernel variants (the model's, the router's, the expert routing's) compiled now, on scratch
        states, in the forms the runner decodes in (worker/warm_decode.py): at attach on CUDA; force: anywhere (the
        tests). -> its seconds and compiles, {"skipped": why}, or None (no static-form decode here)."""
        return warm_decode(self, force)

    def _flex_cache(self) -> FlexCache | None:
        """The attachment's flex cache (worker/flex_cache.py) in the plan's KV reservation that running sequences
        leave unused, or None (flex_cache off, or no room); the sequences holding KV carry over a re-attach."""
        want = self.cfg.flex_cache
        on = self.cache.is_cuda if want == "auto" else bool(want)
        flex = FlexCache.for_plan(self.plan, self.mcfg.n_expert, self.device,
                                  self.cache.is_cuda and self.cfg.cuda_graphs) if on else None
        if flex is not None:
            flex.hold(self.kv_bytes)
        event(log, "flex_cache", on=flex is not None, requested=str(want),
              **(flex.describe() if flex is not None else {"why": "off" if not on else "no spare KV reservation"}))
        return flex

    @property
    def state_bytes(self) -> int:
        """Device bytes of the live sequence states' tensors (and of the parked ones: new_cache)."""
        return sum(self._kv_live.values())

    @property
    def kv_bytes(self) -> int:
        """Bytes of the plan's KV reservation the live sequences take: their states and their decode graphs (a parked
        state's too: its graphs are kept)."""
        return self.state_bytes + len(self._kv_live) * self._graph_bytes

    @property
    def _graph_bytes(self) -> int:
        """A running sequence's decode graphs, as the plan counts them (store/plan.py), or 0 without graphs."""
        return GRAPHS_BYTES_PER_SEQ if self.cache.is_cuda and self.cfg.cuda_graphs else 0

    def _state_bytes(self, max_len: int) -> int:
        """A state of max_len tokens' bytes (the plan's figure: model/registry.py state_bytes) + its graphs'."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        return arch_of(self.mcfg).state_bytes(self.mcfg, max_len, elt) + self._graph_bytes

    def _hold_kv(self, nbytes: int):
        """The sequence states take `nbytes`, or are about to: the flex cache gives that room back first (before a
        state is allocated: new_cache, grow_cache), or may grow into it again (after one is released: release)."""
        if self.flex is not None:
            self.flex.hold(nbytes)

    def _static_form(self) -> bool:
        """Decode in the static (graph-capturable) form: always on CUDA, so that whether a step was replayed from a
        graph never changes its bits (a model whose state is not fixed-shape says static_decode = False:
        model/interface.py), in every routing mode (the graphs route with MoEStep.route_static); not while routing
        hooks (recording, replay) run in Python at every layer."""
        return (self.device.type == "cuda" and self.model.static_decode
                and self._recorder is None and self._replayer is None)

    def hook_routing(self, recorder=None, replayer=None):
        """Record the routed choices (routing.trace.Recorder: written after each pass) and/or take them from a trace
        instead of the router (routing.trace.Replayer: outputs meaningless, for measuring caching and I/O on other
        routing); no arguments: the model's own routing, unrecorded. Decode leaves the static form meanwhile."""
        if self._recorder is not None and self._recorder is not recorder:
            self._recorder.close()
        route = type(self.model).route.__get__(self.model)          # the model's own
        if replayer is not None:
            route = replayer.wrap(route)
        if recorder is not None:
            route = recorder.wrap(route)
        if recorder is None and replayer is None:
            self.model.__dict__.pop("route", None)
        else:
            self.model.route = route
        self._recorder, self._replayer = recorder, replayer
        self._static_decode = self._static_form()
        self._lanes = None

    def _replay_from(self, kvs):
        """A replayed pass starts at its sequence's position in the trace (one sequence per pass)."""
        if self._replayer is not None:
            if len(kvs) != 1:
                raise BetelgeuseError("routing replay drives one sequence per pass")
            self._replayer.begin(kvs[0].length)

    @property
    def store(self) -> StoreClient:
        return self.session.store

    @store.setter
    def store(self, client: StoreClient):
        """A new client (the store restarted); attach() next."""
        self.session.store = client

    @property
    def cache(self):
        """The device slot pool (worker/expert_cache.py ExpertCache) of the current attachment."""
        return self.session.cache

    @property
    def plan(self):
        return self.session.plan

    @property
    def gpu_marks(self) -> bool:
        """PassStats.gpu_marks: the device's steps between a layer's last disk expert and the next routing (the
        bench turns it on: issue 21's disk idle chain; services/bench/disk_idle.py)."""
        return self.clock.marks

    @gpu_marks.setter
    def gpu_marks(self, on: bool):
        self.clock.marks = on

    @property
    def timing(self) -> bool:
        """Per-layer CUDA event timing (the bench turns it on)."""
        return self.clock.timing

    @timing.setter
    def timing(self, on: bool):
        self.clock.timing = on

    def new_cache(self, max_len: int | None = None) -> SequenceState:
        """The model's per-sequence state of max_len tokens (default max_context; qwen3moe: KVCache; deepseek4:
        DS4Cache, same begin/commit). Its bytes are out of the plan's KV reservation until release(): the flex cache
        gives them back first.

        Recycled where decode captures graphs (recycle_states): a released state of this size is parked (release)
        with its decode graphs (solo: SoloDecode's, keyed on its uid; lanes: its lane's attention graphs,
        Lanes.park); the next state of that size is that one, reset to a fresh state's bits in the same tensors
        (state.reset: one zeroing launch, no copy, no capture), so a new sequence replays the graphs from its first
        step (issue 21: the first two tokens of a request ran eagerly, then captured ~100 graphs). At most
        max_running states are live or parked (the plan's count of states and graph pools: invariant 3); a new state
        of another size drops the oldest parked ones to stay within it and the KV reservation."""
        n = max_len or self.cfg.max_context
        for uid in reversed(self._parked):
            kv = self._parked[uid]
            if kv.max_len == n:
                del self._parked[uid]
                kv.reset()
                return kv
        while self._parked and (len(self._kv_live) + 1 > max(1, int(self.cfg.max_running))
                                or self.kv_bytes + self._state_bytes(n) > self._kv_reserved()):
            self._drop_parked(next(iter(self._parked)))
        self._hold_kv(self.kv_bytes + self._state_bytes(n))
        try:
            kv = self.model.new_cache(n)
        except BaseException:
            self._hold_kv(self.kv_bytes)
            raise
        self._live(kv)
        return kv

    def grow_cache(self, kv: SequenceState, max_len: int) -> SequenceState:
        """A live state grown to max_len tokens (model.grow_cache, state_grows): the same tokens in a larger state,
        which replaces it (the old one is consumed). The flex cache makes room first for the new state and the one
        layer's tensors the copy holds twice, or, where that would pass the plan's KV reservation (the others hold
        theirs), the copy goes through host memory and holds nothing twice. The old state's graphs (solo, its lane's
        attention) go; its lane stays."""
        assert self.model.state_grows and max_len > kv.max_len, (type(self.model).__name__, max_len, kv.max_len)
        old = self._kv_live.pop(kv.uid)
        need, twice = self.kv_bytes + self._state_bytes(max_len), -(-old // self.mcfg.n_layer)
        via_host = need + twice > self._kv_reserved()
        self._hold_kv(need + (0 if via_host else twice))
        try:
            new = self.model.grow_cache(kv, max_len, via_host)
        except BaseException:
            self._kv_live[kv.uid] = old
            self._hold_kv(self.kv_bytes)
            raise
        self._live(new)
        if self.solo is not None:
            self.solo.release(kv.uid)
        if self._lanes is not None:
            self._lanes.rebind(kv.uid, new)
        event(log, "kv_grow", logging.DEBUG, tokens=new.length, max_len=new.max_len, old_max_len=kv.max_len,
              bytes=new.nbytes(), kv_bytes=self.kv_bytes, via_host=via_host)
        return new

    def _kv_reserved(self) -> int:
        """The plan's bytes for max_running sequences' states and graphs (what the states and the flex cache share)."""
        return self.plan.vram_parts.get("kv", 0) + self.plan.max_running * self._graph_bytes

    def _live(self, kv: SequenceState):
        """A state just allocated is live: its bytes counted, and the flex cache held to exactly what they are."""
        self._kv_live[kv.uid] = kv.nbytes()
        self._hold_kv(self.kv_bytes)

    def consolidate(self):
        """Consolidate now (with the decode usage of the open store pass, if any); never waits for one still filling."""
        self.session.consolidate()

    def settle(self, timeout: float | None = None) -> float:
        """Wait until the store is quiet (StoreSession.settle: consolidation applied and its VRAM fills done, no read
        in flight) -> seconds waited."""
        return self.session.settle(timeout)

    def settle_step(self) -> str:
        """One bounded step of idle settling (StoreSession.settle_step: one layer's VRAM fills) -> "step", "wait"
        (a consolidation still filling in the store) or "done"."""
        return self.session.settle_step()

    def release(self, kv):
        """A sequence is done: drop its captured decode graphs (solo, and its batched-decode lane with its attention
        graphs) and their memory pools now, not when an LRU bound reaches them (the slot plan counts graphs for
        max_running sequences). With recycle_states its state is parked instead, its graphs kept, for the next
        new_cache of its size (new_cache); the caller lets go of it either way."""
        if self.recycle_states and kv.uid in self._kv_live:
            self._parked[kv.uid] = kv
            if self._lanes is not None:
                self._lanes.park(kv.uid)
            return
        self._forget(kv)

    def _drop_parked(self, uid: int | None = None):
        """A parked state (default: every one) goes, with its graphs; its bytes go back to the flex cache."""
        for u in ([uid] if uid is not None else list(self._parked)):
            self._forget(self._parked.pop(u))

    def _forget(self, kv):
        """kv's bytes uncounted (the flex cache may grow into them), its graphs dropped."""
        self._kv_live.pop(kv.uid, None)
        self._hold_kv(self.kv_bytes)
        if self.solo is not None:
            self.solo.release(kv.uid)
        if self._lanes is not None:
            self._lanes.leave(kv.uid)

    def warm_graphs(self, max_len: int, lanes: bool) -> dict | None:
        """Decode's graphs captured now over a state of max_len tokens (issue 21: vLLM captures its decode graphs at
        start), so the next sequence of that size (new_cache: this state, recycled) replays from its first step: two
        decode steps of token 0 from position 0 (eager, then captured) in the form the caller decodes in (lanes:
        decode_batch, the engine's; else forward(), the bench's), then the state released and the store pass closed
        without consolidation (a request that ended without decoding: request_done). Real passes: token 0's experts
        are read and counted like any decode's. -> {"seconds", "captured" (graphs, worker/graphs.py), "max_len",
        "form"}, or None where decode captures no graphs (recycle_states off: the CPU, cuda_graphs off) or the state
        does not fit beside the live ones."""
        if not self.recycle_states or not self._static_decode:
            return None
        if len(self._kv_live) - len(self._parked) >= max(1, int(self.cfg.max_running)):
            return None
        from betelgeuse.worker.graphs import CAPTURED
        t, c0 = time.perf_counter(), CAPTURED[0]
        kv = self.new_cache(max_len)
        try:
            for _ in range(2):
                if lanes:
                    self.decode_batch([0], [kv])
                else:
                    self.forward([0], kv, consolidate=False)
        finally:
            others = len(self._kv_live) - len(self._parked) - 1         # live states but this one
            self.request_done(kv, others_running=others > 0, decoded=False)
        out = {"seconds": time.perf_counter() - t, "captured": CAPTURED[0] - c0, "max_len": max_len,
               "form": "lanes" if lanes else "solo"}
        event(log, "warm_graphs", logging.INFO, seconds=round(out["seconds"], 3), captured=out["captured"],
              max_len=max_len, form=out["form"])
        return out

    def request_done(self, kv, others_running: bool, decoded: bool = True):
        """A request ended: release its sequence (release) and apply the end-of-request consolidation rule
        (StoreSession.request_done: only when it decoded and no other sequence runs). May raise
        StoreUnavailableError (the store went away); a release that raises still applies the rule, then raises
        (else an idle worker would keep its store pass open and the directory frozen)."""
        try:
            self.release(kv)
        finally:
            self.session.request_done(others_running, decoded)

    # ---- one pass ---------------------------------------------------------------------------
    def forward(self, ids: list[int], kv: SequenceState, all_logits: bool = False, consolidate: bool = True,
                schedule: str | None = None, should_stop=None) -> tuple[torch.Tensor, PassStats]:
        """ids [T] -> logits [T or 1, n_vocab] float32 and the pass's stats; appends to kv.
        consolidate=True closes the store pass with consolidation (a prefill); False keeps it open (decode).
        should_stop() is called between layers and may raise (cancellation): the pass is abandoned,
        the KV cache is left uncommitted and the store's pass is closed without consolidation."""
        schedule = schedule or self.cfg.schedule
        if schedule == "standard" and len(ids) > 1:
            ids_t = self.model.check_ids(ids)
            self._replay_from([kv])
            logits, stats = self._pass(PassStats("prefill", schedule, len(ids)), consolidate, should_stop,
                                       lambda snap, stats: [self._standard(ids_t, kv, snap, stats, all_logits)])
        else:
            logits, stats = self.prefill_batch([(ids, kv)], all_logits, consolidate, should_stop, schedule)
        return logits[0], stats

    def prefill_batch(self, parts: list[tuple[list[int], SequenceState]], all_logits: bool = False,
                      consolidate: bool = True, should_stop=None,
                      schedule: str = "layer_major") -> tuple[list[torch.Tensor], PassStats]:
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
        self._replay_from([kv for _, kv in parts])
        return self._pass(stats, consolidate, should_stop,
                          lambda snap, stats: self._layer_major(idss, [kv for _, kv in parts], snap, stats, all_logits),
                          [int(ids[0]) for ids, _ in parts] if stats.kind == "decode" else None)

    def _pass(self, stats: PassStats, consolidate: bool, should_stop, work, tokens: list[int] | None = None):
        """One store-backed pass: open (or go on with) the store pass, work(snap, stats) -> a list of logits (made
        float32), the end sync, the usage; an exception closes the store pass first. tokens: a decode step's token
        per sequence (host ints): its hash-routed layers' disk reads start first (MoEStep.hash_ahead)."""
        self.should_stop = should_stop or (lambda: None)
        start = self._begin()
        try:
            snap = self.session.begin(stats)
            if tokens:
                self.moe.hash_ahead(tokens, snap, stats)
            logits = [x.float() for x in work(snap, stats)]
            counts = self.session.end_counts()
        except BaseException:
            self._abandon()
            raise
        self._end(stats, counts, consolidate, *start)
        return logits, stats

    def _begin(self) -> tuple[int, int]:
        """The pass's clock starts -> (h2d bytes, store calls) so far."""
        self.clock.begin()
        if self.session.engram is not None:
            self.session.engram.take_stats()
        return self.cache.h2d_bytes, self.session.calls

    def _engram_begin(self, pieces, chunk: int | None = None) -> None:
        """deepseek41 (an EngramModel): the pass's pieces [(cache, ids)] are known (caches begun), each run in
        position-aligned chunks of `chunk` tokens (None: whole): hash them and start their Engram reads, so they
        run under the layers before the first Engram layer."""
        if self.session.engram is not None:
            self.session.engram.begin(self.model, pieces, chunk)

    def _engram_stage(self, kvs, ids_t: torch.Tensor, lanes: torch.Tensor | None = None, n_lanes: int = 0) -> None:
        """A static decode step (one token per sequence, ids_t [n]): its Engram rows hashed, read and staged into
        fixed device buffers before the layers (Deepseek41Model.engram_stage; the lanes' too), so no host lookup
        sits inside the captured graphs."""
        if self.session.engram is not None:
            self._engram_begin([(kv, ids_t[i:i + 1]) for i, kv in enumerate(kvs)])
            self.model.engram_stage(kvs, lanes, n_lanes)

    def _end(self, stats: PassStats, counts: np.ndarray, consolidate: bool, h2d0: int, calls0: int):
        """After a pass's end sync: the VRAM reads of wholly resident layers (known only now), the store pass
        (StoreSession.end: consolidation after a prefill, the decode cadence) and the pass's figures."""
        for l, ls in enumerate(stats.layers):
            if not ls.synced:
                ls.vram = int((counts[l] > 0).sum())
                stats.reads["vram"] += ls.vram
        self.session.end(counts, consolidate)
        eng = self.session.engram
        if eng is not None:
            stats.engram = eng.take_stats()
            self.clock.blocked += stats.engram.wait_s
        self.clock.finish(stats)
        stats.store_calls = self.session.calls - calls0 + (2 * stats.engram.requests if eng is not None else 0)
        stats.h2d_bytes = self.cache.h2d_bytes - h2d0
        stats.disk_wait_s += sum(x.disk_wait_s for x in stats.layers)
        if self._recorder is not None:
            self._recorder.flush()

    def _abandon(self):
        if self.moe is not None:
            self.moe.gate_abandon()         # a step launched ahead finishes on the device (worker/gate.py)
        self.clock.abandon()
        self.session.abandon()
        if self._recorder is not None:
            self._recorder.discard()                # the abandoned pass's rows (some layers only)

    def decode_batch(self, tokens: list[int], kvs: list[SequenceState]) -> tuple[torch.Tensor, PassStats]:
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
        self._replay_from(kvs)
        stats = PassStats("decode", "layer_major", n)
        start = self._begin()
        static = self._static_decode
        sb = self.kern.sub_batch
        gated: list = []              # decode_gate on CUDA: the layers launched ahead, to drain (_drain_gated)
        try:
            snap = self.session.begin(stats)
            self.moe.hash_ahead([int(t) for t in tokens], snap, stats)   # before any layer (MoEStep.hash_ahead)
            self.kern.sub_batch = 1
            if static:                              # CUDA: row-batched dense part over fixed lanes (worker/lanes.py)
                ln = self._lane_set()
                idx = ln.join(kvs)
                for kv in kvs:
                    kv.begin_static()
                self._engram_stage(kvs, ids_t, idx, ln.B)
                self.moe.refresh_static(snap)
                self.moe.hand_refresh(snap, n)
                self.moe.gate_begin()
                if self.moe.gate is not None:     # the host catches up before any launch that is not a replay
                    ln.before_host = lambda: self._drain_gated(gated, snap, stats)
                variant = self.moe.static_variant()
                if self._lane_fold():       # which layers' post parts hold the fold: the all-VRAM pattern's
                    variant = (variant, self.cache.all_vram.tobytes())
                ln.begin(ids_t, kvs, idx, variant)
            else:
                pos = [kv.begin(1) for kv in kvs]
                self._engram_begin([(kv, ids_t[i:i + 1]) for i, kv in enumerate(kvs)])
                xs = [self.model.embed(ids_t[i:i + 1]) for i in range(n)]
            for l in range(self.mcfg.n_layer):
                ls = LayerStats()
                if static:
                    self._lane_layer(ln, l, kvs, snap, stats, ls, gated)
                else:
                    xs = self._rows_layer(l, xs, ids_t, kvs, pos, snap, stats, ls)
                stats.layers.append(ls)
            for kv in kvs:
                kv.commit()
            logits = (ln.head(kvs, self.kern.combine) if static
                      else torch.cat([self.model.logits(x) for x in xs])).float()
            self._drain_gated(gated, snap, stats)   # decode_gate on CUDA: the step is launched; the misses now
            if static and self.moe.gate is not None:
                self.moe.gate_end()
            counts = self.session.end_counts()
        except BaseException:
            self._abandon()
            raise
        finally:
            self.kern.sub_batch = sb
            if static:
                ln.before_host = None
        self._end(stats, counts, False, *start)
        return logits, stats

    def _lane_layer(self, ln: Lanes, l: int, kvs, snap, stats, ls: LayerStats, gated: list):
        """Layer l of a batched decode on the lanes: the dense part, the routing of the running rows and the previous
        layer's combine in the lane graphs; then the experts, eagerly (MoEStep.experts)."""
        t = time.perf_counter()
        gate = self.moe.gate
        # the fold (engine.decode_fold, _lane_fold): post[l] ends with the sync's start and the at-hand group
        # (MoEStep.hand_front), timed here as the layer's attention part
        fold = self._lane_fold() and self.moe.hand_layer(l)
        r, guess = ln.front(l, kvs, self.moe.route_rows, self.kern.combine,
                            partial(self.clock.mark, "attn", l) if self.clock.marks else None,
                            self.moe.hand_front if fold else None)
        t1 = time.perf_counter()
        ls.attn_s = t1 - t
        if gate is not None and self.moe.hand_layer(l):    # gated (worker/gate.py): ahead where its part replays
            ahead = ln.replays("gate", l, kvs)              # never on the CPU (no graphs): drained at once
            gate.set_ahead(ahead)
            ln.part("gate", l, kvs, self.moe.gate_layer, r, guess)
            gated.append((l, r, self.moe.guess_shape(l, guess), ls, ahead))
            if not ahead:               # eager or captured (or the CPU): drained where its gate stands
                self._drain_gated(gated, snap, stats)
            ln.part("miss", l, kvs, self.moe.gate_misses, r)       # the misses' group, after the gate
        elif fold:                        # the sync's start and the at-hand group ran in post[l]: the misses
            self.moe.hand_experts(l, r, snap, stats, ls, guess, None)
        elif self.moe.hand_layer(l):      # the at-hand group in a lane graph, the host for the misses only
            self.moe.hand_experts(l, r, snap, stats, ls, guess, lambda: ln.part("hand", l, kvs, self.moe.hand_group, r))
        else:
            if gated:                   # eager expert work: the gates launched ahead are drained first
                self._drain_gated(gated, snap, stats)
            self.moe.experts(l, r, snap, stats, ls, guess)
        ls.moe_s = time.perf_counter() - t1

    def _lane_fold(self) -> bool:
        """The lanes take each at-hand layer's routing-sync start and at-hand group at the end of its post part
        (MoEStep.hand_fold: engine.decode_fold, not with gpu_marks; not gated, whose parts are its own): one replay
        and one host part a layer fewer (issue 21). The one pinned buffer of moe.graph_sync (sized for max_running
        rows' guesses) is written by every folded layer; what orders its reuse: layer l's post part writes it and
        records the event, hand_misses waits on that event and finish() copies the counts out and turns the guesses
        into lists before it returns, and only then does the host launch layer l+1's parts (program order) whose
        post part writes it next; the next step's first write comes after this step's end_counts sync."""
        return self.moe.gate is None and self.moe.hand_fold()

    def _drain_gated(self, gated: list, snap, stats: PassStats):
        """decode_gate: the gated layers launched so far drained in order (MoEStep.gate_drain), the list emptied."""
        for l, r, shape, ls, ahead in gated:
            self.moe.gate_drain(l, r, shape, snap, stats, ls, armed=ahead)
        gated.clear()

    def _rows_layer(self, l: int, xs, ids_t, kvs, pos, snap, stats, ls: LayerStats):
        """Layer l of a batched decode, each sequence's dense part alone (the ops of its solo decode), the MoE over
        all rows -> the sequences' residuals [1,H] each."""
        t = time.perf_counter()
        m = self.model
        hs, auxs, tids, tws = [], [], [], []
        for i in range(len(kvs)):
            xs[i] = m.attention_block(l, xs[i], kvs[i], pos[i])
            h, aux = m.moe_input(l, xs[i])
            ti, tw = m.route(l, h, ids_t[i:i + 1], self.moe.residency(snap, l))
            hs.append(h), auxs.append(aux), tids.append(ti), tws.append(tw)
        guess = self._guess(l, torch.cat(xs), ids_t, snap)
        t1 = time.perf_counter()
        ls.attn_s = t1 - t
        routed = self.moe.layer(l, torch.cat(hs), torch.cat(tids), torch.cat(tws), snap, stats, ls, False,
                                guess=guess)
        ls.moe_s = time.perf_counter() - t1
        return [m.moe_output(l, xs[i], auxs[i], hs[i], routed[i:i + 1]) for i in range(len(kvs))]

    def _guess(self, l: int, x, ids, snap):
        """Layers l+1 .. l+D's guessed experts [T,D,k] from x, the residual after layer l's attention
        (worker/guess.py), where worth it (MoEStep.wants_guess; not while a routing replay stands in for the router),
        else None; an approximate mode's guess is its own choice over the snapshot's resident sets."""
        if self._replayer is None and self.moe.wants_guess(l):
            return guess_ahead(self.model, l, x, ids, self.moe.depth, self.mcfg.n_layer,
                               self.moe.guess_route(self.model, snap))
        return None

    @property
    def decodes_in_lanes(self) -> bool:
        """decode_batch runs the static form's lanes (worker/lanes.py), whose bits differ from forward()'s one-row
        decode: the engine then decodes a lone sequence with decode_batch as well."""
        return self._static_decode

    def _lane_set(self) -> Lanes:
        """The batched decode lanes (max_running of them; their graphs are captured once per attachment)."""
        if self._lanes is None:
            if not self.model.lane_decode:
                raise BetelgeuseError(f"{self.mcfg.arch}: no row-batched decode (lane_decode) for the static form")
            self._lanes = Lanes(self.model, self.mcfg.n_layer, max(1, self.cfg.max_running),
                                self.cache.is_cuda and self.cfg.cuda_graphs, guess=self.moe.depth,
                                router=self.moe.route_static, guess_route=self.moe.guess_route(self.model))
        return self._lanes

    # ---- layer-major --------------------------------------------------------------------------
    def _layer_major(self, idss, kvs, snap, stats, all_logits) -> list[torch.Tensor]:
        """Pieces idss [T_i] of sequences kvs in one pass -> each piece's logits (all rows or its last)."""
        if len(idss) == 1 and idss[0].numel() == 1 and self._static_decode:
            self._engram_stage(kvs, idss[0])
            return [self.solo.decode(idss[0], kvs[0], snap, stats)]
        chunks, ends = [], []                       # every piece's chunks, rows offset into the pass; piece ends
        for ids, kv in zip(idss, kvs):
            a, start = (ends[-1] if ends else 0), kv.length
            positions = kv.begin(ids.numel())
            chunks += [Chunk(a + c.a, a + c.b, c.positions, kv) for c in pass_chunks(positions, start, self.chunk)]
            ends.append(a + ids.numel())
        self._engram_begin(list(zip(kvs, idss)), self.chunk)
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
            mark = partial(self.clock.mark, "attn", l) if self.clock.marks else None   # PassStats.gpu_marks
            x, h, auxs, top_ids, top_w = layer_front(self.model, l, x, kvs[0], chunks, ids,
                                                     self.moe.residency(snap, l), mark)
            t1 = time.perf_counter()
            ls.attn_s = t1 - t
            # decode (few rows, no read-ahead of the whole next layer): guess the next layers' experts instead
            guess = None if readahead else self._guess(l, x, ids, snap)
            routed = self.moe.layer(l, h, top_ids, top_w, snap, stats, ls, readahead, chunks, guess)
            x = layer_back(self.model, l, x, auxs, h, routed, chunks)
            ls.moe_s = time.perf_counter() - t1
            stats.layers.append(ls)
        for kv in kvs:
            kv.commit()
        # the head per piece (its own rows only: a matmul's bits may depend on its row count)
        return [self.model.logits(x[a:b] if all_logits else x[b - 1:b]) for a, b in zip([0] + ends[:-1], ends)]

    # ---- standard (baseline) -------------------------------------------------------------------
    def _standard(self, ids, kv, snap, stats, all_logits):
        outs = []
        mb = self.cfg.micro_batch
        m = self.model
        layer_stats = [LayerStats() for _ in range(self.mcfg.n_layer)]
        for s in range(0, ids.numel(), mb):
            self.should_stop()
            chunk = ids[s:s + mb]
            positions = kv.begin(chunk.numel())
            self._engram_begin([(kv, chunk)])
            x = m.embed(chunk)
            for l in range(self.mcfg.n_layer):
                ls = layer_stats[l]
                t = time.perf_counter()
                x = m.attention_block(l, x, kv, positions)
                h, aux = m.moe_input(l, x)
                top_ids, top_w = m.route(l, h, chunk, self.moe.residency(snap, l))
                r = self.moe.route_rows(l, h, top_ids, top_w)
                used = np.nonzero(r.counts.cpu().numpy())[0]
                t1 = time.perf_counter()
                ls.attn_s += t1 - t
                self.moe.serial(l, r, used, snap, stats, ls)
                x = m.moe_output(l, x, aux, h, self.kern.combine(r))
                ls.moe_s += time.perf_counter() - t1
            kv.commit()
            outs.append(x if all_logits else x[-1:])
        stats.layers = layer_stats
        return m.logits(torch.cat(outs) if all_logits else outs[-1])

    def detach(self):
        """Let go of the store while keeping the model: unmap its arena and free the slot pool, with every captured
        graph (the bench swaps stores under one memory limit). Set `store` and attach() to go on."""
        self.clock.sync()
        self._let_go()
        self.kern = None                    # its weights_fn holds the slot pool

    def _let_go(self):
        """Drop every view of the store's arena (slot pool, directory, its snapshot, the mask) and the captured
        graphs, so the arena's memfd is unmapped once the caller lets go (the kernels stay: callers read
        kern.backend after a close)."""
        self._drop_parked()                         # their graphs read the slot pool: they go with it
        self.session.close()
        self.moe = self.solo = self._lanes = None
        if getattr(self, "flex", None) is not None:
            self.flex.clear()                        # its chunks go with the slot pool (the held count stays)

    def close(self):
        """Close the slot pool and the file (_let_go) and a routing recorder; on CUDA the model's weights go too."""
        self._let_go()
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        self.file.close()
        if self.device.type == "cuda":
            self.model = None
            torch.cuda.empty_cache()
