"""`betelgeuse bench --suite agents`: the serving figures of issue 11 on the real scheduler (`LLMEngine`)
against a real expert-store child, inside the bench's cgroup (memory.max, no swap) and VRAM budget.

  agent loop    a fixed system prompt + N turns, each resending the whole conversation (previous prompt +
                previous completion + new "user" ids); TTFT per turn with the prefix cache off and on (a fresh
                store and engine each, the same warm-up); then one prompt submitted twice (TTFT of the second)
  concurrency   1, 2, 4, 8, 16 greedy clients submitting at once (threads, distinct prompts): aggregate decode
                tok/s, per-request TG, p50/p99 TTFT; a fresh store and engine per client count with
                max_running = clients (the KV reserve shrinks the VRAM slots: the plan is reported per case)
  expert loads  per batched decode pass and the disk share, per client count (the runner's PassStats)

Token ids are synthetic and seeded; requests are greedy with ignore_eos, so each makes exactly max_tokens.
Cases run in priority order (agent off, agent on, 1 and 8 clients, then 2, 4, 16) while the time budget allows;
bench.json / bench.md are rewritten after every case.

Definitions (also printed under the tables):
  TTFT              client clock: submit() to the first TokenEvent read from the handle
  aggregate decode  tokens that all clients received after the last client's first token, divided by the
                    wall from that first token to the last token of any client (the window in which every
                    request has been admitted; 1 client: (n - 1) / (t_last - t_first))
  per-request TG    (n - 1) / (t_last - t_first) of one request, client clock
  loads / pass      expert loads (VRAM + host + disk, one per (layer, expert) a pass applied) per decode pass
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from betelgeuse.errors import BetelgeuseError, InvalidRequestError
from betelgeuse.config import EngineConfig
from services.bench.args import (OutOfTime, engine_from_args, ensure_model, opt_reader, options_record,
                                 parse_ints, parse_slots, target)

AGENTS_QUICK = {"preset": "small", "layers": 2, "device": "cpu", "budget.memory_max": "4G", "budget.vram": "2GiB",
                "slots": "8+24", "time_budget": 150.0, "turns": 6, "agent_prompts": "64,320", "system_tokens": 32,
                "turn_tokens": 8, "repeat_prompt": 128, "clients": "1,2,4,8,16", "client_prompt": "16,32",
                "client_tokens": 12, "warm_prompt": 32, "warm_tokens": 4, "case_cap": 40.0, "disk_sample": "32MiB"}
# the scheduler keys a case records (engine_config): it sets the first three, prefix_cache_bytes is 0 (cache off) or
# the settings' size, the last two are the settings'
SCHEDULER_KEYS = ("max_running", "max_context", "max_queue", "prefix_cache_bytes", "max_batched_tokens", "prefill_chunk")
GB = 1e9
MiB = 1 << 20


@dataclass(slots=True)
class AgentOptions:
    model: str
    engine: EngineConfig                    # the engine's keys (settings, flags); a case sets its scheduler keys
    device: str = "cpu"
    slots: str = "auto"                     # "V+H" or "auto", the same for every case
    cgroup: bool = True
    time_budget: float = 480.0              # seconds for the whole run, from t0 (model writing included)
    t0: float = field(default_factory=time.monotonic)
    reserve_s: float = 10.0                 # kept for writing results
    case_cap: float = 150.0                 # seconds per case before its requests are cut (deadline)
    seed: int = 0
    run_dir: str = "/tmp/betelgeuse-bench"
    # agent loop
    turns: int = 8
    first_prompt: int = 300                 # tokens of turn 1 (system + first user message)
    last_prompt: int = 2000                 # about the tokens of the last turn
    system_tokens: int = 96
    turn_tokens: int = 24                   # completion tokens per turn
    repeat_prompt: int = 500
    agent_loop: bool = True                 # False (--no-agent-loop): the concurrency cases only
    # concurrency
    clients: tuple = (1, 2, 4, 8, 16)
    client_prompt: tuple = (64, 128)        # prompt tokens, min and max over the clients
    client_tokens: int = 48
    # the same warm-up before every measured phase
    warm_prompt: int = 64
    warm_tokens: int = 8
    # the disk's rate, sampled before every concurrency case in both patterns (random, layer: ceilings.measure_disk),
    # each with this budget; the bound of its decode passes' disk reads uses the faster
    disk_sample_bytes: int = 1 << 30
    disk_sample_s: float = 1.5


# ---- requests -------------------------------------------------------------------------------------------
def synthetic_ids(n: int, n_vocab: int, *seed) -> list[int]:
    """n deterministic token ids in [3, n_vocab) (low ids are the synth vocabulary's control tokens)."""
    return [int(x) for x in np.random.default_rng([*seed]).integers(3, n_vocab, n)]


def run_request(engine, ids: list[int], max_tokens: int, deadline: float | None) -> dict:
    """One greedy request through engine.submit; every figure on the client's clock (perf_counter)."""
    from betelgeuse.api import FinalEvent, GenerateRequest, SamplingParams, TokenEvent
    req = GenerateRequest(prompt_ids=list(ids), max_tokens=max_tokens, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    rec = {"prompt_tokens": len(ids), "t_submit": t0, "times": [], "tokens": []}
    try:
        final = None
        for ev in engine.submit(req, deadline=deadline):
            if isinstance(ev, TokenEvent):
                rec["times"].append(time.perf_counter())
                rec["tokens"].append(ev.token_id)
            elif isinstance(ev, FinalEvent):
                final = ev
    except BetelgeuseError as e:               # failed (or cut by its deadline) after the tokens it got
        rec["error"] = f"{type(e).__name__}: {e}"
        final = None
    if "error" not in rec:
        u = final.usage if final is not None else None
        rec["finish_reason"] = final.finish_reason if final is not None else None
        rec["usage"] = dataclasses.asdict(u) if u is not None else {}
        rec["cached_tokens"] = int(getattr(u, "cached_tokens", 0) or 0)   # 0 until the engine has a prefix cache
    n = len(rec["times"])
    rec["completion_tokens"] = n
    rec["ttft_s"] = rec["times"][0] - t0 if n else None
    rec["tg"] = (n - 1) / (rec["times"][-1] - rec["times"][0]) if n > 1 and rec["times"][-1] > rec["times"][0] else None
    return rec


def _slim(rec: dict) -> dict:
    """A request record for the JSON: times relative to its submit, in seconds."""
    out = {k: v for k, v in rec.items() if k not in ("times", "t_submit")}
    out["token_s"] = [round(t - rec["t_submit"], 6) for t in rec["times"]]
    return out


# ---- pass statistics ---------------------------------------------------------------------------------
class PassRecorder:
    """Every PassStats of the engine's passes, through its on_pass hook (called on the engine thread after each
    pass that completed); take() hands over what a phase of the suite recorded."""

    def __init__(self, engine):
        self._lock = threading.Lock()
        self.passes: list = []
        engine.on_pass = self.add

    def add(self, stats):
        with self._lock:
            self.passes.append(stats)

    def take(self) -> list:
        with self._lock:
            out, self.passes = self.passes, []
        return out


def pass_summary(passes: list, n_layer: int) -> dict:
    """Per pass kind ("decode", "prefill", ...): passes, tokens, expert loads per pass / per token, disk share."""
    out = {}
    for kind in sorted({p.kind for p in passes}):
        ps = [p for p in passes if p.kind == kind]
        reads = {t: sum(p.reads.get(t, 0) for p in ps) for t in ("vram", "host", "disk")}
        loads, toks, secs = sum(reads.values()), sum(p.n_tokens for p in ps), sum(p.seconds for p in ps)
        disk_bytes = sum(p.disk_bytes for p in ps)
        out[kind] = {"passes": len(ps), "tokens": toks, "seconds": secs, "reads": reads, "loads": loads,
                     "mean_batch": toks / len(ps), "loads_per_pass": loads / len(ps),
                     "loads_per_layer_pass": loads / len(ps) / max(n_layer, 1),
                     "loads_per_token": loads / toks if toks else None,
                     "disk_share": reads["disk"] / loads if loads else 0.0, "disk_bytes": disk_bytes,
                     "disk_bytes_per_pass": disk_bytes / len(ps),
                     "disk_wait_ms": sum(p.disk_wait_s for p in ps) * 1e3, "pass_ms_mean": secs / len(ps) * 1e3,
                     # opening the store pass: waiting for a pending consolidation, then VRAM fills (no backing: disk)
                     "open_ms": sum(p.open_s for p in ps) * 1e3, "open_ms_max": max(p.open_s for p in ps) * 1e3}
    return out


def concurrency_figures(recs: list[dict]) -> dict:
    """Aggregate decode tok/s and TTFT percentiles of clients that started together (definitions: module doc)."""
    ok = [r for r in recs if r.get("times") and r.get("ttft_s") is not None]
    if not ok:
        return {"completed": 0, "clients": len(recs), "errors": sum("error" in r for r in recs)}
    t0 = min(r["t_submit"] for r in recs)
    first = max(r["times"][0] for r in ok)
    last = max(r["times"][-1] for r in ok)
    window = sum(sum(t > first for t in r["times"]) for r in ok)
    ttft = np.array([r["ttft_s"] for r in ok])
    tg = [r["tg"] for r in ok if r.get("tg")]
    total = sum(len(r["times"]) for r in ok)
    return {"completed": sum(r.get("finish_reason") == "length" for r in ok), "clients": len(recs),
            "completion_tokens": total, "window_tokens": window, "window_s": last - first,
            "aggregate_decode_tps": window / (last - first) if last > first else None,
            "end_to_end_tps": total / (last - t0) if last > t0 else None,
            "tg_mean": float(np.mean(tg)) if tg else None, "tg_min": min(tg) if tg else None,
            "tg_max": max(tg) if tg else None,
            "usage_tg_mean": float(np.mean([r.get("usage", {}).get("predicted_per_second", 0.0) for r in ok])),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "ttft_max_s": float(ttft.max()), "wall_s": last - t0}


# ---- the suite ---------------------------------------------------------------------------------------
class AgentSuite:
    def __init__(self, o: AgentOptions, results: dict, save):
        import torch
        from betelgeuse.gguf.reader import GGUFModelFile
        self.o, self.results, self.save = o, results, save
        self.torch = torch
        self.cuda = o.device.startswith("cuda")
        f = GGUFModelFile.open(o.model)
        self.mcfg = f.config
        f.close()
        self.ctx_model = self.mcfg.context_length or 1 << 20
        self.tags = 0

    def remaining(self) -> float:
        return self.o.t0 + self.o.time_budget - self.o.reserve_s - time.monotonic()

    def deadline(self) -> float:
        """A request deadline (monotonic): the case cap or the run's budget, whichever ends first."""
        return time.monotonic() + max(1.0, min(self.o.case_cap, self.remaining()))

    # ---- engine per case -------------------------------------------------------------------------------
    def _ctx(self, tokens: int) -> int:
        """max_context for a case: its longest sequence, rounded up to 64 (a prefix-cache block), within the model."""
        return max(64, min(self.ctx_model, -(-(tokens + 16) // 64) * 64))

    def _open(self, case: dict, max_running: int, max_context: int, prefix_cache_bytes):
        """A fresh store child and engine for one case, both with the case's scheduler keys (the store plans the
        slots: it counts the same KV / prefix-cache reserve as this engine)."""
        from services.assembly import open_engine, open_store
        from services.bench.harness import slots_pair
        from services.bench.procs import cgroup_of, mkdir
        o = self.o
        v, h = slots_pair(o.slots)
        cfg = dataclasses.replace(o.engine, vram_slots=v, host_slots=h, max_running=max_running,
                                  max_context=max_context, prefix_cache_bytes=prefix_cache_bytes,
                                  max_queue=max(16, 2 * max_running))
        case["engine_config"] = {k: getattr(cfg, k) for k in SCHEDULER_KEYS}
        self.tags += 1
        store = open_store(cfg, "process", str(mkdir(o.run_dir) / f"store-agents-{self.tags}"), timeout=300.0)
        engine = None
        client = store.client
        try:
            case["store_start_s"] = store.ready_s
            case["cgroups"] = {"store": cgroup_of(store.proc.pid), "worker": cgroup_of("self")}
            t = time.perf_counter()
            engine = open_engine(cfg, store)
            case["engine_start_s"] = time.perf_counter() - t
            case["engine_config"]["prefill_chunk"] = engine.cfg.prefill_chunk     # auto: the architecture's, resolved
            p = engine.runner.plan
            case["plan"] = {"n_vram": p.n_vram, "n_host": p.n_host, "n_staging": p.n_staging,
                            "arena_bytes": p.arena_bytes, "notes": list(p.notes),
                            "resident_share": (p.n_vram + p.n_host) / self.mcfg.n_expert}
            pc = getattr(engine, "prefix_cache", None)
            case["prefix_cache"] = {"engine_has_prefix_cache": hasattr(engine, "prefix_cache"),
                                    "enabled": pc is not None and prefix_cache_bytes != 0,
                                    "type": type(pc).__name__ if pc is not None else None}
            return engine, client, store, PassRecorder(engine)
        except BaseException:
            self._close(case, engine, client, store)
            raise

    def _close(self, case: dict, engine, client, store):
        from services.bench.procs import arena_mappings
        try:
            if engine is not None:
                case.setdefault("prefix_cache", {})["final"] = _numbers(getattr(engine, "prefix_cache", None))
                engine.close()           # the runner drops its views of the store's arena (ModelRunner.close)
                # so its memfd is unmapped now: the next case's store pre-faults its own arena in the same cgroup
                engine.runner = None
            if client is not None:
                client.close()
            del engine
            gc.collect()
            if self.cuda:
                self.torch.cuda.synchronize()
                self.torch.cuda.empty_cache()
            case["arena_mappings_after_close"] = arena_mappings()
        finally:
            rc = store.close()
            case["store_exit"] = rc
            if rc not in (0, None):
                case["store_error"] = store.proc.last_line()

    def _warm(self, engine, clients: int = 1) -> dict:
        """The same warm-up before every measured phase: `clients` short requests at once (Triton compiles, CUDA
        graphs, the batched shapes), prompts of their own seed (no prefix shared with a measured prompt)."""
        t = time.perf_counter()
        recs = self._together(engine, [synthetic_ids(self.o.warm_prompt, self.mcfg.n_vocab, self.o.seed, 9, i)
                                       for i in range(clients)], self.o.warm_tokens)
        errs = [r["error"] for r in recs if "error" in r]
        if errs:
            raise BetelgeuseError(f"warm-up failed: {errs[0]}")
        return {"clients": clients, "seconds": time.perf_counter() - t}

    def _together(self, engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        """Submit every prompt at once, one thread each (a barrier releases them together)."""
        recs = [dict() for _ in prompts]
        barrier = threading.Barrier(len(prompts))
        dl = self.deadline()

        def client(i):
            barrier.wait()
            recs[i].update(run_request(engine, prompts[i], max_tokens, dl))
        ts = [threading.Thread(target=client, args=(i,), name=f"bench-client-{i}", daemon=True)
              for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(max(1.0, dl - time.monotonic()) + 30.0)
        for r in recs:
            if not r.get("finish_reason") and "error" not in r:
                r["error"] = "the client did not finish"
        return recs

    def _one(self, engine, ids, max_tokens) -> dict:
        r = run_request(engine, ids, max_tokens, self.deadline())
        if "error" in r:
            raise BetelgeuseError(f"request of {len(ids)} tokens failed: {r['error']}")
        if r["finish_reason"] == "cancelled":
            raise OutOfTime()
        return r

    # ---- the run -------------------------------------------------------------------------------------
    def run(self):
        from services.bench.procs import watched
        o, r = self.o, self.results
        cg, mon = watched(r, o.engine.memory_max, o.cgroup, self.torch.device(o.device), o.engine.vram_budget)
        plan = [("agent loop, prefix cache off", lambda c: self._agent(c, 0)),
                ("agent loop, prefix cache on", lambda c: self._agent(c, o.engine.prefix_cache_bytes))]
        if not o.agent_loop:
            r["skipped"] += [{"case": name, "reason": "--no-agent-loop"} for name, _ in plan]
            plan = []
        first = [n for n in (1, 8) if n in o.clients]          # the judged ratio first, the costliest (16) last
        for n in first + sorted(n for n in o.clients if n not in first):
            plan.append((f"{n} client{'s' if n > 1 else ''}", lambda c, n=n: self._clients(c, n)))
        try:
            for name, fn in plan:
                if self.remaining() <= 0:
                    r["skipped"].append({"case": name, "reason": "time budget"})
                    continue
                case = {"name": name, "started_at_s": time.monotonic() - o.t0}
                r["cases"].append(case)
                t = time.monotonic()
                try:
                    fn(case)
                except OutOfTime:
                    case["partial"] = True
                    r["skipped"].append({"case": name, "reason": "time budget (cut mid-case)"})
                except (BetelgeuseError, self.torch.OutOfMemoryError) as e:     # refused budget, dead store, OOM
                    r["errors"].append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())}")
                except Exception as e:              # noqa: BLE001 - a bug: recorded with its traceback, next case
                    import traceback
                    traceback.print_exc(file=sys.stderr)
                    r["errors"].append(f"{name}: internal error {type(e).__name__}: {' '.join(str(e).split())}")
                case["seconds"] = time.monotonic() - t
                self._after_case(case)
                r["summary"] = summarize(r)
                self.save(False)
        finally:
            mon.close()
            r["memory"].update(cg.summary(mon.mem_peak), peak_by=mon.sources["memory"])
            if self.cuda:
                r["vram"].update(mon.vram_record())
            cg.close()
            r["summary"] = summarize(r)
            r["elapsed_s"] = time.monotonic() - o.t0

    def _after_case(self, case: dict):
        """What a finished case left in this process: live runners (must be 0: one keeps its VRAM and RAM), RSS,
        torch's allocated VRAM."""
        from betelgeuse.worker.runner import ModelRunner
        gc.collect()
        case["runners_alive_after"] = sum(isinstance(x, ModelRunner) for x in gc.get_objects())
        case["rss_after"] = _rss()
        if self.cuda:
            case["vram_allocated_after"] = self.torch.cuda.memory_allocated()

    def _agent(self, case: dict, prefix_cache_bytes):
        o, V = self.o, self.mcfg.n_vocab
        case.update(kind="agent", prefix_cache_bytes=prefix_cache_bytes)
        system = synthetic_ids(o.system_tokens, V, o.seed, 1)
        users = agent_user_lengths(o)
        longest = max(o.system_tokens + sum(users) + o.turns * o.turn_tokens,      # the last turn + its completion
                      o.repeat_prompt + 4)
        engine, client, store, rec = self._open(case, 1, self._ctx(longest), prefix_cache_bytes)
        try:
            case["warmup"] = self._warm(engine)
            rec.take()
            turns, ids = [], list(system)
            case["turns"] = turns
            for k, n_user in enumerate(users):
                ids = ids + synthetic_ids(n_user, V, o.seed, 2, k)
                rr = self._one(engine, ids, o.turn_tokens)
                rr["turn"] = k + 1
                rr["passes"] = pass_summary(rec.take(), self.mcfg.n_layer)
                turns.append(_slim(rr))
                ids = ids + rr["tokens"]
                self.save(False)
            rep = synthetic_ids(o.repeat_prompt, V, o.seed, 3)
            # twice the same prompt (the 2nd: the whole-prompt entry, no pass), then it + 1 token (the prefill
            # resumes at its last whole block: the tokens after it are computed)
            case["repeat"] = [_slim(self._one(engine, p, 4)) for p in (rep, rep, rep + [synthetic_ids(1, V, o.seed, 4)[0]])]
            rec.take()
        finally:
            self._close(case, engine, client, store)

    def _disk_rate(self, k: int) -> dict:
        """The disk read as the store reads it (its reader settings), sampled now in both patterns
        (ceilings.measure_disk_rates: random, layer): "bps", the faster, is the ceiling of this case's disk reads,
        measured in the same run."""
        from services.bench.ceilings import measure_disk_rates
        rc = self.o.engine
        return measure_disk_rates(self.o.model, rc.read_threads, rc.read_request_bytes, self.o.disk_sample_bytes,
                                  self.o.disk_sample_s, self.o.seed + k, self.o.t0)

    def _clients(self, case: dict, n: int):
        o, V = self.o, self.mcfg.n_vocab
        lo, hi = o.client_prompt
        lens = [lo + (i * 37) % (hi - lo + 1) for i in range(n)]
        prompts = [synthetic_ids(lens[i], V, o.seed, 4, n, i) for i in range(n)]
        case.update(kind="concurrency", clients=n, prefix_cache_bytes=o.engine.prefix_cache_bytes)
        d = self._disk_rate(len(self.results["cases"]))
        # the bound's rate: max(random, layer) (serve_meter.disk_rate); each pattern's sample beside it
        case["disk_bps"], case["disk_pattern"] = d["bps"], d["pattern"]
        case["disk_bps_random"], case["disk_bps_layer"] = d["random"]["bps"], d["layer"]["bps"]
        engine, client, store, rec = self._open(case, n, self._ctx(hi + o.client_tokens), o.engine.prefix_cache_bytes)
        try:
            case["warmup"] = self._warm(engine, n)
            rec.take()
            st0 = _store_status(engine)
            recs = self._together(engine, prompts, o.client_tokens)
            st1 = _store_status(engine)
            case["figures"] = concurrency_figures(recs)
            case["passes"] = pass_summary(rec.take(), self.mcfg.n_layer)
            case["store_disk_bytes"] = (st1.get("disk_bytes", 0) - st0.get("disk_bytes", 0)) if st0 and st1 else None
            case["requests"] = [_slim(x) for x in recs]
            errs = [x["error"] for x in recs if "error" in x]
            if errs:
                raise BetelgeuseError(f"{len(errs)} of {n} clients failed: {errs[0]}")
            if any(x.get("finish_reason") == "cancelled" for x in recs):
                raise OutOfTime()
        finally:
            self._close(case, engine, client, store)


def _numbers(obj) -> dict:
    """The public int/float attributes of an object (the prefix cache's counters, whatever it names them)."""
    out = {}
    for k in dir(obj) if obj is not None else ():
        try:
            v = getattr(obj, k)
        except Exception:               # noqa: BLE001 - a property that cannot be read now
            continue
        if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif k == "stats" and v is not None:          # the cache's counters object (hits, evictions, ...)
            out[k] = _numbers(v)
    return out


def _rss() -> int:
    """This process's resident set, bytes (/proc/self/statm)."""
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _store_status(engine) -> dict:
    try:
        return engine.runner.store.status()
    except Exception:                   # noqa: BLE001 - a cross-check only
        return {}


def agent_user_lengths(o: AgentOptions) -> list[int]:
    """New user tokens per turn: turn 1 fills the first prompt after the system prompt; later turns grow the
    conversation by ~(last - first) / (turns - 1) tokens each (completion included), +-5% seeded jitter."""
    first = o.first_prompt - o.system_tokens
    if first < 1 or o.turns < 2:
        raise InvalidRequestError(f"the agent loop needs >= 2 turns and a first prompt longer than the system "
                                  f"prompt ({o.first_prompt} <= {o.system_tokens})")
    step = (o.last_prompt - o.first_prompt) / (o.turns - 1) - o.turn_tokens
    rng = np.random.default_rng([o.seed, 5])
    return [first] + [max(1, int(round(step * (1 + rng.uniform(-0.05, 0.05))))) for _ in range(o.turns - 1)]


# ---- summary and markdown ------------------------------------------------------------------------------
def _by_name(r: dict, kind: str) -> list[dict]:
    return [c for c in r.get("cases", []) if c.get("kind") == kind]


def summarize(r: dict) -> dict:
    """The judged figures, each with its ratio."""
    s = {}
    for c in _by_name(r, "agent"):
        key = "agent_cache_on" if c.get("prefix_cache_bytes") != 0 else "agent_cache_off"
        t = [x for x in c.get("turns", []) if x.get("ttft_s")]
        d = {"turns": len(t), "prefix_cache_bytes": c.get("prefix_cache_bytes")}
        if t:
            d.update(ttft_first_s=t[0]["ttft_s"], ttft_last_s=t[-1]["ttft_s"], ratio_last_first=t[-1]["ttft_s"] / t[0]["ttft_s"],
                     prompt_first=t[0]["prompt_tokens"], prompt_last=t[-1]["prompt_tokens"],
                     cached_tokens_total=sum(x.get("cached_tokens", 0) for x in t),
                     cached_tokens_last=t[-1].get("cached_tokens", 0))
        rep = c.get("repeat", [])
        if len(rep) >= 2:
            d.update(repeat_prompt=rep[1]["prompt_tokens"], repeat_ttft_first_s=rep[0]["ttft_s"],
                     repeat_ttft_second_s=rep[1]["ttft_s"], repeat_cached_second=rep[1].get("cached_tokens", 0))
        if len(rep) >= 3:
            d.update(repeat_plus1_ttft_s=rep[2]["ttft_s"], repeat_plus1_cached=rep[2].get("cached_tokens", 0))
        s[key] = d
    on, off = s.get("agent_cache_on", {}), s.get("agent_cache_off", {})
    if on.get("turns") and off.get("turns"):
        a = [x["tokens"] for x in _by_name(r, "agent")[0].get("turns", [])]
        b = [x["tokens"] for x in _by_name(r, "agent")[1].get("turns", [])]
        s["agent_same_tokens"] = a == b          # greedy: a prefix hit must not change the output
    conc = {}
    for c in _by_name(r, "concurrency"):
        f = c.get("figures", {})
        dec = c.get("passes", {}).get("decode", {})
        # the disk alone: a decode pass of mean_batch tokens cannot take less than its disk bytes at the disk's rate
        disk_s = dec.get("disk_bytes_per_pass", 0) / c["disk_bps"] if c.get("disk_bps") else None
        conc[str(c["clients"])] = {"aggregate_decode_tps": f.get("aggregate_decode_tps"), "ttft_p50_s": f.get("ttft_p50_s"),
                                   "ttft_p99_s": f.get("ttft_p99_s"), "tg_mean": f.get("tg_mean"),
                                   "slots": f"{c.get('plan', {}).get('n_vram', '?')}+{c.get('plan', {}).get('n_host', '?')}",
                                   "decode_loads_per_pass": dec.get("loads_per_pass"), "decode_disk_share": dec.get("disk_share"),
                                   "decode_mean_batch": dec.get("mean_batch"), "disk_bps": c.get("disk_bps"),
                                   "disk_bps_random": c.get("disk_bps_random"), "disk_bps_layer": c.get("disk_bps_layer"),
                                   "decode_disk_bound_tps": dec["mean_batch"] / disk_s if disk_s else None}
    s["concurrency"] = conc
    a1, a8 = (conc.get(k, {}).get("aggregate_decode_tps") for k in ("1", "8"))
    s["aggregate_8_over_1"] = a8 / a1 if a1 and a8 else None
    b8 = conc.get("8", {}).get("decode_disk_bound_tps")
    s["disk_bound_8_over_1"] = b8 / a1 if a1 and b8 else None      # the most the disk allows 8 clients, over 1
    return s


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def markdown(r: dict) -> str:
    from services.bench.report import _pct
    m, s, o = r.get("machine", {}), r.get("summary", {}), r.get("options", {})
    gpu = o.get("device", "cpu").startswith("cuda")
    L = [f"# Betelgeuse agents benchmark: {r.get('run', '')}", "", f"Command: `{r.get('command', '')}`", "",
         f"Machine: GPU {m.get('gpu') or 'none'}; CPU {m.get('cpu', '')} x{m.get('cpus', '')}; "
         f"RAM {m.get('ram_bytes', 0) / 2**30:.0f} GiB; torch {m.get('torch', '')}; device `{r.get('device', '')}`; "
         f"model {Path(o.get('model', '')).name}; slots `{o.get('slots')}`", ""]
    if r.get("status") != "complete":
        L += [f"**Partial results** (status: {r.get('status')}).", ""]
    off, on = s.get("agent_cache_off", {}), s.get("agent_cache_on", {})
    cached_any = on.get("cached_tokens_total", 0) > 0
    tgt = lambda t: t if gpu else f"{t} on the GPU"        # noqa: E731
    L += ["## Judged figures", "", "| Figure | Measured | Target |", "|---|---|---|",
          f"| Agent loop TTFT last turn / first turn, prefix cache off | {_f(off.get('ratio_last_first'))}x "
          f"({_f(off.get('ttft_first_s'), '{:.3f}')} s -> {_f(off.get('ttft_last_s'), '{:.3f}')} s, "
          f"{off.get('prompt_first', '–')} -> {off.get('prompt_last', '–')} tokens) | – (grows with the prompt) |",
          f"| Agent loop TTFT last turn / first turn, prefix cache on | {_f(on.get('ratio_last_first'))}x "
          f"({_f(on.get('ttft_first_s'), '{:.3f}')} s -> {_f(on.get('ttft_last_s'), '{:.3f}')} s; "
          f"{on.get('cached_tokens_total', 0)} prompt tokens from the cache) | flat (~1x) |",
          f"| Repeated {on.get('repeat_prompt', '–')}-token prompt, TTFT of the 2nd submission (cache on / off) | "
          f"{_f(on.get('repeat_ttft_second_s'), '{:.3f}')} s ({on.get('repeat_cached_second', 0)} cached) / "
          f"{_f(off.get('repeat_ttft_second_s'), '{:.3f}')} s | {tgt('< 0.5 s')} |",
          f"| The same prompt + 1 token, TTFT (cache on / off; prefilled from its last whole block) | "
          f"{_f(on.get('repeat_plus1_ttft_s'), '{:.3f}')} s ({on.get('repeat_plus1_cached', 0)} cached) / "
          f"{_f(off.get('repeat_plus1_ttft_s'), '{:.3f}')} s | report |"]
    c = s.get("concurrency", {})
    bound = (f"; the disk alone allows 8 clients {_f(c.get('8', {}).get('decode_disk_bound_tps'))} tok/s = "
             f"{_f(s.get('disk_bound_8_over_1'))}x (its bytes per pass at {_f((c.get('8', {}).get('disk_bps') or 0) / GB)} "
             f"GB/s = max(random {_f((c.get('8', {}).get('disk_bps_random') or 0) / GB)}, layer "
             f"{_f((c.get('8', {}).get('disk_bps_layer') or 0) / GB)}), sampled before the case)"
             if s.get("disk_bound_8_over_1") else "")
    L.append(f"| Aggregate decode 8 clients / 1 client | {_f(s.get('aggregate_8_over_1'))}x "
             f"({_f(c.get('8', {}).get('aggregate_decode_tps'))} / {_f(c.get('1', {}).get('aggregate_decode_tps'))} tok/s"
             f"{bound}) | {tgt('>= 4x')} |")
    one, eight = c.get("1", {}), c.get("8", {})
    L.append(f"| Expert loads per decode pass, 1 vs 8 sequences (disk share) | {_f(one.get('decode_loads_per_pass'), '{:.0f}')} "
             f"({_pct(one.get('decode_disk_share'))}) vs {_f(eight.get('decode_loads_per_pass'), '{:.0f}')} "
             f"({_pct(eight.get('decode_disk_share'))}) | report |")
    if "agent_same_tokens" in s:
        L.append(f"| Greedy tokens of every turn identical with the cache on and off | {s['agent_same_tokens']} | True |")
    if not cached_any and _by_name(r, "agent"):
        L += ["", "No prompt token came from a prefix cache in this run (`cached_tokens` 0 on every turn): "
              + ("the engine has no prefix cache yet." if not any(x.get("prefix_cache", {}).get("engine_has_prefix_cache")
                                                                   for x in _by_name(r, "agent")) else "check the cache.")]
    agents = {("on" if x.get("prefix_cache_bytes") != 0 else "off"): x for x in _by_name(r, "agent")}
    plans = ", ".join(f"cache {k}: {x.get('plan', {}).get('n_vram', '?')}+{x.get('plan', {}).get('n_host', '?')} "
                      f"(prefix_cache_bytes {x.get('prefix_cache_bytes')})" for k, x in agents.items())
    L += ["", "## Agent loop (each turn resends the whole conversation)", "",
          f"Slots/layer (VRAM+host): {plans or '–'}. New user tokens per turn: {o.get('user_tokens_per_turn', '–')}; "
          f"{o.get('turn_tokens', '–')} completion tokens per turn.", "",
          "| Turn | Prompt tokens | TTFT off s | Cached off | Prefill off ms | TTFT on s | Cached on | Prefill on ms | "
          "Disk loads off / on |", "|---|---|---|---|---|---|---|---|---|"]
    toff, ton = agents.get("off", {}).get("turns", []), agents.get("on", {}).get("turns", [])
    for k in range(max(len(toff), len(ton))):
        a = toff[k] if k < len(toff) else {}
        b = ton[k] if k < len(ton) else {}
        L.append(f"| {k + 1} | {a.get('prompt_tokens', b.get('prompt_tokens', '–'))} | {_f(a.get('ttft_s'), '{:.3f}')} | "
                 f"{a.get('cached_tokens', '–')} | {_f(a.get('usage', {}).get('prompt_ms'), '{:,.0f}')} | "
                 f"{_f(b.get('ttft_s'), '{:.3f}')} | {b.get('cached_tokens', '–')} | "
                 f"{_f(b.get('usage', {}).get('prompt_ms'), '{:,.0f}')} | "
                 f"{a.get('usage', {}).get('expert_reads_disk', '–')} / {b.get('usage', {}).get('expert_reads_disk', '–')} |")
    for key in ("off", "on"):
        rep = agents.get(key, {}).get("repeat", [])
        if len(rep) >= 2:
            L.append(f"\nRepeated {rep[0]['prompt_tokens']}-token prompt, cache {key}: TTFT {rep[0]['ttft_s']:.3f} s, "
                     f"then {rep[1]['ttft_s']:.3f} s ({rep[1].get('cached_tokens', 0)} tokens cached)"
                     + (f", then + 1 token {rep[2]['ttft_s']:.3f} s ({rep[2].get('cached_tokens', 0)} cached)."
                        if len(rep) >= 3 else "."))
    L += ["", "## Concurrency (greedy clients submitting at once, distinct prompts)", "",
          "| Clients | max_running | Slots/layer (VRAM+host) | Aggregate decode tok/s | End-to-end tok/s | Per-request TG "
          "mean (min-max) | TTFT p50 s | TTFT p99 s | Completed |", "|---|---|---|---|---|---|---|---|---|"]
    for x in sorted(_by_name(r, "concurrency"), key=lambda x: x["clients"]):
        f, p = x.get("figures", {}), x.get("plan", {})
        L.append(f"| {x['clients']} | {x.get('engine_config', {}).get('max_running', '–')} | "
                 f"{p.get('n_vram', '?')}+{p.get('n_host', '?')} | {_f(f.get('aggregate_decode_tps'))} | "
                 f"{_f(f.get('end_to_end_tps'))} | {_f(f.get('tg_mean'))} ({_f(f.get('tg_min'))}-{_f(f.get('tg_max'))}) | "
                 f"{_f(f.get('ttft_p50_s'), '{:.3f}')} | {_f(f.get('ttft_p99_s'), '{:.3f}')} | "
                 f"{f.get('completed', 0)}/{x['clients']} |")
    L += ["", "## Expert loads per decode pass (one batched pass = one decode step of every running sequence)", "",
          "| Clients | Decode passes | Mean batch | Loads / pass | Loads / layer / pass | Loads / token | VRAM / host / disk | "
          "Disk share | Disk MB / pass | Pass ms | Pass-open ms (sum / max) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in sorted(_by_name(r, "concurrency"), key=lambda x: x["clients"]):
        d = x.get("passes", {}).get("decode")
        if not d:
            continue
        rd = d["reads"]
        L.append(f"| {x['clients']} | {d['passes']} | {d['mean_batch']:.2f} | {d['loads_per_pass']:.1f} | "
                 f"{d['loads_per_layer_pass']:.2f} | {_f(d['loads_per_token'], '{:.1f}')} | "
                 f"{rd['vram']} / {rd['host']} / {rd['disk']} | {_pct(d['disk_share'])} | "
                 f"{d['disk_bytes_per_pass'] / MiB:.2f} | {d['pass_ms_mean']:.1f} | "
                 f"{_f(d.get('open_ms'), '{:,.0f}')} / {_f(d.get('open_ms_max'), '{:,.0f}')} |")
    mem, vram = r.get("memory", {}), r.get("vram", {})
    L += ["", "## Budgets", "",
          f"- Peak VRAM: {_f(None if vram.get('peak_bytes') is None else vram['peak_bytes'] / MiB, '{:,.0f}')} MiB "
          f"device-wide above the baseline (torch max reserved "
          f"{_f(None if vram.get('torch_max_reserved') is None else vram['torch_max_reserved'] / MiB, '{:,.0f}')} MiB) "
          f"under a budget of {vram.get('budget', 0) / 2**30:.0f} GiB",
          f"- Peak cgroup memory: {_f(None if not mem.get('peak') else mem['peak'] / 2**30)} GiB of limit "
          f"{_f(None if not mem.get('limit') else mem['limit'] / 2**30)} GiB "
          f"({mem.get('cgroup') or 'no cgroup: ' + str(mem.get('reason'))}); OOM kills: {mem.get('oom_kills', '–')}",
          "", "## Definitions", "",
          "- TTFT: client clock, `submit()` to the first TokenEvent. Prefill ms: the request's usage (`prompt_ms`).",
          "- Aggregate decode tok/s: tokens every client received after the last client's first token / the wall from "
          "that first token to the last token (1 client: (n - 1) / (t_last - t_first)). End-to-end: all completion "
          "tokens / the wall from the first submit to the last token. Per-request TG: (n - 1) / (t_last - t_first).",
          "- Loads: expert applications of the runner's passes (one per (layer, expert) a pass used, by the tier it "
          "came from), over the measured phase only (after the warm-up); a batched decode pass loads each expert "
          "once for every sequence that chose it.",
          "- Pass-open ms: the decode passes' time opening the store pass (BeginPass, which first waits for a "
          "pending consolidation's disk reads, then the VRAM slots filled for the new placement): stalls, not compute.",
          "- Every case runs on a fresh store (empty slots) and engine after the same warm-up (`clients` requests of "
          f"{o.get('warm_prompt')} prompt + {o.get('warm_tokens')} completion tokens at once); the store plans its "
          "slots with the case's max_running / max_context / prefix_cache_bytes.", ""]
    if r.get("skipped"):
        L += ["## Skipped", ""] + [f"- {x.get('case')}: {x['reason']}" for x in r["skipped"]] + [""]
    if r.get("errors"):
        L += ["## Errors", ""] + [f"- {e}" for e in r["errors"]] + [""]
    return "\n".join(L)


# ---- CLI ------------------------------------------------------------------------------------------------
def add_arguments(p):
    g = p.add_argument_group("--suite agents")
    g.add_argument("--turns", type=int, help="agent-loop turns (default 8)")
    g.add_argument("--agent-prompts", help="FIRST,LAST prompt tokens of the agent loop (default 300,2000)")
    g.add_argument("--system-tokens", type=int, help="tokens of the fixed system prompt (default 96)")
    g.add_argument("--turn-tokens", type=int, help="completion tokens per turn (default 24)")
    g.add_argument("--repeat-prompt", type=int, help="tokens of the prompt submitted twice (default 500)")
    g.add_argument("--clients", help="client counts, comma-separated (default 1,2,4,8,16)")
    g.add_argument("--no-agent-loop", action="store_true", help="skip the agent-loop cases (concurrency only)")
    g.add_argument("--client-prompt", help="MIN,MAX prompt tokens of the concurrent clients (default 64,128)")
    g.add_argument("--client-tokens", type=int, help="completion tokens per concurrent client (default 48)")
    g.add_argument("--warm-prompt", type=int, help="warm-up prompt tokens (default 64)")
    g.add_argument("--warm-tokens", type=int, help="warm-up completion tokens (default 8)")
    g.add_argument("--case-cap", type=float, help="seconds per case before its requests are cut (default 150)")
    # the engine's keys are the bench's engine flags (services/bench/args.py): --prefix-cache-bytes is the cache-on
    # cases' size; each case sets max_running, max_context and max_queue itself (SCHEDULER_KEYS)


_opt = opt_reader(AGENTS_QUICK)


def _pair(text, flag) -> tuple[int, int]:
    v = parse_ints(text, flag)
    if len(v) != 2 or v[0] > v[1]:
        raise InvalidRequestError(f"{flag}: expected MIN,MAX (MIN <= MAX), got {text!r}")
    return v


def options_from_args(args, model: str, device: str, t0: float, work: Path) -> AgentOptions:
    import os
    from betelgeuse.settings import parse_size
    slots = parse_slots(_opt(args, "slots", "auto"))
    if len(slots) != 1:
        raise InvalidRequestError(f"--suite agents takes one slot configuration, got {len(slots)}")
    first, last = _pair(_opt(args, "agent_prompts", "300,2000"), "--agent-prompts")
    engine = engine_from_args(args, AGENTS_QUICK, model, device)
    if engine.prefix_cache_bytes == 0:
        raise InvalidRequestError("--prefix-cache-bytes 0: the cache-off case is always run; give the cache-on size")
    ints = {k: _opt(args, k, d) for k, d in (("turns", 8), ("system_tokens", 96), ("turn_tokens", 24),
                                              ("repeat_prompt", 500), ("client_tokens", 48), ("warm_prompt", 64),
                                              ("warm_tokens", 8))}
    bad = [k for k, v in ints.items() if int(v) < 1]
    if bad:
        raise InvalidRequestError(f"--{bad[0].replace('_', '-')} must be >= 1, got {ints[bad[0]]}")
    o = AgentOptions(model=model, engine=engine, device=device, slots=slots[0], cgroup=not args.no_cgroup,
                     time_budget=float(_opt(args, "time_budget", 480.0)), t0=t0,
                     case_cap=float(_opt(args, "case_cap", 150.0)), seed=args.seed,
                     run_dir=str(work / f"run-{os.getpid()}"), first_prompt=first, last_prompt=last,
                     clients=parse_ints(_opt(args, "clients", "1,2,4,8,16"), "--clients"),
                     client_prompt=_pair(_opt(args, "client_prompt", "64,128"), "--client-prompt"),
                     disk_sample_bytes=parse_size(_opt(args, "disk_sample", "1GiB"), "--disk-sample"),
                     agent_loop=not getattr(args, "no_agent_loop", False), **{k: int(v) for k, v in ints.items()})
    if o.turns < 2:
        raise InvalidRequestError(f"--turns must be >= 2 (a conversation that grows), got {o.turns}")
    agent_user_lengths(o)                # refuses a first prompt shorter than the system prompt
    return o


def run(args) -> int:
    """`betelgeuse bench --suite agents`: write/reuse the model, run the suite, write bench.json / bench.md."""
    from services.bench.args import suite_log, suite_results
    from services.bench.report import write_results
    t0 = time.monotonic()
    log = suite_log("agents", t0)
    device, work, _, spec, model, run_name, out = target(args, _opt, "-agents")
    o = options_from_args(args, str(model), device, t0, work)
    results = suite_results(args, "agents", run_name, device)
    save = lambda final: write_results(results, out, png=False, render=markdown)     # noqa: E731
    results["models"]["main"] = ensure_model(model, spec, log)
    results["options"] = options_record(o)
    results["options"]["user_tokens_per_turn"] = agent_user_lengths(o)
    log(f"device {device}; results -> {out}")
    from services.bench.report import run_recorded
    rc = run_recorded(results, save, AgentSuite(o, results, save).run, log)
    md = markdown(results)
    print(md[md.find("## Judged figures"):md.find("## Agent loop")].strip())     # the figures, with their ratios
    return rc
