"""ExpertCache._relayout's TILED work on a bench-geometry Q8_0 slot (gate / up [768, 2048], down [2048, 768]) against a
plain copy of the slot, side by side on the CPU (docs/benchmarks/cpu-tile63): what a VRAM fill adds, a CPU ratio only.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-tile63/relayout_cost.py
"""

import statistics
import time

import torch

from betelgeuse.kernels import tile_layout

PARTS = [(768, 2048), (768, 2048), (2048, 768)]           # (rows, K) of gate, up, down
NBYTES = [r * K // 32 * 34 for r, K in PARTS]              # Q8_0: 34 bytes a 32-element block
slot = torch.randint(0, 255, (sum(NBYTES),), dtype=torch.uint8)
scratch = torch.empty_like(slot)


def tile_slot():
    """The slot through the scratch, each part tiled back into it (ExpertCache._relayout, TILED)."""
    scratch.copy_(slot)
    o = 0
    for (rows, K), n in zip(PARTS, NBYTES):
        tile_layout.tile(scratch[o:o + n], rows, K, 8, out=slot[o:o + n])
        o += n


def copy_slot():
    scratch.copy_(slot)


times = {f.__name__: [] for f in (copy_slot, tile_slot)}
for _ in range(30):                                        # interleaved: the same box state for both
    for f in (copy_slot, tile_slot):
        t = time.perf_counter()
        f()
        times[f.__name__].append(time.perf_counter() - t)
for name, v in times.items():
    print(f"{name}: median {statistics.median(v) * 1e3:.2f} ms, min {min(v) * 1e3:.2f} ms "
          f"({sum(NBYTES) / 2**20:.2f} MiB slot)")
