"""The worker's engine: a busy loop of steps fed by a bounded queue (vLLM v1's engine core, nano-vllm's LLMEngine).

    submit() ─► inputs (RequestProcessor: checks, tokens, constraints -> a Sequence, on the caller's thread)
            ─► the queue (bounded) ─► step():  plan = scheduler.schedule()     what the step does (no torch)
                                               the ended finish, the admitted get their KV caches
                                               for each pass of the plan: run it on the runner,
                                                   outputs (OutputProcessor) turn its logits into tokens and events
            ─► a request that ends: its final event, then runner.request_done (its graphs; the consolidation rule)

The rooms: worker/inputs.py (requests in), worker/scheduler.py (the policy), worker/kv_manager.py (KV caches and
the prefix cache), worker/outputs.py (tokens, events, usage, the log line, metrics), the runner (the passes). This
module keeps the loop, the queue, each pass's failure boundary (invariant 7), the store going away and coming back,
and drain.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from betelgeuse import __version__, gc_pauses
from betelgeuse.api import GenerateRequest, ModelInfo, ServerInfo
from betelgeuse.config import EngineConfig
from betelgeuse.errors import (BetelgeuseError, CancelledError, InternalError, QueueFullError, ShuttingDownError,
                               StoreUnavailableError)
from betelgeuse.gguf.qtypes import qtype_name
from betelgeuse.logs import event
from betelgeuse.reasoning import dialect_for
from betelgeuse.store.client import StoreClient
from betelgeuse.tokenizer import Tokenizer
from betelgeuse.worker.inputs import RequestProcessor
from betelgeuse.worker.kv_manager import KVManager
from betelgeuse.worker.outputs import Finish, OutputProcessor
from betelgeuse.worker.runner import ModelRunner, PassStats
from betelgeuse.worker.scheduler import Limits, Pass, Scheduler
from betelgeuse.worker.sequence import RequestHandle, Sequence, check_alive

log = logging.getLogger("betelgeuse.engine")

SETTLE_POLL_S = 0.02     # idle, with a consolidation still reading in the store: how often to look for it landed


class LLMEngine:
    def __init__(self, cfg: EngineConfig, store: StoreClient, metrics=None, on_tick=None, on_state=None,
                 on_pass=None):
        self.cfg = cfg
        self.on_state = on_state                    # on_state(ready: bool) when the store goes away / comes back
        self.on_tick = on_tick                      # called every loop turn (watchdog ping)
        self.on_pass = on_pass                      # on_pass(PassStats) after every pass that completed (the bench)
        self.draining = False                       # set by drain(): new work is refused
        self.last_tick = time.monotonic()           # the loop's heartbeat (watchdog: is the engine stuck?)
        self.metrics = metrics
        self.runner = ModelRunner(cfg, store)
        # max_running = auto is resolved by the store's plan on attach: the engine runs the runner's number
        cfg = self.cfg = self.runner.cfg
        self.tokenizer = Tokenizer.from_metadata(self.runner.file.metadata)
        # how this model family writes reasoning and tool calls (its chat template says; the arch if it has none)
        self.dialect = dialect_for(self.tokenizer.chat_template, self.runner.mcfg.arch)
        self.inputs = RequestProcessor(cfg, self.runner.mcfg, self.tokenizer, self.dialect)
        self.kv_manager = KVManager(cfg, self.runner, metrics)
        self.outputs = OutputProcessor(metrics, cfg.routing)
        self.warmed_graphs = self._warm_graphs()
        self.scheduler = Scheduler(
            Limits(cfg.max_running, cfg.max_batched_tokens, cfg.prefill_pass_tokens, self.runner.chunk or 1,
                   one_prefill=cfg.schedule == "standard", admission_window=cfg.admission_window),
            self.kv_manager.hit if self.kv_manager.prefix is not None else None,
            lambda: self.runner.decodes_in_lanes)
        self.cv = threading.Condition()             # guards the queue (submit adds, schedule admits)
        self.store_ok = True
        self.store_why = ""                          # why the store is unavailable (its last error), for refusals
        self.started = time.monotonic()
        self._stop = False
        self._store_lost: StoreUnavailableError | None = None   # set by a health probe on another thread
        self._reattach_lock = threading.Lock()
        self._reattaching = False                # one re-attach thread at a time (_store_down)
        # idle settling: while nothing runs or waits, the store's pending consolidation and the VRAM fills it left
        # are advanced a step (one layer) per loop turn, so a request after an idle gap finds the store settled
        self.settle_idle = True
        self._unsettled = False                     # work may remain (set by every busy turn, cleared by "done")
        self.settle_steps = 0                       # idle settle steps that filled a layer (all time)
        self._settle_run, self._settle_t0 = 0, 0.0  # steps of the idle settling under way and when it began
        self._gauges()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def _warm_graphs(self) -> dict | None:
        """Decode's graphs captured now (warm_up on; ModelRunner.warm_graphs: on CUDA with graphs) over a state of the
        kv manager's smallest size (one granule: a request whose prompt and output fit it), so the first such request
        replays from its first decode token as later ones do (issue 21). Guarded like the compile warm-ups: one that
        raises is a warning and {"failed": error} (its graphs are captured in a request's first tokens)."""
        try:
            if self.cfg.warm_up != "on":
                return None
            return self.runner.warm_graphs(self.kv_manager.state_size(1), lanes=self.runner.decodes_in_lanes)
        except Exception as e:                      # noqa: BLE001 -- a warm-up never fails the start
            log.warning("decode graphs warm-up failed: %s", e)
            return {"failed": f"{type(e).__name__}: {e}"}

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def prefix_cache(self):
        return self.kv_manager.prefix

    # ---- requests in --------------------------------------------------------------------------
    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as checked token ids (the Anthropic front counts tokens with it)."""
        return self.inputs.prompt_ids(req)

    def submit(self, req: GenerateRequest, deadline: float | None = None) -> RequestHandle:
        try:
            return self._submit(req, deadline)
        except BetelgeuseError as e:            # refused before it was queued: still one line
            event(log, "request", logging.WARNING, id=req.request_id or None, status="rejected",
                  error=" ".join(str(e).split()), error_type=type(e).__name__)
            raise

    def _submit(self, req: GenerateRequest, deadline: float | None) -> RequestHandle:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        self.inputs.check(req)
        self._check_queue()                     # cheap, before the tokenizing work
        ids = self.inputs.prompt_ids(req)
        room = self.inputs.room(req, ids)
        if not self.store_ok:
            raise StoreUnavailableError(f"the expert store is unavailable ({self.store_why or 'restarting'}); retry "
                                        "when health is SERVING")
        seq = self.inputs.sequence(req, ids, room, deadline)
        with self.cv:
            self._check_queue()
            self.scheduler.add(seq)
            self.cv.notify_all()
        self._gauges()
        return RequestHandle(seq, self._wake)

    def _check_queue(self):
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFullError(f"the request queue is full ({self.cfg.max_queue} waiting); retry later")

    def _wake(self):
        with self.cv:
            self.cv.notify_all()

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self):
        while not self._stop:
            self.last_tick = time.monotonic()
            if self.on_tick:
                self.on_tick()
            if self._store_lost is not None:
                err, self._store_lost = self._store_lost, None
                if self.store_ok:
                    self._store_down(err)
            with self.cv:
                idle = not self.waiting and not self.running
                if idle and not self._unsettled:
                    self.cv.wait(0.5)
                    continue
            if idle:
                self._settle_idle()
                continue
            self._unsettled, self._settle_run = self.settle_idle, 0     # a busy turn: settle again once idle
            try:
                self.step()
            except Exception:                        # noqa: BLE001
                # a bug that no sequence's own boundary caught (invariant 7): fail the sequences of the
                # pass in flight, keep the waiting ones, keep serving
                log.exception("engine step failed")
                for seq in list(self.running):
                    self._end(seq, Finish.failed(InternalError("internal error in the engine; see the worker log")))

    def _settle_idle(self):
        """One idle settle step (StoreSession.settle_step); the loop checks the queue between steps, so a request
        that arrives waits for at most one step (one layer's VRAM fills). While only the store's consolidation is
        left (its reads land in the store), the loop waits on the queue for SETTLE_POLL_S before asking again."""
        if not self.store_ok:
            self._unsettled = False                  # the re-attach sets it again
            return
        try:
            got = self.runner.settle_step()
        except StoreUnavailableError as e:
            self._store_down(e)
            return
        except Exception:                            # noqa: BLE001 (the next request's pass does the fills)
            log.exception("idle settling failed")
            self._unsettled = False
            return
        if got == "step":
            if not self._settle_run:
                self._settle_t0 = time.perf_counter()
            self.settle_steps += 1
            self._settle_run += 1
        elif got == "wait":
            with self.cv:
                if not self.waiting:
                    self.cv.wait(SETTLE_POLL_S)
        else:
            self._unsettled = False
            if self._settle_run:
                log.info("settled while idle: %d layer(s) of VRAM fills in %.3f s", self._settle_run,
                         time.perf_counter() - self._settle_t0)
                self._settle_run = 0

    def step(self):
        """Schedule, then carry the plan out: end, admit, and each pass run and its outputs processed in turn."""
        with self.cv:
            plan = self.scheduler.schedule()
            if plan.hold:                   # idle: the rest of a burst may still arrive (Limits.admission_window)
                self.cv.wait(plan.hold)
        for seq in plan.ended:
            self._end(seq, Finish("cancelled"))
        for seq in plan.admitted:
            self._admit(seq)
        for work in plan.passes():          # the prefill pass, then the decode pass (without who ended meanwhile)
            if work.kind != "prefill":
                work = self._make_room(work)
                if work is None:
                    continue
            logits = self._run(work)
            if logits is not None:
                self._process(work, logits)
        self._gauges()

    def _admit(self, seq: Sequence):
        """The sequence's KV cache, its cached prefix copied in; a whole cached prompt's first token now (no pass)."""
        self.outputs.admitted(seq)
        self.kv_manager.admit(seq)
        if not seq.prefilling:
            self.outputs.prompt_done(seq)
            self._token(seq, self.kv_manager.cached_logits(seq))

    def _make_room(self, work: Pass) -> Pass | None:
        """Before a decode pass: each state with room for its token (KVManager.make_room: grown where full). A growth
        that fails ends its own sequence only (invariant 7) -> the pass without it (None: nobody left)."""
        keep = []
        for seq in work.seqs:
            try:
                self.kv_manager.make_room(seq)
                keep.append(seq)
            except BetelgeuseError as e:
                self._end(seq, Finish.failed(e))
            except Exception:                        # noqa: BLE001 (the device out of memory, say)
                log.exception("growing the state of request %s failed", seq.request.request_id or seq.seq_id)
                self._end(seq, Finish.failed(InternalError("internal error growing the request's KV cache; see the "
                                                           "worker log")))
        if len(keep) == len(work.seqs):
            return work
        return Pass(work.kind, keep, [1] * len(keep)) if keep else None

    def _beat(self, seq: Sequence):
        """Between layers: the engine is alive (watchdog), and the sequence still wanted (may raise)."""
        self.last_tick = time.monotonic()
        check_alive(seq)

    def _run(self, work: Pass) -> list[torch.Tensor] | None:
        """One pass of the plan on the runner -> the last-position logits [n_vocab] of each of its sequences.
        A cancelled or expired sequence stops it between layers and is finished; the others lose only the pass
        (nothing was committed: the next step redoes it). Any other failure cannot be pinned on one of several
        sequences: it fails all of them (invariant 7); the engine and the waiting ones go on. Returns None when the
        pass did not complete."""
        seqs = work.seqs
        what = {"prefill": "a prefill pass", "solo": "a decode pass"}.get(
            work.kind, f"a batched decode pass of {len(seqs)} requests")

        def should_stop():
            for seq in seqs:
                self._beat(seq)
        try:
            logits, st = self._execute(work, should_stop)
        except CancelledError:
            for seq in [s for s in seqs if s.cancelled or s.expired] or seqs:
                self._end(seq, Finish("cancelled"))
            return None
        except StoreUnavailableError as e:
            self._store_down(e)
            return None
        except BetelgeuseError as e:
            for seq in seqs:
                self._end(seq, Finish.failed(e))
            return None
        except Exception:                            # noqa: BLE001 (a bug or a bad value in this pass)
            log.exception("%s of %s failed", what, ", ".join(str(s.request.request_id or s.seq_id) for s in seqs))
            for seq in seqs:
                self._end(seq, Finish.failed(InternalError(f"internal error in {what}; see the worker log")))
            return None
        for i, seq in enumerate(seqs):
            self.outputs.account(seq, st, count_metrics=i == 0)    # each request waited the whole pass; metrics once
        if self.on_pass is not None:
            self.on_pass(st)
        return logits

    def _execute(self, work: Pass, stop) -> tuple[list[torch.Tensor], PassStats]:
        """The runner call for a pass: prefill_batch over the pieces (forward() for one piece: the standard schedule
        prefills through it), decode_batch over the decoders, or forward()'s one-row decode of a lone one."""
        r = self.runner
        if work.kind == "prefill":
            parts = [(s.prompt_ids[s.n_done:s.n_done + t], s.kv) for s, t in work.pieces]
            if len(parts) == 1:
                lg, st = r.forward(*parts[0], consolidate=True, should_stop=stop)
                return [lg[-1]], st
            lgs, st = r.prefill_batch(parts, consolidate=True, should_stop=stop)
            return [lg[-1] for lg in lgs], st
        if work.kind == "batch":            # a sequence's logits do not depend on its batch (invariant 6)
            return r.decode_batch([s.out_ids[-1] for s in work.seqs], [s.kv for s in work.seqs])
        seq, = work.seqs
        lg, st = r.forward([seq.out_ids[-1]], seq.kv, consolidate=False, should_stop=stop)
        return [lg[-1]], st

    def _process(self, work: Pass, logits: list[torch.Tensor]):
        """A completed pass's outputs: prefill pieces advance their prompts (the prefix cache keeps the new blocks)
        and a completed prompt gives its first token; a decode gives each sequence its next token."""
        for (seq, take), lg in zip(work.pieces, logits):
            if work.kind == "prefill":
                seq.n_done += take
                self.kv_manager.prefilled(seq, lg)
                if seq.prefilling:
                    continue
                self.outputs.prompt_done(seq)
            self._token(seq, lg)

    def _token(self, seq: Sequence, logits: torch.Tensor):
        """Sample and emit one token; a failure here is this sequence's alone (invariant 7)."""
        fin = self.outputs.token(seq, logits)
        if fin is not None:
            self._end(seq, fin)

    def _end(self, seq: Sequence, fin: Finish):
        """The sequence ends: it leaves the running set, its prefix blocks are released, its final event (or error)
        and log line go out; then the runner releases its graphs and applies the end-of-request consolidation rule
        (only after a request that decoded, only while no other sequence runs: StoreSession)."""
        self.scheduler.finish(seq)
        kv = seq.kv
        try:                        # a failure here must not keep the request from its final event
            self.kv_manager.free(seq)
        except Exception:                            # noqa: BLE001
            log.exception("releasing the resources of request %s failed", seq.request.request_id or seq.seq_id)
        try:
            self.outputs.finish(seq, fin)
        except Exception as e:                       # noqa: BLE001 (parsing its tool calls, say): it fails alone
            if fin.error is not None:
                raise
            self.outputs.finish(seq, self.outputs.failure(seq, e))
        finally:
            if kv is not None:
                self._request_done(seq, kv, fin)

    def _request_done(self, seq: Sequence, kv, fin: Finish):
        decoded = fin.reason in ("stop", "length") and len(seq.out_ids) > 1 and self.store_ok
        try:
            self.runner.request_done(kv, others_running=bool(self.running), decoded=decoded)
        except StoreUnavailableError as e:
            self._store_down(e)
        except Exception:                            # noqa: BLE001
            log.exception("releasing the resources of request %s failed", seq.request.request_id or seq.seq_id)

    # ---- the store going away and coming back ------------------------------------------------------
    def _store_down(self, err: StoreUnavailableError):
        log.warning("store unavailable: %s", err)
        self.store_why = str(err)
        self.store_ok = False
        if self.on_state:
            self.on_state(False)
        for seq in list(self.running):
            self._end(seq, Finish.failed(err))
        with self.cv:
            for seq in self.scheduler.abort_waiting():
                seq.fail(err)
        # ONE re-attach thread: a pass's failure and its request's release both report the same loss, and two
        # threads attaching one after the other would leave the first attachment's pass with a session the store
        # has replaced. store_ok is False before the lock, so a thread that is leaving sees it (_reattach)
        with self._reattach_lock:
            if self._reattaching:
                return
            self._reattaching = True
        threading.Thread(target=self._reattach, name="reattach", daemon=True).start()

    def report_store_down(self, err: StoreUnavailableError):
        """From another thread (the worker's health probe): the store stopped answering. The caller also aborts
        the client's calls in flight, so a pass blocked in one fails now instead of at its deadline."""
        self._store_lost = err
        if self.on_state:
            self.on_state(False)
        self._wake()

    def _reattach(self):
        while True:
            with self._reattach_lock:
                if self._stop or self.store_ok:
                    self._reattaching = False
                    return
            try:
                self.runner.attach()
                gc_pauses.refreeze()                 # the old attachment's cycles (its arena views) collected
                self.kv_manager.bind_host()          # the new store's prefix host tier (empty)
                self.warmed_graphs = self._warm_graphs()     # the old attachment's graphs went with it
                self.store_ok = True
                self._unsettled = self.settle_idle   # the new attachment's VRAM slots fill while idle
                log.info("re-attached to the expert store")
                if self.on_state:
                    self.on_state(True)
            except BetelgeuseError as e:             # gone, or (briefly) still holding our old lease
                log.debug("re-attach failed: %s", e)
                self.store_why = str(e)
                time.sleep(0.5)

    # ---- info ---------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return self.inputs.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.inputs.detokenize(ids)

    def is_ready(self) -> bool:
        return self.store_ok and self._thread.is_alive() and not self.draining and self._store_lost is None

    def stalled(self, seconds: float) -> bool:
        """The engine thread is dead, or has not turned its loop for `seconds` (stuck in a call)."""
        return not self._thread.is_alive() or time.monotonic() - self.last_tick > seconds

    # ---- drain (SIGTERM) --------------------------------------------------------------------------------
    def drain(self, grace: float) -> int:
        """Refuse new work, let running and waiting requests finish for up to `grace` seconds, then end the
        rest with a final event (finish_reason "cancelled"). Returns how many were cancelled."""
        self.draining = True
        t_end = time.monotonic() + grace
        while (self.running or self.waiting) and time.monotonic() < t_end and self._thread.is_alive():
            time.sleep(0.05)
        left = list(self.running) + list(self.waiting)
        for seq in left:
            seq.cancelled = True                       # the next schedule() ends them: a final "cancelled" event
        self._wake()
        t_end = time.monotonic() + 5.0
        while (self.running or self.waiting) and time.monotonic() < t_end and self._thread.is_alive():
            time.sleep(0.02)
        return len(left)

    def model_info(self) -> ModelInfo:
        c, f, p = self.runner.mcfg, self.runner.file, self.runner.plan
        qt = f.expert_parts(0, 0)[0].qtype
        return ModelInfo(name=c.name, arch=c.arch, path=f.path, n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head,
                         n_head_kv=c.n_head_kv, head_dim=c.head_dim, n_expert=c.n_expert, n_expert_used=c.n_expert_used,
                         n_ff_exp=c.n_ff_exp, n_vocab=c.n_vocab, context_length=c.context_length,
                         quant=qtype_name(qt), expert_bytes=f.expert_nbytes(0),
                         vram_slots_per_layer=p.n_vram, host_slots_per_layer=p.n_host,
                         schedule=self.cfg.schedule, sub_batch=self.cfg.sub_batch, routing=self.cfg.routing,
                         vram_backing=p.vram_backing, plan=p.describe(), prefill_chunk=self.runner.chunk or 0)

    def server_info(self) -> ServerInfo:
        cache = self.runner.cache
        slots = {"vram": int((cache.vram_owner[:, :, 0] >= 0).sum()) if self.runner.plan.n_vram else 0}
        try:
            st = self.runner.store.status() if self.store_ok else None
        except StoreUnavailableError:
            st = None
        if st:
            slots["host"] = st["slots"]["host"] + st["slots"]["vram"]
            slots["staging"] = st["slots"]["staging"]
        mem = {"arena": cache.arena.nbytes}
        if cache.is_cuda:
            mem["vram_in_use"] = torch.cuda.memory_reserved(self.runner.device)
        from betelgeuse.store.cgroup import CgroupMemory
        cg = CgroupMemory.of_process()
        if cg:
            mem["cgroup_current"] = cg.current()
            mem["cgroup_max"] = cg.limit() or 0
        return ServerInfo(version=__version__, device=str(self.runner.device), queue_depth=len(self.waiting),
                          active_requests=len(self.running), store_attached=self.store_ok, slots_used=slots,
                          memory=mem, uptime_s=time.monotonic() - self.started)

    def _gauges(self):
        m = self.metrics
        if m:
            m.requests_running.set(len(self.running))
            m.requests_waiting.set(len(self.waiting))
            kvs = [s.kv for s in self.running if s.kv is not None]
            used, reserved = sum(kv.length for kv in kvs), sum(kv.max_len for kv in kvs)
            cap = self.cfg.max_running * self.inputs.ctx
            m.kv_cache_tokens.labels(state="used").set(used)
            m.kv_cache_tokens.labels(state="reserved").set(reserved)
            m.kv_cache_capacity.set(cap)
            m.kv_cache_usage.set(min(1.0, reserved / cap) if cap else 0.0)
            flex = self.runner.flex
            m.flex_slots.labels(state="allocated").set(flex.n_slots if flex is not None else 0)
            m.flex_slots.labels(state="used").set(flex.n_held if flex is not None else 0)
            m.flex_bytes.labels(state="allocated").set(flex.nbytes if flex is not None else 0)
            m.flex_bytes.labels(state="room").set(flex.room if flex is not None else 0)
            m.vram_used_bytes.labels(pool="kv_cache").set(self.runner.state_bytes)

    def close(self):
        self._stop = True
        self._wake()
        self._thread.join(timeout=5)
        self.runner.close()
