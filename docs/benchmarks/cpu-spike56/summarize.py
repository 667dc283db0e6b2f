"""cpu-spike56: ab.sh's runs -> a markdown table per config and side (means over the repeats).

Per run (decode_host.py --per-token rows [step, host ms, blocked ms, worker CPU ms, open ms, reply wait ms, msgs]):
the pass-boundary tokens (an EndPass or BeginPass message in the step, step 0's first open apart) against the steady
ones (steps >= 3 with neither): their host ms, the worker's CPU ms (getrusage: all its threads), the messages' own host
ms (store_rpc) and the blocked wait for their replies (None on main: counted as host there), and the mean host ms a
timed token (steps >= 3, boundaries included: what the bench's mean sees); the first two steps' host ms; the
collector's pauses: mean ms a timed token, the largest of a step, the steps with a generation-2 collection."""
import glob
import json
import statistics as S
import sys
from collections import defaultdict

d = sys.argv[1] if len(sys.argv) > 1 else "."
acc = defaultdict(lambda: defaultdict(list))
sha = defaultdict(set)
for f in sorted(glob.glob(f"{d}/ab_*_*_*.json")):
    _, rep, side, cfg = f.rsplit("/", 1)[1][:-5].split("_", 3)
    r = json.load(open(f))
    sha[cfg].add((side, r["logits_sha256"]))
    rows = r["per_token"]
    bnd = [x for x in rows if x[0] > 0 and ({"begin_pass", "end_pass"} & set(x[6]))]
    steady = [x for x in rows if x[0] >= 3 and x not in bnd]
    a = acc[(cfg, side)]
    for k in ("end_pass", "begin_pass"):
        a[k + "_msg_ms"] += [x[6][k][1] for x in bnd if k in x[6]]
    a["reply_wait_ms"] += [x[5] for x in bnd if x[5] is not None]
    a["bnd_host_ms"] += [x[1] for x in bnd]
    a["bnd_cpu_ms"] += [x[3] for x in bnd]
    a["steady_host_ms"].append(S.median(x[1] for x in steady))
    a["steady_cpu_ms"].append(S.median(x[3] for x in steady))
    a["mean_host_ms"].append(S.mean(x[1] for x in rows if x[0] >= 3))
    a["first2_host_ms"] += [x[1] for x in rows[:2]]
    if len(rows[0]) > 7:                 # the collector's pauses (decode_host's _GcWatch), ms a token, and gen-2 ones
        a["gc_ms_token"].append(S.mean(sum(x[7].values()) for x in rows if x[0] >= 3))
        a["gc_ms_max"].append(max(sum(x[7].values()) for x in rows))
        a["gen2_tokens"].append(sum(1 for x in rows if "2" in x[7]))

cols = ["end_pass_msg_ms", "begin_pass_msg_ms", "reply_wait_ms", "bnd_host_ms", "bnd_cpu_ms", "steady_host_ms",
        "steady_cpu_ms", "mean_host_ms", "first2_host_ms", "gc_ms_token", "gc_ms_max", "gen2_tokens"]
print("| config | side | runs | " + " | ".join(cols) + " |")
print("|" + "---|" * (len(cols) + 3))
for (cfg, side), a in sorted(acc.items()):
    cell = lambda v: f"{S.mean(v):.2f}" if v else "–"
    print(f"| {cfg} | {side} | {len(a['mean_host_ms'])} | " + " | ".join(cell(a[c]) for c in cols) + " |")
print()
for cfg, s in sorted(sha.items()):
    print(f"logits_sha256 {cfg}: {sorted(s)} -> {'same bits' if len({h for _, h in s}) == 1 else 'DIFFER'}")
