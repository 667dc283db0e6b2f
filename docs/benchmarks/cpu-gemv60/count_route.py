"""The expert routing's launches (kernels.moe.MoEKernels.route, triton backend) for decode's rows (T = 1 and 8 tokens
x top-6 of 256 experts), counted on the CPU: torch ops by KernelCount (views and bare allocations excluded:
tests/memtrack.py), triton_moe's sort launch (where the checkout has it) replaced by a counter (the interpreter's own
host copies are no CUDA launches). Run from a checkout's root:

    PYTHONPATH=$PWD .venv/bin/python docs/benchmarks/cpu-gemv60/count_route.py
"""
import sys

sys.path.insert(0, "tests")
import torch

from betelgeuse.kernels import triton_moe
from betelgeuse.kernels.moe import MoEKernels
from memtrack import KernelCount, _Launcher

launches = __import__("collections").Counter()
if hasattr(triton_moe, "_SORT_ROWS"):
    triton_moe._SORT_ROWS = _Launcher("_sort_rows_kernel", launches)

E, k, H = 256, 6, 64
kern = MoEKernels("triton", E, 32, torch.zeros((1, E, 3), dtype=torch.int64), [(0, 0)], 8)
for T in (1, 8):
    ids = torch.randint(0, E, (T, k))
    h, w = torch.zeros(T, H), torch.zeros(T, k)
    launches.clear()
    with KernelCount(launches) as c:
        kern.route(h, ids, w)
    print(f"T={T}: launches {c.total}: torch {dict(c.ops)}, triton {dict(launches)}")
