"""GroupGraphs.apply's own Python on a replay (the key of every launch argument, the LRU lookup), CPU: the graph a
no-op stand-in, ds4-flash's widths (H 4096, F 2048, 256 experts, k 6, one row). Median us over 20000 calls.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 docs/benchmarks/cpu-graph49/memo_overhead.py
"""
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from betelgeuse.kernels.moe import Group, MoEKernels  # noqa: E402
from betelgeuse.worker import group_graphs as gg  # noqa: E402


class _Noop:
    def replay(self):
        pass

    def pool(self):
        return None


gg.capture = lambda pool, fn: (_Noop(), None)
gg.on_side = lambda device, fn: None
torch.cuda.is_current_stream_capturing = lambda: False
E, H, F = 256, 4096, 2048
kern = MoEKernels("triton", E, F, torch.zeros(1, E, 3, dtype=torch.int64), [(39, 39)], 16, act_limit=10.0)
r = kern.route(torch.zeros(1, H), torch.arange(6)[None], torch.zeros(1, 6))
pool, g = torch.zeros(1 << 20, dtype=torch.uint8), Group(None, None, torch.full((E,), -1, dtype=torch.int64))
m = gg.GroupGraphs(kern, 8)
for _ in range(3):                    # launch (stand-in), capture (stand-in), replay
    m.apply(r, 0, pool, g, 13_369_344)
ts = []
for _ in range(20000):
    t = time.perf_counter()
    m.apply(r, 0, pool, g, 13_369_344)
    ts.append(time.perf_counter() - t)
print(f"GroupGraphs.apply, replay of a no-op: {statistics.median(ts) * 1e6:.2f} us median; {m.stats()}")
