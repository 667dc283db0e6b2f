"""split.jsonl (split.sh) -> a markdown table: per function, the median over the runs of its median us per call, and
its calls per decode step, main / branch."""
import json
import statistics
import sys

rows = [json.loads(x) for x in open(sys.argv[1] if len(sys.argv) > 1 else "split.jsonl")]
names = list(dict.fromkeys(k for r in rows for k in r["run"]["split_us"]))
print("| function | main us / call | branch us / call | calls / step (main, branch) |")
print("|---|---|---|---|")
for k in ["miss_layer_us"] + names:
    cells, calls = [], []
    for s in ("main", "branch"):
        if k == "miss_layer_us":
            v = [r["run"]["per_token_median"][k] for r in rows if r["side"] == s]
            c = [r["run"]["per_token_median"]["miss_layer_calls"] / r["run"]["tokens"] for r in rows if r["side"] == s]
        else:
            v = [r["run"]["split_us"][k][0] for r in rows if r["side"] == s and k in r["run"]["split_us"]]
            c = [r["run"]["split_us"][k][1] for r in rows if r["side"] == s and k in r["run"]["split_us"]]
        cells.append(f"{statistics.median(v):.1f}" if v else "-")
        calls.append(f"{statistics.median(c):.2f}" if c else "-")
    print(f"| `{k}` | {cells[0]} | {cells[1]} | {calls[0]}, {calls[1]} |")
