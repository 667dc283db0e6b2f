"""The host cost of one H2D copy call (issue 21: a ds4 decode token's _foreach_copy_ read 83 µs a call of host in
gpu-run67's cProfile): torch._foreach_copy_(non_blocking) of N arena slots into device slots, the arena a memfd
mapping registered as the worker's (store/arena.py register_pinned), against torch's own pinned memory and a copy_
a slot, at the slot sizes of ds4-flash (13.4 MB) and smaller. Each call timed on the host alone
(the device synced before it, so no queue is full); prints µs a call (median of REPS) per case.

--idle: what the thread did just before each timed call. `none` (the calls back to back: a hot core, as gpu-run67's
6-30 µs), `sleep:MS` (off the CPU MS ms, as the decode's main thread is while it waits for a landed expert in poll()
or a condition: ~14-20 waits a token of ~5 ms), `spin:MS` (on the CPU MS ms, busy). If a call costs more after a
sleep than after a spin of the same length, the decode's 83 µs a copy call (and 63 µs a graph replay) are the cost of
a core woken cold (its caches and clock after a sleep), not the driver's or the GIL's; store.session_reader "spin"
(services/grpc/store_client.py) is the engine's side of that A/B. Beside the copies: `python` (a fixed piece of pure
Python, 200 small calls: the interpreter's own cost when cold), `record` (an Event.record: a driver call) and
`replay` (a CUDA graph of 16 tiny kernels replayed).

    python3 deploy/device/h2d_call.py [--reps 50] [--idle none,sleep:5,spin:5] [--slots 13369344]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned


def _idle(mode: str):
    """-> a function run before each timed call (--idle): nothing, a sleep or a busy spin of MS ms."""
    kind, _, ms = mode.partition(":")
    s = float(ms or 0) / 1e3
    if kind == "none":
        return lambda: None
    if kind == "sleep":
        return lambda: time.sleep(s)
    if kind == "spin":
        def spin():
            end = time.perf_counter() + s
            while time.perf_counter() < end:
                pass
        return spin
    raise SystemExit(f"h2d_call.py: --idle {mode!r}: none, sleep:MS or spin:MS")


def _python_piece(d={i: i for i in range(64)}):
    """200 small Python calls (dict gets and a list append each): the interpreter's own work, no C library below."""
    out = []
    for i in range(200):
        out.append(d.get(i & 63))
    return out


def _time(fn, reps: int, queued: int = 1, idle=lambda: None) -> float:
    """Median host µs of fn(); queued > 1: the device synced only before every `queued` calls, so the later calls
    find the earlier ones' copies still in flight (as a decode's do); idle: run (untimed) just before each call."""
    out = []
    for i in range(reps):
        if i % queued == 0:
            torch.cuda.synchronize()
        idle()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--idle", default="none", help="comma list of none | sleep:MS | spin:MS (the module doc)")
    p.add_argument("--slots", default="13369344,1048576,65536", help="comma list of slot sizes, bytes")
    a = p.parse_args()
    idles = [(m, _idle(m)) for m in a.idle.split(",")]
    dev = torch.device("cuda")
    ev = torch.cuda.Event()
    pieces = [("python", _python_piece), ("record", ev.record)]
    try:                                    # 16 tiny kernels: a graph replay's host cost (gpu-run67: 63 µs a replay)
        x = torch.zeros(1, device=dev)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)                       # warmed outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(16):
                x.add_(1)
        pieces.append(("replay", graph.replay))
    except RuntimeError as e:               # the copies below still measured
        print(f"replay: no graph captured: {e}", flush=True)
    for mode, idle in idles:
        for name, fn in pieces:
            fn()
            print(f"idle {mode:<9} {name:<15} {_time(fn, a.reps, 1, idle):8.1f} µs a call", flush=True)
    for slot in (int(x) for x in a.slots.split(",")):
        n_max = 3
        arena = Arena.create(slot * n_max * 2, name="h2d-call")
        register_pinned(arena)
        srcs = [arena.torch(i * slot, slot) for i in range(n_max)]
        pinned = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(n_max)]
        dsts = [torch.empty(slot, dtype=torch.uint8, device=dev) for _ in range(n_max)]
        stream = torch.cuda.Stream()
        for n in (1, 3):
            cases = {
                "foreach arena": lambda: torch._foreach_copy_(dsts[:n], srcs[:n], non_blocking=True),
                "foreach pinned": lambda: torch._foreach_copy_(dsts[:n], pinned[:n], non_blocking=True),
                "copy_ arena": lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dsts[:n], srcs[:n])],
            }
            with torch.cuda.stream(stream):
                for name, fn in cases.items():
                    fn()                                        # first call apart
                    for q in (1, 4):
                        for mode, idle in idles:
                            us = _time(fn, a.reps, q, idle)
                            print(f"slot {slot:>10} B  n {n}  queued {q}  idle {mode:<9} {name:<15} {us:8.1f} µs a "
                                  f"call  {us / n:7.1f} a slot", flush=True)
        torch.cuda.synchronize()
        del srcs
        unregister_pinned(arena)
        arena.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
