"""The host Python of one expert group's launches (MoEKernels.apply on the triton backend: gate_up + down) with the
Triton launches themselves stubbed: what our code costs before Triton's dispatch, on any machine (no GPU: CPU tensors;
on CUDA _workspace also asks for the current stream). ds4-flash's shapes: E 256, H 4096, F 2048, k 6, one decode row.

    PYTHONPATH=<checkout> python3 docs/benchmarks/cpu-host-miss2/launch_prep.py [--qt 39] [--n 5000]
-> {"qt", "apply_prep_us": median of 5 batches of n applies, "launches": kernel names of one apply}
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--qt", type=int, default=39, help="GGML type of gate/up and down (39 MXFP4, 8 Q8_0)")
    p.add_argument("--n", type=int, default=5000)
    a = p.parse_args()
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.moe import Group, MoEKernels
    names: list = []

    class Stub:                     # kernel[grid](*args, **kw): recorded, nothing launched
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                names.append(self.name)
            return launch
    for n in ("_GATE_UP", "_DOWN", "_GATE_UP_MV", "_DOWN_MV", "_COMBINE"):
        setattr(tk, n, Stub(n))
    E, H, F, k, L = 256, 4096, 2048, 6, 2
    kern = MoEKernels("triton", E, F, torch.zeros((L, E, 3), dtype=torch.int64), [(a.qt, a.qt)] * L, 16)
    r = kern.route(torch.zeros(1, H), torch.tensor([[1, 5, 9, 100, 200, 255]]), torch.full((1, k), 1 / k))
    pool = torch.zeros(1024, dtype=torch.uint8)
    g = Group(None, np.full(E, -1, dtype=np.int64), torch.full((E,), -1, dtype=torch.int64))
    for _ in range(200):
        kern.apply(r, 1, pool, g, 4096 * 64)
    names.clear()
    kern.apply(r, 1, pool, g, 4096 * 64)
    one = list(names)
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(a.n):
            kern.apply(r, 1, pool, g, 4096 * 64)
        runs.append((time.perf_counter() - t) / a.n * 1e6)
    print(json.dumps({"qt": a.qt, "apply_prep_us": round(statistics.median(runs), 2), "launches": one}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
