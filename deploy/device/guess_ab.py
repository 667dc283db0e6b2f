#!/usr/bin/env python3
"""Decode without guesses and with the next D layers' guessed experts read ahead (worker/guess.py), side by side.

    python3 deploy/device/guess_ab.py MODEL.gguf [--device cpu|cuda] [--slots 4+8] [--prompt 64] [--decode 32]
                                       [--rounds 2] [--staging auto] [--depth 1,2,3]

The same prompt and greedy decode, `prefetch_decode` off, then on at each `prefetch_depth` of --depth, `rounds` times
(alternating, each a fresh store and runner in this process: real O_DIRECT reads, cold staging), decoded by
runner.forward one token at a time (the bench's decode; on CUDA the static solo decode with its graphs). Prints per
setting: decode tok/s, disk wait ms per token, disk MB per token, the disk's busy share of the decode's wall time
(reads in flight / wall: what guessing deeper should raise), the guesses (experts guessed on disk, hit rate = used /
guessed, recall = used / disk experts of guessed layers), bytes read ahead and wasted; and whether every setting's
decoded logits are the bits of off (they must be: a guess only changes when bytes arrive). Exit status 1 when not.

The depth A/B on a ds4-flash synth (deepseek4's default depth, model guess_depth; ~2 minutes on the H200: 6.9 GB
written, 8 fresh stores): 8 V4-Flash layers (3 hash-routed) of 64 experts, the slots in ds4-flash's auto ratio:

    python3 -m services.cli synth /var/tmp/g/f64.gguf --preset ds4-flash --experts 64 --no-progress
    python3 deploy/device/guess_ab.py /var/tmp/g/f64.gguf --device cuda --slots 12+22 --prompt 32 --decode 32 \
        --rounds 2 --depth 1,2,3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _common  # first: puts this checkout on sys.path
import numpy as np
import torch

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig

FIELDS = ("guessed", "guess_hits", "guess_disk", "guess_bytes", "guess_wasted_bytes")


def one(a, depth: int) -> tuple[torch.Tensor, dict]:
    """One fresh store and runner guessing `depth` layers ahead (0: off) -> (decoded logits, totals)."""
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       prefetch_decode=depth > 0, prefetch_depth=max(depth, 1), decode_consolidate_every=0,
                       **({} if a.staging == "auto" else {"staging_slots": int(a.staging)}))
    store = open_store(cfg)
    rn = open_runner(cfg, store)
    try:
        n_vocab = rn.mcfg.n_vocab
        ids = [int(x) for x in np.random.default_rng(a.seed).integers(3, n_vocab, a.prompt)]
        kv = rn.new_cache(a.prompt + a.decode + 8)
        lg, _ = rn.forward(ids, kv)
        rn.settle()
        tok = int(lg[-1].argmax())
        out, tot = [], dict.fromkeys(("seconds", "disk_wait_s", "disk_bytes", *FIELDS), 0.0)
        active0 = rn.store.status()["disk_active_seconds"]
        for _ in range(a.decode):
            t = time.perf_counter()
            lg, st = rn.forward([tok], kv, consolidate=False)
            tot["seconds"] += time.perf_counter() - t
            out.append(lg[-1:].float().cpu())
            tok = int(lg[-1].argmax())
            for k in tot:
                if k != "seconds":
                    tot[k] += getattr(st, k)
        tot["disk_active_s"] = rn.store.status()["disk_active_seconds"] - active0
        return torch.cat(out), tot
    finally:
        rn.close()
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="4+8", slots_help=_common.FEW_SLOTS)
    ap.add_argument("--staging", default="auto")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--depth", default="1", help="prefetch_depth settings to run beside off, e.g. 1,2,3")
    a = ap.parse_args()
    try:
        depths = [int(x) for x in a.depth.split(",")]
        assert depths and all(d >= 1 for d in depths)
    except (ValueError, AssertionError):
        ap.error(f"--depth: expected layer counts >= 1 like 1,2,3, got {a.depth!r}")
    settings = [0, *depths]
    runs = {d: [] for d in settings}
    logits = {}
    for _ in range(a.rounds):
        for d in settings:
            lg, tot = one(a, d)
            runs[d].append(tot)
            logits.setdefault(d, lg)
    same = {d: torch.equal(logits[0], logits[d]) for d in depths}
    print(f"model {Path(a.model).name}, device {a.device}, slots {a.slots}, prompt {a.prompt}, "
          f"{a.decode} decode tokens x {a.rounds} rounds each")
    print("| prefetch_depth | tok/s | disk wait ms / token | disk MB / token | disk busy | guessed / token | hit rate | "
          "recall | read ahead MB / token | wasted MB / token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in settings:
        t = {k: sum(r[k] for r in runs[d]) for k in runs[d][0]}
        n = a.decode * a.rounds
        hit = t["guess_hits"] / t["guessed"] if t["guessed"] else float("nan")
        rec = t["guess_hits"] / t["guess_disk"] if t["guess_disk"] else float("nan")
        print(f"| {d or 'off'} | {n / t['seconds']:.2f} | {t['disk_wait_s'] / n * 1e3:.2f} | "
              f"{t['disk_bytes'] / n / 1e6:.2f} | {t['disk_active_s'] / t['seconds']:.1%} | {t['guessed'] / n:.1f} | "
              f"{hit:.1%} | {rec:.1%} | {t['guess_bytes'] / n / 1e6:.2f} | {t['guess_wasted_bytes'] / n / 1e6:.2f} |")
    for d in depths:
        print(f"decoded logits depth {d} vs off: {'IDENTICAL' if same[d] else 'DIFFERENT'}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
