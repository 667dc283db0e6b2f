#!/usr/bin/env python3
"""Where a warm prefill pass and a decode step spend host time (cProfile) on the GPU, all experts in VRAM.

    python3 deploy/device/profile_pass.py MODEL.gguf [--tokens 64] [--decode 24]
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from betelgeuse.assembly import open_runner, open_store  # noqa: E402
from betelgeuse.config import EngineConfig  # noqa: E402
from betelgeuse.gguf.reader import GGUFModelFile  # noqa: E402

a = argparse.ArgumentParser()
a.add_argument("model")
a.add_argument("--tokens", type=int, default=64)
a.add_argument("--decode", type=int, default=24)
o = a.parse_args()
with GGUFModelFile.open(o.model) as f:
    c = f.config
cfg = EngineConfig(model_path=o.model, device="cuda", vram_slots=c.n_expert, host_slots=0, vram_budget=100 << 30)
rn = open_runner(cfg, open_store(cfg))
ids = torch.randint(0, c.n_vocab, (o.tokens,)).tolist()
rn.forward(ids, rn.new_cache(o.tokens + 8))
rn.settle()
rn.forward(ids, rn.new_cache(o.tokens + 8))          # fills VRAM, consolidates the rest
rn.settle()
for _ in range(2):
    _, st = rn.forward(ids, rn.new_cache(o.tokens + 8), consolidate=False)
print(f"warm {o.tokens}-token pass: {st.seconds * 1e3:.1f} ms, host {st.host_s * 1e3:.1f} ms, reads {st.reads}")


def top(pr, n=22):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    print("\n".join(s.getvalue().splitlines()[:n + 12]))


pr = cProfile.Profile()
pr.enable()
_, st = rn.forward(ids, rn.new_cache(o.tokens + 8), consolidate=False)
pr.disable()
print(f"profiled warm pass {st.seconds * 1e3:.1f} ms")
top(pr)
kv = rn.new_cache(o.tokens + o.decode + 8)
lg, _ = rn.forward(ids, kv, consolidate=False)
times = []
pr = cProfile.Profile()
for i in range(o.decode):
    if i == o.decode // 2:
        pr.enable()
    t = time.perf_counter()
    lg, st = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
    times.append(time.perf_counter() - t)
pr.disable()
print("decode step ms:", " ".join(f"{x * 1e3:.1f}" for x in times))
top(pr)
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
