#!/usr/bin/env python3
"""A/B of a measuring script between two checkouts, runs alternating, and its table: what each CPU or device A/B in
docs/benchmarks/ runs (one tool; the benchmark folders keep only their configurations and the exact command).

    # one JSON line per run: {"side", "rep", "args", "run": <the script's JSON output>}
    python3 deploy/device/ab.py run A_CHECKOUT B_CHECKOUT (--configs CONFIGS | --config ARGS) [--reps 3]
        [--labels main,branch] [--script deploy/device/decode_host.py] [--extra=--split] > results.jsonl
    # per configuration: the median over the runs of each side's figure, and the ratio B / A
    python3 deploy/device/ab.py table results.jsonl --keys miss_layer_us,host_us_per_application [--at per_token_median]

Why alternating: the machine's speed drifts (other processes, thermal, the page cache), so A and B take turns, rep by
rep, configuration by configuration, and a drift falls on both. The script is B's (the new measuring code wraps
either checkout's classes); only PYTHONPATH changes between the sides, so the script must leave sys.path to
PYTHONPATH (decode_host.py and store_messages.py do; a script that imports `_common` puts B's checkout first and would
run B's code on both sides). Each run's working directory is its side's checkout: the `python -m` children a script
starts (the store process) put the working directory first on sys.path, ahead of PYTHONPATH. CONFIGS: one argument line per configuration (blank lines and lines starting with #
skipped). A device A/B extracts A with
`git archive <commit> betelgeuse services deploy | tar -x -C _base` and passes `_base` as A_CHECKOUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def configs(path: str) -> list[str]:
    lines = [x.strip() for x in Path(path).read_text().splitlines()]
    return [x for x in lines if x and not x.startswith("#")]


def run(a: str, b: str, cfgs: list[str], reps: int, labels: tuple[str, str], script: str, extra: str,
        python: str, out=sys.stdout) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    script_path = str((Path(b) / script).resolve())
    for args in cfgs:
        for rep in range(1, reps + 1):
            for side, root in zip(labels, (a, b)):
                cmd = [python, script_path, *shlex.split(args), *shlex.split(extra)]
                # the side's checkout first; what PYTHONPATH held (the device's wheels in /tmp/site) after it
                path = os.pathsep.join(x for x in (str(Path(root).resolve()), env.get("PYTHONPATH", "")) if x)
                # run in the side's checkout: a `python -m services.*` child (the store decode_host.py starts) puts its
                # working directory before PYTHONPATH, so from B's checkout both sides would run B's store
                p = subprocess.run(cmd, env=dict(env, PYTHONPATH=path), capture_output=True, text=True,
                                   cwd=str(Path(root).resolve()))
                if p.returncode != 0:
                    print(f"ab: {side} run of `{' '.join(cmd)}` exited {p.returncode}:\n{p.stderr[-2000:]}",
                          file=sys.stderr)
                    return 1
                out.write(json.dumps({"side": side, "rep": rep, "args": args, "run": json.loads(p.stdout)}) + "\n")
                out.flush()
    return 0


def _at(run: dict, at: str, key: str):
    for part in [p for p in at.split(".") if p]:
        run = run[part]
    return run[key]


def table(rows: list[dict], keys: list[str], at: str, drop: str = "") -> list[str]:
    """Markdown: per configuration, per key, median over runs of A / of B and the ratio B / A."""
    sides = list(dict.fromkeys(r["side"] for r in rows))
    assert len(sides) == 2, f"results hold sides {sides}; an A/B has two"
    a, b = sides
    L = ["| configuration | " + " | ".join(f"{k} {a} / {b} (ratio)" for k in keys) + " |",
         "|---|" + "---|" * len(keys)]
    for args in dict.fromkeys(r["args"] for r in rows):
        cells = []
        for k in keys:
            m = {s: statistics.median(_at(r["run"], at, k) for r in rows if r["args"] == args and r["side"] == s)
                 for s in sides}
            cells.append(f"{m[a]:.3g} / {m[b]:.3g} ({m[b] / m[a]:.2f})" if m[a] else f"{m[a]:.3g} / {m[b]:.3g}")
        name = args.replace(drop, "").strip() if drop else args
        L.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the A/B; JSON lines on stdout")
    r.add_argument("a"), r.add_argument("b")
    r.add_argument("--configs", help="a file of argument lines, one configuration each")
    r.add_argument("--config", action="append", default=[], help="one configuration's arguments (repeatable)")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--labels", default="main,branch")
    r.add_argument("--script", default="deploy/device/decode_host.py", help="relative to B")
    r.add_argument("--extra", default="", help="arguments added to every configuration")
    r.add_argument("--python", default=sys.executable)
    t = sub.add_parser("table", help="results.jsonl -> markdown")
    t.add_argument("results")
    t.add_argument("--keys", required=True, help="comma-separated figures of the script's JSON")
    t.add_argument("--at", default="per_token_median", help="dotted path to the figures in the script's JSON")
    t.add_argument("--drop", default=" --tokens 200", help="text left out of the configuration's name")
    ns = ap.parse_args(argv)
    if ns.cmd == "run":
        labels = tuple(ns.labels.split(","))
        if len(labels) != 2:
            ap.error(f"--labels takes two names, got {ns.labels!r}")
        for d in (ns.a, ns.b):
            if not Path(d, "betelgeuse").is_dir():
                ap.error(f"{d} is not a checkout (no betelgeuse/ in it)")
        if not Path(ns.b, ns.script).is_file():
            ap.error(f"no script {ns.script} in {ns.b}")
        if ns.reps < 1:
            ap.error("--reps must be at least 1")
        try:
            cfgs = (configs(ns.configs) if ns.configs else []) + ns.config
        except OSError as e:
            ap.error(f"cannot read --configs {ns.configs}: {e.strerror}")
        if not cfgs:
            ap.error("no configuration: give --configs FILE or --config ARGS")
        return run(ns.a, ns.b, cfgs, ns.reps, labels, ns.script, ns.extra, ns.python)
    try:
        rows = [json.loads(x) for x in Path(ns.results).read_text().splitlines() if x.strip()]
    except OSError as e:
        ap.error(f"cannot read {ns.results}: {e.strerror}")
    print("\n".join(table(rows, ns.keys.split(","), ns.at, ns.drop)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
