#!/usr/bin/env python3
"""The issue-21 figures of a deepseek4 bench run, from its bench.json (step 5 of bench_ds4.sh).

    python3 deploy/device/ds4_summary.py OUT/RUN/bench.json [--out OUT/RUN/ds4_summary.md]

Per case: decode TG (mean / peak) and its disk share, host µs per expert application, kernel launches per layer
(the bench's profiled decode step and warm pass), the decode run's bound and the achieved fraction of it (above 1.0
the bound is wrong, and it says so); then the peak VRAM against the budget and the disk rates sampled in the run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MiB, GB = 1 << 20, 1e9


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def summary(r: dict) -> str:
    L = ["## ds4 summary (issue 21 figures)", "",
         "| case | decode tok/s mean / peak | decode disk share | host µs / application (decode) | "
         "launches / layer (decode / warm) | decode bound tok/s (limiter) | achieved |",
         "|---|---|---|---|---|---|---|"]
    for c in r.get("cases", []):
        d, prof = c.get("decode") or {}, c.get("profile", {})
        b = d.get("bound", {})
        bt = d["tokens"] / b["bound_s"] if d and b.get("bound_s") else None
        ach = b.get("achieved")
        share = d.get("disk_share")
        L.append(f"| {c['name']} | {_f(d.get('tg_mean'), '{:.2f}')} / {_f(d.get('tg_peak'), '{:.2f}')} | "
                 f"{_f(None if share is None else 100 * share, '{:.1f}%')} | {_f(d.get('host_us_per_application'))} | "
                 f"{_f(prof.get('decode', {}).get('launches_per_layer'))} / "
                 f"{_f(prof.get('warm', {}).get('launches_per_layer'))} | {_f(bt, '{:.2f}')} ({b.get('limiter', '–')}) | "
                 f"{_f(ach, '{:.2f}')}{' (over 1.0: the bound is wrong)' if ach and ach > 1 else ''} |")
    v = r.get("vram", {})
    peak, budget = v.get("peak_bytes"), v.get("budget", 0)
    verdict = "–" if peak is None else ("within" if peak <= budget else f"OVER by {(peak - budget) / MiB:,.0f} MiB")
    L += ["", f"- Peak VRAM {_f(None if peak is None else peak / MiB, '{:,.0f}')} MiB device-wide (torch allocated "
          f"{(v.get('torch_max_allocated') or 0) / MiB:,.0f} MiB, reserved {(v.get('torch_max_reserved') or 0) / MiB:,.0f} "
          f"MiB) vs the budget {budget / MiB:,.0f} MiB: {verdict}"]
    disk = [s["bps"] / GB for s in r.get("ceilings", {}).get("disk", [])]
    if disk:
        L.append(f"- Disk (O_DIRECT) sampled during this run: {min(disk):.2f}-{max(disk):.2f} GB/s over {len(disk)} samples")
    L.append(f"- Status {r.get('status')}, {r.get('elapsed_s', 0):.0f} s")
    return "\n".join(L) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json")
    p.add_argument("--out", help="also write the summary here")
    a = p.parse_args()
    try:
        r = json.loads(Path(a.bench_json).read_text())
    except (OSError, ValueError) as e:
        print(f"ds4_summary: error: cannot read {a.bench_json}: {e}")
        return 2
    md = summary(r)
    print(md, end="")
    if a.out:
        Path(a.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
