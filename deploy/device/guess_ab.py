#!/usr/bin/env python3
"""Decode without guesses and with the next D layers' guessed experts read ahead (worker/guess.py), side by side.

    python3 deploy/device/guess_ab.py MODEL.gguf [--device cpu|cuda] [--slots 4+8] [--prompt 64] [--decode 32]
                                       [--rounds 2] [--staging auto] [--depth 1,2,3] [--min-hit 0.5,0.7,0.9]

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


def one(a, depth: int, min_hit: float | None = None) -> tuple[torch.Tensor, dict]:
    """One fresh store and runner guessing `depth` layers ahead (0: off), reading a (depth, class)'s guesses ahead
    while its hit rate is >= `min_hit` (None: the setting's default) -> (decoded logits, totals; "depth_hits": per
    guessing depth d (1-based) its guesses on disk and their hits, all classes together)."""
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       prefetch_decode=depth > 0, prefetch_depth=max(depth, 1), decode_consolidate_every=0,
                       **({} if a.staging == "auto" else {"staging_slots": int(a.staging)}),
                       **({} if min_hit is None else {"prefetch_min_hit": min_hit}))
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
        g = rn.moe.guesser if depth > 0 else None
        tot["depth_hits"] = [] if g is None else [(int(g.class_tries[d].sum()), int(g.class_hits[d].sum()))
                                                  for d in range(g.class_tries.shape[0])]
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
    ap.add_argument("--min-hit", default="", help="prefetch_min_hit settings, each run at every depth, e.g. "
                    "0.5,0.7,0.9 (default: the setting's default only). Under a saturated disk every wasted read "
                    "costs its whole read time, a hit only the idle time it fills: a higher bar may decode faster")
    a = ap.parse_args()
    try:
        depths = [int(x) for x in a.depth.split(",")]
        assert depths and all(d >= 1 for d in depths)
    except (ValueError, AssertionError):
        ap.error(f"--depth: expected layer counts >= 1 like 1,2,3, got {a.depth!r}")
    try:
        bars = [float(x) for x in a.min_hit.split(",")] if a.min_hit else [None]
        assert all(b is None or 0.0 <= b <= 1.0 for b in bars)
    except (ValueError, AssertionError):
        ap.error(f"--min-hit: expected hit rates in [0, 1] like 0.5,0.7,0.9, got {a.min_hit!r}")
    settings = [(0, None)] + [(d, b) for d in depths for b in bars]
    runs = {s: [] for s in settings}
    logits = {}
    for _ in range(a.rounds):
        for s in settings:
            lg, tot = one(a, *s)
            runs[s].append(tot)
            logits.setdefault(s, lg)
    same = {s: torch.equal(logits[(0, None)], logits[s]) for s in settings[1:]}
    print(f"model {Path(a.model).name}, device {a.device}, slots {a.slots}, prompt {a.prompt}, "
          f"{a.decode} decode tokens x {a.rounds} rounds each")
    print("| prefetch_depth (min hit) | tok/s | disk wait ms / token | disk MB / token | disk busy | guessed / token | "
          "hit rate | recall | read ahead MB / token | wasted MB / token | hit rate by depth |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in settings:
        d = s[0]
        t = {k: sum(r[k] for r in runs[s]) for k in runs[s][0] if k != "depth_hits"}
        by = [(sum(r["depth_hits"][i][0] for r in runs[s]), sum(r["depth_hits"][i][1] for r in runs[s]))
              for i in range(len(runs[s][0]["depth_hits"]))]
        by_s = ", ".join(f"{i + 1}: {h / n:.0%}" if n else f"{i + 1}: –" for i, (n, h) in enumerate(by)) or "–"
        name = "off" if d == 0 else (f"{d}" if s[1] is None else f"{d} ({s[1]:g})")
        n = a.decode * a.rounds
        hit = t["guess_hits"] / t["guessed"] if t["guessed"] else float("nan")
        rec = t["guess_hits"] / t["guess_disk"] if t["guess_disk"] else float("nan")
        print(f"| {name} | {n / t['seconds']:.2f} | {t['disk_wait_s'] / n * 1e3:.2f} | "
              f"{t['disk_bytes'] / n / 1e6:.2f} | {t['disk_active_s'] / t['seconds']:.1%} | {t['guessed'] / n:.1f} | "
              f"{hit:.1%} | {rec:.1%} | {t['guess_bytes'] / n / 1e6:.2f} | {t['guess_wasted_bytes'] / n / 1e6:.2f} | "
              f"{by_s} |")
    for s in settings[1:]:
        print(f"decoded logits depth {s[0]}{'' if s[1] is None else f' min hit {s[1]:g}'} vs off: "
              f"{'IDENTICAL' if same[s] else 'DIFFERENT'}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
