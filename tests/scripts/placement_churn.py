"""Placement churn: how much the expert store moves and reads to keep its tiers placed, in counts (not times), for
steady workloads through the engine (CPU; the store in this process).

    .venv/bin/python tests/scripts/placement_churn.py [--workloads repeat,batch,agent] [--sequences 8]
        [--rounds 4] [--tokens 24] [--vram 6] [--host 18] [--experts 64] [--backing] [--before] [--seeds 1]
        [--fill-budget] [--sticky F] [--margin M]

Writes a 3-layer synth model with `--experts` experts (top-8, the calibrated router: popularity and temporal locality
fitted to real decode statistics). Per workload, over all rounds and over the rounds after the first (the steady
part): placement moves planned, consolidations, consolidation fills read from disk, expert uses passes read from
disk (demand misses), VRAM fills from disk, the store's disk MB. --before also runs the same with the residency
policy's host hysteresis off (engine.placement_hysteresis = false: the policy before it) and prints
both side by side, and whether the tokens are the same (they must be: placement never changes a result).
--fill-budget: the after run with engine.fill_budget on (on the CPU's tiny experts it rarely binds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_helpers import CHURN_WORKLOADS, churn_model, churn_workload  # noqa: E402

COLS = ("moves", "consolidations", "fill_reads", "demand_reads", "vram_fill_disk", "disk_bytes")


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={d[k] / 1e6:.2f}MB" if k == "disk_bytes" else f"{k}={d[k]}" for k in COLS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(CHURN_WORKLOADS))
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--vram", type=int, default=6)
    ap.add_argument("--host", type=int, default=18)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--backing", action="store_true", help="VRAM backing copies (default off, as under 12G)")
    ap.add_argument("--sticky", type=float, help="HOST_STICKY for the after run (default: the module's)")
    ap.add_argument("--margin", type=float, help="HOST_MARGIN for the after run (default: the module's)")
    ap.add_argument("--seeds", type=int, default=1, help="prompt seeds (counts summed over them)")
    ap.add_argument("--fill-budget", action="store_true", help="the after run with engine.fill_budget on")
    ap.add_argument("--before", action="store_true", help="also run the policy without hysteresis, side by side")
    a = ap.parse_args()
    from betelgeuse.store import residency
    if a.sticky is not None:
        residency.HOST_STICKY = a.sticky
    if a.margin is not None:
        residency.HOST_MARGIN = a.margin
    with tempfile.TemporaryDirectory() as tmp:
        model = churn_model(Path(tmp), a.experts)
        for w in a.workloads.split(","):
            runs = {}
            for name in (("before", "after") if a.before else ("after",)):
                rs = [churn_workload(model, w, a.vram, a.host, a.backing, a.sequences, a.rounds, a.tokens, seed,
                                     placement_hysteresis=name == "after", fill_budget=a.fill_budget and name == "after")
                      for seed in range(3, 3 + a.seeds)]
                runs[name] = r = {"tokens": [x["tokens"] for x in rs], **{k: sum(x[k] for x in rs) for k in COLS},
                                  "late": {k: sum(x["late"][k] for x in rs) for k in COLS}}
                print(f"{w:7} {name:6} all:  {_fmt(r)}")
                print(f"{w:7} {name:6} late: {_fmt(r['late'])}", flush=True)
            if a.before:
                print(f"{w:7} tokens the same before and after: {runs['before']['tokens'] == runs['after']['tokens']}")


if __name__ == "__main__":
    main()
