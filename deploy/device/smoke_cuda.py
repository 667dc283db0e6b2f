"""Quick CUDA smoke of the out-of-core engine (in-process store): bit-identity across slot configs on the GPU,
pinned arena, and layer-major vs standard timing on a small model. Prints a table. Usage:
    python3 deploy/device/smoke_cuda.py [--preset tiny|small]"""
import argparse
import _common  # first: puts this checkout on sys.path
import torch
from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig
from betelgeuse.gguf.synth import PRESETS

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="small")
ap.add_argument("--device", default="cuda")
ap.add_argument("--tokens", type=int, default=64)
a = ap.parse_args()
path = str(_common.synth_if_missing(f"/var/tmp/bg-{a.preset}.gguf", PRESETS[a.preset],
                                    say="wrote {path} in {secs:.1f}s"))
ids = list(range(10, 10 + a.tokens))
rows = []
base = None
for vs, hs in [(0, 0), (5, 15), ("auto", "auto")]:
    cfg = EngineConfig(model_path=path, device=a.device, vram_slots=vs, host_slots=hs)
    store = open_store(cfg)
    r = open_runner(cfg, store)
    plan = r.plan
    for p in range(2):
        kv = r.new_cache(a.tokens + 4)
        logits, st = r.forward(ids, kv, all_logits=True)
        r.settle()
        if base is None:
            base = logits
        rows.append((f"{plan.n_vram}/{plan.n_host}", "layer_major", p, st.tok_per_s, st.reads, st.disk_bytes >> 20,
                     st.h2d_bytes >> 20, torch.equal(logits, base), r.cache.pinned))
    kv = r.new_cache(a.tokens + 4)
    logits, st = r.forward(ids, kv, all_logits=True, schedule="standard")
    rows.append((f"{plan.n_vram}/{plan.n_host}", "standard", 2, st.tok_per_s, st.reads, st.disk_bytes >> 20,
                 st.h2d_bytes >> 20, f"maxdiff {(logits - base).abs().max().item():.3g}", r.cache.pinned))
    r.close(); store.close()
print("| slots | schedule | pass | PP tok/s | reads | disk MiB | h2d MiB | bit-identical | pinned |")
print("|---|---|---|---|---|---|---|---|---|")
for row in rows:
    print("| " + " | ".join(str(x if not isinstance(x, float) else round(x, 1)) for x in row) + " |")
