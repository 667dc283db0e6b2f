"""The first launches of the approximate selection (TritonOps.route_approx) at ds4-flash's shape, timed: Triton
compiles a kernel variant at its first launch, and MoEStep.warm_routes moves those compiles to attach (the first warm
pool pass of ds4-flash paid them as host time: docs/benchmarks/gpu-run25-ds4). Prints one line per launch: the first
of each variant (top-k, hash) is the compile, the later ones the launch alone. ~20 s on a bare H200:

    PYTHONPATH=$PWD python3 deploy/device/route_first_launch.py            # (TRITON_INTERPRET=1 ... cpu: a dry run)
"""

import sys
import time

import torch

from betelgeuse.kernels.triton_ds4 import TritonOps
from betelgeuse.routing_approx import Residency

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
E, k, T, V = 256, 6, 64, 1000                       # ds4-flash's experts and top-k, a 64-token prompt
lg = torch.randn(T, E, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
bias, mask = torch.randn(E, device=dev), torch.rand(8, E, device=dev) < 0.5       # mask: [n_layer, E] as the passes'
tab, tok = torch.randint(0, E, (V, k), device=dev, dtype=torch.int32), torch.randint(0, V, (T,), device=dev)
for hashed in (False, True):
    for i in range(3):
        sync()
        t = time.perf_counter()
        TritonOps.route_approx(lg, None if hashed else bias, tab if hashed else None, tok if hashed else None, k,
                               Residency("pool", mask[1]), True, 1.0, lg.dtype)
        sync()
        print(f"route_approx {'hash' if hashed else 'top-k'} launch {i}: {(time.perf_counter() - t) * 1e3:.1f} ms",
              flush=True)
