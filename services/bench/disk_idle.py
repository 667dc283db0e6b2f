"""Where a decode run's disk stands idle: between tokens or within one (issue 21: exact decode at its disk bound).

The store's reader logs each stretch with no read in flight as (start, end) on the host's CLOCK_MONOTONIC
(store/reader.py idle_gaps; ExpertStore.status(disk_gaps_since)); the bench times each decode step on the same clock
(the forward call and the sampling sync after it: [start, end] per token). An idle gap is

  between   it touches a token boundary: it overlaps the stretch from one step's end to the next step's start, the
            run's start or its end. It runs from the token's last read landing to the next token's first read
            starting: the last layers' experts, the head, the sampling sync, the next step's setup, layer 0's
            attention and routing. The part of it outside every step (`outside`: the caller's time between forward
            calls) is counted in it and also shown alone
  within    any other: inside one step, between two of its reads (a layer's routing sync, attention, experts waiting
            for a host copy while no read is queued)

Per token: idle ms between / within, their sum + the disk's active time = the run's span (active = span - idle, the
store's own active-seconds counter the independent check: tests/services/test_disk_idle.py).
"""

from __future__ import annotations

import bisect


def split_idle(gaps, windows) -> dict:
    """gaps [(start, end)] the disk's idle gaps (monotonic s, oldest first, as the store logs them), windows [(start,
    end)] the decode steps in order (monotonic s, each end <= the next start) -> {"tokens", "span_s", "idle_s",
    "between_s", "within_s", "outside_s", "active_s", "between_gaps", "within_gaps"} and per token in ms
    (between_ms_per_token, within_ms_per_token, outside_ms_per_token, active_ms_per_token). Each gap clipped to the
    run's span [first start, last end]."""
    n = len(windows)
    if not n:
        return {}
    lo, hi = windows[0][0], windows[-1][1]
    # the boundaries, closed, in order: the run's start, each step's end to the next one's start, the run's end
    bounds = [(lo, lo)] + [(windows[k][1], windows[k + 1][0]) for k in range(n - 1)] + [(hi, hi)]
    ends = [s for _, s in bounds]
    between = within = outside = 0.0
    nb = nw = 0
    for a, b in gaps:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        k = bisect.bisect_left(ends, a)                         # the first boundary that ends at or after a
        if k < len(bounds) and bounds[k][0] <= b:               # it starts by b: the gap touches it
            between += b - a
            nb += 1
            while k < len(bounds) and bounds[k][0] <= b:        # its parts outside every step
                outside += max(0.0, min(b, bounds[k][1]) - max(a, bounds[k][0]))
                k += 1
        else:
            within += b - a
            nw += 1
    span = hi - lo
    idle = between + within
    ms = 1e3 / n
    return {"tokens": n, "span_s": span, "idle_s": idle, "between_s": between, "within_s": within,
            "outside_s": outside, "active_s": span - idle, "between_gaps": nb, "within_gaps": nw,
            "between_ms_per_token": between * ms, "within_ms_per_token": within * ms,
            "outside_ms_per_token": outside * ms, "active_ms_per_token": (span - idle) * ms}


def idle_label(d: dict) -> str:
    """A decode record's idle split for a table cell: 'idle ms/token between / within' ('' where not measured)."""
    s = d.get("disk_idle") or {}
    if "between_ms_per_token" not in s:
        return ""
    return f" (idle ms/token {s['between_ms_per_token']:.1f} between / {s['within_ms_per_token']:.1f} within)"
