"""Where host->device copies sit relative to compute in one warm layer-major prefill (CUDA).

    python3 deploy/device/overlap.py [--layers 4] [--tokens 128]
Profiles the pass with torch.profiler and prints, per stream, the busy time of kernels and copies, the
fraction of copy time that overlaps kernels on another stream, and a short timeline around a copy."""
import argparse, json, os, tempfile
from dataclasses import replace

import _common  # first: puts this checkout on sys.path
from torch.profiler import ProfilerActivity, profile

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig
from betelgeuse.gguf.synth import PRESETS
from check_cuda import _union as union  # one interval union for both device scripts


def inter(a, b):
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--slots", default="5,15")
a = ap.parse_args()
path = str(_common.synth_if_missing(f"/var/tmp/overlap-bench-{a.layers}L.gguf",
                                    replace(PRESETS["bench"], n_layer=a.layers)))
vs, hs = _common.slot_pair(a.slots, ",")
cfg = EngineConfig(model_path=path, device="cuda", vram_slots=vs, host_slots=hs)
r = open_runner(cfg, open_store(cfg))
ids = list(range(100, 100 + a.tokens))
for _ in range(2):                                   # cold, then consolidate -> warm state
    r.forward(ids, r.new_cache(len(ids) + 4))
    r.settle()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    _, st = r.forward(ids, r.new_cache(len(ids) + 4), consolidate=False)
tp = os.path.join(tempfile.gettempdir(), "overlap-trace.json")
prof.export_chrome_trace(tp)
ev = [e for e in json.load(open(tp))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
streams = {}
for e in gpu:
    streams.setdefault((e["cat"], e.get("args", {}).get("stream")), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
print("reads", st.reads, f"{st.tok_per_s:.1f} tok/s", "copy_ms", round(sum(l.copy_ms for l in st.layers), 2),
      "compute_ms", round(sum(l.compute_ms for l in st.layers), 2))
for (cat, s), iv in sorted(streams.items(), key=lambda x: str(x[0])):
    u = union(iv)
    print(f"stream {s} {cat}: {len(iv)} events, busy {sum(e - b for b, e in u) / 1e3:.2f} ms")
h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")]
cs = {e.get("args", {}).get("stream") for e in h2d}
copy_u = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in h2d])
kern_u = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu
                if e["cat"] == "kernel" and e.get("args", {}).get("stream") not in cs])
tot = sum(e - b for b, e in copy_u)
print(f"H2D copies on streams {cs}: {len(h2d)} copies, {tot / 1e3:.2f} ms; overlapping kernels on other streams: "
      f"{inter(copy_u, kern_u) / 1e3:.2f} ms = {inter(copy_u, kern_u) / max(tot, 1e-9):.1%}")
big = sorted(h2d, key=lambda e: -float(e["dur"]))[:1]
if big:
    t0 = float(big[0]["ts"])
    near = sorted([e for e in gpu if abs(float(e["ts"]) - t0) < 300], key=lambda e: float(e["ts"]))[:16]
    for e in near:
        print(f"  {float(e['ts']) - t0:9.1f} us  +{float(e['dur']):7.1f}  stream {e.get('args', {}).get('stream')}  {e['cat']}  {e['name'][:60]}")
