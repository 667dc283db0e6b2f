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

The chain of a gap ended by a layer's message (issue 21: the disk waits on it), given the worker's routing times and
expert arrivals (PassStats.routed, .landed) and the store's message log (status' disk_msgs: [taken, first read, last
expert delivered]), cut at each step's time, each clipped into the gap after the one before (the parts sum to it):

  earlier   the gap's start -> the store took the layer before's message, where that was sent during the gap (it
            started no read: its experts were staged by read-ahead): the disk idled through earlier layers' work
            with nothing queued (only deeper read-ahead fills that); else 0
  land      -> the store's thread that delivers the layer before's load has its last expert (the reader's completion
            callback; the reader thread delivers it itself since cpu-chain58, before it a loader thread's wakeup)
  deliver   -> the worker has it (the answer over the session stream: the store's send, the socket, the worker's read)
  gpu       -> the next layer's routing on the host: the expert's H2D copy and group, the next layer's attention and
            routing, the routing's sync to the host (between tokens: also the head, sampling and the next step's start)
            With the worker's device marks (PassStats.gpu_marks, on with the bench's --gpu-marks) `gpu` is also cut, its
            parts clipped the same way and summing to it (a mark not found: a part of 0, the time goes to the next):
    copy    -> the landed layer's last disk batch's H2D copy ends (its queue behind earlier copies, the copy itself)
    group   -> that batch's expert group ends (gate_up + down, or its group-graph replay)
    attn    -> the next layer's attention ends (between tokens: also the rest of the step, its head, sampling and
               the next step up to layer 0's attention)
    route   -> its routing and the copy of its counts to the host end (the MoE input, the router, the guesses)
    sync    -> the host has them: the sync's wakeup and the host's work to the stamp (and, where the message has no
               routing of its own, the hash ahead, all of gpu after the group)
  host      -> the load message sent (the host's tier split, guesses, bookkeeping before the send)
  message   -> the store took it (the session stream: the client's send thread, the socket, the store's reader thread)
  store     -> the gap's end: the store starts the reads (slot choice, the reader's queue, a thread's preadv)
"""

from __future__ import annotations

import bisect


CHAIN = ("earlier", "land", "deliver", "gpu", "host", "message", "store")
GPU = ("copy", "group", "attn", "route", "sync")    # gpu's parts (module doc), where the device marks were taken


def split_idle(gaps, windows, sends=(), routed=(), landed=(), msgs=(), marks=()) -> dict:
    """gaps [(start, end)] the disk's idle gaps (monotonic s, oldest first, as the store logs them), windows [(start,
    end)] the decode steps in order (monotonic s, each end <= the next start) -> {"tokens", "span_s", "idle_s",
    "between_s", "within_s", "outside_s", "active_s", "between_gaps", "within_gaps"} and per token in ms
    (between_ms_per_token, within_ms_per_token, outside_ms_per_token, active_ms_per_token). Each gap clipped to the
    run's span [first start, last end]. sends [(monotonic s, layer)] (PassStats.sends, in order): also "ended_by",
    per layer whose message ended a gap (-1: the step's hash ahead; "other": no message sent during the gap) the
    idle ms per token [between, within]: what the disk waited for. routed, landed [(monotonic s, layer)] (PassStats),
    msgs [(taken, first read[, delivered])] (status' disk_msgs), with sends: also "chain" {"between" | "within":
    {part: ms per token, ..., "gaps": n, "own_read": n}} over the gaps a layer's message ended (module doc: CHAIN).
    marks [(monotonic s, layer, name)] (PassStats.gpu_marks): the chain also has gpu's parts (GPU), summing to it."""
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
    chained = bool(times) and bool(routed or landed or msgs)
    parts_of = CHAIN + (GPU if marks else ())
    chain = {w: dict.fromkeys(parts_of + ("gaps", "own_read"), 0.0) for w in ("between", "within")}
    by_mark: dict = {}                                          # (name, layer) -> its marks' times, sorted
    for t, layer, name in marks:
        by_mark.setdefault((name, layer), []).append(t)
    for v in by_mark.values():
        v.sort()
    rt, lt, mt = [t for t, _ in routed], [t for t, _ in landed], [m[0] for m in msgs]
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
            if chained and label != "other":
                prev = times[i - 1] if i and times[i - 1] >= a else None
                parts, own = _chain(a, b, times[i], sends[i][1], prev, routed, landed, rt, lt, msgs, mt,
                                    by_mark if marks else None)
                c = chain["between" if touches else "within"]
                for name, v in zip(parts_of, parts):
                    c[name] += v
                c["gaps"] += 1
                c["own_read"] += own
    span = hi - lo
    idle = between + within
    ms = 1e3 / n
    return {"tokens": n, "span_s": span, "idle_s": idle, "between_s": between, "within_s": within,
            "outside_s": outside, "active_s": span - idle, "between_gaps": nb, "within_gaps": nw,
            "between_ms_per_token": between * ms, "within_ms_per_token": within * ms,
            "outside_ms_per_token": outside * ms, "active_ms_per_token": (span - idle) * ms,
            **({"ended_by": {k: [v[0] * ms, v[1] * ms] for k, v in sorted(ended.items(), key=_label_order)}}
               if times else {}),
            **({"chain": {w: {k: (v * ms if k in parts_of else v) for k, v in c.items()} for w, c in chain.items()}}
               if chained else {})}


def _chain(a: float, b: float, c: float, layer: int, prev, routed, landed, rt, lt, msgs, mt,
           by_mark=None) -> tuple[list[float], bool]:
    """A gap [a, b] ended by layer `layer`'s message sent at c -> its parts (CHAIN) in seconds: the store's take of
    the message before it where that was sent in the gap (prev: its time, or None), the layer's routing
    on the host (the last before c), the last expert handed to the worker before that (and the store's delivery of it:
    the last load taken before it that delivered one), the last message the store took by b (after c); a step not
    found takes the time of the one before it (a part of 0). And whether the read that
    ended the gap was that message's own first one (its first preadv within 0.2 ms of b: the store part is the
    message's own scheduling, not a read it waited behind). by_mark ({(name, layer): sorted times}, or None): gpu's
    parts (GPU) follow CHAIN's, each mark the last of its name by the routing (copy, group: the landed layer's;
    attn, route: the routed layer's), clipped into gpu after the part before."""
    j = bisect.bisect_right(rt, c) - 1
    while j >= 0 and routed[j][1] != layer and c - rt[j] < 1.0:     # the hash ahead (-1) has none: host 0
        j -= 1
    t_routed = routed[j][0] if j >= 0 and routed[j][1] == layer else c
    k = bisect.bisect_right(lt, t_routed) - 1
    t_landed = lt[k] if k >= 0 else a
    n = bisect.bisect_right(mt, t_landed) - 1
    while n >= 0 and (len(msgs[n]) < 3 or msgs[n][2] is None) and t_landed - mt[n] < 1.0:
        n -= 1
    t_store = msgs[n][2] if n >= 0 and len(msgs[n]) >= 3 and msgs[n][2] is not None else t_landed
    m = bisect.bisect_right(mt, b) - 1
    t_taken = mt[m] if m >= 0 and mt[m] >= c else c
    if prev is None:
        t_earlier = a
    else:
        p = bisect.bisect_left(mt, prev)
        t_earlier = mt[p] if p < len(mt) and mt[p] < c else prev
    cuts, at = [a], a
    for t in (t_earlier, t_store, t_landed, t_routed, c, t_taken):
        at = min(max(t, at), b)
        cuts.append(at)
    cuts.append(b)
    first = msgs[m][1] if m >= 0 and mt[m] >= c else None
    parts = [cuts[x + 1] - cuts[x] for x in range(len(CHAIN))]
    if by_mark is not None:         # gpu = cuts[3] .. cuts[4] (landed .. routed) cut at the device's marks
        lo, hi = cuts[3], cuts[4]
        at, sub = lo, []
        lay = landed[k][1] if k >= 0 else None
        for name, of in (("copy", lay), ("group", lay), ("attn", layer), ("route", layer)):
            ts = by_mark.get((name, of), ())
            x = bisect.bisect_right(ts, t_routed) - 1
            t = ts[x] if x >= 0 else at         # a mark of an earlier step clips to at: 0
            nxt = min(max(t, at), hi)
            sub.append(nxt - at)
            at = nxt
        sub.append(hi - at)
        parts += sub
    return parts, first is not None and abs(first - b) < 2e-4


def _label_order(kv) -> tuple:
    k = kv[0]
    return (1, 0) if k == "other" else (0, int(k))


def ended_label(s: dict, top: int = 4) -> str:
    """split_idle's ended_by, the largest first: 'L0 8.1 / 0.2, hash 1.0 / 0.0, ...' (ms/token between / within)."""
    by = s.get("ended_by") or {}
    rows = sorted(by.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]
    name = {"-1": "hash ahead", "other": "other"}
    return ", ".join(f"{name.get(k, 'L' + k)} {b:.1f} / {w:.1f}" for k, (b, w) in rows)


def chain_label(s: dict, where: str = "within") -> str:
    """split_idle's chain of the `where` gaps: 'earlier 0.50 / land 0.10 / deliver 0.10 / gpu 1.20 / host 0.30 /
    message 0.10 / store 0.05 (3.0 gaps/token, ...)' (ms per token); '' where not measured."""
    c = (s.get("chain") or {}).get(where)
    if not c or not c["gaps"]:
        return ""
    return (" / ".join(f"{k} {c[k]:.2f}" for k in CHAIN)
            + f" ({c['gaps'] / max(1, s['tokens']):.1f} gaps/token, {c['own_read']:.0f} of {c['gaps']:.0f} ended by the "
            "message's own first read)")


def gpu_label(s: dict, where: str = "within") -> str:
    """The chain's gpu part of the `where` gaps cut at the device's marks: 'copy 0.40 / group 0.30 / attn 0.50 / route
    0.20 / sync 0.10 (of gpu 1.50)' (ms per token); '' where not measured (a record before the marks)."""
    c = (s.get("chain") or {}).get(where)
    if not c or not c["gaps"] or GPU[0] not in c:
        return ""
    return " / ".join(f"{k} {c[k]:.2f}" for k in GPU) + f" (of gpu {c['gpu']:.2f})"


def idle_label(d: dict) -> str:
    """A decode record's idle split for a table cell: 'idle ms/token between / within' ('' where not measured)."""
    s = d.get("disk_idle") or {}
    if "between_ms_per_token" not in s:
        return ""
    return f" (idle ms/token {s['between_ms_per_token']:.1f} between / {s['within_ms_per_token']:.1f} within)"
