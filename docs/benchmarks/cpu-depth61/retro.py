"""The exact decode's disk split (services/bench/ceilings.disk_split) of earlier device runs, from their bench.json:
those records hold every counter the split needs but the bound's sample's busy / active (not recorded before depth61).

    PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-depth61/retro.py docs/benchmarks/gpu-run61-h100/*/bench.json
"""
import json
import sys

from services.bench import ceilings as C

print("| run | case | achieved (limiter, rate from) | busy share | rate while busy ÷ bound rate | needed ÷ read | "
      "product | reads in flight while busy | read / needed GB | bound GB/s | guesses read, unused GB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    r = json.load(open(path))
    for c in r.get("cases", []):
        d = c.get("decode") or {}
        if not d.get("tokens") or c.get("routing_mode", "exact") != "exact":
            continue
        b, s = d["bound"], C.disk_split(d["bound"], d)
        if not s:
            continue
        run = path.split("benchmarks/")[-1].rsplit("/", 1)[0]
        print(f"| {run} | {c['name']} | {b['achieved']:.3f} ({b['limiter']}, "
              f"{b.get('disk_source')}) | {s['busy_share']:.3f} | {s['busy_rate']:.3f} | {s['needed_share']:.3f} | "
              f"{s['busy_share'] * s['busy_rate'] * s['needed_share']:.3f} | {s['depth']:.2f} | "
              f"{d['store_disk_bytes'] / 1e9:.2f} / {d['disk_bytes'] / 1e9:.2f} | {b['disk_bps'] / 1e9:.2f} | "
              f"{d.get('guess', {}).get('guess_wasted_bytes', 0) / 1e9:.2f} |")
