"""The host cost of one H2D copy call (issue 21: a ds4 decode token's _foreach_copy_ read 83 µs a call of host in
gpu-run67's cProfile): torch._foreach_copy_(non_blocking) of N arena slots into device slots, the arena a memfd
mapping registered as the worker's (store/arena.py register_pinned), against torch's own pinned memory and a copy_
a slot, at the slot sizes of ds4-flash (13.4 MB) and smaller. Each call timed on the host alone
(the device synced before it, so no queue is full); prints µs a call (median of REPS) per case.

    python3 deploy/device/h2d_call.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned


def _time(fn, reps: int, queued: int = 1) -> float:
    """Median host µs of fn(); queued > 1: the device synced only before every `queued` calls, so the later calls
    find the earlier ones' copies still in flight (as a decode's do)."""
    out = []
    for i in range(reps):
        if i % queued == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    dev = torch.device("cuda")
    for slot in (13_369_344, 1 << 20, 64 << 10):
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
                        us = _time(fn, a.reps, q)
                        print(f"slot {slot:>10} B  n {n}  queued {q}  {name:<15} {us:8.1f} µs a call  {us / n:7.1f} "
                              "a slot", flush=True)
        torch.cuda.synchronize()
        del srcs
        unregister_pinned(arena)
        arena.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
