#!/usr/bin/env python3
"""FlexCache.keep's host time a call, the cache full (every fill evicts), n experts a call (1, 2, 4): the checkout on
PYTHONPATH's keep, so one script times either side of an A/B.

    PYTHONPATH=CHECKOUT python3 docs/benchmarks/cpu-copy49/keep_bench.py [--slot-bytes 64] [--device cpu|cuda]
"""

import argparse
import json
import timeit

import torch

from betelgeuse.worker.flex_cache import FlexCache

p = argparse.ArgumentParser()
p.add_argument("--slot-bytes", type=int, default=64)
p.add_argument("--device", default="cpu")
a = p.parse_args()
sb, dev = a.slot_bytes, torch.device(a.device)
out = {"slot_bytes": sb, "device": a.device}
for n in (1, 2, 4):
    f = FlexCache(sb, sb * 3, 2, 8, 64, dev)               # 6 slots, filled by the warm-up: every fill evicts
    pool = torch.zeros(sb * 16, dtype=torch.uint8, device=dev)
    f.changed = []                                          # logged, as when the at-hand table reads it
    i = [0]

    def one():
        i[0] += 1
        f.keep(i[0] % 8, [(i[0] * 7 + k) % 64 for k in range(n)], pool, [sb * k for k in range(n)])
        if len(f.changed) > 100:
            f.changed.clear()

    for _ in range(50):
        one()

    def rep():
        for _ in range(500):
            one()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    out[f"keep_{n}_us"] = round(min(timeit.repeat(rep, number=1, repeat=5)) / 500 * 1e6, 2)
print(json.dumps(out))
