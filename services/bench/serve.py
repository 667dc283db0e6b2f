"""`betelgeuse bench --suite serve`: the live service's figures (issue 24), as a user gets them.

For each configuration (--config shipped,auto or V+H; --serve-args adds flags) it starts the real `betelgeuse serve`
(both processes, services/cli.py through services/launcher.py) in a memory cgroup of its own (memory.max =
--memory-max, memory.swap.max = 0; where none can be made it says so and serve gets --memory-max instead), waits for
/health, and drives it over the OpenAI HTTP API with its own client: POST /v1/completions, streamed, greedy
(temperature 0), ignore_eos, prompts as token ids, every time on the client's clock. Tokens are counted, not text:
each request asks for logprobs (`logprobs: 0`), so every generated token arrives in a chunk of its own with a
logprobs entry even when its text is "" or held back (a synthetic model's unused tokens, part of a UTF-8 character).
Beside the client's TTFT / TG the table prints the server's own (usage timings: ttft_ms, predicted_per_second).

  cold prompt   one --prompt-token prompt (default 512): TTFT, TG over --decode tokens (default 128)
  again         the same prompt again (the prefix cache): TTFT, TG, cached tokens
  clients       1, 4, 8 clients (--clients) released together, --client-prompt tokens each (default 128, distinct
                prompts), --client-tokens each (default 64): aggregate decode tok/s, per-request tok/s, TTFT p50/max;
                the ratios aggregate(N) / aggregate(1) and TTFT p50(8) / TTFT of the lone (1-client) cold prompt
  agent loop    --turns turns (default 6), each resending the conversation (346 -> 1,756 tokens): TTFT first -> last
  budgets       peak VRAM (device-wide, nvidia-smi, above what was in use before serve started) and the cgroup's peak
  bound         beside each decode rate: what the service moved in that phase (the store's disk bytes, the
                worker's H2D bytes and tokens, read before, when the decode window opens and after) over the disk
                and H2D rates measured in this run: tokens / max(disk bytes / disk rate, H2D bytes / H2D rate), its
                limiter, achieved = rate / bound (services/bench/serve_meter.py). The disk is sampled in both
                patterns the store reads (random and layer, a sample's rate the faster: serve_meter.disk_rate) before
                the first serve (--disk-sample) and beside every phase (--disk-sample-beside: before it once the
                store's disk counter stands still, and after the last), and each window is bounded at the fastest
                rate observed around it (serve_meter.window_disk_rate: the samples before and after its phase, the
                run's first, its own reads); beside each TTFT the prefill
                window's (the phase's start -> its last first token) TTFT bound in seconds: max(disk bytes / disk
                rate, H2D bytes / H2D rate, the prefill passes' work outside disk waits), achieved = bound / TTFT,
                and the TTFT target's floor: the most clients' bound / the lone prompt's

A warm-up request (--warm-prompt / --warm-tokens, its own ids) comes first, and N of them together before the N-client
case, so one-time costs (Triton compiles, CUDA graph captures) are not in the figures. Results: bench.json / bench.md
(report.write_results), serve-<k>-<config>.log (the end of each serve's logs); --json prints bench.json to stdout
instead of the figures.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


from betelgeuse.errors import BetelgeuseError, InvalidRequestError
from services.bench.agents import _pair, agent_user_lengths, concurrency_figures, synthetic_ids
from services.bench.args import OutOfTime, ensure_model, opt_reader, parse_ints, target
from services.bench.serve_meter import BOUND_WRONG, Meter, bounds, describe, describe_prefill, disk_rates, size

GB = 1e9
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "betelgeuse.toml"

SERVE_QUICK = {"preset": "tiny", "device": "cpu", "budget.memory_max": "4G", "time_budget": 120.0, "prompt": 32,
               "decode": 48, "clients": "1,2", "client_prompt": "16,16", "client_tokens": 24, "turns": 3,
               "agent_prompts": "40,120", "system_tokens": 16, "turn_tokens": 4, "warm_prompt": 8, "warm_tokens": 2,
               "disk_sample": "16MiB", "disk_sample_beside": "8MiB", "disk_sample_beside_s": 0.25,
               "idle_quiet_s": 0.2, "config": "auto"}


@dataclass(slots=True)
class ServeOptions:
    model: str
    device: str
    configs: tuple = ("shipped", "auto")   # "shipped" | "auto" | "V+H", each optionally ":flag=value..."; a serve each
    serve_args: tuple = ()                 # more flags for every serve
    engine_flags: tuple = ()               # the bench's engine flags the user gave, forwarded to serve
    memory_max: int | None = 12 << 30      # the cgroup's memory.max (None: no cgroup, serve plans against its own)
    cgroup: bool = True
    time_budget: float = 480.0
    t0: float = field(default_factory=time.monotonic)
    seed: int = 0
    run_dir: str = "/tmp/betelgeuse-bench"
    prompt: int = 512
    decode: int = 128
    clients: tuple = (1, 4, 8)
    client_prompt: tuple = (128, 128)
    client_tokens: int = 64
    turns: int = 6
    agent_loop: bool = True                # False (--no-agent-loop): its time goes to the next configuration
    first_prompt: int = 346
    last_prompt: int = 1756
    system_tokens: int = 96
    turn_tokens: int = 24
    warm_prompt: int = 16
    warm_tokens: int = 4
    disk_sample_bytes: int = 1 << 30       # the run's first disk sample, before the first serve (per pattern)
    disk_sample_s: float = 3.0
    disk_beside_bytes: int = 512 << 20     # the samples beside every phase (per pattern: ~0.35 s each at 1.5 GB/s)
    disk_beside_s: float = 0.75
    idle_quiet_s: float = 0.5              # before a sample beside a phase: the store's disk counter still this long,
    idle_most_s: float = 3.0               # waiting at most this long
    start_timeout: float = 300.0


# ---- the client ------------------------------------------------------------------------------------------
class Client:
    """The OpenAI HTTP API of one serve: /health, /v1/models, streamed /v1/completions (stdlib http.client)."""

    def __init__(self, hostport: str, timeout: float = 300.0):
        self.host, _, port = hostport.rpartition(":")
        self.port, self.timeout = int(port), timeout
        self.model_id = ""
        self.deadline: float | None = None     # monotonic: a stream still open then is cut (the connection closed)

    def _conn(self, timeout=None):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, dict | str]:
        c = self._conn(timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            body = r.read().decode(errors="replace")
            try:
                return r.status, json.loads(body)
            except ValueError:
                return r.status, body
        finally:
            c.close()

    def complete(self, ids: list[int], max_tokens: int, on_first=None) -> dict:
        """One streamed greedy completion of token ids; per-token times on the client's clock (perf_counter).
        Tokens are counted, not text: the stream is asked for logprobs (`logprobs: 0`), so the server sends one
        chunk per generated token with its entry in logprobs.tokens even when the token's text is "" (an unused or
        control token) or held back (part of a UTF-8 character); a chunk with text and no logprobs (the held-back
        tail) is no token. completion_tokens and cached_tokens come from the final usage, the server's own timings
        (ttft_ms, predicted_per_second) from its `timings`. on_first() is called when the first token arrives."""
        body = json.dumps({"model": self.model_id, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "logprobs": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
        rec = {"prompt_tokens": len(ids), "times": [], "text": "", "t_submit": time.perf_counter()}
        c = self._conn()

        def wait_at_most():
            # a read blocked past the deadline (a long prefill sends nothing) times out there: the stream is cut
            if self.deadline is not None and c.sock is not None:
                c.sock.settimeout(max(0.05, min(self.timeout, self.deadline - time.monotonic())))
        try:
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            wait_at_most()
            r = c.getresponse()
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {r.read().decode(errors='replace')[:300]}"
                return _finish(rec)
            while True:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    rec["error"] = CUT
                    break
                wait_at_most()
                line = r.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                ev = json.loads(data)
                if "error" in ev:
                    rec["error"] = str(ev["error"].get("message", ev["error"]))
                    break
                for ch in ev.get("choices", []):
                    rec["text"] += ch.get("text") or ""
                    n_tok = len((ch.get("logprobs") or {}).get("tokens") or ())
                    if n_tok:
                        first = not rec["times"]
                        rec["times"] += [now] * n_tok
                        if on_first is not None and first:
                            on_first()
                    if ch.get("finish_reason"):
                        rec["finish_reason"] = ch["finish_reason"]
                        rec["t_final"] = now
                if ev.get("usage"):
                    u = ev["usage"]
                    rec["completion_tokens"] = u.get("completion_tokens", 0)
                    rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    rec["usage"] = ev.get("timings", {})
        except (OSError, http.client.HTTPException, ValueError) as e:
            past = self.deadline is not None and time.monotonic() >= self.deadline
            rec["error"] = CUT if past and isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        finally:
            c.close()
        return _finish(rec)


CUT = "cut by the time budget"


def _finish(rec: dict) -> dict:
    """TTFT (submit to the first token) and TG ((n - 1) tokens over the first to the last token) of a record."""
    t = rec["times"]
    n = rec.get("completion_tokens", len(t))
    last = rec.get("t_final", t[-1] if t else None)
    rec["ttft_s"] = t[0] - rec["t_submit"] if t else None
    rec["tg"] = (n - 1) / (last - t[0]) if t and n > 1 and last > t[0] else None
    if "error" in rec:
        rec["finish_reason"] = None
    return rec


def server_figures(recs: list[dict]) -> dict:
    """The server's own clock for the same requests (usage `timings`: ttft_ms, predicted_per_second), the
    cross-check printed beside the client's figures: TTFT p50 / max (s) and per-request TG min / max (tok/s)."""
    u = [r["usage"] for r in recs if r.get("usage") and r["usage"].get("predicted_n")]
    if not u:
        return {}
    ttft = [x["ttft_ms"] / 1e3 for x in u]
    tg = [x["predicted_per_second"] for x in u if x.get("predicted_per_second")]
    return {"server_ttft_p50_s": statistics.median(ttft), "server_ttft_max_s": max(ttft),
            "server_tg_min": min(tg) if tg else None, "server_tg_max": max(tg) if tg else None}


def _server(x: dict | None) -> str:
    """One request's server timings as a table's cross-check: "server 0.052 s / 23.9 tok/s"."""
    u = (x or {}).get("usage") or {}
    if not u.get("predicted_n"):
        return "server –"
    return f"server {u['ttft_ms'] / 1e3:.3f} s / {u.get('predicted_per_second', 0):.1f} tok/s"


def _slim(rec: dict) -> dict:
    out = {k: v for k, v in rec.items() if k not in ("times", "t_submit", "t_final")}
    out["token_s"] = [round(x - rec["t_submit"], 6) for x in rec["times"]]
    return out


# ---- budgets: the cgroup and peak VRAM ----------------------------------------------------------------------
class ServeCgroup:
    """A memory cgroup of our own for one serve (memory.max, no swap), entered by serve itself before it execs
    (so its store and worker are born inside); `reason` says why there is none."""

    def __init__(self, name: str, memory_max: int, enabled: bool):
        from betelgeuse.store.cgroup import make_cgroup
        self.cg, self.reason, self.polled = None, "", 0
        if not enabled:
            self.reason = "disabled (--no-cgroup or --memory-max none)"
            return
        try:
            self.cg = make_cgroup(name, memory_max, swap_max=0)
        except (OSError, BetelgeuseError) as e:
            self.reason = f"cannot create a memory cgroup: {e}"

    def preexec(self):
        if self.cg is None:
            return None
        procs = os.path.join(self.cg.path, "cgroup.procs")
        return lambda: Path(procs).write_text(str(os.getpid()))

    def poll(self):
        if self.cg is not None:
            self.polled = max(self.polled, self.cg.current())

    def summary(self) -> dict:
        if self.cg is None:
            return {"cgroup": None, "reason": self.reason}
        self.poll()
        return {"cgroup": self.cg.path, "version": self.cg.version, "limit": self.cg.limit(),
                "swap_limit": self.cg.swap_limit(), "peak": max(self.cg.peak() or 0, self.polled),
                "oom_kills": self.cg.oom_kills()}

    def close(self):
        from betelgeuse.store.cgroup import remove_cgroup
        if self.cg is not None:
            remove_cgroup(self.cg)
            self.cg = None


def gpu_memory_used() -> int | None:
    """Device-wide GPU memory in use (nvidia-smi, GPU 0), bytes; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return int(float(out.splitlines()[0])) << 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class Monitor:
    """Polls the cgroup's memory and (on CUDA) device-wide VRAM every `period` s while a serve runs."""

    def __init__(self, cg: ServeCgroup, cuda: bool, period: float = 0.5):
        self.cg, self.cuda, self.period = cg, cuda, period
        self.vram_base = gpu_memory_used() if cuda else None
        self.vram_peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="serve-monitor", daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(self.period):
            try:
                self.cg.poll()
                if self.cuda:
                    used = gpu_memory_used()
                    if used is not None and self.vram_base is not None:
                        self.vram_peak = max(self.vram_peak, used - self.vram_base)
            except Exception:            # noqa: BLE001 - a monitor never takes the run down
                pass

    def close(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"vram_baseline_bytes": self.vram_base, "vram_peak_bytes": self.vram_peak if self.cuda else None}


def attach_event(paths) -> dict | None:
    """The first `attach_warm` event (worker/runner.py attach: warm-ups, each step's VRAM) in these logs, text or JSON
    lines -> its fields (values as logged), or None. A worker that trimmed its VRAM tier attaches again (runner
    _trim_vram): its steps then show only what the re-attach added (the warm-ups' kernels are loaded already), so the
    first event is the one that says what the warm-ups cost; the last one's figures follow under "reattached"."""
    from betelgeuse.logs import parse_text_line
    found = []
    for path in paths:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if "attach_warm" not in line:
                continue
            try:
                rec = json.loads(line) if line.lstrip().startswith("{") else parse_text_line(line)
            except (ValueError, IndexError):
                continue
            if rec.get("event") == "attach_warm":         # a text line's null is the string "null"
                found.append({k: None if v == "null" else v for k, v in rec.items()
                              if k not in ("ts", "level", "logger", "event")})
    if not found:
        return None
    first = found[0]
    if len(found) > 1:
        last = found[-1]
        first["reattached"] = {"times": len(found) - 1, **{k: last.get(k) for k in (
            "vram_device_torch_mib", "used_mib", "non_torch_mib", "projected_mib")}}
    return first


def serve_argv(o: ServeOptions, config: str, runtime_dir: str, port: int, http_port: int, no_cgroup: bool) -> list[str]:
    """`betelgeuse serve` for one configuration: the model and sockets of this run, then the configuration
    (shipped: --config deploy/betelgeuse.toml; auto: --vram-slots auto --host-slots auto; V+H: those counts),
    the bench's engine flags the user gave, --serve-args, then the configuration's own flags (":flag=value" after
    its base, e.g. auto:prefetch-batch-rule=union -> --prefetch-batch-rule union, auto:fill-budget -> --fill-budget:
    an A/B in one run)."""
    argv = ["serve", o.model, "--runtime-dir", runtime_dir, "--port", str(port), "--http",
            f"127.0.0.1:{http_port}", "--worker-metrics", "127.0.0.1:0", "--store-metrics", "127.0.0.1:0",
            "--device", o.device, "--drain-grace", "5"]     # (a stream cut by the budget ends at once)
    config, *own = config.split(":")
    if config == "shipped":
        if not SHIPPED.exists():
            raise BetelgeuseError(f"--config shipped: {SHIPPED} does not exist (run from a checkout)")
        argv += ["--config", str(SHIPPED)]
    elif config == "auto":
        argv += ["--vram-slots", "auto", "--host-slots", "auto"]
    else:
        v, _, h = config.partition("+")
        argv += ["--vram-slots", v, "--host-slots", h]
    argv += list(o.engine_flags)
    if no_cgroup and o.memory_max:   # no cgroup of ours: the store plans against the bench's memory budget instead
        argv += ["--memory-max", str(o.memory_max)]
    argv += list(o.serve_args)
    for f in own:
        k, _, v = f.partition("=")
        argv += [f"--{k}"] + ([v] if v else [])          # an on/off flag has no value (auto:no-fill-budget)
    return argv


# ---- the suite --------------------------------------------------------------------------------------------------
class ServeSuite:
    def __init__(self, o: ServeOptions, results: dict, save, log):
        from betelgeuse.gguf.reader import GGUFModelFile
        self.o, self.results, self.save, self.log = o, results, save, log
        self.meter: Meter | None = None
        self._open = None           # the last measured phase, waiting for the disk sample after it (_settle)
        f = GGUFModelFile.open(o.model)
        try:
            c = f.config
            self.geom = {"n_layer": c.n_layer, "n_expert": c.n_expert, "n_expert_used": c.n_expert_used,
                         "n_vocab": c.n_vocab, "expert_bytes": f.expert_nbytes(0)}
        finally:
            f.close()

    def remaining(self) -> float:
        return self.o.t0 + self.o.time_budget - time.monotonic()

    def run(self):
        o, r = self.o, self.results
        r["disk"] = d = self._disk_rate()
        self.log(f"disk: random {d['random']['bps'] / GB:.2f} GB/s, layer {d['layer']['bps'] / GB:.2f} GB/s "
                 f"({d['mode']}) over {d['bytes'] / MiB:.0f} MiB; bounds use {d['bps'] / GB:.2f} GB/s "
                 f"(max(random, layer): {d['pattern']})")
        r["h2d"] = self._h2d_rate()
        self.log(f"H2D: {r['h2d']['bps'] / GB:.2f} GB/s (pinned)" if r["h2d"]["bps"] else f"H2D: {r['h2d']['why']}")
        self.save(False)
        for k, config in enumerate(o.configs):
            if self.remaining() < min(30.0, o.time_budget / 8):      # too little left for a serve to start
                r["skipped"].append({"case": config, "reason": "time budget"})
                continue
            case = {"name": config, "kind": "serve", "started_at_s": time.monotonic() - o.t0}
            r["cases"].append(case)
            t = time.monotonic()
            try:
                self._serve_case(case, config, k, budget=self.remaining() / (len(o.configs) - k))
            except BetelgeuseError as e:
                r["errors"].append(f"{config}: {' '.join(str(e).split())}")
            case["seconds"] = time.monotonic() - t
            r["summary"] = summarize(r)
            self.save(False)
        r["summary"] = summarize(r)
        r["elapsed_s"] = time.monotonic() - o.t0
        for c in r["cases"]:
            self.log(f"{c['name']}: {bound_verdict(r['summary'].get(c['name'], {}))}")

    def _disk_rate(self, nbytes: int | None = None, seconds: float | None = None, seed: int = 0) -> dict:
        """The store's reader (its settings' defaults) reading whole experts of the model file in both patterns
        (ceilings.measure_disk_rates: random, layer; each up to nbytes / seconds, default the first sample's) and the
        rate the bounds use (the faster). seed: the sample's own experts (never an earlier sample's bytes)."""
        from betelgeuse.config import EngineConfig
        from services.bench.ceilings import measure_disk_rates
        cfg = EngineConfig(model_path=self.o.model)
        return measure_disk_rates(self.o.model, cfg.read_threads, cfg.read_request_bytes,
                                  nbytes or self.o.disk_sample_bytes, seconds or self.o.disk_sample_s,
                                  self.o.seed + seed, self.o.t0)

    def _beside(self, case: dict, where: str) -> dict:
        """A disk sample beside a phase (where: "before cold", "after the last phase"): once the service is idle (the
        store's disk counter still for idle_quiet_s, at most idle_most_s: Meter.wait_idle), both patterns with
        --disk-sample-beside bytes / --disk-sample-beside-s each. Recorded in case["disk_samples"]; the phase measured
        last, still open, takes it as its sample after and is bounded again (_settle)."""
        idle_s, idle = None, None
        try:
            idle_s, idle = self.meter.wait_idle(self.o.idle_quiet_s, self.o.idle_most_s)
        except BetelgeuseError as e:       # no idle wait: the sample is still taken (the phase's counters say more)
            case.setdefault("errors", []).append(f"{where}: waiting for the store to stand still: {e}")
        samples = case.setdefault("disk_samples", [])
        d = self._disk_rate(self.o.disk_beside_bytes, self.o.disk_beside_s, seed=1 + len(self.results["cases"]) * 1000
                            + len(samples))
        d.update(where=where, at_s=d["random"]["at_s"], idle_wait_s=idle_s, idle=idle)
        samples.append(d)
        self._settle(d)
        return d

    def _settle(self, after: dict | None):
        """The phase measured last gets its sample after (None: there is none, e.g. the case ran out of time), is
        bounded at the fastest rate around each of its windows and logged."""
        if self._open is not None:
            self._open, settle = None, self._open
            settle(after)

    def _h2d_rate(self) -> dict:
        """The pinned copy rate to the GPU the worker will use (ceilings.measure_h2d: a memfd arena registered with
        cudaHostRegister, as the worker's, copied whole); on the CPU none (the worker's "copies" are memcpy)."""
        if not self.o.device.startswith("cuda"):
            return {"bps": None, "why": "n/a on the CPU"}
        import torch
        from services.bench.ceilings import measure_h2d
        nbytes, reps = 256 * MiB, 8
        bps, pinned = measure_h2d(torch.device(self.o.device), nbytes, reps)
        torch.cuda.empty_cache()                 # (the bench's CUDA context stays: in each serve's VRAM baseline)
        return {"bps": bps, "pinned": pinned, "bytes": nbytes * reps,
                "why": "" if pinned else "cudaHostRegister refused: a pageable copy rate"}

    def _serve_case(self, case: dict, config: str, k: int, budget: float):
        from services.launcher import free_port, spawn, terminate
        o = self.o
        deadline = time.monotonic() + budget
        rundir = Path(o.run_dir) / f"serve-{k}"
        rundir.mkdir(parents=True, exist_ok=True)
        cg = ServeCgroup(f"betelgeuse-bench-serve-{os.getpid()}-{k}", o.memory_max, o.cgroup)
        if cg.cg is None:
            self.log(f"note: {config}: no cgroup of the bench's ({cg.reason}); serve plans against --memory-max "
                     f"{o.memory_max / 2**30:.2f} GiB and the figures have no cgroup peak")
        port, http_port = free_port(), free_port()
        argv = serve_argv(o, config, str(rundir), port, http_port, cg.cg is None)
        case["serve_command"] = shlex.join(["betelgeuse", *argv])
        case["memory"] = {"cgroup": cg.cg.path if cg.cg else None, "reason": cg.reason}
        mon = Monitor(cg, o.device.startswith("cuda"))
        log_path = rundir / "serve.log"
        self.log(f"{config}: {case['serve_command']}")
        proc = spawn("serve", "services.cli", argv, log_path, preexec=cg.preexec())
        client = Client(f"127.0.0.1:{http_port}")
        try:
            t = time.monotonic()
            self._wait_ready(client, proc, min(o.start_timeout, max(10.0, deadline - time.monotonic())))
            case["start_s"] = time.monotonic() - t
            status, models = client.get("/v1/models")
            if status != 200:
                raise BetelgeuseError(f"GET /v1/models answered {status}: {str(models)[:200]}")
            card = models["data"][0]
            client.model_id = card["id"]
            case["plan"] = card.get("meta", {}).get("plan") or {}
            p = case["plan"]
            self.log(f"{config}: serving after {case['start_s']:.1f} s; plan {p.get('vram_slots')}+"
                     f"{p.get('host_slots')} slots/layer ({p.get('why', '')})")
            self.meter = Meter(client, str(rundir / "store.sock"))
            self._phases(case, client, deadline)
        finally:
            if self.meter is not None:
                self.meter.close()
                self.meter = None
            case["serve_exit"] = terminate(proc.popen, 90.0)
            case["vram"] = mon.close()
            case["memory"].update(cg.summary())
            cg.close()
            att = attach_event([rundir / n for n in ("worker.log", "serve.log")])
            if att is not None:                 # the warm-ups and each attach step's VRAM (worker/attach_steps.py)
                case["attach_warm"] = att
            for name in ("serve.log", "store.log", "worker.log"):
                try:
                    tail = (rundir / name).read_text(errors="replace").splitlines()[-200:]
                except OSError:
                    continue
                case.setdefault("logs", {})[name] = str(rundir / name)
                out = Path(self.results["out"]) / f"serve-{k}-{re.sub(r'[^A-Za-z0-9_.-]', '_', config)}.log"
                with open(out, "a") as fo:
                    fo.write(f"==== {name}\n" + "\n".join(tail) + "\n")

    def _wait_ready(self, client: Client, proc, timeout: float):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if not proc.alive():
                raise BetelgeuseError(f"serve exited with status {proc.popen.returncode} while starting: "
                                      f"{proc.last_line()} (log: {proc.log_path})")
            try:
                status, _ = client.get("/health", timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise BetelgeuseError(f"serve did not answer /health in {timeout:.0f} s (log: {proc.log_path})")

    def _one(self, client: Client, ids: list[int], n: int, what: str, on_first=None) -> dict:
        rec = client.complete(ids, n, on_first)
        if rec.get("error") == CUT:
            raise OutOfTime(what)
        if "error" in rec:
            raise BetelgeuseError(f"{what}: {rec['error']}")
        return rec

    def _together(self, client: Client, prompts: list[list[int]], n: int, on_all_first=None) -> list[dict]:
        """The prompts sent at once, a thread each; on_all_first() once every one of them has its first token."""
        recs = [dict() for _ in prompts]
        barrier = threading.Barrier(len(prompts))
        lock, firsts = threading.Lock(), [0]

        def first():
            with lock:
                firsts[0] += 1
                last = firsts[0] == len(prompts)
            if last and on_all_first is not None:
                on_all_first()

        def run(i):
            barrier.wait()
            recs[i].update(client.complete(prompts[i], n, first))
        ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(client.timeout + 30)
        return recs

    def _snapshot(self, case: dict, what: str):
        try:
            return self.meter.snapshot()
        except BetelgeuseError as e:
            case.setdefault("errors", []).append(f"{what}: the service's counters: {e}")
            return None

    def _metered(self, case: dict, what: str, send) -> "Metered":
        """send(mark) -> the phase's records, between two snapshots of the service's counters, after a disk sample
        beside it (_beside); send calls mark() when the decode window opens (every request has its first token). The
        records come back with their figures (agents.concurrency_figures), the bound of what moved
        (serve_meter.bounds) and the disk samples beside the phase (`disk`: before, after, the run's first); the
        bound is at the sample before it (and the run's first) until the next sample beside a phase (the next
        phase's, or the one after the case's last) comes: _settle then bounds it again with that one too, in place."""
        before = self._beside(case, f"before {what}")
        a = self._snapshot(case, what)
        try:
            recs = Metered(send(self.meter.mark))
        finally:
            # joined before the end's snapshot (its counters are never read after the end's); a phase cut short
            # leaves no mark for the next
            opened = self.meter.marked()
        b = self._snapshot(case, what)
        recs.figures = fig = concurrency_figures(recs)
        fig.update(server_figures(recs))
        r = self.results
        recs.disk = {"before": _sample_rates(before), "after": None, "first": _sample_rates(r["disk"])}
        if a is None or b is None:
            return recs
        tokens = sum(x.get("completion_tokens", len(x.get("times", []))) for x in recs)   # the server's count

        def bound(after: dict | None):
            beside = [("sample before", disk_rates(before))] + ([("sample after", disk_rates(after))] if after else [])
            new = bounds(a, opened, b, beside + [("the run's first sample", disk_rates(r["disk"]))], r["h2d"]["bps"],
                         tokens, fig.get("aggregate_decode_tps"), fig.get("end_to_end_tps"), fig.get("ttft_max_s"))
            recs.bound.clear()
            recs.bound.update(new)

        def settle(after: dict | None):
            recs.disk["after"] = _sample_rates(after) if after else None
            bound(after)
            self.log(f"{case['name']}: {what}: prefill {describe_prefill(recs.bound.get('prefill'))}; "
                     f"decode {describe(recs.bound.get('decode'))}")
        bound(None)                 # recorded now (a partial bench.json has it); bounded again with the sample after
        self._open = settle
        return recs

    def _phases(self, case: dict, client: Client, deadline: float):
        """The measured phases, each begun while the case's deadline allows; a stream still open at the deadline is
        cut (the connection closed, the phase listed under skipped)."""
        client.deadline = deadline
        try:
            self._measure(case, client, deadline)
        except OutOfTime as e:
            case.setdefault("skipped", []).append({"phase": str(e), "reason": "time budget (cut mid-phase)"})
        finally:
            self._settle(None)      # a phase still without its sample after (its case's time ran out) keeps its bound

    def _measure(self, case: dict, client: Client, deadline: float):
        o, V = self.o, self.geom["n_vocab"]
        skipped = case.setdefault("skipped", [])

        def left(phase) -> bool:
            if time.monotonic() < deadline:
                return True
            skipped.append({"phase": phase, "reason": "time budget"})
            return False
        case["warmup"] = _slim(self._one(client, synthetic_ids(o.warm_prompt, V, o.seed, 90), o.warm_tokens, "warm-up"))
        if left("cold prompt"):
            ids = synthetic_ids(o.prompt, V, o.seed, 91)
            for key, what in (("cold", f"the {o.prompt}-token prompt"), ("again", f"the {o.prompt}-token prompt again")):
                if key == "again" and not left("same prompt again"):
                    break
                recs = self._metered(case, key, lambda mark: [self._one(client, ids, o.decode, what, mark)])
                case[key] = dict(_slim(recs[0]), bound=recs.bound, disk=recs.disk)
                self.save(False)
        lo, hi = o.client_prompt
        case["clients"] = {}
        for n in o.clients:
            if not left(f"{n} clients"):
                continue
            # the same warm-up at this batch size first (its decode graphs captured, its kernels compiled)
            warm = self._together(client, [synthetic_ids(o.warm_prompt, V, o.seed, 96, n, i) for i in range(n)],
                                  o.warm_tokens)
            werr = [x["error"] for x in warm if "error" in x]
            if werr:
                if CUT in werr:
                    raise OutOfTime(f"warm-up of {n} clients")
                raise BetelgeuseError(f"warm-up of {n} clients: {werr[0]}")
            prompts = [synthetic_ids(lo + (i * 37) % (hi - lo + 1), V, o.seed, 92, n, i) for i in range(n)]
            recs = self._metered(case, f"{n} clients", lambda mark: self._together(client, prompts, o.client_tokens, mark))
            case["clients"][str(n)] = {"figures": recs.figures, "bound": recs.bound, "disk": recs.disk,
                                       "requests": [_slim(x) for x in recs]}
            errs = [x["error"] for x in recs if "error" in x]
            self.save(False)
            if CUT in errs:
                raise OutOfTime(f"{n} clients")
            if errs:
                case.setdefault("errors", []).append(f"{n} clients: {len(errs)} failed: {errs[0]}")
        if self._open is not None and left("disk sample after the last phase"):
            self._beside(case, "after the last phase")       # the last measured phase's sample after
            self.save(False)
        if not o.agent_loop:
            skipped.append({"phase": "agent loop", "reason": "--no-agent-loop"})
        elif left("agent loop"):
            users = agent_user_lengths(o)
            ids, turns = synthetic_ids(o.system_tokens, V, o.seed, 93), []
            case["agent"] = turns
            for t, n_user in enumerate(users):
                if not left(f"agent loop turn {t + 1}"):
                    break
                ids = ids + synthetic_ids(n_user, V, o.seed, 94, t)
                rec = self._one(client, ids, o.turn_tokens, f"agent loop turn {t + 1}")
                turns.append(_slim(rec))
                # the conversation goes on with the completion's tokens: the same count of new ids (the client
                # sees text, not ids; the server's greedy ids are in no response)
                ids = ids + synthetic_ids(rec.get("completion_tokens", o.turn_tokens), V, o.seed, 95, t)


class Metered(list):
    """A measured phase's records, with their figures and the bound of what the service moved meanwhile."""

    def __init__(self, recs):
        super().__init__(recs)
        self.figures: dict = {}
        self.bound: dict = {}
        self.disk: dict = {}


def _sample_rates(d: dict) -> dict:
    """A disk sample as a phase records it beside its bound: bps (the faster pattern's), pattern, each pattern's bps,
    when it was taken (s since the run started) and how long the service took to stand still before it."""
    out = {"bps": d["bps"], "pattern": d["pattern"], **disk_rates(d), "at_s": d.get("at_s", d["random"]["at_s"])}
    if "where" in d:
        out.update(where=d["where"], idle_wait_s=d.get("idle_wait_s"), idle=d.get("idle"))
    return out


# ---- summary and markdown ----------------------------------------------------------------------------------
def _ratio(a, b):
    return a / b if a is not None and b else None


def beaten(c: dict) -> tuple[list | None, list]:
    """A case's highest achieved over every window of every measured phase ([value, "phase window"], None: no bound)
    and the windows that beat their bound ("phase window achieved", above BOUND_WRONG): a bound a pass beats is a
    wrong bound (the disk rate too slow for how the window read)."""
    holders = [("cold", c.get("cold")), ("again", c.get("again"))]
    holders += [(f"{n} clients", x) for n, x in c.get("clients", {}).items()]
    got = [(w["achieved"], f"{name} {win}") for name, h in holders for win, w in ((h or {}).get("bound") or {}).items()
           if w.get("achieved") is not None]
    top = max(got, default=None)
    return (list(top) if top else None), [f"{where} {a:.2f}" for a, where in got if a > BOUND_WRONG]


def summarize(r: dict) -> dict:
    """Per configuration: the judged ratios (aggregate(N) / aggregate(1), aggregate(N) / the bound of its decode
    window = achieved, TTFT p50 of the most clients / the lone cold prompt); across: the shipped config's aggregate
    over auto's."""
    out = {}
    for c in r.get("cases", []):
        cl = c.get("clients", {})
        a1 = cl.get("1", {}).get("figures", {}).get("aggregate_decode_tps")
        lone = cl.get("1", {}).get("figures", {}).get("ttft_p50_s")
        s = {"aggregate_over_1": {}, "aggregate_over_bound": {}}
        for n, x in cl.items():
            f = x.get("figures", {})
            s["aggregate_over_1"][n] = _ratio(f.get("aggregate_decode_tps"), a1)
            s["aggregate_over_bound"][n] = (x.get("bound") or {}).get("decode", {}).get("achieved")
        s["cold_tg_over_bound"] = ((c.get("cold") or {}).get("bound") or {}).get("decode", {}).get("achieved")
        most = max((int(n) for n in cl), default=None)
        if most:
            s["ttft_p50_most_over_lone"] = _ratio(cl[str(most)].get("figures", {}).get("ttft_p50_s"), lone)
            s["most_clients"] = most
            # the ratio's floor at this run's disk: the burst's TTFT bound over the lone prompt's (serve_meter)
            pre = {n: (cl.get(n, {}).get("bound") or {}).get("prefill") or {} for n in ("1", str(most))}
            s["ttft_bound_lone_s"] = pre["1"].get("ttft_bound_s")
            s["ttft_bound_most_s"] = pre[str(most)].get("ttft_bound_s")
            s["ttft_disk_lone_bps"] = pre["1"].get("disk_bps")        # each bound's own disk rate (per phase)
            s["ttft_disk_most_bps"] = pre[str(most)].get("disk_bps")
            s["ttft_lone_achieved"] = pre["1"].get("achieved")
            s["ttft_most_achieved"] = pre[str(most)].get("achieved")
            s["ttft_floor_most_over_lone"] = _ratio(s["ttft_bound_most_s"], s["ttft_bound_lone_s"])
            s["ttft_ratio_over_floor"] = _ratio(s["ttft_floor_most_over_lone"], s["ttft_p50_most_over_lone"])
        s["bound_max_achieved"], s["bounds_beaten"] = beaten(c)
        t = [x for x in c.get("agent", []) if x.get("ttft_s")]
        if t:
            s["agent_ttft_first_s"], s["agent_ttft_last_s"] = t[0]["ttft_s"], t[-1]["ttft_s"]
            s["agent_prompt_first"], s["agent_prompt_last"] = t[0]["prompt_tokens"], t[-1]["prompt_tokens"]
        out[c["name"]] = s
    cases = {c["name"]: c for c in r.get("cases", [])}
    if "shipped" in cases and "auto" in cases:
        def agg(c):
            cl = c.get("clients", {})
            most = max((int(n) for n in cl), default=None)
            return cl[str(most)]["figures"].get("aggregate_decode_tps") if most else None
        out["shipped_over_auto_most_clients"] = _ratio(agg(cases["shipped"]), agg(cases["auto"]))
    return out


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _x(x):
    return "–" if x is None else f"{x:.2f}x"


def _disk_rates(disk: dict) -> str:
    """'1.63 GB/s (direct; random 1.41, layer 1.63)': the rate the bounds use and the two samples it is the faster of
    (ServeSuite._disk_rate: every bound uses max(random, layer))."""
    pats = [f"{p} {_f(disk[p]['bps'] / GB)}" for p in ("random", "layer") if isinstance(disk.get(p), dict)]
    return (f"{_f(disk.get('bps', 0) / GB)} GB/s ({disk.get('mode', '?')}" + ("; " + ", ".join(pats) if pats else "")
            + ")")


def moved_section(r: dict, cases: list, ns: list) -> list[str]:
    """What each measured phase moved, per token, and the bounds it sets (serve_meter): its decode window against
    the clients' decode rate, the whole phase (prefill included) against the end-to-end rate."""
    h2d = r.get("h2d") or {}
    o = r.get("options") or {}
    L = ["", "## What the service moved, and the bound it sets", "",
         f"Rates measured in this run before the first serve: disk {_disk_rates(r.get('disk') or {})}, H2D "
         + (f"{h2d['bps'] / GB:.2f} GB/s (pinned)" if h2d.get("bps") else f"n/a ({h2d.get('why', '')})")
         + ". The disk is sampled again beside every phase (its \"disk rate\" row: before it, once the store's disk "
         f"counter stood still {_f(o.get('idle_quiet_s'), '{:.1f}')} s (at most {_f(o.get('idle_most_s'), '{:.0f}')} "
         f"s), and after the last; {_f((o.get('disk_beside_bytes') or 0) / MiB, '{:.0f}')} MiB or "
         f"{_f(o.get('disk_beside_s'))} s per pattern), "
         "and each window is bounded at the fastest disk rate observed around it: the sample before its phase, the "
         "one after it (the next phase's), the run's first, its own reads (disk bytes / seconds with a read in "
         "flight); each sample's rate is max(random, layer). "
         "Bound = tokens / max(disk bytes / disk rate, H2D bytes / H2D rate); achieved = the rate / the bound. "
         "TTFT bound (prefill window) = max(disk bytes / disk rate, H2D bytes / H2D rate, the prefill passes' work "
         "outside disk waits) in seconds; achieved = the bound / the TTFT of the window's last first token.",
         "", "Bounds check: " + "; ".join(f"`{c['name']}` {bound_verdict((r.get('summary') or {}).get(c['name'], {}))}"
                                         for c in cases) + ".",
         "", "| phase | window | " + " | ".join(f"`{c['name']}`" for c in cases) + " |",
         "|---|---" + "|---" * len(cases) + "|"]

    def cell(w, rate_name):
        if not w:
            return "–"
        per = (f"{size(w.get('disk_bytes_per_token'))} / {size(w.get('h2d_bytes_per_token'))} per token (disk / H2D) "
               f"over {w['tokens']:.0f} tokens, {w['seconds']:.2f} s")
        pre = f", {w['prefill_tokens']:.0f} prefilled" if w.get("prefill_tokens") else ""
        return f"{per}{pre}; {describe(w)} ({rate_name})"
    phases = [("the lone prompt", lambda c: c.get("cold") or {}),
              ("the same prompt again", lambda c: c.get("again") or {})]
    phases += [(f"{n} client{'s' if n > 1 else ''}", lambda c, n=n: c.get("clients", {}).get(str(n), {})) for n in ns]
    def first(w):
        if not w:
            return "–"
        return (f"{w['prefill_tokens']:.0f} prompt tokens prefilled, {w['seconds']:.2f} s; "
                f"{describe_prefill(w)} (time to first token)")
    for name, get in phases:
        L.append(f"| {name} | disk rate (the samples beside it) | " + " | ".join(beside_rates(get(c).get("disk"))
                                                                              for c in cases) + " |")
        for win, fn in (("prefill", first), ("decode", lambda w: cell(w, "decode rate")),
                        ("phase", lambda w: cell(w, "end-to-end"))):
            label = "whole phase" if win == "phase" else f"{win} window"
            L.append(f"| {name} | {label} | " + " | ".join(fn((get(c).get("bound") or {}).get(win)) for c in cases)
                     + " |")
    return L


def beside_rates(d: dict | None) -> str:
    """A phase's disk samples (ServeSuite._metered's `disk`) as its "disk rate" row prints them: "before 1.52 GB/s
    (random 1.40, layer 1.52; at 31 s, idle after 0.6 s), after 1.61 GB/s (...); the run's first 1.48 GB/s"."""
    if not d or not d.get("before"):
        return "–"

    def one(x):
        pats = ", ".join(f"{p} {x[p] / GB:.2f}" for p in ("random", "layer") if x.get(p) is not None)
        idle = "" if x.get("idle_wait_s") is None else (
            f", {'idle' if x.get('idle') else 'NOT idle'} after {x['idle_wait_s']:.1f} s")
        return f"{x['bps'] / GB:.2f} GB/s ({pats}; at {x['at_s']:.0f} s{idle})"
    after = one(d["after"]) if d.get("after") else "none"
    return f"before {one(d['before'])}, after {after}; the run's first {d['first']['bps'] / GB:.2f} GB/s"


def bound_verdict(s: dict) -> str:
    """One case's check of its bounds, as the log and the report print it."""
    top = s.get("bound_max_achieved")
    if s.get("bounds_beaten"):
        return f"BOUND BEATEN (achieved > {BOUND_WRONG}): " + ", ".join(s["bounds_beaten"])
    return "bounds: none beaten" + (f" (highest achieved {top[0]:.2f}, {top[1]})" if top else " (no bound)")


def ttft_ratio(a: dict) -> str:
    """The TTFT target's cell: the measured ratio, its floor (the burst's TTFT bound over the lone prompt's), the two
    bounds with how near each TTFT came to its own, and the ratio's share of its floor."""
    got = _x(a.get("ttft_p50_most_over_lone"))
    floor = a.get("ttft_floor_most_over_lone")
    if floor is None:
        return f"{got} (floor –)"
    most, lone = _f(a.get("ttft_bound_most_s")), _f(a.get("ttft_bound_lone_s"))
    rates = ""
    if a.get("ttft_disk_most_bps") and a.get("ttft_disk_lone_bps"):
        rates = f" at disk {a['ttft_disk_most_bps'] / GB:.2f} / {a['ttft_disk_lone_bps'] / GB:.2f} GB/s"
    return (f"{got} (floor {_x(floor)}: bounds {most} s ÷ {lone} s{rates}, "
            f"achieved {_f(a.get('ttft_most_achieved'))} / {_f(a.get('ttft_lone_achieved'))}; floor ÷ ratio "
            f"{_f(a.get('ttft_ratio_over_floor'))})")


def markdown(r: dict) -> str:
    m, o, s = r.get("machine", {}), r.get("options", {}), r.get("summary", {})
    cases = r.get("cases", [])
    disk = r.get("disk", {})
    L = [f"# Betelgeuse serve benchmark: {r.get('run', '')}", "", f"Command: `{r.get('command', '')}`", "",
         f"Machine: GPU {m.get('gpu') or 'none'}; CPU {m.get('cpu', '')} x{m.get('cpus', '')}; "
         f"RAM {m.get('ram_bytes', 0) / 2**30:.0f} GiB; torch {m.get('torch', '')}; device `{r.get('device', '')}`; "
         f"model {Path(o.get('model', '')).name}", "",
         "The live service: `betelgeuse serve` (store + worker) driven over the OpenAI HTTP API by the bench's own "
         "client (streamed /v1/completions, greedy, ignore_eos, prompts as token ids, client clock; tokens counted by "
         "their logprobs entries, one chunk each, text or none). \"server\": the same requests' TTFT / TG on the "
         "server's clock (usage timings), a cross-check.", ""]
    if r.get("status") != "complete":
        L += [f"**Partial results** (status: {r.get('status')}).", ""]
    if not cases:
        return "\n".join(L + [f"- {e}" for e in r.get("errors", [])])
    head = "| | " + " | ".join(f"`{c['name']}`" for c in cases) + " |"
    L += ["## The service", "", head, "|---" * (len(cases) + 1) + "|"]

    def row(label, fn):
        L.append(f"| {label} | " + " | ".join(fn(c) for c in cases) + " |")

    def plan(c):
        p = c.get("plan", {})
        backing = {True: "on", False: "off"}.get(p.get("vram_backing"), "?")
        return (f"{p.get('vram_slots', '?')} VRAM + {p.get('host_slots', '?')} host (asked "
                f"{p.get('vram_slots_requested', '?')}+{p.get('host_slots_requested', '?')}); VRAM backing copies "
                f"{backing} (asked {p.get('vram_backing_requested', '?')}): "
                f"{p.get('resident_experts_per_layer', '?')} distinct experts resident"
                + (f"; VRAM TRIMMED at attach by measurement: {p['vram_trim']}" if p.get("vram_trim") else ""))
    row("slots per layer", plan)

    def budgets(c):
        v, mem = c.get("vram", {}), c.get("memory", {})
        vram = "–" if v.get("vram_peak_bytes") is None else f"{v['vram_peak_bytes'] / MiB:,.0f} MiB"
        cg = (f"{mem['peak'] / GB:.1f} GB of {mem['limit'] / 2**30:.0f} GiB" if mem.get("peak") and mem.get("limit")
              else "no cgroup")
        return f"{vram} / {cg}"
    row("peak VRAM / cgroup peak", budgets)

    def attach(c):
        a = c.get("attach_warm")
        if not a:
            return "–"
        used = f"; device used {a['used_mib']} MiB at most" if a.get("used_mib") is not None else ""
        spill = (f"; SPILLING: max {a['max_local_b']} B/thread (~{a.get('lmem_mib') or '?'} MiB reserved), "
                 f"`{a.get('spilling')}`" if a.get("max_local_b") not in (None, "0") else "")
        fit = (f"; budget check: outside torch {a['non_torch_mib']} MiB, projected {a['projected_mib']} of "
               f"{a['budget_mib']} MiB" if a.get("projected_mib") is not None else "")
        r = a.get("reattached")
        again = (f"; attached again {r['times']}x after a VRAM trim: {r.get('vram_device_torch_mib')}, device used "
                 f"{r.get('used_mib')} MiB, projected {r.get('projected_mib')} MiB" if r else "")
        return (f"warm-ups {a.get('warm_up', '?')}; {a.get('vram_device_torch_mib') or 'no VRAM figures (CPU)'}{used}; "
                f"compiles {a.get('compiles', '–')}{spill}{fit}"
                + (f"; FAILED: {a['failed']}" if a.get("failed") else "") + again)
    row("attach: warm-ups; VRAM by step, MiB device-wide / torch reserved (worker log)", attach)

    def one(key):
        def fn(c):
            x = c.get(key)
            if not x:
                return "–"
            cached = f" ({x.get('cached_tokens', 0)} cached)" if key == "again" else ""
            return (f"{_f(x.get('ttft_s'), '{:.3f}')} s / {_f(x.get('tg'), '{:.1f}')} tok/s{cached} "
                    f"({describe((x.get('bound') or {}).get('decode'))}; {_server(x)})")
        return fn
    row(f"one {o.get('prompt')}-token prompt: TTFT / TG over {o.get('decode')} tokens (its bound; server's)", one("cold"))
    row("the same prompt again (prefix cache): TTFT / TG (its bound; server's)", one("again"))
    ns = sorted({int(n) for c in cases for n in c.get("clients", {})})
    lo, hi = o.get("client_prompt", ("?", "?"))
    for n in ns:
        def conc(c, n=n):
            f = c.get("clients", {}).get(str(n), {}).get("figures")
            if not f:
                return "–"
            srv = (f"server: {_f(f.get('server_tg_min'), '{:.1f}')}-{_f(f.get('server_tg_max'), '{:.1f}')} tok/s, "
                   f"TTFT {_f(f.get('server_ttft_p50_s'), '{:.2f}')} s, {_f(f.get('server_ttft_max_s'), '{:.2f}')} s")
            if f.get("aggregate_decode_tps") is None:
                return f"– ({srv})"
            b = (c["clients"][str(n)].get("bound") or {}).get("decode")
            return (f"{_f(f['aggregate_decode_tps'], '{:.1f}')} tok/s (end-to-end {_f(f.get('end_to_end_tps'), '{:.1f}')}; "
                    f"{describe(b)}) / {_f(f.get('tg_min'), '{:.1f}')}-{_f(f.get('tg_max'), '{:.1f}')} / "
                    f"{_f(f.get('ttft_p50_s'), '{:.2f}')} s, {_f(f.get('ttft_max_s'), '{:.2f}')} s ({srv})")
        prompt = f"{lo}" if lo == hi else f"{lo}-{hi}"
        row(f"{n} client{'s' if n > 1 else ''} ({prompt}-token prompts, {o.get('client_tokens')} tokens each): "
            "aggregate decode (its bound) / per request / TTFT p50, max (server's)", conc)

    def agent(c):
        a = s.get(c["name"], {})
        if "agent_ttft_first_s" not in a:
            return "–"
        return (f"{a['agent_ttft_first_s']:.2f} → {a['agent_ttft_last_s']:.2f} s "
                f"({a['agent_prompt_first']} → {a['agent_prompt_last']} tokens)")
    row(f"agent loop, {o.get('turns')} turns: TTFT first → last", agent)
    L += ["", "## Against the targets (issue 24)", "", head.replace("| |", "| figure |", 1) + " target |",
          "|---" * (len(cases) + 2) + "|"]

    def trow(label, fn, tgt):
        L.append(f"| {label} | " + " | ".join(fn(s.get(c['name'], {})) for c in cases) + f" | {tgt} |")
    def ratios(a, n):
        return f"{_x(a.get('aggregate_over_1', {}).get(str(n)))} ({_x(a.get('aggregate_over_bound', {}).get(str(n)))})"
    targets = {4: "≥ 2x (or ≥ 0.8 of the bound)", 8: "≥ 3x (or ≥ 0.8 of the bound)"}
    for n in ns:
        if n != 1:
            trow(f"aggregate decode {n} clients ÷ 1 client (÷ its bound)", lambda a, n=n: ratios(a, n),
                 targets.get(n, "report"))
    if ns:
        trow(f"TTFT p50, {max(ns)} clients together ÷ the lone cold prompt (1 client) (its floor: the TTFT bounds' "
             "ratio, what the prefills moved)", ttft_ratio, "≤ 2x")
    if s.get("shipped_over_auto_most_clients") is not None:
        L += ["", f"Shipped config vs auto, {max(ns)} clients (aggregate decode): "
                  f"**{_x(s['shipped_over_auto_most_clients'])}** (target: the shipped config is the best measured)."]
    L += moved_section(r, cases, ns)
    L += ["", "## The plans (the store's, as `/v1/models` meta.plan says)", ""]
    for c in cases:
        p = c.get("plan", {})
        mib = lambda k: _f((p.get(k) or 0) / MiB, "{:,.0f}") + " MiB"          # noqa: E731
        gib = lambda k: _f(None if p.get(k) is None else p[k] / 2**30) + " GiB"  # noqa: E731
        L.append(f"- `{c['name']}`: `{c.get('serve_command', '')}`; VRAM budget {gib('vram_budget_bytes')} (fixed "
                 f"{mib('vram_fixed_bytes')}: KV {mib('kv_bytes')}, prefix cache {mib('prefix_cache_bytes')}, ring "
                 f"{mib('ring_bytes')}), arena {gib('arena_bytes')} (staging {p.get('staging_slots', '?')} slots), "
                 f"memory limit {gib('memory_limit_bytes')} ({p.get('memory_limit_source', '?')}); started in "
                 f"{_f(c.get('start_s'), '{:.1f}')} s. Why: {p.get('why', '–')}")
    L += ["", "## Definitions", "",
          "- TTFT: the client's clock, from sending the request to the first streamed token. TG: (completion tokens "
          "- 1) / (last token - first token) of one request.",
          "- Aggregate decode: tokens all clients received after the last client's first token / the wall from that "
          "first token to the last token of any client (1 client: its TG); end-to-end: all completion tokens / the "
          "wall from the first request sent to the last token. Per request: each client's TG (min-max). Tokens are "
          "timed as they arrive: a burst (the server writing several at once) shows as a TG above the decode rate.",
          f"- Bound: what the service moved in the window (the store's disk bytes read, from its Status RPC; the "
          "worker's host-to-device bytes and decode tokens, from its /metrics), read just before the phase, when "
          "its last request got its first token and right after its last token: tokens / max(disk bytes / the disk "
          "rate, H2D bytes / the H2D rate). The disk rate is the store's reader on whole experts of the model file "
          "sampled in both ways the store's loads read: random (batches of random experts, each waited for: decode's "
          "few per layer) and layer (whole layers' experts in file order, the reader's queue kept full: a prefill's); "
          "a sample's rate is the faster, max(random, layer), since a window holds reads of either kind and a bound "
          f"must hold for every pattern in it. The disk is sampled before the first serve (here: {_disk_rates(disk)}) "
          "and again beside every phase (before it, once the service's reads stopped; after the last phase of each "
          "configuration), since it drifts within a run: each window is bounded at the fastest rate observed around "
          "it, max(the sample before its phase, the sample after it (the next phase's), the run's first sample, its "
          "own reads: disk bytes / seconds with a read in flight), so a bound holds at the best the disk showed "
          "beside the window; the table prints each phase's samples and, beside each bound, the rate it used and "
          "where from. The H2D rate is a pinned copy to the GPU (none on the CPU), measured in this run before the "
          "first serve. The decode window (the last "
          "request's first token -> the end: every prompt is prefilled by then) bounds the decode rate (aggregate, "
          "TG); the whole phase (prefill included) bounds the end-to-end rate. Achieved = the rate / its bound: "
          "above 1 is a bug in the bound (BOUND BEATEN, in the bounds check), not a figure.",
          "- TTFT bound: the prefill window (the phase's start -> its last request's first token: every prompt "
          "prefilled; no decode pass yet when they share one prefill pass) bounds the time to first token: max(the "
          "disk bytes the store read in it / the disk rate, its H2D bytes / the H2D rate, the prefill passes' busy "
          "seconds less their disk wait = the work they would still do with an infinitely fast disk). It counts each "
          "byte once, however many requests shared the pass (the store's counter: read-ahead and 4 KiB rounding "
          "included), and no HTTP, tokenizer or admission-window time. Achieved = the bound / the window's last TTFT. "
          "The TTFT target's floor = the most clients' bound / the lone (1-client) prompt's: the ratio one joint "
          "pass of the whole burst cannot beat at this disk (floor ÷ ratio: how near the ratio came to it).",
          "- Peak VRAM: device-wide (nvidia-smi, every 0.5 s) above what was in use before serve started. Cgroup "
          "peak: memory.peak (v2; v1 memory.max_usage_in_bytes) of the cgroup serve and its children ran in.",
          f"- Before the figures, one warm-up request ({o.get('warm_prompt')} prompt tokens, {o.get('warm_tokens')} "
          "completion tokens, ids of its own), and before each client count as many together: one-time costs (Triton "
          "compiles, CUDA graph captures) are not in the figures. Concurrent clients send distinct prompts; the agent "
          "loop resends the whole conversation (each completion as as many new ids) every turn.", ""]
    notes = [f"- `{c['name']}`: no cgroup: {c['memory'].get('reason')}" for c in cases
             if not c.get("memory", {}).get("cgroup")]
    skipped = r.get("skipped", []) + [dict(x, case=c["name"]) for c in cases for x in c.get("skipped", [])]
    if notes:
        L += ["## Notes", ""] + notes + [""]
    if skipped:
        L += ["## Skipped", ""] + [f"- {x.get('case')} {x.get('phase', '')}: {x['reason']}" for x in skipped] + [""]
    errors = r.get("errors", []) + [f"{c['name']}: {e}" for c in cases for e in c.get("errors", [])]
    if errors:
        L += ["## Errors", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(L)


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_arguments(p):
    g = p.add_argument_group("--suite serve")
    g.add_argument("--config", help="configurations, comma-separated, a serve each: shipped (deploy/betelgeuse.toml), "
                                    "auto (--vram-slots auto --host-slots auto), V+H (default shipped,auto); each "
                                    "may add serve flags of its own: auto:prefetch-batch-rule=union")
    g.add_argument("--serve-args", help="more flags for every serve, as one string (e.g. \"--max-running 8\")")
    g.add_argument("--prompt", type=int, help="tokens of the cold prompt, sent twice (default 512)")
    g.add_argument("--json", action="store_true", help="print bench.json to stdout (default: the figures)")
    g.add_argument("--disk-sample-beside", help="bytes per pattern of the disk sample taken beside every phase (before "
                                                "it, once the service is idle; and after the last; default 512MiB)")
    g.add_argument("--disk-sample-beside-s", type=float, help="seconds per pattern of the sample beside every phase, "
                                                              "at most (default 0.75)")
    # shared with --suite agents: --clients (default 1,4,8 here), --client-prompt (128,128), --client-tokens (64),
    # --no-agent-loop, --turns (6), --agent-prompts (346,1756), --system-tokens, --turn-tokens, --warm-prompt, --warm-tokens;
    # with the passes suite: --decode (128), --disk-sample


_opt = opt_reader(SERVE_QUICK)


def parse_configs(text: str) -> tuple[str, ...]:
    out = []
    for s in (x.strip() for x in str(text).split(",") if x.strip()):
        base, *own = s.split(":")
        v, plus, h = base.partition("+")
        if base not in ("shipped", "auto") and not (plus and v.isdigit() and h.isdigit()):
            raise InvalidRequestError(f"--config: {s!r} is none of shipped, auto, V+H (e.g. 5+15)")
        bad = [f for f in own if not re.fullmatch(r"[a-z][a-z0-9-]*(=[^\s=]+)?", f)]
        if bad:
            raise InvalidRequestError(f"--config: {s!r}: {bad[0]!r} is not flag=value or an on/off flag (e.g. "
                                      "auto:prefetch-batch-rule=union, auto:fill-budget)")
        out.append(s)
    if not out:
        raise InvalidRequestError("--config is empty")
    return tuple(out)


def options_from_args(args, model: str, device: str, t0: float, work: Path) -> ServeOptions:
    from betelgeuse.settings import flag_values, parse_size, to_flags
    serve_args = tuple(shlex.split(args.serve_args or ""))
    given = flag_values(args)                      # the bench's engine flags the user gave: serve gets them too
    given.pop(("budget", "memory_max"), None)      # the cgroup's (or, with none, serve's --memory-max)
    mm = str(_opt(args, "budget.memory_max", "12G"))
    memory_max = None if mm.lower() in ("none", "auto") else parse_size(mm, "--memory-max")   # none: no cgroup
    engine_flags = tuple(to_flags({k: v for k, (v, _) in given.items()}))
    if args.quick and ("budget", "vram") not in given:
        engine_flags += ("--vram-budget", "2GiB")
    ints = {k: int(_opt(args, k, d)) for k, d in (("prompt", 512), ("decode", 128), ("client_tokens", 64),
                                                   ("turns", 6), ("system_tokens", 96), ("turn_tokens", 24),
                                                   ("warm_prompt", 16), ("warm_tokens", 4))}
    bad = [k for k, v in ints.items() if v < 1]
    if bad:
        raise InvalidRequestError(f"--{bad[0].replace('_', '-')} must be >= 1, got {ints[bad[0]]}")
    beside = (parse_size(_opt(args, "disk_sample_beside", "512MiB"), "--disk-sample-beside"),
              float(_opt(args, "disk_sample_beside_s", 0.75)))
    if not (beside[0] > 0 and beside[1] > 0):
        raise InvalidRequestError(f"--disk-sample-beside and --disk-sample-beside-s must be > 0, got {beside[0]} "
                                  f"bytes, {beside[1]} s")
    first, last = _pair(_opt(args, "agent_prompts", "346,1756"), "--agent-prompts")
    o = ServeOptions(model=model, device=device, configs=parse_configs(_opt(args, "config", "shipped,auto")),
                     serve_args=serve_args, engine_flags=engine_flags, memory_max=memory_max,
                     cgroup=not args.no_cgroup and memory_max is not None,
                     time_budget=float(_opt(args, "time_budget", 480.0)), t0=t0,
                     agent_loop=not getattr(args, "no_agent_loop", False),
                     seed=args.seed, run_dir=str(work / f"run-{os.getpid()}"),
                     clients=parse_ints(_opt(args, "clients", "1,4,8"), "--clients"),
                     client_prompt=_pair(_opt(args, "client_prompt", "128,128"), "--client-prompt"),
                     first_prompt=first, last_prompt=last,
                     disk_sample_bytes=parse_size(_opt(args, "disk_sample", "1GiB"), "--disk-sample"),
                     disk_beside_bytes=beside[0], disk_beside_s=beside[1],
                     idle_quiet_s=float(_opt(args, "idle_quiet_s", 0.5)), **ints)
    agent_user_lengths(o)                          # refuses < 2 turns, a first prompt shorter than the system prompt
    # every serve's flags parse (a bad --serve-args is refused here, not after the model is written)
    import argparse

    from services.launcher import serve_arguments

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise InvalidRequestError(message)
    p = Parser(prog="betelgeuse serve")
    serve_arguments(p)
    for c in o.configs:
        try:
            p.parse_args(serve_argv(o, c, "/tmp/x", 1, 2, True)[1:])
        except (SystemExit, BetelgeuseError) as e:
            what = (f"--config {c!r}: serve does not accept its flags or --serve-args" if ":" in c
                    else f"--serve-args: serve does not accept {args.serve_args!r}")
            raise InvalidRequestError(f"{what}: {e}") from None
    return o


def run(args) -> int:
    """`betelgeuse bench --suite serve`: write/reuse the model, run the suite, write bench.json / bench.md."""
    from services.bench.args import suite_log, suite_results
    from services.bench.report import run_recorded, write_results
    t0 = time.monotonic()
    log = suite_log("serve", t0)
    device, work, _, spec, model, run_name, out = target(args, _opt, "-serve")
    o = options_from_args(args, str(model), device, t0, work)
    out.mkdir(parents=True, exist_ok=True)
    results = suite_results(args, "serve", run_name, device)
    results["out"] = str(out)
    save = lambda final: write_results(results, out, png=False, render=markdown)     # noqa: E731
    results["models"]["main"] = ensure_model(model, spec, log)
    import dataclasses
    results["options"] = {k: v for k, v in dataclasses.asdict(o).items() if k != "t0"}
    results["options"]["user_tokens_per_turn"] = agent_user_lengths(o)
    log(f"device {device}; configurations {', '.join(o.configs)}; results -> {out}")
    rc = run_recorded(results, save, ServeSuite(o, results, save, log).run, log)
    if getattr(args, "json", False):
        print(json.dumps(results, indent=1, default=str))
    else:
        md = markdown(results)
        print(md[md.find("## The service"):md.find("## The plans")].strip())
    if any(c.get("errors") for c in results["cases"]):
        rc = rc or 1
    return rc
