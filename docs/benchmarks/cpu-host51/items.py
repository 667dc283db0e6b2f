#!/usr/bin/env python3
"""Per configuration, the median over an A/B's runs (deploy/device/ab.py run ... > ab.jsonl) of each side's per-call
figure of the named items of split_us (decode_host.py --split) and client_us (client_split.py): us a call, A / B and
the ratio B / A, as Markdown.

    python3 docs/benchmarks/cpu-host51/items.py ab.jsonl moe.session.load client.load ..."""

import json
import statistics
import sys

rows = [json.loads(x) for x in open(sys.argv[1])]
items = sys.argv[2:]
a, b = list(dict.fromkeys(r["side"] for r in rows))
print("| configuration | item | " + f"{a} / {b} us a call (ratio) | calls ({b}; split: a step, client: a run) |")
print("|---|---|---|---|")
for args in dict.fromkeys(r["args"] for r in rows):
    for k in items:
        part = "client_us" if k.startswith(("client.", "stream.")) else "split_us"
        m = {s: statistics.median(r["run"][part][k][0] for r in rows if r["args"] == args and r["side"] == s)
             for s in (a, b)}
        n = statistics.median(r["run"][part][k][1] for r in rows if r["args"] == args and r["side"] == b)
        print(f"| `{args}` | {k} | {m[a]:.1f} / {m[b]:.1f} ({m[b] / m[a]:.2f}) | {n:.3g} |")
