#!/usr/bin/env python3
"""Where decode's guessed reads ahead go (worker/guess.py), through a real store process: used, wasted, dropped.

    python3 deploy/device/guess_waste.py [MODEL.gguf] [--device cpu|cuda] [--slots 2+6] [--depth 3] [--prompt 24]
                                         [--decode 24] [--jitter 7:4] [--read-threads 2] [--min-hit X]
                                         [--batch 1] [--rule rows|union] [--experts 32]

A `services.store_main` child (gRPC on a Unix socket, as served), `--batch` prompts, greedy decode one token at a time
(B = 1: runner.forward; B > 1: all B together, runner.decode_batch) with `prefetch_depth` layers guessed ahead and a
batch's guesses read ahead by `--rule` (prefetch_batch_rule). Without MODEL a tiny 8-layer qwen3moe synth model is
written (`--experts` experts, 4 used, a skewed router; few slots: decode misses). `--jitter SEED:MS` slows the store's
reads (store/reader.py Jitter: each piece up to MS late), so that on a page-cache file reads queue as on a busy disk
(off: `--jitter ""`). Prints one line of `key=value` figures: decode tok/s (tokens of all rows); the passes' guess
counts (guessed, hits, bytes read ahead, wasted); the store's (status deltas): disk bytes, reads ahead started /
dropped before starting / promoted to demand / evicted unused, bytes read ahead that no load took, demand reads' mean
queue wait (ms) — counters an older store lacks print as `-`; then one line per (depth, class) of the guesses
(guess.CLASS_NAMES: lone = one running row; in a batch, one row's non-top-1 guess, one row's top-1, two rows, more):
guessed on disk, the hit rate (used / guessed), the share read ahead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import _common  # first: puts this checkout on sys.path
import numpy as np

STATUS = ("disk_bytes", "demand_loads", "staged_hits", "readahead_reads", "readahead_wasted", "readahead_dropped",
          "readahead_promoted", "readahead_skipped", "readahead_bytes", "readahead_used", "demand_wait_s",
          "demand_started")
PASS = ("guessed", "guess_hits", "guess_disk", "prefetched", "guess_bytes", "guess_wasted_bytes", "disk_bytes",
        "store_wait_s")


def tiny_model(d: Path, n_expert: int = 32) -> Path:
    from dataclasses import replace
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = d / "guess-waste.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=8, n_embd=64, n_expert=n_expert, n_expert_used=4, n_ff_exp=128,
                              n_vocab=320, router_skew=0.5, seed=3, qtype="Q8_0"), progress=False)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="2+6", slots_help=_common.FEW_SLOTS, device="cpu", model_optional=True)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--jitter", default="7:4", help="SEED:MS slow reads in the store ('' = off)")
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--min-hit", type=float, default=None, help="prefetch_min_hit (where the engine has it)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (1: one alone)")
    ap.add_argument("--rule", default="rows", help="prefetch_batch_rule: rows | union")
    ap.add_argument("--experts", type=int, default=32, help="the tiny model's experts per layer (without MODEL)")
    a = ap.parse_args()
    if a.jitter:
        os.environ["BETELGEUSE_TEST_READ_JITTER"] = a.jitter        # the store child inherits it
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    tmp = Path(tempfile.mkdtemp(prefix="guess-waste-"))
    model = a.model or str(tiny_model(tmp, a.experts))
    vram, host = _common.slot_pair(a.slots)
    extra = {} if a.min_hit is None else {"prefetch_min_hit": a.min_hit}
    cfg = EngineConfig(model_path=model, device=a.device, vram_slots=vram, host_slots=host, read_threads=a.read_threads,
                       prefetch_decode=True, prefetch_depth=a.depth, decode_consolidate_every=0,
                       prefetch_batch_rule=a.rule, max_running=a.batch, **extra)
    store = open_store(cfg, "process", str(tmp / "store"), timeout=120.0)
    try:
        rn = open_runner(cfg, store)
        prompts = [[int(x) for x in np.random.default_rng(5 + i).integers(3, rn.mcfg.n_vocab, a.prompt)]
                   for i in range(a.batch)]
        kvs = [rn.new_cache(a.prompt + a.decode + 8) for _ in prompts]
        toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
        rn.settle()
        s0 = store.client.status()
        tot = dict.fromkeys(PASS, 0.0)
        t = time.perf_counter()
        for _ in range(a.decode):
            if a.batch == 1:
                lg, st = rn.forward(toks, kvs[0], consolidate=False)
                lg = lg[-1:]
            else:
                lg, st = rn.decode_batch(toks, kvs)
            toks = [int(x) for x in lg.argmax(-1)]
            for k in PASS:
                tot[k] += getattr(st, k)
        wall = time.perf_counter() - t
        for kv in kvs:
            rn.request_done(kv, others_running=False)
        rn.settle()
        s1 = store.client.status()
        g = rn.moe.guesser
        classes = (g.class_tries.copy(), g.class_hits.copy(), g.class_read.copy())
        rn.close()
    finally:
        store.close()
    d = {k: (s1[k] - s0[k] if k in s1 else None) for k in STATUS}
    out = {"batch": a.batch, "rule": a.rule, "tok_s": a.decode * a.batch / wall, **{k: tot[k] for k in PASS},
           **{f"store_{k}": v for k, v in d.items()}}
    if d["demand_started"]:
        out["demand_wait_ms_mean"] = d["demand_wait_s"] / d["demand_started"] * 1e3
    if d["readahead_bytes"] is not None:
        out["store_readahead_unused_bytes"] = d["readahead_bytes"] - d["readahead_used"]
    print(" ".join(f"{k}={'-' if v is None else (f'{v:.3g}' if isinstance(v, float) else v)}" for k, v in out.items()))
    from betelgeuse.worker.guess import CLASS_NAMES
    tries, hits, read = classes
    for d in range(tries.shape[0]):
        print(f"depth={d + 1} " + " ".join(
            f"{name}={tries[d, c]}:{hits[d, c] / max(tries[d, c], 1):.2f}:{read[d, c] / max(tries[d, c], 1):.2f}"
            for c, name in enumerate(CLASS_NAMES) if tries[d, c]) + "   (class=guessed:hit rate:share read ahead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
