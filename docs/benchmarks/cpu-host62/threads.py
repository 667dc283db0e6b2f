#!/usr/bin/env python3
"""The worker's threads a token from decode_host.py --threads runs (ab.py's JSON lines): per configuration and side,
the median over the runs of each thread's CPU µs and wakeups a token (by thread name, its id dropped), the main
thread's CPU µs and the store process's CPU ms a token, and the logits hashes seen per configuration.

    python3 docs/benchmarks/cpu-host62/threads.py ab_threads1.jsonl ab_threads2.jsonl
"""
import collections
import json
import statistics
import sys

rows = [json.loads(line) for f in sys.argv[1:] for line in open(f)]
agg: dict = collections.defaultdict(lambda: collections.defaultdict(list))
shas = collections.defaultdict(set)
for r in rows:
    form = r["args"].split("--form ")[1].split(" ")[0] + (" fold" if "--fold" in r["args"] else "")
    shas[form].add(r["run"]["logits_sha256"])
    key = (form, r["side"])
    for name, v in r["run"].get("threads", {}).items():
        n = name.rsplit(":", 1)[0]
        agg[key][n + " cpu_us"].append(v["cpu_us"])
        agg[key][n + " wakeups"].append(v["wakeups"])
    pt = r["run"]["per_token_median"]
    agg[key]["main_cpu_us"].append(pt["main_cpu_us"])
    agg[key]["store_cpu_ms"].append(pt["store_cpu_ms"])
names = sorted({n for v in agg.values() for n in v})
print("| configuration | side | runs | " + " | ".join(names) + " |")
print("|---" * (len(names) + 3) + "|")
for (form, side), v in sorted(agg.items()):
    runs = len(next(iter(v.values())))
    print(f"| {form} | {side} | {runs} | " + " | ".join(f"{statistics.median(v[n]):.1f}" if v.get(n) else "-"
                                                      for n in names) + " |")
print("logits_sha256:", {k: sorted(v) for k, v in shas.items()})
