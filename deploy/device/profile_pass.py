#!/usr/bin/env python3
"""Where a warm prefill pass and a decode step spend host time (cProfile) on the GPU, all experts in VRAM.

    python3 deploy/device/profile_pass.py MODEL.gguf [--tokens 64] [--decode 24] [--warm-tokens 512] [--warm-rounds 12]

vram_slots = n_expert makes room for every expert, but the residency policy places only experts a pass has used
(store/residency.py): a 64-token prompt uses ~39 of the bench geometry's 128 per layer, so the others stay on disk,
no layer is wholly in VRAM, and decode takes the host-synced partial path and reads them from disk. So the warm-up
runs prefill passes of random `--warm-tokens` prompts (each consolidated and settled) until every layer is wholly in
VRAM (at most --warm-rounds), and the report says how many layers are, and the store's disk bytes during decode.
Then --decode greedy steps: their times (the second half's mean is the one to compare), the layers that took the
host-synced path, the expert-kernel launches per such layer (kernels/triton_launch.py COUNTS) and cProfile over the
second half.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time

import _common  # noqa: F401  (first: puts this checkout on sys.path)
import torch

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.kernels import triton_launch

a = argparse.ArgumentParser()
a.add_argument("model")
a.add_argument("--tokens", type=int, default=64)
a.add_argument("--decode", type=int, default=24)
a.add_argument("--warm-tokens", type=int, default=512)
a.add_argument("--warm-rounds", type=int, default=12)
a.add_argument("--device", default="cuda")
o = a.parse_args()
with GGUFModelFile.open(o.model) as f:
    c = f.config
cfg = EngineConfig(model_path=o.model, device=o.device, vram_slots=c.n_expert, host_slots=0, vram_budget=100 << 30)
opened = open_store(cfg)
store = opened.store
rn = open_runner(cfg, opened)
ids = torch.randint(0, c.n_vocab, (o.tokens,)).tolist()
rn.forward(ids, rn.new_cache(o.tokens + 8))
rn.settle()
rn.forward(ids, rn.new_cache(o.tokens + 8))          # fills VRAM, consolidates the rest
rn.settle()
print(f"after the {o.tokens}-token prompt: {int(rn.cache.all_vram.sum())} of {c.n_layer} layers wholly in VRAM, "
      f"tiers {store.tier_counts()}")
rounds = 0
while not rn.cache.all_vram.all() and rounds < o.warm_rounds:     # until every expert has been used and placed
    rn.forward(torch.randint(0, c.n_vocab, (o.warm_tokens,)).tolist(), rn.new_cache(o.warm_tokens + 8))
    rn.settle()
    rounds += 1
print(f"after {rounds} warm-up passes of {o.warm_tokens} tokens: {int(rn.cache.all_vram.sum())} of {c.n_layer} "
      f"layers wholly in VRAM, tiers {store.tier_counts()}")
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
partials = [0]
_partial = rn.moe.partial


def counted_partial(*args, **kw):          # the host-synced path of a layer not wholly in VRAM (eager or graphs)
    partials[0] += 1
    return _partial(*args, **kw)


rn.moe.partial = counted_partial


def decode():
    """--decode greedy steps after the prompt; cProfile over the second half. -> the last logits."""
    kv = rn.new_cache(o.tokens + o.decode + 8)
    lg, _ = rn.forward(ids, kv, consolidate=False)
    times, disk = [], {"vram": 0, "host": 0, "disk": 0}
    partials[0] = 0
    n0, d0 = sum(triton_launch.COUNTS.values()), store.status()["disk_bytes"]
    pr = cProfile.Profile()
    for i in range(o.decode):
        if i == o.decode // 2:
            pr.enable()
        t = time.perf_counter()
        lg, st = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
        times.append(time.perf_counter() - t)
        disk = {k: disk[k] + v for k, v in st.reads.items()}
    pr.disable()
    half = times[o.decode // 2:]
    print("decode step ms:", " ".join(f"{x * 1e3:.1f}" for x in times),
          f"| second half mean {sum(half) / len(half) * 1e3:.2f}")
    n = sum(triton_launch.COUNTS.values()) - n0
    print(f"decode: {partials[0]} host-synced layers of {o.decode * c.n_layer}, reads {disk}, store disk bytes "
          f"{store.status()['disk_bytes'] - d0}; expert-kernel launches {n} ({n / max(1, partials[0]):.2f} per "
          f"host-synced layer)")
    top(pr)
    rn.release(kv)
    return lg


lg = decode()
if o.device == "cpu":
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    rn.forward([int(lg[-1].argmax())], rn.new_cache(o.tokens + 8), consolidate=False)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
