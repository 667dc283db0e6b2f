#!/usr/bin/env python3
"""The verdict of deploy/device/churn_check.sh from its bench.json: per configuration the store's consolidation log
lines (moves, disk_reads, max_new) and the aggregate decode at 4 and 8 clients; exit 1 when a run is missing.

    python3 deploy/device/churn_verdict.py OUT/RUN/bench.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FIELD = re.compile(r"(\w+)=(\S+)")


def consolidations(store_log: str) -> list[dict]:
    """The store's `consolidation` events (betelgeuse/logs.py text lines: key=value fields)."""
    out = []
    try:
        lines = Path(store_log).read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if " consolidation " in line and "moves=" in line:
            out.append({k: v for k, v in FIELD.findall(line)})
    return out


def main() -> int:
    r = json.loads(Path(sys.argv[1]).read_text())
    rows = {}
    for c in r.get("cases", []):
        ev = consolidations((c.get("logs") or {}).get("store.log", ""))
        moves = sum(int(e["moves"]) for e in ev)
        reads = sum(int(e.get("disk_reads", 0)) for e in ev)
        agg = {n: (c.get("clients", {}).get(n, {}).get("figures") or {}).get("aggregate_decode_tps") for n in ("4", "8")}
        rows[c["name"]] = dict(n=len(ev), moves=moves, per=moves / max(1, len(ev)), reads=reads, agg=agg)
        fmt = {n: f"{v:.1f}" if v else "-" for n, v in agg.items()}
        print(f"{c['name']:32} consolidations {len(ev):4}  moves/consolidation {moves / max(1, len(ev)):7.1f}  "
              f"fills from disk {reads:6}  aggregate tok/s 4: {fmt['4']:>6}  8: {fmt['8']:>6}")
    pairs = (("auto:no-placement-hysteresis", "auto", "hysteresis"), ("auto", "auto:fill-budget", "fill budget"))
    for a, b, what in pairs:
        if a not in rows or b not in rows:
            print(f"verdict {what}: NOT MEASURED (a run is missing)")
            return 1
        x, y = rows[a], rows[b]
        fewer = y["per"] < x["per"]
        a8, b8 = x["agg"]["8"], y["agg"]["8"]
        kept = a8 is not None and b8 is not None and b8 >= 0.97 * a8
        tps = "-" if a8 is None or b8 is None else f"{a8:.1f} -> {b8:.1f} tok/s"
        print(f"verdict {what}: moves/consolidation {x['per']:.1f} -> {y['per']:.1f}, 8-client aggregate {tps}: "
              f"{'HELPS' if fewer and kept and b8 > a8 else 'NEUTRAL' if fewer and kept else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
