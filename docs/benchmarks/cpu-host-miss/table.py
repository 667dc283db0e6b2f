"""results.jsonl (ab.sh) -> a markdown table: per configuration, the median over the runs of each side's per-token
medians (miss_layer_us: the median miss layer of each run), and the ratio branch / main."""
import json
import statistics
import sys

KEYS = ("miss_layer_us", "store_messages_ms", "moe_host_ms", "host_us_per_application", "host_ms", "wall_ms")
rows = [json.loads(x) for x in open(sys.argv[1] if len(sys.argv) > 1 else "results.jsonl")]
print("| configuration | " + " | ".join(f"{k} main / branch (ratio)" for k in KEYS) + " |")
print("|---|" + "---|" * len(KEYS))
for args in dict.fromkeys(r["args"] for r in rows):
    cells = []
    for k in KEYS:
        m = {s: statistics.median(r["run"]["per_token_median"][k] for r in rows if r["args"] == args and r["side"] == s)
             for s in ("main", "branch")}
        cells.append(f"{m['main']:.3g} / {m['branch']:.3g} ({m['branch'] / m['main']:.2f})")
    print(f"| `{args.replace(' --tokens 200', '')}` | " + " | ".join(cells) + " |")
