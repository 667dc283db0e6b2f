#!/usr/bin/env python3
"""Where decode's guessed reads ahead go (worker/guess.py), through a real store process: used, wasted, dropped.

    python3 deploy/device/guess_waste.py [MODEL.gguf] [--device cpu|cuda] [--slots 2+6] [--depth 3] [--prompt 24]
                                         [--decode 24] [--prompts 1] [--jitter 7:4] [--read-threads 2] [--min-hit X]
                                         [--batch 1] [--rule rows[,ranks,union]] [--preset tiny] [--experts 32]

A `services.store_main` child (gRPC on a Unix socket, as served), `--prompts` rounds of `--batch` prompts, each round
prefilled, then greedy decode one token at a time (B = 1: a lone stream, runner.forward, the device bench's decode;
B > 1: all B together, runner.decode_batch) with `prefetch_depth` layers guessed ahead, the guesses budgeted by
`--rule` (prefetch_batch_rule). Several rules (`--rule rows,ranks`): the same decode once per rule, each on a fresh
store and runner, side by side in one run, and whether their logits are the same bits (a guess only moves bytes
earlier: they must be). Without MODEL a synth model is written (`--preset`): `tiny`, an 8-layer qwen3moe
(`--experts` experts, 4 used, a skewed router), or `ds4-tiny` / `ds4-wide` (deepseek4, Q8_0 experts: 8 experts
top-2, or ds4-flash's 256 top-6 over ds4-tiny's dims; random routers, as the device bench's synth ds4-flash);
few slots: decode misses. `--jitter SEED:MS` slows the store's reads (store/reader.py Jitter: each piece up to MS
late), so that on a page-cache file reads queue as on a busy disk (off: `--jitter ""`).

Prints per rule one line of `key=value` figures: decode tok/s (tokens of all rows); the decode passes' guess counts
(guessed, hits, bytes read ahead, wasted, held) and the bench's totals (hit_rate = hits / guessed, recall = hits /
disk experts of the guessed layers, needed_read = expert bytes the decode loaded from disk / expert bytes the store
read: the issue-21 product's last factor, over payload bytes, as a tiny model's page rounding would swamp it); the
store's counters (deltas over the decodes, read once their reads in flight landed, before any consolidation): disk
bytes, reads ahead started / dropped before starting / promoted to demand / evicted unused, bytes read ahead that no
load took, demand reads' mean queue wait (ms) — counters an older store lacks print as `-`; then one line per depth
of the decode's guesses by class (guess.CLASS_NAMES: lone = a lone stream's under rows, lone-r1 / lone-r2-3 /
lone-r4+ its guesses by rank under ranks; in a batch one row's non-top-1 guess, one row's top-1, two rows, more):
guessed on disk, the hit rate (used / guessed), the share read ahead, the MB read ahead and not used by their layer.
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

STATUS = ("disk_bytes", "disk_payload_bytes", "demand_loads", "staged_hits", "readahead_reads", "readahead_wasted",
          "readahead_dropped", "readahead_promoted", "readahead_skipped", "readahead_bytes", "readahead_used",
          "demand_wait_s", "demand_started")
PASS = ("guessed", "guess_hits", "guess_disk", "prefetched", "guess_bytes", "guess_wasted_bytes", "guess_held",
        "disk_bytes", "store_wait_s")
LAND_S = 0.5        # after the decode: the reads ahead still in flight land before the store's counters are read


def synth_model(d: Path, preset: str, n_expert: int = 32) -> Path:
    """The synth model of `preset` (module doc) written into d: ds4-tiny / ds4-wide as decode_host.py writes them."""
    if preset != "tiny":
        from decode_host import _model
        return _model(preset, d)
    from dataclasses import replace
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = d / "guess-waste.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=8, n_embd=64, n_expert=n_expert, n_expert_used=4, n_ff_exp=128,
                              n_vocab=320, router_skew=0.5, seed=3, qtype="Q8_0"), progress=False)
    return path


def run(a, model: str, rule: str, tmp: Path) -> tuple[dict, tuple, list]:
    """One decode under `rule` on a fresh store and runner -> (the figures, the decode's per-(depth, class) tables
    [4, D, C]: guessed on disk, used, read ahead, bytes read ahead unused; every decode step's logits)."""
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    vram, host = _common.slot_pair(a.slots)
    extra = {} if a.min_hit is None else {"prefetch_min_hit": a.min_hit}
    cfg = EngineConfig(model_path=model, device=a.device, vram_slots=vram, host_slots=host, read_threads=a.read_threads,
                       prefetch_decode=True, prefetch_depth=a.depth, decode_consolidate_every=0,
                       prefetch_batch_rule=rule, max_running=a.batch, **extra)
    store = open_store(cfg, "process", str(tmp / f"store-{rule}"), timeout=120.0)
    tot, logits, wall, classes = dict.fromkeys(PASS, 0.0), [], 0.0, 0
    d: dict = dict.fromkeys(STATUS, 0.0)    # the store's counters over the rounds' decodes (None: this store lacks it)
    try:
        rn = open_runner(cfg, store)
        for r in range(a.prompts):
            prompts = [[int(x) for x in np.random.default_rng(5 + r * a.batch + i).integers(3, rn.mcfg.n_vocab,
                                                                                          a.prompt)]
                       for i in range(a.batch)]
            kvs = [rn.new_cache(a.prompt + a.decode + 8) for _ in prompts]
            toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
            rn.settle()
            g = rn.moe.guesser
            c0 = np.stack([g.class_tries, g.class_hits, g.class_read, g.class_unused_bytes])    # [4, D, C]
            st0 = store.client.status()
            t = time.perf_counter()
            for _ in range(a.decode):
                if a.batch == 1:
                    lg, st = rn.forward(toks, kvs[0], consolidate=False)
                    lg = lg[-1:]
                else:
                    lg, st = rn.decode_batch(toks, kvs)
                logits.append(lg.detach().cpu().clone())
                toks = [int(x) for x in lg.argmax(-1)]
                for k in PASS:
                    tot[k] += getattr(st, k)
            wall += time.perf_counter() - t
            time.sleep(LAND_S)
            st1 = store.client.status()
            # the decode's own (a short prefill guesses too: its rows' classes, not these)
            classes = classes + np.stack([g.class_tries, g.class_hits, g.class_read, g.class_unused_bytes]) - c0
            d = {k: None if k not in st1 or d[k] is None else d[k] + st1[k] - st0[k] for k in STATUS}
            for kv in kvs:
                rn.request_done(kv, others_running=False)
            rn.settle()
        rn.close()
    finally:
        store.close()
    out = {"batch": a.batch, "rule": rule, "tok_s": a.decode * a.batch * a.prompts / wall, **{k: tot[k] for k in PASS},
           "hit_rate": tot["guess_hits"] / tot["guessed"] if tot["guessed"] else None,
           "recall": tot["guess_hits"] / tot["guess_disk"] if tot["guess_disk"] else None,
           "needed_read": tot["disk_bytes"] / d["disk_payload_bytes"] if d["disk_payload_bytes"] else None,
           **{f"store_{k}": v for k, v in d.items()}}
    if d["demand_started"]:
        out["demand_wait_ms_mean"] = d["demand_wait_s"] / d["demand_started"] * 1e3
    if d["readahead_bytes"] is not None:
        out["store_readahead_unused_bytes"] = d["readahead_bytes"] - d["readahead_used"]
    return out, classes, logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="2+6", slots_help=_common.FEW_SLOTS, device="cpu", model_optional=True)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=1, help="rounds, each of --batch prompts prefilled and decoded")
    ap.add_argument("--jitter", default="7:4", help="SEED:MS slow reads in the store ('' = off)")
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--min-hit", type=float, default=None, help="prefetch_min_hit (where the engine has it)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (1: one alone)")
    ap.add_argument("--rule", default="rows", help="prefetch_batch_rule, or several comma-separated side by side: "
                                                   "rows | ranks | union")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "ds4-tiny", "ds4-wide"],
                    help="the synth model written without MODEL")
    ap.add_argument("--experts", type=int, default=32, help="the tiny model's experts per layer (without MODEL)")
    a = ap.parse_args()
    if a.jitter:
        os.environ["BETELGEUSE_TEST_READ_JITTER"] = a.jitter        # the store child inherits it
    import torch
    from betelgeuse.worker.guess import CLASS_NAMES
    tmp = Path(tempfile.mkdtemp(prefix="guess-waste-"))
    model = a.model or str(synth_model(tmp, a.preset, a.experts))
    first = None
    for rule in a.rule.split(","):
        out, (tries, hits, read, unused), logits = run(a, model, rule, tmp)
        print(" ".join(f"{k}={'-' if v is None else (f'{v:.3g}' if isinstance(v, float) else v)}"
                       for k, v in out.items()))
        for d in range(tries.shape[0]):
            print(f"  depth={d + 1} " + " ".join(
                f"{name}={tries[d, c]}:{hits[d, c] / max(tries[d, c], 1):.2f}:{read[d, c] / max(tries[d, c], 1):.2f}:"
                f"{unused[d, c] / 1e6:.2f}" for c, name in enumerate(CLASS_NAMES) if tries[d, c])
                + "   (class=guessed:hit rate:share read ahead:MB read ahead unused)")
        if first is None:
            first = (rule, logits)
        else:
            same = len(logits) == len(first[1]) and all(torch.equal(x, y) for x, y in zip(logits, first[1]))
            print(f"bits_equal {rule} vs {first[0]}: {'yes' if same else 'NO'} ({len(logits)} decode steps)")
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
