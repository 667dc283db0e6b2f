"""How often would decode's eager groups replay under engine.group_graphs? (CPU estimate, issue 21.)

Runs deploy/device/decode_host.py's decode (its flags) with MoEStep._apply wrapped to record each eager group's
structural key: (layer, slot-table row: which of the ExpertCache ring's rows or another fixed one, pool or flex
chunk). On the device the Routing a step's groups read is the captured one (fixed per sequence and residency
pattern: the decode graphs replay route() in place), so these are the parts of worker/group_graphs.py's key that vary.
The memo's rule (launch at a key's first sighting, capture at its second, replay after; no LRU drop at these counts)
over the sequence -> JSON: groups, distinct keys, launches, captures, replays (every step, the skipped ones too).

    PYTHONPATH=$PWD python3 docs/benchmarks/cpu-graph49/group_keys.py --preset ds4-tiny --form solo --flex on \\
        --flex-slots 3 --tokens 64
"""
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "deploy" / "device"))
import decode_host as D  # noqa: E402
from betelgeuse.worker import moe_step  # noqa: E402

keys = []
_apply = moe_step.MoEStep._apply


def recorded(self, r, l, g, ls, pool=None):
    c, t = self.cache, g.base_dev
    at = t.data_ptr() - c.tables_dev.data_ptr()
    row = ("ring", at // (c.tables_dev.shape[1] * 8)) if 0 <= at < c.tables_dev.numel() * 8 else ("fixed", t.data_ptr())
    keys.append((l, row, "pool" if pool is None else pool.data_ptr()))
    return _apply(self, r, l, g, ls, pool)


moe_step.MoEStep._apply = recorded
a = D.parser().parse_args(sys.argv[1:])
with tempfile.TemporaryDirectory() as d:
    res = D.run(a, Path(d))
seen, out = collections.Counter(), collections.Counter()
for k in keys:
    out[("launch", "capture")[seen[k]] if seen[k] < 2 else "replay"] += 1
    seen[k] += 1
print(json.dumps({"args": sys.argv[1:], "groups": len(keys), "distinct_keys": len(seen), **out,
                  "groups_per_token": round(len(keys) / a.tokens, 2),
                  "miss_layer_groups": res["per_token_median"].get("miss_layer_groups")}))
