"""Every thread's wakeups and CPU per decode token, by name (services/bench/threads.py), in (a) the bench's timed
decode (services/bench harness: the worker engine in the bench process beside a real store process; the decode
record's `threads` entry) and (b) a live serve (store and worker processes, real sockets, one streamed generation over
the worker's HTTP API), each with the session stream's reader thread and with the caller reader, and for (a) with the
old polling monitor (BENCH_MONITOR=poll) and without it. Prints markdown tables; writes census.json.

    PYTHONPATH=. OMP_NUM_THREADS=1 python docs/benchmarks/cpu-gil66/census.py [--tokens 64] [--preset ds4-tiny]
        [--slots 2+3] [--parts bench,serve] [--out /tmp/gil66-census]

(a)'s worker threads are named by Python (services/bench/threads.py); (b)'s processes are others, so their Python
threads carry kernel names set by shim/sitecustomize.py ("py:" + the Python name, cut to 15 bytes; the main thread
"py:main"): those take the GIL, the rest are gRPC's C threads. (b)'s window: from the first streamed token to the
last; per token = over the tokens after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def bench(a, reader: str, monitor: str) -> dict:
    name = f"bench-{reader}-{monitor or 'new'}"
    out = Path(a.out) / name
    env = dict(os.environ, PYTHONPATH=str(ROOT), BETELGEUSE_STORE_SESSION_READER=reader, BENCH_MONITOR=monitor)
    cmd = [sys.executable, "-m", "services.bench.cli", "--preset", a.preset, "--variant-skew", "none", "--routing",
           "exact", "--slots", a.slots, "--prompts", "8", "--standard-prompts", "8", "--decode", str(a.tokens),
           "--memory-max", "4G", "--time-budget", "300", "--disk-sample", "4MiB", "--device", "cpu",
           "--work-dir", str(Path(a.out) / "work"), "--out", str(out), "--run-name", name]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{name}: bench failed:\n{p.stderr[-3000:]}")
    r = json.loads((out / "bench.json").read_text())
    d = next(c["decode"] for c in r["cases"] if c.get("decode"))
    return {"name": name, "tokens": d["tokens"], "token_ms": round(d["seconds"] / d["tokens"] * 1e3, 2),
            "memory_peak": r["memory"].get("peak"), "memory_peak_by": r["memory"].get("peak_by"),
            "threads": d["threads"]}


def serve(a, reader: str) -> dict:
    from services.bench.serve import Client
    from services.bench.threads import Census
    from services.launcher import Cluster
    model = next((Path(a.out) / "work").glob(f"{a.preset}-*.gguf"), None)
    if model is None:
        raise SystemExit(f"no {a.preset} model in {a.out}/work: run the bench part first")
    os.environ["PYTHONPATH"] = str(HERE / "shim")          # the children's thread names (module doc)
    v, h = a.slots.split("+")
    c = Cluster(str(model), str(Path(a.out) / f"serve-{reader}"), device="cpu", http="auto",
                settings={"slots.vram_per_layer": int(v), "slots.host_per_layer": int(h),
                          "store.session_reader": reader})
    try:
        c.start_store()
        c.start_worker()
        cl = Client(c.http)
        cl.model_id = cl.get("/v1/models")[1]["data"][0]["id"]
        cl.complete(list(range(3, 11)), 4)                  # a first request: warm-ups out of the window
        census = Census({"worker": c.worker.pid, "store": c.store.pid})
        rec = cl.complete(list(range(11, 19)), a.tokens, on_first=census.start)
        res = census.stop(max(1, rec.get("completion_tokens", 1) - 1))
        if "error" in rec:
            raise SystemExit(f"serve-{reader}: {rec['error']}")
        t = rec["times"]
        return {"name": f"serve-{reader}", "tokens": rec["completion_tokens"] - 1,
                "token_ms": round((t[-1] - t[0]) / max(1, len(t) - 1) * 1e3, 2), "threads": res}
    finally:
        c.stop()


def table(runs: list[dict], proc: str) -> list[str]:
    names = []
    for r in runs:
        for k in r["threads"][proc].get("threads", {}):
            if k not in names:
                names.append(k)
    out = [f"| {proc} thread (x threads): wakeups a token, voluntary + preempted / CPU us a token | "
           + " | ".join(r["name"] for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for k in names:
        cells = []
        for r in runs:
            x = r["threads"][proc].get("threads", {}).get(k)
            cells.append("–" if x is None else
                         f"{x['wakeups'] - x['involuntary']:.2f} + {x['involuntary']:.2f} / {x['cpu_us']:.0f}")
        py = next((r["threads"][proc]["threads"][k].get("python") for r in runs
                   if k in r["threads"][proc].get("threads", {})), None)
        tag = " (Python)" if py or k.startswith("py:") else ""
        n = max(r["threads"][proc].get("threads", {}).get(k, {}).get("threads", 0) for r in runs)
        out.append(f"| {k}{tag} (x{n}) | " + " | ".join(cells) + " |")
    out.append("| tokens / ms a token | " + " | ".join(f"{r['tokens']} / {r['token_ms']}" for r in runs) + " |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--preset", default="ds4-tiny")
    p.add_argument("--slots", default="2+3")
    p.add_argument("--parts", default="bench,serve")
    p.add_argument("--out", default="/tmp/gil66-census")
    p.add_argument("--tables", help="print the tables of this census.json, run nothing")
    a = p.parse_args()
    if a.tables:
        for part, runs in json.loads(Path(a.tables).read_text()).items():
            for proc in ("worker", "store"):
                print(f"\n{part}, {proc} process:\n")
                print("\n".join(table(runs, proc)))
        return 0
    Path(a.out).mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    res = {}
    if "bench" in parts:
        res["bench"] = [bench(a, rd, mon) for rd in ("thread", "caller") for mon in ("poll", "")]
    if "serve" in parts:
        res["serve"] = [serve(a, rd) for rd in ("thread", "caller")]
    (Path(a.out) / "census.json").write_text(json.dumps(res, indent=1))
    for part, runs in res.items():
        for proc in ("worker", "store"):
            print(f"\n{part}, {proc} process:\n")
            print("\n".join(table(runs, proc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
