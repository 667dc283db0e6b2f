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
store's own active-seconds counter the independent check: tests/services/test_disk_idle.py). Given the worker's
messages that ask for disk reads (PassStats.sends: time, layer), each gap is also put on the message that ended it
(the last one sent by its end, if sent during it): the layer whose routing the disk waited for, or the step's hash
ahead (-1); "other" where no message was sent during the gap.
"""

from __future__ import annotations

import bisect


def split_idle(gaps, windows, sends=()) -> dict:
    """gaps [(start, end)] the disk's idle gaps (monotonic s, oldest first, as the store logs them), windows [(start,
    end)] the decode steps in order (monotonic s, each end <= the next start) -> {"tokens", "span_s", "idle_s",
    "between_s", "within_s", "outside_s", "active_s", "between_gaps", "within_gaps"} and per token in ms
    (between_ms_per_token, within_ms_per_token, outside_ms_per_token, active_ms_per_token). Each gap clipped to the
    run's span [first start, last end]. sends [(monotonic s, layer)] (PassStats.sends, in order): also "ended_by",
    per layer whose message ended a gap (-1: the step's hash ahead; "other": no message sent during the gap) the
    idle ms per token [between, within]: what the disk waited for."""
    n = len(windows)
    if not n:
        return {}
    lo, hi = windows[0][0], windows[-1][1]
    # the boundaries, closed, in order: the run's start, each step's end to the next one's start, the run's end
    bounds = [(lo, lo)] + [(windows[k][1], windows[k + 1][0]) for k in range(n - 1)] + [(hi, hi)]
    ends = [s for _, s in bounds]
    between = within = outside = 0.0
    nb = nw = 0
    times = [t for t, _ in sends]
    ended: dict = {}                                            # label -> [between s, within s]
    for a, b in gaps:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        k = bisect.bisect_left(ends, a)                         # the first boundary that ends at or after a
        touches = k < len(bounds) and bounds[k][0] <= b         # it starts by b: the gap touches it
        if touches:
            between += b - a
            nb += 1
            while k < len(bounds) and bounds[k][0] <= b:        # its parts outside every step
                outside += max(0.0, min(b, bounds[k][1]) - max(a, bounds[k][0]))
                k += 1
        else:
            within += b - a
            nw += 1
        if times:                   # the last message sent by the gap's end, if sent during it, ended it
            i = bisect.bisect_right(times, b) - 1
            label = str(sends[i][1]) if i >= 0 and times[i] >= a else "other"
            ended.setdefault(label, [0.0, 0.0])[0 if touches else 1] += b - a
    span = hi - lo
    idle = between + within
    ms = 1e3 / n
    return {"tokens": n, "span_s": span, "idle_s": idle, "between_s": between, "within_s": within,
            "outside_s": outside, "active_s": span - idle, "between_gaps": nb, "within_gaps": nw,
            "between_ms_per_token": between * ms, "within_ms_per_token": within * ms,
            "outside_ms_per_token": outside * ms, "active_ms_per_token": (span - idle) * ms,
            **({"ended_by": {k: [v[0] * ms, v[1] * ms] for k, v in sorted(ended.items(), key=_label_order)}}
               if times else {})}


def _label_order(kv) -> tuple:
    k = kv[0]
    return (1, 0) if k == "other" else (0, int(k))


def ended_label(s: dict, top: int = 4) -> str:
    """split_idle's ended_by, the largest first: 'L0 8.1 / 0.2, hash 1.0 / 0.0, ...' (ms/token between / within)."""
    by = s.get("ended_by") or {}
    rows = sorted(by.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]
    name = {"-1": "hash ahead", "other": "other"}
    return ", ".join(f"{name.get(k, 'L' + k)} {b:.1f} / {w:.1f}" for k, (b, w) in rows)


def idle_label(d: dict) -> str:
    """A decode record's idle split for a table cell: 'idle ms/token between / within' ('' where not measured)."""
    s = d.get("disk_idle") or {}
    if "between_ms_per_token" not in s:
        return ""
    return f" (idle ms/token {s['between_ms_per_token']:.1f} between / {s['within_ms_per_token']:.1f} within)"
