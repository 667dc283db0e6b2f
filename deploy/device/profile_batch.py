#!/usr/bin/env python3
"""Where a batched decode pass spends its wall time, 1 vs N sequences, on the GPU machine.

    python3 deploy/device/profile_batch.py MODEL.gguf [--clients 1,8] [--prompt 32] [--steps 10]
                                           [--backing on,off] [--memory-max 12G] [--vram-budget 12GiB]

The real expert-store process (gRPC, shared arena) and a ModelRunner in this process, both in a cgroup of
`memory_max` (no swap) as in the bench, the slots planned for it and `vram_budget`. For each
vram_backing setting and each N: N distinct prompts are prefilled (cold, then consolidated), the sequences
decode together (runner.decode_batch; N = 1 also through runner.forward, the solo path with CUDA graphs), and
per pass it prints: wall ms, disk wait ms, other blocked ms (syncs, copies), host ms, expert applications per
tier, disk MB, store round trips, the per-sequence dense part (attention, routing, head: host enqueue ms) and
the MoE part; then one pass under torch.profiler: kernels launched and GPU busy ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import _common  # first: puts this checkout on sys.path
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.gc_pauses import GcPauses, freeze
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.settings import parse_size
from betelgeuse.worker import graphs
from services.assembly import open_runner, open_store
from services.bench.procs import BenchCgroup, mkdir


def summary(sts) -> dict:
    n = len(sts)
    tot = lambda f: sum(f(s) for s in sts) / n   # noqa: E731
    return {"passes": n, "batch": sts[0].n_tokens,
            "wall_ms": tot(lambda s: s.seconds) * 1e3,
            "disk_wait_ms": tot(lambda s: s.disk_wait_s) * 1e3,
            "other_blocked_ms": tot(lambda s: s.blocked_s - s.disk_wait_s) * 1e3,
            "host_ms": tot(lambda s: s.host_s) * 1e3,
            "dense_ms": tot(lambda s: sum(x.attn_s for x in s.layers)) * 1e3,
            "moe_ms": tot(lambda s: sum(x.moe_s for x in s.layers)) * 1e3,
            "vram": tot(lambda s: s.reads["vram"]), "host": tot(lambda s: s.reads["host"]),
            "disk": tot(lambda s: s.reads["disk"]), "disk_MB": tot(lambda s: s.disk_bytes) / 1e6,
            "store_calls": tot(lambda s: s.store_calls)}


def kernels_of(fn, top: int = 0) -> dict:
    """One pass under torch.profiler: kernels launched, GPU busy ms; top > 0 also prints the top kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in ev) / 1e3
    if top:
        by: dict = {}
        for e in ev:
            n, t = by.get(e.name, (0, 0.0))
            by[e.name] = (n + 1, t + e.device_time / 1e3)
        print("    GPU time by kernel (count, ms):")
        for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"      {t:8.2f} ms {n:6d}x  {name[:110]}")
    return {"kernels": len(ev), "gpu_busy_ms": busy}


def host_profile(fn, top: int):
    """One pass under cProfile: the host's time by function (tottime and cumulative), top entries."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
        text = buf.getvalue()
        print(f"    host profile by {key}:\n" + "\n".join("      " + ln for ln in text.splitlines()[6:] if ln.strip()))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("model")
    a.add_argument("--clients", default="1,8")
    a.add_argument("--prompt", type=int, default=32)
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--warm-steps", type=int, default=4)
    a.add_argument("--backing", default="on,off")
    a.add_argument("--memory-max", default="12G")
    a.add_argument("--vram-budget", default="12GiB")
    a.add_argument("--run-dir", default="/var/tmp/betelgeuse-profile")
    a.add_argument("--device", default="cuda", help="cpu: checks this script on a small model")
    a.add_argument("--preset", default="bench", help="the synth preset written when MODEL does not exist")
    a.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                   help="freeze the objects alive after the runner opens, as the worker does once ready")
    a.add_argument("--trace", action="store_true", help="one line per measured pass (wall, disk, VRAM fills)")
    a.add_argument("--top", type=int, default=0, help="> 0: for the largest N, the top kernels and a cProfile")
    o = a.parse_args()
    clients = [int(x) for x in o.clients.split(",")]
    mem, vram = parse_size(o.memory_max), parse_size(o.vram_budget)
    if not Path(o.model).exists():                   # the benchmark geometry, written here (~40 s on the device)
        from betelgeuse.gguf.synth import spec_from_preset
        _common.synth_if_missing(o.model, spec_from_preset(o.preset), say="wrote {path} in {secs:.0f} s")
    cg = BenchCgroup(mem, True)                      # both processes in memory.max (the store plans against it)
    print(f"cgroup: {cg.cg.path if cg.cg else cg.reason}", flush=True)
    try:
        run(o, clients, mem, vram)
    finally:
        cg.close()


def run(o, clients, mem, vram):
    V = GGUFModelFile.open(o.model).config.n_vocab
    g = torch.Generator().manual_seed(0)
    results = []
    pauses = GcPauses().start()         # each traced pass's collection pauses (betelgeuse/gc_pauses.py)
    for backing in [x == "on" for x in o.backing.split(",")]:
        cfg = EngineConfig(model_path=o.model, device=o.device, vram_slots="auto", host_slots="auto", vram_budget=vram,
                           memory_max=mem, vram_backing=backing, max_running=max(clients),
                           max_context=o.prompt + o.steps + o.warm_steps + 64, prefix_cache_bytes=0)
        store = open_store(cfg, "process", str(mkdir(o.run_dir) / f"store-b{int(backing)}"), timeout=300.0)
        rn = open_runner(cfg, store)
        p = rn.plan
        if o.gc_freeze == "on":
            print(f"  gc: {freeze()} objects frozen", flush=True)
        print(f"\n== vram_backing={backing}: {p.n_vram} VRAM + {p.n_host} host slots per layer, "
              f"{p.n_staging} staging", flush=True)
        try:
            for n in clients:
                prompts = [torch.randint(3, V, (o.prompt,), generator=g).tolist() for _ in range(n)]
                kvs, toks = [], []
                t = time.perf_counter()
                for ids in prompts:
                    kv = rn.new_cache()
                    lg, _ = rn.forward(ids, kv)
                    kvs.append(kv), toks.append(int(lg[-1].argmax()))
                print(f"  N={n}: prefilled {n} x {o.prompt} tokens in {time.perf_counter() - t:.1f} s", flush=True)
                paths = [("batch", None)] + ([("solo", None)] if n == 1 else [])
                for name, _ in paths:
                    sts = []
                    for i in range(o.warm_steps + o.steps):
                        gc0, full0, cap0 = pauses.total_s(), pauses.count[2], graphs.CAPTURED[0]
                        if name == "solo":
                            lg, st = rn.forward([toks[0]], kvs[0], consolidate=False)
                        else:
                            lg, st = rn.decode_batch(toks, kvs)
                        toks = [int(x.argmax()) for x in lg]
                        if i >= o.warm_steps:
                            sts.append(st)
                            if o.trace:
                                print(f"      pass {i}: {st.seconds * 1e3:.1f} ms, disk wait {st.disk_wait_s * 1e3:.1f} ms, "
                                      f"blocked {st.blocked_s * 1e3:.1f} ms, reads {st.reads}, disk "
                                      f"{st.disk_bytes / 1e6:.1f} MB, pass open {st.open_s * 1e3:.1f} ms, vram filled {st.vram_filled}, "
                                      f"store calls {st.store_calls}, gc {(pauses.total_s() - gc0) * 1e3:.1f} ms "
                                      f"({pauses.count[2] - full0} full), graphs captured "
                                      f"{graphs.CAPTURED[0] - cap0}", flush=True)
                    s = summary(sts)
                    s.update(backing=backing, n=n, path=name, slots=f"{p.n_vram}+{p.n_host}")

                    def one():
                        nonlocal toks
                        if name == "solo":
                            lg, _ = rn.forward([toks[0]], kvs[0], consolidate=False)
                        else:
                            lg, _ = rn.decode_batch(toks, kvs)
                        toks = [int(x.argmax()) for x in lg]
                    top = o.top if n == max(clients) else 0
                    s.update(kernels_of(one, top) if o.device == "cuda" else {"kernels": 0, "gpu_busy_ms": 0.0})
                    if top:
                        host_profile(one, top)
                    s["tok_per_s"] = n * 1e3 / s["wall_ms"]
                    results.append(s)
                    print("   ", name, " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in s.items()), flush=True)
                rn.consolidate()
                rn.settle()
        finally:
            rn.close()                         # drops its views of the arena: unmapped before the next store starts
            del rn
            gc.unfreeze()                      # what was frozen with it is collectable again
            gc.collect()
            store.close()
    cols = ["backing", "slots", "n", "path", "tok_per_s", "wall_ms", "disk_wait_ms", "other_blocked_ms", "host_ms",
            "dense_ms", "moe_ms", "vram", "host", "disk", "disk_MB", "store_calls", "kernels", "gpu_busy_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        Path(out, "profile_batch.md").write_text("\n".join(lines) + "\n")
        Path(out, "profile_batch.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
