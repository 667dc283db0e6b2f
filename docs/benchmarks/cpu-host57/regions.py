#!/usr/bin/env python3
"""token_split.py's regions from an A/B's runs: per configuration, the median over each side's runs of each region's
self us a token (0 where a side has no such region: host57 makes no hand_start host part), the rest's totals, and
the rest's eager calls a token by kind (graph.replay: CUDA's replays, the CPU's segments).

    python3 docs/benchmarks/cpu-host57/regions.py ab.jsonl"""

import json
import statistics
import sys

rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
a, b = list(dict.fromkeys(r["side"] for r in rows))
REST = ["forward", "pass.begin", "hash_ahead", "step.refresh", "kv", "solo", "graph.replay", "hand_start",
        "hand_misses", "mark", "end_counts", "pass.end", "lanes", "segment"]
OTHER = ["moe", "store", "blocked"]


def med(args, side, get):
    v = [get(r["run"]["token_split"]) for r in rows if r["args"] == args and r["side"] == side]
    return statistics.median(v) if v else None


for args in dict.fromkeys(r["args"] for r in rows):
    print(f"\n`{args}` (us a token; {a} / {b})\n")
    print(f"| region | {a} | {b} |")
    print("|---|---|---|")
    for rg in REST + OTHER + ["rest_us", "rest_less_segments_us"]:
        if rg in ("rest_us", "rest_less_segments_us"):
            m = [med(args, s, lambda t, k=rg: t[k]) for s in (a, b)]
        else:
            m = [med(args, s, lambda t, k=rg: t["self_us"].get(k, 0.0)) for s in (a, b)]
        if any(m):
            print(f"| {rg} | {m[0]:.1f} | {m[1]:.1f} |")
    kinds = sorted({k for r in rows if r["args"] == args for k in r["run"]["token_split"]["rest_eager_calls"]})
    calls = {s: {k: med(args, s, lambda t, k=k: t["rest_eager_calls"].get(k, 0.0)) for k in kinds} for s in (a, b)}
    print("\nthe rest's eager calls a token: " + "; ".join(
        f"{k} {calls[a][k]:.3g} / {calls[b][k]:.3g}" for k in kinds))
