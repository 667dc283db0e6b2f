#!/usr/bin/env python3
"""Sweep the Triton expert kernels' block configuration on the GPU (benchmark geometry, Q8_0).

For each CONFIG: time one launch group (gate_up + down + combine) at 1, 16 and 64 rows per expert over
n experts, the HBM bytes/s of expert bytes it reaches, and check on the GPU that a row computed alone is
bit-identical to the same row in the full launch (row invariance) and that the result is close to the
default config's. Prints a table; the best config by decode + prefill time is printed last as JSON.
"""

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from betelgeuse.kernels import triton_moe as tk  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels  # noqa: E402

H, F, E, K = 2048, 768, 128, 8
dev = torch.device("cuda")
rng = np.random.default_rng(0)


def q8(n, k):
    """Random Q8_0 bytes of an [n, k] matrix: f16 scale 0.01, random int8 quants."""
    blocks = rng.integers(-127, 128, size=(n * k // 32, 34), dtype=np.int8).view(np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return blocks.reshape(-1)


part = [q8(F, H), q8(F, H), q8(H, F)]
sizes = [p.size for p in part]
slot = -(-sum(sizes) // 4096) * 4096
nbytes = sum(sizes)
pool = torch.empty(E * slot, dtype=torch.uint8)
for e in range(E):
    o = e * slot
    for p in part:                       # the same expert bytes everywhere (timing only)
        pool[o:o + p.size] = torch.from_numpy(p)
        o += p.size
pool = pool.to(dev)
starts = torch.tensor([[0, sizes[0], sizes[0] + sizes[1]]] * E, dtype=torch.int64, device=dev)
base_all = torch.arange(E, dtype=torch.int64, device=dev) * slot


def bench(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def case(n_exp, rows):
    T = max(1, -(-rows * n_exp // K))
    ids = (torch.arange(T * K) % n_exp).reshape(T, K).to(dev)
    h = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.full((T, K), 1.0 / K, device=dev, dtype=torch.bfloat16)
    return h, ids, w


kern = MoEKernels("triton", E, F, starts[None], [(8, 8)], 16)
g = Group(None, None, base_all)
cases = {"decode 8x1": case(8, 1), "16 exp x1": case(16, 1), "16 exp x16": case(16, 16), "32 exp x64": case(32, 64)}


def run(h, ids, w):
    r = kern.route(h, ids, w)
    kern.apply(r, 0, pool, g, slot)
    return kern.combine(r)


default = dict(tk.CONFIG)
ref = {k: run(*v).clone() for k, v in cases.items()}
configs = [dict(BM=16, BN=bn, BK=bk, num_warps=nw, num_stages=ns)
           for bn, bk, nw, ns in [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 4, 3), (32, 128, 4, 3), (128, 64, 8, 2),
                                  (32, 256, 4, 2), (16, 128, 2, 2), (64, 256, 8, 3), (16, 256, 4, 2)]]
results = []
print(f"{'config':45s} " + " ".join(f"{k:>20s}" for k in cases) + "   row-inv  close")
for c in configs:
    tk.CONFIG.update(c)
    try:
        times, close = {}, True
        for name, (h, ids, w) in cases.items():
            out = run(h, ids, w)
            close &= bool(torch.allclose(out.float(), ref[name].float(), rtol=2e-2, atol=2e-2))
            times[name] = bench(lambda: run(h, ids, w))
        h, ids, w = cases["16 exp x16"]
        inv = bool(torch.equal(run(h[3:4], ids[3:4], w[3:4])[0], run(h, ids, w)[3]))
    except Exception as ex:  # noqa: BLE001
        print(f"{json.dumps(c):45s} failed: {type(ex).__name__}: {str(ex)[:200]}")
        continue
    n_of = {"decode 8x1": 8, "16 exp x1": 16, "16 exp x16": 16, "32 exp x64": 32}
    cells = " ".join(f"{times[k] * 1e6:8.1f}us {n_of[k] * nbytes / times[k] / 1e9:6.0f}GB/s" for k in cases)
    print(f"{json.dumps(c):45s} {cells}   {inv!s:7s}  {close}")
    results.append((times["decode 8x1"] + times["16 exp x16"] + times["32 exp x64"] / 4, c, inv and close, times))
ok = [r for r in results if r[2]]
best = min(ok, key=lambda r: r[0]) if ok else None
print("BEST", json.dumps({"config": best[1] if best else default,
                          "times_us": {k: v * 1e6 for k, v in best[3].items()} if best else None}))
