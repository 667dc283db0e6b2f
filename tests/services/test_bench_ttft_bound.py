"""The serve bench's TTFT bound (services/bench/serve_meter.py prefill_window, serve.summarize / markdown) from recorded
counters: the figures of the H200 run gpu-run37-serve (Q8_0 bench geometry, 12G / 12 GiB, disk sampled 1.63 GB/s),
its prefill windows re-derived as the whole phase less the decode window (docs/benchmarks/gpu-run37-serve/bench.json).
That run sampled the disk in the random pattern only, and its prefills beat that bound (achieved 1.07 / 1.03): a layer
sample beside it is taken here at 2.16 GB/s, the rate gpu-run30-serve's 512-token prefill read at (13.29 GB / 6.15 s),
and every window's bound uses the faster of the two (serve_meter.disk_rate).
The live path (a real serve on the CPU, the same fields from its counters) is in test_bench_serve.py."""

from __future__ import annotations

import pytest

from services.bench.serve import markdown, summarize
from services.bench.serve_meter import Snapshot, bounds, prefill_window

DISK, H2D = 1.6285e9, 55.28e9          # B/s, sampled in that run (the disk: random pattern)
LAYER = 2.16e9                          # B/s, the layer pattern's rate (module doc)
RATES = {"random": DISK, "layer": LAYER}

# (prompt tokens, disk bytes, H2D bytes, prefill busy s, prefill disk wait s, TTFT p50 s, TTFT max s) of each burst's
# prefill window in gpu-run37-serve: 1 client and 8 clients of 128-token prompts
RUN37 = {1: (128, 4.98e9, 7.05e9, 2.816, 2.021, 2.85, 2.85), 8: (1024, 15.60e9, 19.42e9, 9.237, 6.781, 9.32, 9.34)}


def _snap(t=0.0, prompt=0.0, disk=0, h2d=0.0, busy=0.0, wait=0.0, gen=0.0) -> Snapshot:
    return Snapshot(t, gen, prompt, h2d, 0.0, {"prefill": busy, "decode": 0.0}, {"prefill": wait, "decode": 0.0},
                    disk_bytes=int(disk))


def _phase(n: int, rates: dict = RATES) -> dict:
    """One client count's phase as the suite records it: a (before), opened (every first token out), b (the end)."""
    tokens, disk, h2d, busy, wait, p50, mx = RUN37[n]
    a = _snap()
    opened = _snap(mx, tokens, disk, h2d, busy, wait)
    b = _snap(mx + 6.0, tokens, disk + 6e9, h2d + 3e9, busy, wait, gen=63.0 * n)
    # the rates the clients saw: 63 tokens each in the 6 s decode window, 64 each over the whole phase
    fig = {"aggregate_decode_tps": 63.0 * n / 6.0, "end_to_end_tps": 64.0 * n / (mx + 6.0), "ttft_p50_s": p50,
           "ttft_max_s": mx}
    return {"figures": fig, "bound": bounds(a, opened, b, rates, H2D, 64 * n, fig["aggregate_decode_tps"],
                                           fig["end_to_end_tps"], fig["ttft_max_s"])}


def test_the_ttft_bound_is_the_longest_of_disk_copies_and_work():
    lone = _phase(1)["bound"]["prefill"]
    assert lone["prefill_tokens"] == 128 and lone["decode_tokens"] == 0
    assert lone["disk_s"] == pytest.approx(4.98e9 / LAYER) and lone["h2d_s"] == pytest.approx(7.05e9 / H2D)
    assert lone["work_s"] == pytest.approx(2.816 - 2.021)            # the passes' busy time outside disk waits
    assert (lone["ttft_limiter"], lone["ttft_bound_s"]) == ("disk", pytest.approx(2.306, abs=1e-3))
    assert lone["achieved"] == pytest.approx(lone["ttft_bound_s"] / 2.85) == pytest.approx(0.809, abs=1e-3)
    # a pass with the experts at hand: its work bounds it, not the few bytes it read
    w = prefill_window(_snap(), _snap(1.0, 64, 1e6, 0.0, busy=0.6, wait=0.1), DISK, None, 0.8)
    assert (w["ttft_limiter"], w["ttft_bound_s"], w["h2d_s"]) == ("work", pytest.approx(0.5), None)
    assert w["achieved"] == pytest.approx(0.5 / 0.8)
    # nothing prefilled, nothing read (the whole prompt from the prefix cache): no bound
    w = prefill_window(_snap(), _snap(0.02), DISK, H2D, 0.02)
    assert w["ttft_bound_s"] is None and w["ttft_limiter"] is None and w["achieved"] is None


def test_every_window_bounds_at_the_faster_of_the_two_patterns():
    """max(random, layer) in every window: at the random sample alone run37's prefills beat their bound (1.07 / 1.03,
    the bug this rule removes); whichever pattern is faster sets the disk term of prefill, decode and the phase."""
    for n, beaten in ((1, 1.073), (8, 1.026)):
        tokens, disk, h2d, busy, wait, p50, mx = RUN37[n]
        a, opened, b = _snap(), _snap(mx, tokens, disk, h2d, busy, wait), _snap(mx + 6.0, tokens, disk + 6e9, h2d + 3e9,
                                                                              busy, wait, gen=63.0 * n)
        for rates, rate, pattern in ((RATES, LAYER, "layer"), ({"random": DISK, "layer": 1.2e9}, DISK, "random"),
                                     ({"random": DISK}, DISK, "random")):
            w = bounds(a, opened, b, rates, H2D, 64 * n, 63.0 * n / 6.0, 64.0 * n / (mx + 6.0), mx)
            for name, x in w.items():
                assert (x["disk_bps"], x["disk_pattern"]) == (rate, pattern), (name, rates)
                assert x["disk_s"] == pytest.approx(x["disk_bytes"] / rate), (name, rates)
            assert w["prefill"]["achieved"] == pytest.approx(disk / rate / mx)
            assert (w["prefill"]["achieved"] > 1) == (rate == DISK), (n, rates)    # beaten only at the random rate
        assert prefill_window(a, opened, DISK, H2D, mx)["achieved"] == pytest.approx(beaten, abs=1e-3)


def test_the_ratio_floor_is_the_bounds_ratio_and_printed_beside_the_target():
    case = {"name": "auto", "clients": {"1": _phase(1), "8": _phase(8)}, "memory": {"cgroup": "/sys/fs/cgroup/x"}}
    disk = {"random": {"bps": DISK}, "layer": {"bps": LAYER}, "bps": LAYER, "pattern": "layer", "mode": "direct"}
    r = {"cases": [case], "disk": disk, "h2d": {"bps": H2D}, "status": "complete",
         "options": {"client_prompt": (128, 128), "client_tokens": 64}}
    s = summarize(r)["auto"]
    b1, b8 = 4.98e9 / LAYER, 15.60e9 / LAYER                         # both disk-bound, at the layer rate
    assert s["ttft_bound_lone_s"] == pytest.approx(b1) and s["ttft_bound_most_s"] == pytest.approx(b8)
    assert s["ttft_p50_most_over_lone"] == pytest.approx(9.32 / 2.85)
    assert s["ttft_floor_most_over_lone"] == pytest.approx(15.60 / 4.98)  # the bytes' ratio: 3.13x, not <= 2x
    assert s["ttft_ratio_over_floor"] == pytest.approx((15.60 / 4.98) / (9.32 / 2.85))
    assert s["ttft_most_achieved"] == pytest.approx(b8 / 9.34) and s["ttft_lone_achieved"] == pytest.approx(b1 / 2.85)
    r["summary"] = {"auto": s}
    md = markdown(r)
    assert ("| TTFT p50, 8 clients together ÷ the lone cold prompt (1 client) (its floor: the TTFT bounds' ratio, "
            "what the prefills moved) | 3.27x (floor 3.13x: bounds 7.22 s ÷ 2.31 s at disk 2.16 / 2.16 GB/s, "
            "achieved 0.77 / 0.81; floor ÷ ratio 0.96) | ≤ 2x |") in md
    assert ("| 8 clients | prefill window | 1024 prompt tokens prefilled, 9.34 s; TTFT bound 7.22 s (disk; "
            "disk 7.22 s at 2.16 GB/s from the sample (layer), h2d 0.35 s, work 2.46 s), achieved 0.77 of TTFT 9.34 s; "
            "disk 15.6 GB") in md
    assert ("Rates measured in this run before the first serve: disk 2.16 GB/s (direct; random 1.63, layer 2.16), "
            "H2D 55.28 GB/s (pinned). The disk is sampled again beside every phase") in md
    assert "a sample's rate is the faster, max(random, layer)" in md
    # the check printed under the rates: no window beat its bound; at the random sample alone both prefills did
    assert s["bounds_beaten"] == [] and s["bound_max_achieved"] == [pytest.approx(b1 / 2.85), "1 clients prefill"]
    assert "Bounds check: `auto` bounds: none beaten (highest achieved 0.81, 1 clients prefill)." in md
    case["clients"] = {"1": _phase(1, {"random": DISK}), "8": _phase(8, {"random": DISK})}
    assert summarize(r)["auto"]["bounds_beaten"] == ["1 clients prefill 1.07", "8 clients prefill 1.03"]


def _sample(random: float, layer: float, at_s: float = 0.0) -> dict:
    """A disk sample beside a phase as ServeSuite._metered records it (serve._sample_rates)."""
    return {"bps": max(random, layer), "pattern": "random" if random >= layer else "layer", "random": random,
            "layer": layer, "at_s": at_s, "idle_wait_s": 0.6, "idle": True}


def test_each_phase_is_bounded_at_the_samples_beside_it():
    """The device's disk drifts within a run (1.1-2.1 GB/s in gpu-run39-serve, whose prefills beat the one sample
    taken before the first serve: 1.04-1.26). Each window is bounded at the fastest rate observed around it: the
    sample before its phase, the one after it, the run's first (1.5 GB/s here), its own reads; the TTFT floor is the
    ratio of those per-phase bounds."""
    first = {"random": 1.5e9, "layer": 1.1e9}
    lone = {"before": _sample(1.2e9, 1.0e9, 30), "after": _sample(1.3e9, 1.9e9, 50)}     # after: 1.9 GB/s, layer
    most = {"before": _sample(2.3e9, 1.4e9, 80), "after": None}                         # the case's time ran out
    slow = {"before": _sample(0.9e9, 1.0e9, 60), "after": _sample(1.2e9, 0.8e9, 70)}    # both below the first
    beside = {n: [("sample before", {p: d["before"][p] for p in ("random", "layer")})]
              + ([("sample after", {p: d["after"][p] for p in ("random", "layer")})] if d["after"] else [])
              + [("the run's first sample", first)] for n, d in ((1, lone), (8, most), (4, slow))}
    want = {1: (1.9e9, "sample after", "layer"), 8: (2.3e9, "sample before", "random"),
            4: (1.5e9, "the run's first sample", "random")}
    phases = {n: _phase(n if n != 4 else 1, beside[n]) for n in (1, 8, 4)}
    for n, ph in phases.items():
        for name, w in ph["bound"].items():
            assert (w["disk_bps"], w["disk_source"], w["disk_pattern"]) == want[n], (n, name, w)
            assert w["disk_s"] == pytest.approx(w["disk_bytes"] / want[n][0])
    # a window that read faster than every sample beside it (its disk bytes over its seconds with a read in flight)
    # is bounded at its own reads' rate: 15.6 GB in 6 s = 2.6 GB/s for the burst's prefill, its decode window keeps
    # the sample's
    tokens, disk, h2d, busy, wait, p50, mx = RUN37[8]
    a, opened = _snap(), _snap(mx, tokens, disk, h2d, busy, wait)
    opened.disk_active_s = 6.0
    b = _snap(mx + 6.0, tokens, disk + 6e9, h2d + 3e9, busy, wait, gen=504.0)
    b.disk_active_s = 6.0 + 4.0                                            # 6 GB in 4 s: 1.5 GB/s, below 2.3
    w = bounds(a, opened, b, beside[8], H2D, 512, 84.0, 33.4, mx)
    assert (w["prefill"]["disk_bps"], w["prefill"]["disk_source"]) == (pytest.approx(2.6e9), "the window's own reads")
    assert w["prefill"]["disk_own_bps"] == pytest.approx(2.6e9) and w["prefill"]["disk_pattern"] == "own"
    assert (w["decode"]["disk_bps"], w["decode"]["disk_source"]) == (2.3e9, "sample before")
    assert w["decode"]["disk_own_bps"] == pytest.approx(1.5e9) and w["decode"]["disk_active_s"] == 4.0
    assert w["prefill"]["achieved"] == pytest.approx(6.0 / mx)             # the disk's busy share of the TTFT
    most["after"] = None
    phases[8]["bound"] = w
    phases[8]["disk"] = dict(most, first=_sample(1.5e9, 1.1e9))
    phases[1]["disk"] = dict(lone, first=_sample(1.5e9, 1.1e9))
    case = {"name": "auto", "clients": {"1": phases[1], "8": phases[8]}, "memory": {"cgroup": "/sys/fs/cgroup/x"}}
    r = {"cases": [case], "disk": {"random": {"bps": 1.5e9}, "layer": {"bps": 1.1e9}, "bps": 1.5e9, "pattern": "random",
                                   "mode": "direct"}, "h2d": {"bps": H2D}, "status": "complete",
         "options": {"client_prompt": (128, 128), "client_tokens": 64, "idle_quiet_s": 0.5, "idle_most_s": 3.0,
                     "disk_beside_bytes": 512 << 20, "disk_beside_s": 0.75}}
    s = summarize(r)["auto"]
    b1, b8 = 4.98e9 / 1.9e9, 15.60e9 / 2.6e9                             # each phase's bound at its own rate
    assert s["ttft_bound_lone_s"] == pytest.approx(b1) and s["ttft_bound_most_s"] == pytest.approx(b8)
    assert s["ttft_floor_most_over_lone"] == pytest.approx(b8 / b1)
    assert (s["ttft_disk_lone_bps"], s["ttft_disk_most_bps"]) == (1.9e9, pytest.approx(2.6e9))
    assert s["bounds_beaten"] == []
    r["summary"] = {"auto": s}
    md = markdown(r)
    assert f"(floor {b8 / b1:.2f}x: bounds {b8:.2f} s ÷ {b1:.2f} s at disk 2.60 / 1.90 GB/s" in md
    assert ("| 1 client | disk rate (the samples beside it) | before 1.20 GB/s (random 1.20, layer 1.00; at 30 s, idle "
            "after 0.6 s), after 1.90 GB/s (random 1.30, layer 1.90; at 50 s, idle after 0.6 s); the run's first "
            "1.50 GB/s |") in md
    assert ("| 8 clients | disk rate (the samples beside it) | before 2.30 GB/s (random 2.30, layer 1.40; at 80 s, "
            in md)
    assert "after none; the run's first 1.50 GB/s |" in md
    assert f"TTFT bound {b1:.2f} s (disk; disk {b1:.2f} s at 1.90 GB/s from the sample after (layer), h2d" in md
    assert f"TTFT bound {b8:.2f} s (disk; disk {b8:.2f} s at 2.60 GB/s from the window's own reads, h2d" in md
    assert "bound 193.2 (disk at 2.30 GB/s from the sample before (random)), achieved 0.43" in md   # 504 tokens, 6 GB
    assert ("once the store's disk counter stood still 0.5 s (at most 3 s), and after the last; 512 MiB or 0.75 s per "
            "pattern)") in md


def test_a_decode_window_opened_after_the_last_token_is_said_empty():
    """The decode window opens with a scrape started at the last client's first token; a toy model can decode every
    token before it returns (CI under load). Its window then holds no decode pass: said empty and bounding nothing,
    the phase and prefill windows as before; a window with tokens is never labelled."""
    from services.bench.serve_meter import EMPTY, describe
    a = _snap()
    late = _snap(0.5, 16, 4e6, 0.0, gen=48.0)               # the scrape saw all 48 tokens already counted
    b = _snap(0.51, 16, 4e6, 0.0, gen=48.0)
    w = bounds(a, late, b, RATES, None, 50, 500.0, 100.0, 0.4)
    d = w["decode"]
    assert (d["empty"], d["tokens"], d["bound_tps"], d["achieved"]) == (EMPTY, 0, None, None)
    assert describe(d) == EMPTY and w["prefill"]["decode_tokens"] == w["phase"]["decode_tokens"] == 48
    assert w["phase"]["tokens"] == 50 and "empty" not in w["phase"]
    on_time = _snap(0.1, 16, 1e6, 0.0, gen=2.0)
    w = bounds(a, on_time, b, RATES, None, 50, 500.0, 100.0, 0.09)
    assert "empty" not in w["decode"] and w["decode"]["tokens"] == 46 and w["decode"]["achieved"] is not None
