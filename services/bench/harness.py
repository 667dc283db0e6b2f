"""The benchmark run: a plan of cases in priority order, each on a fresh store process, measured against
ceilings sampled in the same run, inside one cgroup, within a time budget.

A case = (model, slots, prompt length): a fresh store (empty slots) ->
  cold    layer-major prefill (consolidates at its end; settle() waits until the store is quiet: printed)
  warm    the same prompt again, layer-major (reads what consolidation left out)
  std     the same prompt, standard schedule, on the same warm state (consolidate=False: state unchanged)
  decode  greedy tokens after the warm pass (its KV cache), no consolidation
Standard-cold cases (fresh store, standard schedule) come last: they are the slowest.
Cases run while the time budget allows; a pass that would overrun is aborted between layers (or
micro-batches) through the runner's should_stop hook, and results are written after every pass.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from betelgeuse.config import GiB, EngineConfig
from betelgeuse.errors import BetelgeuseError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.kernels import triton_launch as TL
from betelgeuse.worker.runner import ModelRunner
from services.assembly import ChildStore, open_runner, open_store
from services.bench import ceilings as C
from services.bench.args import OutOfTime
from services.bench.disk_idle import split_idle
from services.bench.procs import arena_mappings, cgroup_of, mkdir, watched
from services.bench.profile import DecodeCProfile, profile_pass
from services.bench.threads import Census


# the suite's defaults (flags override them): one sequence at a time, no prefix cache: the plan (KV reserve for
# 2 x max_context) of the earlier runs, so their figures stay comparable; `bench --suite agents` measures the
# scheduler and the prefix cache
BENCH_ENGINE = {"engine.max_running": 2, "engine.prefix_cache_bytes": 0}


@dataclass(slots=True)
class Case:
    name: str
    model: str                  # path
    slots: str                  # "V+H" or "auto"
    prompt: int                 # tokens
    passes: tuple               # subset of ("cold", "warm", "std", "decode", "std_cold")
    routing: str = "exact"      # EngineConfig.routing of the case (routing_approx.py: the approximate modes)


@dataclass(slots=True)
class BenchOptions:
    model: str                              # main model (made by the CLI if absent)
    engine: EngineConfig                    # the engine's keys (settings, flags); a case sets the model and slots
    variants: tuple = ()                    # ((router label, path), ...): smaller models with other routers
    device: str = "cpu"
    slots: tuple = ("5+15", "auto")
    prompts: tuple = (64, 512)
    standard_prompts: tuple = (64,)
    decode: int = 128
    cgroup: bool = True
    time_budget: float = 480.0              # seconds for the whole run, from `t0`
    t0: float = field(default_factory=time.monotonic)
    standard_cap: float = 20.0              # seconds per standard pass (a partial pass still gives tok/s)
    decode_cap: float = 20.0                # seconds per decode run
    disk_sample_bytes: int = 1 * GiB
    disk_sample_s: float = 1.5
    reserve_s: float = 10.0                 # kept for writing results
    seed: int = 0
    run_dir: str = "/tmp/betelgeuse-bench"  # sockets, store logs
    routing_trace: str | None = None        # replay this routing trace instead of the router (outputs meaningless)
    routings: tuple = ("exact",)            # each main-model case runs in each of these routing modes (--routing a,b)
    # decode's gpu link cut at the device's steps (PassStats.gpu_marks): timing events, one sync a token more and the
    # solo graph cut at each attention, so they change the run they time: opt-in (--gpu-marks), never in a TG figure
    # compared with runs without them
    gpu_marks: bool = False
    # decode's graphs captured before the warm pass over a state of the decode's size (ModelRunner.warm_graphs, as the
    # service's engine does at start for its first state size), so the timed decode's first tokens replay as a
    # service's do; off (--no-graphs-warm): they run eagerly, then capture (the bench before graphs57)
    graphs_warm: bool = True
    # the disk's depth curve before the cases: the random pattern at each of these experts in flight (--disk-depths
    # 1,2,4,8,19; ceilings.measure_disk_depths), one sample each; () off
    disk_depths: tuple = ()


def slots_pair(s: str) -> tuple[int | str, int | str]:
    """"5+15" -> (5, 15); "auto" -> ("auto", "auto"): EngineConfig's vram_slots, host_slots."""
    return ("auto", "auto") if s == "auto" else tuple(int(x) for x in s.split("+"))


def plan_cases(o: BenchOptions) -> list[Case]:
    """Priority order: what the reference table needs first, the slow or secondary cases last. With several
    routing modes (--routing exact,pool) each main-model case runs in each, one right after the other, the first
    mode's name unchanged and the others' suffixed with the mode."""
    first, more = (o.routings or ("exact",))[0], tuple(o.routings[1:])
    out = []
    for c in _plan_cases(o):
        main = not c.name.startswith("variant") and "std_cold" not in c.passes
        out.append(dataclasses.replace(c, routing=first, name=c.name + (f" {first}" if first != "exact" and main else "")))
        out += [dataclasses.replace(c, name=f"{c.name} {r}", routing=r) for r in more if main]
    return out


def _plan_cases(o: BenchOptions) -> list[Case]:
    s0, rest = o.slots[0], list(o.slots[1:])
    p0, more = o.prompts[0], list(o.prompts[1:])
    std = lambda p: ("std",) if p in o.standard_prompts else ()      # noqa: E731
    lm = lambda p: ("cold", "warm") + std(p) + (("decode",) if o.decode else ())   # noqa: E731
    cases = [Case(f"{s0} p{p0}", o.model, s0, p0, lm(p0))]
    cases += [Case(f"{s} p{p0}", o.model, s, p0, lm(p0)) for s in rest]
    cases += [Case(f"{s0} p{p}", o.model, s0, p, lm(p)) for p in more]
    vm = ("cold", "warm") + (("decode",) if o.decode else ())
    cases += [Case(f"variant {label} {s0} p{p0}", path, s0, p0, vm) for label, path in o.variants]
    cases += [Case(f"{s} p{p}", o.model, s, p, lm(p)) for s in rest for p in more]
    cases += [Case(f"variant {label} {s0} p{p}", path, s0, p, vm) for label, path in o.variants for p in more]
    cases += [Case(f"{s0} p{p} standard cold", o.model, s0, p, ("std_cold",)) for p in o.standard_prompts]
    return cases


class Harness:
    def __init__(self, o: BenchOptions, results: dict, save):
        self.o, self.results, self.save = o, results, save     # save(final: bool) writes the files
        self.dev = torch.device(o.device)
        self.cuda = self.dev.type == "cuda"
        self.ceil = C.Ceilings()
        self.runner: ModelRunner | None = None
        self.runner_model = ""
        self.replay = None                  # the --routing-trace replayer of the current runner
        self.calib = 1.0            # actual / estimated seconds of the last layer-major pass
        self.exact_logits = {}      # (model, prompt ids) -> exact routing's logits [T, n_vocab] (divergence)
        self.states: list = []      # the case's sequence states not yet released (_state / _release)
        self.store_pid = None       # the case's store child (the decode's thread census)

    # ---- time -------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.o.t0 + self.o.time_budget - self.o.reserve_s - time.monotonic()

    def _stopper(self, cap: float | None, counter: list | None = None):
        end = time.monotonic() + min(self.remaining(), cap if cap else float("inf"))

        def should_stop():
            if counter is not None:
                counter[0] += 1
            if time.monotonic() > end:
                raise OutOfTime()
        return should_stop

    def _estimate(self, f: GGUFModelFile, kind: str, T: int) -> float:
        """Seconds, uniform-routing upper bound scaled by the last pass's actual/estimate ratio."""
        c = f.config
        E, k, L = c.n_expert, c.n_expert_used, c.n_layer
        per_load = max(f.expert_nbytes(0) / max(self.ceil.disk_bps, 1.0), self.ceil.expert_s(T * k / E))
        if kind == "decode":
            return min(self.o.decode_cap, self.o.decode * L * k * per_load)
        if kind in ("std", "std_cold"):
            return self.o.standard_cap
        return self.calib * (L * E * (1 - (1 - k / E) ** T) * per_load + 0.02 * L)

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> None:
        o, r = self.o, self.results
        cg, mon = watched(r, o.engine.memory_max, o.cgroup, self.dev, o.engine.vram_budget)
        try:
            self._ceilings_h2d()
            if o.disk_depths:
                with GGUFModelFile.open(o.model) as f:
                    self.ceil.disk_depths = C.measure_disk_depths(
                        f, o.engine.read_threads, o.engine.read_request_bytes, o.disk_sample_bytes, o.disk_sample_s,
                        o.seed + 1_000_003, o.t0, o.disk_depths)
            for case in plan_cases(o):
                if self.remaining() <= 0:
                    r["skipped"].append({"case": case.name, "reason": "time budget"})
                    continue
                try:
                    self._case(case)
                except OutOfTime:
                    r["skipped"].append({"case": case.name, "reason": "time budget (aborted mid-pass)"})
                except (BetelgeuseError, torch.OutOfMemoryError) as e:   # refused budget, dead store, CUDA OOM:
                    r["errors"].append(f"{case.name}: {type(e).__name__}: {e}")   # recorded; next case
                self.save(False)
        except Exception as e:          # the partial results still go out, with the error
            r["errors"].append(f"{type(e).__name__}: {e}")
            raise
        finally:
            self._drop_runner()
            self._rebound()
            mon.close()
            r["memory"].update(cg.summary(mon.mem_peak), peak_by=mon.sources["memory"])
            if self.cuda:
                r["vram"].update(mon.vram_record())
            cg.close()
            r["ceilings"] = self.ceil.to_json()
            r["elapsed_s"] = time.monotonic() - o.t0

    def _ceilings_h2d(self):
        n = 256 << 20 if self.cuda else 32 << 20
        self.ceil.h2d_bps, self.ceil.h2d_pinned = C.measure_h2d(self.dev, n, 8 if self.cuda else 3)
        if self.cuda:
            torch.cuda.empty_cache()

    def _runner_for(self, cfg: EngineConfig, store: ChildStore) -> ModelRunner:
        """A runner over this case's store: the last case's, re-attached, if it ran the same model (its dense
        weights stay loaded), else a new one."""
        if self.runner is not None and self.runner_model == cfg.model_path:
            self.runner.cfg = dataclasses.replace(self.runner.cfg, routing=cfg.routing)   # MoEStep reads it at attach
            self.runner.store = store.client
            self.runner.attach()
            return self.runner
        self._drop_runner()
        self.runner, self.runner_model = open_runner(cfg, store), cfg.model_path
        self.replay = self._replayer(self.runner) if self.o.routing_trace else None
        if self.replay is not None:
            self.runner.hook_routing(replayer=self.replay)
        return self.runner

    def _replayer(self, rn: ModelRunner):
        """The --routing-trace replayer for this runner's model (its geometry must be the trace's)."""
        from betelgeuse.routing.trace import Replayer, read_trace
        c = rn.mcfg
        try:
            return Replayer(read_trace(self.o.routing_trace), c.n_layer, c.n_expert, c.n_expert_used)
        except (OSError, ValueError) as e:
            raise BetelgeuseError(f"--routing-trace {self.o.routing_trace}: {e}") from None

    def _rebound(self):
        """Bounds of every pass and decode run with the final compute ceiling and the disk rate beside the pass
        (ceilings.case_disk_rate: the samples before and after its case, the pass's own reads)."""
        for case in self.results["cases"]:
            samples = [case.get("disk_bps", 0.0), case.get("disk_bps_after", 0.0)]
            sample_of = {"sample before": case.get("disk_sample"), "sample after": case.get("disk_sample_after")}
            runs = [(p, p) for p in case["passes"] if "loads" in p]
            d = case.get("decode") or {}
            if d.get("tokens"):
                runs.append((d, dict(d, n_tokens=d["tokens"], loads=sum(d["reads"].values()))))
            for dest, p in runs:
                bps, src = C.case_disk_rate(samples, p.get("store_disk_bytes", 0), p.get("store_disk_busy_s", 0.0),
                                            p.get("read_threads", 1))
                b = C.pass_bound(self.ceil, bps, p["n_tokens"], p["loads"], p["disk_bytes"], p["h2d_bytes"],
                                 case["n_layer"], p["k"], p["seconds"])
                b["disk_source"] = src
                dest["bound"] = b
                dest["disk_split"] = C.disk_split(b, p, sample_of.get(src))

    def _measure_compute(self):
        rn = self.runner
        by = C.measure_compute_by_type(rn, 20 if self.cuda else 3)
        self.ceil.sub_batch = rn.cfg.sub_batch
        for t, v in by.items():                     # the best seen per type
            old = self.ceil.by_type.get(t)
            if old is not None:
                v["mm_s"] = {k: min(x, old["mm_s"].get(k, x)) for k, x in v["mm_s"].items()}
                v["hbm_bps"] = {k: max(x, old["hbm_bps"].get(k, x)) for k, x in v["hbm_bps"].items()}
                v["layers"] = old["layers"]         # the weights stay the main model's (it is measured first)
            self.ceil.by_type[t] = v
        self.ceil.mm_s = C.layer_mean(self.ceil.by_type, "mm_s")
        self.ceil.hbm_bps = C.layer_mean(self.ceil.by_type, "hbm_bps")

    def _detach(self):
        """Unmap the store's arena and free the VRAM slots, so the next store's arena fits the cgroup."""
        rn = self.runner
        if rn is None or rn.cache is None:
            return
        rn.detach()
        gc.collect()                    # the arena's last views go: it is unmapped
        rn.store.close()
        if self.cuda:
            torch.cuda.empty_cache()

    def _drop_runner(self):
        self._detach()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def _case(self, case: Case):
        o, r = self.o, self.results
        f = GGUFModelFile.open(case.model)
        c = f.config
        out = {"name": case.name, "model": case.model, "router_skew": _skew(f), "router": router_label(f, o),
               "n_layer": c.n_layer,
               "slots_requested": case.slots, "prompt_tokens": case.prompt, "passes": [], "skipped": []}
        r["cases"].append(out)
        v, h = slots_pair(case.slots)
        cfg = dataclasses.replace(o.engine, model_path=case.model, vram_slots=v, host_slots=h, routing=case.routing)
        out["routing_mode"] = case.routing
        self._disk_sample(f, cfg, out, "")
        try:
            store = open_store(cfg, "process", str(mkdir(o.run_dir) / f"store-{len(r['cases'])}"), timeout=300.0)
        except BaseException:
            f.close()
            raise
        try:
            out["store_start_s"] = store.ready_s
            # store.session_transport (BETELGEUSE_STORE_SESSION_TRANSPORT): the loads' stream (issue 21's A/B)
            out["session_transport"] = store.client.session_transport
            out["cgroups"] = {"store": cgroup_of(store.proc.pid), "worker": cgroup_of("self")}
            self.store_pid = store.proc.pid         # the decode's thread census (services/bench/threads.py)
            t = time.perf_counter()
            TL.watch_compiles()                     # Triton's compiles counted in each timed region (issue 21)
            mark = TL.compile_mark()
            rn = self._runner_for(cfg, store)
            out["attach_s"] = time.perf_counter() - t
            # the compiles at attach (decode's expert-kernel variants: MoEStep.warm_kernels) and the warm-up's own
            out["attach_triton_compiles"] = TL.compiles_since(mark)
            out["kernel_warmup"] = getattr(rn, "warmed", None)
            self._measure_compute()                 # every case: the ceiling is the best seen in the run
            p = rn.plan
            out["plan"] = {"n_vram": p.n_vram, "n_host": p.n_host, "n_staging": p.n_staging, "arena_bytes": p.arena_bytes,
                           "slot_bytes": p.slot.slot_bytes, "vram_slot_bytes": p.vram_slot_bytes, "notes": list(p.notes),
                           "resident_share": (p.n_vram + p.n_host) / c.n_expert, "vram_trim": p.vram_trim}
            ids = np.random.default_rng([o.seed, case.prompt]).integers(0, c.n_vocab, case.prompt).tolist()
            kv_len = case.prompt + o.decode + 8
            warm_kv, warm_logits = None, None
            for kind in case.passes:
                est = self._estimate(f, kind, case.prompt)
                if self.remaining() < 0.5 * est:
                    why = f"time budget ({self.remaining():.0f} s left, ~{est:.0f} s needed)"
                    out["skipped"].append({"pass": kind, "reason": why})
                    continue
                if kind == "decode":
                    if warm_kv is not None:
                        out["decode"] = self._decode(rn, warm_kv, warm_logits)
                        if out["decode"]["tokens"]:
                            tok = int(warm_logits[-1].argmax())
                            wall = min(out["decode"]["token_s"])
                            prof = profile_pass(lambda: rn.forward([tok], warm_kv, consolidate=False), c.n_layer, wall, self.dev)
                            if prof:
                                out.setdefault("profile", {})["decode"] = prof
                    continue
                if kind == "warm" and "decode" in case.passes and self.o.graphs_warm:
                    out["graphs_warm"] = self._graphs_warm(rn, kv_len)
                kv = self._state(rn, kv_len)
                rec, logits = self._prefill(rn, f, kind, ids, kv)
                out["passes"].append(rec)
                if kind == "warm" and logits is not None:
                    if warm_kv is not None:
                        self._release(rn, warm_kv)
                    warm_kv, warm_logits = kv, logits
                    prof = profile_pass(lambda: self._once(rn, ids, kv_len), c.n_layer, rec["seconds"], self.dev)
                    if prof:
                        out.setdefault("profile", {})["warm"] = prof
                if kv is not warm_kv:
                    self._release(rn, kv)
                if kind in ("cold", "warm") and rec.get("complete"):
                    self.calib = max(0.05, rec["seconds"] / max(est / self.calib, 1e-6))
                self.save(False)
            out["routing"] = self._routing(rn, f, ids, out.get("decode", {}).get("token_ids", []))
            if case.routing != "exact":
                out["divergence"] = self._divergence(rn, f, case, ids)
            out["store_status"] = rn.store.status()
        finally:
            for kv in list(self.states):        # the case's states (the warm one, any a failed pass left)
                self._release(self.runner, kv)
            self._detach()
            if self.remaining() > 0:            # the disk sampled again right after the case: its passes' bound
                self._disk_sample(f, cfg, out, "_after")
            out["arena_mappings_after_detach"] = arena_mappings()
            rc = store.close()
            out["store_exit"] = rc
            if rc not in (0, None):
                out["store_error"] = store.proc.last_line()
            f.close()

    def _graphs_warm(self, rn: ModelRunner, n: int) -> dict | None:
        """The service's start-up capture for the decode's state (ModelRunner.warm_graphs, solo: the bench decodes with
        forward()), under the timed decode's device marks (a SoloDecode key), untimed; its state, released, is the warm
        pass's next (ModelRunner.new_cache recycles it), so the decode replays from its first token. None: no graphs
        (the CPU)."""
        marks_were, rn.gpu_marks = rn.gpu_marks, self.o.gpu_marks
        try:
            return rn.warm_graphs(n, lanes=False)
        finally:
            rn.gpu_marks = marks_were

    def _state(self, rn: ModelRunner, n: int):
        """A sequence state of n tokens for the case's passes, counted by the runner (its KV reservation, the flex
        cache's room) until _release, as a request's is until its end: a state left counted made the runner's live
        states outgrow the plan's reservation, the flex cache shrink and a re-attach's warm-up find no room (a free
        KV reservation of -99 MB: worker/warm_decode.py)."""
        kv = rn.new_cache(n)
        self.states.append(kv)
        return kv

    def _release(self, rn: ModelRunner | None, kv):
        """A state of _state's no longer counted (once: by identity, a state has no equality)."""
        i = next((i for i, x in enumerate(self.states) if x is kv), None)
        if i is not None:
            del self.states[i]
            if rn is not None:
                rn.release(kv)

    def _once(self, rn: ModelRunner, ids: list, n: int, all_logits: bool = False):
        """An untimed pass of ids on a state of n tokens of its own, released after -> its logits."""
        kv = self._state(rn, n)
        try:
            return rn.forward(ids, kv, all_logits=all_logits, consolidate=False)[0]
        finally:
            self._release(rn, kv)

    def _disk_sample(self, f: GGUFModelFile, cfg: EngineConfig, case: dict, when: str):
        """One disk ceiling sample of each pattern with the store's reader settings (appended to the run's samples)
        -> case["disk_bps" + when]: the faster one's bytes/s (C.disk_rate: a pass's reads hold both patterns), and
        case["disk_sample" + when]: that sample (its depth beside the runs' it bounds: C.disk_split)."""
        got = {}
        for pattern in C.DISK_PATTERNS:
            s = C.measure_disk(f, cfg.read_threads, cfg.read_request_bytes, self.o.disk_sample_bytes,
                               self.o.disk_sample_s, self.o.seed + len(self.ceil.disk) + 1, self.o.t0, pattern=pattern)
            self.ceil.disk.append(s)
            got[pattern] = s
        bps, pattern = C.disk_rate({p: s.bps for p, s in got.items()})
        case["disk_bps" + when], case["disk_sample" + when] = bps, got[pattern].to_json()

    def _divergence(self, rn: ModelRunner, f: GGUFModelFile, case: Case, ids: list) -> dict:
        """An approximate case's outputs against exact routing on its prompt (teacher-forced, all rows), both on the
        store state the case left (untimed, nothing consolidated): routing_approx.py divergence. The exact logits do
        not depend on the slots (invariant 1): they are computed once per (model, prompt) in the run."""
        from betelgeuse.routing_approx import divergence
        key = (case.model, tuple(ids))
        if self.remaining() < 2 * self._estimate(f, "warm", len(ids)):
            return {"skipped": "time budget"}
        approx = self._once(rn, ids, len(ids) + 1, all_logits=True)
        if key not in self.exact_logits:
            rn.moe.routing = "exact"
            try:
                self.exact_logits[key] = self._once(rn, ids, len(ids) + 1, all_logits=True).float().cpu()
            finally:
                rn.moe.routing = case.routing
        return divergence(self.exact_logits[key], approx.float().cpu()).to_json()

    def _prefill(self, rn: ModelRunner, f: GGUFModelFile, kind: str, ids: list, kv):
        schedule = "standard" if kind in ("std", "std_cold") else "layer_major"
        consolidate = kind in ("cold", "warm")
        counter = [0]
        stop = self._stopper(self.o.standard_cap if schedule == "standard" else None, counter)
        st0 = rn.store.status()
        copy0 = rn.cache.copy_seconds
        mark = TL.compile_mark()
        t = time.perf_counter()
        try:
            logits, st = rn.forward(ids, kv, consolidate=consolidate, schedule=schedule, should_stop=stop)
            int(logits[-1].argmax())
        except OutOfTime:
            dt = time.perf_counter() - t
            done = max(counter[0] - 1, 0) * rn.cfg.micro_batch if schedule == "standard" else 0
            rec = {"label": kind, "schedule": schedule, "complete": False, "n_tokens": done, "seconds": dt,
                   "tok_per_s": done / dt if dt > 0 else 0.0, "prompt_tokens": len(ids),
                   "store_disk_bytes": rn.store.status()["disk_bytes"] - st0["disk_bytes"]}
            if schedule != "standard":
                raise
            return rec, None
        ttft = time.perf_counter() - t
        rec = pass_record(kind, st, ttft, self.ceil, f, rn.plan.slot.slot_bytes)
        rec["triton_compiles"] = TL.compiles_since(mark)       # inside the timed pass (a compile is host time there)
        rec.update(store_delta(st0, rn.store.status(), rn.cfg.read_threads))
        if not self.cuda:
            rec["copy_s"] = rn.cache.copy_seconds - copy0
        if consolidate:
            # the next pass starts on a quiet store (ModelRunner.settle: the consolidation applied, its VRAM fills
            # done, no read in flight), so a warm pass's reads are its own: a warm pool pass reads nothing
            rec["settle_s"] = rn.settle(timeout=max(60.0, self.remaining()))
            print(f"[bench] after the {kind} pass ({len(ids)} tokens, routing {rn.moe.routing}): the store settled in "
                  f"{rec['settle_s']:.3f} s", file=sys.stderr, flush=True)
        return rec, logits

    def _routing(self, rn: ModelRunner, f: GGUFModelFile, ids: list, gen: list) -> dict:
        """What the passes routed: one more, untimed prefill of the prompt and the decoded tokens with the routing
        recorded (a token's experts depend only on the tokens before it: a prefill routes them as the decode did),
        its statistics (betelgeuse/routing_stats.py) for the prompt and for the decode."""
        from betelgeuse.gguf.synth_router import read_router_metadata, summary
        from betelgeuse.routing.measure import ArraySink
        from betelgeuse.routing.trace import Recorder
        from betelgeuse.routing_stats import trace_stats
        c = f.config
        out = {"router": read_router_metadata(f.metadata), "prompt_tokens": len(ids), "decode_tokens": len(gen)}
        if self.remaining() < 2 * self._estimate(f, "warm", len(ids) + len(gen)):
            out["skipped"] = "time budget"
            return out
        sink = ArraySink(c.n_layer)
        rn.hook_routing(Recorder(sink), self.replay)
        try:
            self._once(rn, ids + gen, len(ids) + len(gen) + 8)
        finally:
            rn.hook_routing(None, self.replay)       # the recorder is flushed and closed
        tr, w = sink.arrays()
        hashed = int(f.metadata.get(f"{c.arch}.hash_layer_count", 0))     # deepseek4: routed by token id
        for part, sl in (("prompt", slice(0, len(ids))), ("decode", slice(len(ids), None))):
            if len(tr[sl]) > 1:
                st = trace_stats(tr[sl], c.n_expert, weights=w[sl])
                out[part] = summary(st)
                out[part]["repeat_next_by_layer"] = [round(x["repeat_next"], 4) for x in st["layers"]]
                if hashed:
                    out[part + "_routed_layers"] = summary(trace_stats(tr[sl, hashed:], c.n_expert,
                                                                       weights=w[sl, hashed:]))
        return out

    def _decode(self, rn: ModelRunner, kv, logits) -> dict:
        tok = int(logits[-1].argmax())
        st0 = rn.store.status()
        end = time.monotonic() + min(self.o.decode_cap, self.remaining())
        secs, reads, disk_bytes, disk_wait = [], {"vram": 0, "host": 0, "disk": 0}, 0, 0.0
        host_s, calls, h2d, toks, engram = 0.0, 0, 0, [], None
        flushes = 0                                     # disk batches flushed early (engine.disk_flush_early)
        split = HostSplit()                             # the host time's parts (worker/stats.py)
        token_host = []                                 # per token: (host s, expert applications)
        token_work = []                                 # per token: (disk reads, store waits, of them slept in)
        token_compiles = []                             # per token: Triton compiles inside it (None: not counted)
        mark = TL.compile_mark()
        guess = dict.fromkeys(GUESS_FIELDS, 0)          # decode's guesses of the next layers (worker/guess.py)
        windows = []                                    # per token: its step on the store's clock (monotonic)
        sends = []                                      # the steps' messages asking for disk reads (PassStats.sends)
        routed, landed = [], []                         # the chain before them (PassStats.routed, .landed)
        marks = []                                      # its gpu link cut at the device's steps (PassStats.gpu_marks)
        marks_were, rn.gpu_marks = rn.gpu_marks, self.o.gpu_marks   # on for the timed steps only (--gpu-marks)
        gg = getattr(rn.moe, "group_graphs", None)      # engine.group_graphs: its replays / captures / launches
        gg0 = gg.stats() if gg is not None else None
        # every thread of both processes: its wakeups and CPU over the timed tokens (two reads of /proc, outside them
        # and outside the decode's wall)
        census = Census({"worker": "self", **({"store": self.store_pid} if self.store_pid else {})}).start()
        t_start = time.perf_counter()
        cprof = DecodeCProfile().start()                 # BENCH_DECODE_CPROFILE=path: where the host time goes
        try:
            for _ in range(self.o.decode):
                if time.monotonic() > end:
                    break
                t = time.perf_counter()
                m0 = TL.compile_mark()
                toks.append(tok)
                w0 = time.monotonic()
                lg, st = rn.forward([tok], kv, consolidate=False)
                tok = int(lg[-1].argmax())
                windows.append((w0, time.monotonic()))
                sends += st.sends
                routed += st.routed
                landed += st.landed
                marks += st.gpu_marks
                secs.append(time.perf_counter() - t)
                token_compiles.append(TL.compiles_since(m0)["count"])
                for k_ in reads:
                    reads[k_] += st.reads[k_]
                disk_bytes, disk_wait = disk_bytes + st.disk_bytes, disk_wait + st.disk_wait_s
                host_s, calls, h2d = host_s + st.host_s, calls + st.store_calls, h2d + st.h2d_bytes
                split.add(st)
                flushes += st.disk_flushes
                token_host.append((st.host_s, st.applications))
                token_work.append((st.reads["disk"], st.store_waits, st.store_sleeps))
                for k_ in guess:
                    guess[k_] += getattr(st, k_)
                if st.engram is not None:
                    engram = st.engram if engram is None else engram.add(st.engram)
        finally:
            cprof.finish(len(secs))
            rn.gpu_marks = marks_were
        n = sum(reads.values())
        c = rn.mcfg
        wall = time.perf_counter() - t_start
        threads = census.stop(max(1, len(secs)))
        st1 = rn.store.status(disk_gaps_since=windows[0][0]) if windows else rn.store.status()
        own = store_delta(st0, st1, rn.cfg.read_threads)
        bps, src = C.case_disk_rate([self.ceil.disk_bps], own["store_disk_bytes"], own["store_disk_busy_s"],
                                    own["read_threads"])
        bound = C.pass_bound(self.ceil, bps, len(secs), n, disk_bytes, h2d, c.n_layer, c.n_expert_used,
                             sum(secs)) if secs else {}
        # where the disk idles: between tokens or within one (services/bench/disk_idle.py), from the store's gap log
        idle = (split_idle(st1["disk_gaps"], windows, sends, routed, landed, st1.get("disk_msgs", ()), marks)
                if "disk_gaps" in st1 else None)
        if idle:
            idle["gaps_complete"] = st1.get("disk_gaps_complete")
        return {**own, "k": c.n_expert_used, "tokens": len(secs), "requested": self.o.decode, "seconds": sum(secs), "bound": bound,
                "host_s": host_s, "host_us_per_application": host_s / n * 1e6 if n else None,
                "store_calls_per_token": calls / len(secs) if secs else None, "h2d_bytes": h2d,
                **split.record(len(secs), n),
                # the typical token, apart from the first steps' graph capture and the VRAM fills after consolidations
                "host_us_per_application_median": (float(np.median([h / a * 1e6 for h, a in token_host if a]))
                                                   if any(a for _, a in token_host) else None),
                "token_host_s": [h for h, _ in token_host],
                # the work and the waits beside each token's host (issue 21: host grew with the wait at the same
                # work; a sleep in a wait is a wake after it): disk reads, waits for the store, those slept in
                "token_disk_reads": [d for d, _, _ in token_work],
                "token_store_waits": [w for _, w, _ in token_work],
                "token_store_sleeps": [s_ for _, _, s_ in token_work],
                # Triton compiles inside the timed tokens (issue 21: a compile is 0.3-1.5 s of one token's host time)
                "triton_compiles": TL.compiles_since(mark), "token_triton_compiles": token_compiles,
                "tg_mean": len(secs) / sum(secs) if secs else 0.0, "tg_peak": 1.0 / min(secs) if secs else 0.0,
                "token_s": secs, "reads": reads, "disk_share": reads["disk"] / n if n else 0.0,
                "disk_bytes": disk_bytes, "disk_wait_ms": disk_wait * 1e3, "token_ids": toks, "guess": guess,
                "guess_hit_rate": guess["guess_hits"] / guess["guessed"] if guess["guessed"] else None,
                "guess_recall": guess["guess_hits"] / guess["guess_disk"] if guess["guess_disk"] else None,
                # copy ahead (prefetch_host): guessed host-tier experts copied ahead, the share the next layer used
                "host_guess_hit_rate": (guess["host_guess_hits"] / guess["host_guessed"] if guess["host_guessed"]
                                        else None),
                # the disk's busy share of the decode's wall time (reads in flight / wall): idle disk made visible
                "disk_busy_fraction": own["store_disk_active_s"] / wall if secs and wall > 0 else None,
                "disk_active_ms_per_token": own["store_disk_active_s"] / len(secs) * 1e3 if secs else None,
                "disk_idle": idle,
                "group_graphs": _since(gg0, gg.stats()) if gg is not None else None,
                # engine.disk_flush_early: disk batches copied and grouped because the next expert had not landed
                # (each one a group more: PassStats.disk_flushes)
                "disk_flushes": flushes,
                # by process and thread name, per timed token: wakeups (context switches), CPU us (services/bench/threads.py)
                "threads": threads,
                "engram": engram.record(len(secs), sum(secs)) if engram is not None else None}


def _since(before: dict, now: dict) -> dict:
    """GroupGraphs.stats() counts of the timed steps: each counter less its value before them; "graphs" (held now)
    as it is."""
    return {k: v if k == "graphs" else v - before[k] for k, v in now.items()}


class HostSplit:
    """A decode run's host time by part (PassStats: store messages by kind, the layers' expert steps, the rest) and
    its waits for the store's expert bytes and for the replies of BeginPass / EndPass (blocked: store_wait_s,
    store_reply_wait_s), summed over passes."""

    __slots__ = ("rpc", "store_wait_s", "store_reply_wait_s", "moe_host_s", "other_host_s", "tokens")

    # a solo decode's first two tokens run eagerly and capture its graphs (worker/decode_graphs.py) unless graphs_warm
    # captured them before the timed decode: the steady split leaves them out either way
    STEADY_FROM = 2

    def __init__(self):
        self.rpc: dict = {}
        self.store_wait_s = self.store_reply_wait_s = self.moe_host_s = self.other_host_s = 0.0
        self.tokens: list = []          # per pass: (store messages s, expert steps s, rest s, expert applications)

    def add(self, st):
        self.tokens.append((st.store_s, st.moe_host_s, st.other_host_s, st.applications))
        for k, (n, sec) in st.store_rpc.items():
            rec = self.rpc.setdefault(k, [0, 0.0])
            rec[0] += n
            rec[1] += sec
        self.store_wait_s += st.store_wait_s
        self.store_reply_wait_s += st.store_reply_wait_s
        self.moe_host_s += st.moe_host_s
        self.other_host_s += st.other_host_s

    def record(self, tokens: int, applications: int) -> dict:
        per_app = (lambda s: s / applications * 1e6) if applications else (lambda s: None)
        store_s = sum(sec for _, sec in self.rpc.values())
        return {"store_s": store_s, "store_wait_s": self.store_wait_s, "store_reply_wait_s": self.store_reply_wait_s,
                "moe_host_s": self.moe_host_s,
                "other_host_s": self.other_host_s,
                "store_us_per_application": per_app(store_s), "moe_host_us_per_application": per_app(self.moe_host_s),
                "other_host_us_per_application": per_app(self.other_host_s),
                "store_messages_per_token": {k: n / max(1, tokens) for k, (n, _) in sorted(self.rpc.items())},
                "store_ms_per_token": {k: sec / max(1, tokens) * 1e3 for k, (_, sec) in sorted(self.rpc.items())},
                "steady_split_us_per_application": self.steady()}

    def steady(self) -> dict | None:
        """The split of the tokens from STEADY_FROM on (issue 21: the steady tokens' host time, without the first
        two's eager step and graph capture, which are nearly all rest): {store, moe, other} µs per application over
        them, or None (too few tokens)."""
        rows = self.tokens[self.STEADY_FROM:]
        n = sum(a for *_, a in rows)
        if not n:
            return None
        return {k: sum(r[i] for r in rows) / n * 1e6 for i, k in enumerate(("store", "moe", "other"))}


GUESS_FIELDS = ("guessed", "guess_hits", "guess_disk", "guess_bytes", "guess_wasted_bytes", "guess_held",
                "host_guessed", "host_guess_hits", "host_guess_bytes",
                "hash_ahead", "hash_ahead_started", "hash_ahead_bytes", "hash_ahead_hits")


def pass_record(kind: str, st, ttft: float, ceil: C.Ceilings, f: GGUFModelFile, slot_bytes: int) -> dict:
    c = f.config
    loads = sum(st.reads.values())
    layers = []
    for ls in st.layers:
        copy_est = (ls.host + ls.disk) * slot_bytes / ceil.h2d_bps if ceil.h2d_bps else 0.0
        layers.append({"attn_s": ls.attn_s, "moe_s": ls.moe_s, "disk_wait_s": ls.disk_wait_s,
                       "copy_s": ls.copy_ms / 1e3 if ls.copy_ms else copy_est, "copy_measured": bool(ls.copy_ms),
                       "compute_s": ls.compute_ms / 1e3, "vram": ls.vram, "host": ls.host, "disk": ls.disk})
    return {"label": kind, "schedule": st.schedule, "complete": True, "n_tokens": st.n_tokens, "seconds": st.seconds,
            "host_s": st.host_s, "blocked_s": st.blocked_s, "store_calls": st.store_calls,
            "host_us_per_application": st.host_s / loads * 1e6 if loads else None,
            "tok_per_s": st.tok_per_s, "ttft_s": ttft, "reads": dict(st.reads), "loads": loads,
            "disk_share": st.disk_share, "disk_bytes": st.disk_bytes, "disk_wait_ms": st.disk_wait_s * 1e3,
            "h2d_bytes": st.h2d_bytes, "prefetched": st.prefetched, "vram_filled": st.vram_filled, "fill_disk": st.fill_disk,
            "k": c.n_expert_used, "engram": st.engram.record(st.n_tokens, st.seconds) if st.engram else None,
            "bound": C.pass_bound(ceil, ceil.disk_bps, st.n_tokens, loads, st.disk_bytes, st.h2d_bytes, c.n_layer,
                                  c.n_expert_used, st.seconds),
            "layers": layers}


def store_delta(before: dict, after: dict, read_threads: int) -> dict:
    """What the store's disk did between two status() calls: bytes, the reader threads' summed busy seconds, and the
    wall seconds with a read in flight (active: counted once however many threads read); and its reads ahead: bytes
    landed, of them used by a load, reads dropped before they started, promoted to demand, and the demand reads'
    queue wait (None where the store does not count them)."""
    ahead = {f"store_{k}": (after[k] - before[k] if k in after and k in before else None)
             for k in ("readahead_bytes", "readahead_dropped", "readahead_promoted", "demand_started", "demand_wait_s")}
    ahead["store_readahead_used_bytes"] = (after["readahead_used"] - before["readahead_used"]
                                           if "readahead_used" in after and "readahead_used" in before else None)
    return {**ahead, "store_disk_bytes": after["disk_bytes"] - before["disk_bytes"],
            "store_disk_busy_s": after.get("disk_busy_seconds", 0.0) - before.get("disk_busy_seconds", 0.0),
            "store_disk_active_s": after.get("disk_active_seconds", 0.0) - before.get("disk_active_seconds", 0.0),
            "read_threads": read_threads}


def router_label(f: GGUFModelFile, o: BenchOptions) -> str:
    """The routing a case's passes saw, for the tables."""
    if o.routing_trace:
        return f"REPLAYED {os.path.basename(o.routing_trace)}"
    md = f.metadata
    if md.get("betelgeuse.routing.target"):
        return f"calibrated ({md['betelgeuse.routing.target']})"
    skew, drift = md.get("betelgeuse.synth.router_skew"), md.get("betelgeuse.synth.router_drift", 0.0)
    if skew is None:
        return "the file's own"
    return "uniform (worst case)" if not skew and not drift else f"skew {float(skew):g}"


def _skew(f: GGUFModelFile):
    v = f.metadata.get("betelgeuse.synth.router_skew")
    return None if v is None else round(float(v), 6)
