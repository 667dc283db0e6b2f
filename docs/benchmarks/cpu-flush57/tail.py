"""flush57's CPU measure: a decode miss layer's tail (its last disk expert handed over -> its last disk group done)
with engine.disk_flush_early off and on, under the store's test-only read jitter (reads land apart, as a slow disk's).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 docs/benchmarks/cpu-flush57/tail.py [--reps 3] [--tokens 24]
        [--jitter 7:20] [--ff 1024] [--vram 1 --host 2] [--form solo|default]

A qwen3moe synth (4 layers, 32 experts, top-4, width 256, expert FFN --ff, Q8_0: ~0.8 MB an expert at 1024) in an
in-process store (its own ready(): the load's landing queue), prefilled, consolidated and settled, then `--tokens`
greedy decode steps with the pass clock's marks on (PassStats.gpu_marks: CPU host stamps; landed: the last disk
expert of each layer handed to the worker). Per decode layer with at least two disk experts: tail_ms = its last
"group" mark less its `landed` stamp, i.e. the copies and group that run after the last read (what the early flush
moves before it); per run the mean wall per token, disk_flushes per token, groups per miss layer, host us per
expert application and a hash of every step's logits (the same on both sides: the setting changes no bit).
Runs alternate off / on `--reps` times (2 shared cores here: the spread between reps is the noise).
On the CPU a copy is a memcpy and a group the torch kernels' compute, both synchronous on the host; on CUDA both
are asynchronous, so this is the overlap's shape, not the device's figure (docs/benchmarks/cpu-flush57/README.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _model(tmp: Path, ff: int) -> Path:
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = tmp / f"flush57-{ff}.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=32,
                              n_expert_used=4, n_ff_exp=ff, n_vocab=320, context_length=512, router_skew=0.5,
                              seed=11, qtype="Q8_0"), progress=False)
    return path


def run(path: Path, on: bool, a) -> dict:
    from betelgeuse.assembly import open_runner, open_store
    from betelgeuse.config import EngineConfig
    cfg = EngineConfig(model_path=str(path), vram_slots=a.vram, host_slots=a.host, read_threads=2,
                       host_in_place="never", decode_consolidate_every=0, disk_flush_early=on)
    store = open_store(cfg)
    assert store.store.reader.jitter is not None, "no jitter: set --jitter"
    rn = open_runner(cfg, store)
    try:
        ids = [int(x) for x in np.random.default_rng(4).integers(3, 320, 40)]
        kv = rn.new_cache(40 + a.tokens + 8)
        lg, _ = rn.forward(ids, kv)
        rn.settle()
        rn._static_decode = a.form == "solo"
        rn.gpu_marks = True
        tok, sha = int(lg[-1].argmax()), hashlib.sha256()
        walls, tails, groups, flushes, host_s, apps = [], [], [], 0, 0.0, 0
        for i in range(a.tokens):
            t = time.perf_counter()
            lg, st = rn.forward([tok], kv, consolidate=False)
            wall = time.perf_counter() - t
            tok = int(lg[-1].argmax())
            sha.update(lg.float().numpy().tobytes())
            if i < 2:                                   # the first steps: warm-up
                continue
            walls.append(wall)
            flushes += st.disk_flushes
            host_s += st.host_s
            apps += st.applications
            landed = dict((l, ta) for ta, l in st.landed)
            last_group = {}
            for tm, l, name in st.gpu_marks:
                if name == "group":
                    last_group[l] = max(tm, last_group.get(l, tm))
            for l, ls in enumerate(st.layers):
                if ls.disk >= 2 and l in landed and l in last_group:
                    tails.append(last_group[l] - landed[l])
                    groups.append(ls.groups)
        n = len(walls)
        return {"on": on, "tokens": n, "wall_ms": round(sum(walls) / n * 1e3, 2),
                "tail_ms_median": round(statistics.median(tails) * 1e3, 3) if tails else None,
                "tail_ms_mean": round(statistics.mean(tails) * 1e3, 3) if tails else None,
                "layers_2plus_disk": len(tails), "groups_per_such_layer": round(statistics.mean(groups), 2) if groups
                else None, "disk_flushes_per_token": round(flushes / n, 2),
                "host_us_per_application": round(host_s / max(1, apps) * 1e6, 1),
                "logits_sha256": sha.hexdigest()[:16]}
    finally:
        rn.close()
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--jitter", default="7:20", help="BETELGEUSE_TEST_READ_JITTER: SEED:MAX_MS a read is held back")
    p.add_argument("--ff", type=int, default=1024, help="expert FFN width (the expert's bytes and compute)")
    p.add_argument("--vram", type=int, default=1)
    p.add_argument("--host", type=int, default=2)
    p.add_argument("--form", default="solo", choices=["solo", "default"])
    a = p.parse_args()
    os.environ["BETELGEUSE_TEST_READ_JITTER"] = a.jitter
    with tempfile.TemporaryDirectory(prefix="flush57-") as d:
        path = _model(Path(d), a.ff)
        rows = []
        for _ in range(a.reps):
            for on in (False, True):
                rows.append(run(path, on, a))
                print(json.dumps(rows[-1]), flush=True)
    for on in (False, True):
        rs = [r for r in rows if r["on"] == on]
        print(("on " if on else "off"), "median of reps: wall_ms", statistics.median(r["wall_ms"] for r in rs),
              "tail_ms_median", statistics.median(r["tail_ms_median"] for r in rs),
              "host_us_per_application", statistics.median(r["host_us_per_application"] for r in rs))
    return 0 if len({r["logits_sha256"] for r in rows}) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
