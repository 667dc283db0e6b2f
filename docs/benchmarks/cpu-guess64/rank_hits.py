#!/usr/bin/env python3
"""A lone stream's decode guesses' hit rate by (depth, rank in the guessed top-k): what chose the ranks rule's split
(worker/guess.py: lone-r1 / lone-r2-3 / lone-r4+).

    .venv/bin/python docs/benchmarks/cpu-guess64/rank_hits.py [--preset ds4-wide] [--slots 49+77] [--prompts 4]
                                                              [--decode 48]

An in-process store and runner (betelgeuse.assembly), depth 3, every guess read ahead (prefetch_min_hit 0: the
budget holds nothing back, so every rank is seen), the hash layers' step-start reads off. Guesser.read_ahead and
Guesser.check are wrapped: each guess of a layer t whose expert is on disk in the pass's snapshot is scored when t
runs (hit = t used it), as the budget scores it, per (hash-routed or not, depth, rank). The synth models are
guess_waste.py's (ds4-wide, ds4-tiny as decode_host.py writes them; tiny: the 8-layer qwen3moe, --experts).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "deploy" / "device")]

import numpy as np  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="ds4-wide", choices=["tiny", "ds4-tiny", "ds4-wide"])
    ap.add_argument("--experts", type=int, default=64, help="tiny: experts per layer")
    ap.add_argument("--slots", default="49+77", help="VRAM+host slots per layer")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--decode", type=int, default=48)
    a = ap.parse_args()
    from guess_waste import synth_model
    from betelgeuse.assembly import open_runner, open_store
    from betelgeuse.config import EngineConfig
    from betelgeuse.worker.guess import Guesser
    vram, host = (int(x) for x in a.slots.split("+"))
    path = synth_model(Path(tempfile.mkdtemp(prefix="rank-hits-")), a.preset, a.experts)
    cfg = EngineConfig(model_path=str(path), vram_slots=vram, host_slots=host, read_threads=2, prefetch_decode=True,
                       prefetch_depth=3, prefetch_min_hit=0.0, decode_consolidate_every=0, prefetch_hash=False)
    pending: dict = {}          # id(pass stats) -> guessed layer -> [(depth, rank, expert on disk)]
    tries: dict = {}            # (hash-routed, depth, rank) -> [guesses, hits]
    read_ahead, check = Guesser.read_ahead, Guesser.check

    def spy_read_ahead(self, layer, layers, marks, snap, stats, *args, **kw):
        disk = self._disk(snap)
        mine = pending.setdefault(id(stats), {})
        for d, row in enumerate(marks.ids[0], start=1):
            t = layer + d
            for r, x in enumerate(row):
                if t < len(disk) and x in disk[t]:
                    mine.setdefault(t, []).append((d, r, x))
        return read_ahead(self, layer, layers, marks, snap, stats, *args, **kw)

    def spy_check(self, layer, disk, ahead_used, stats):
        used = set(disk)
        for d, r, x in pending.get(id(stats), {}).pop(layer, []):
            n = tries.setdefault((layer < n_hash, d, r), [0, 0])
            n[0] += 1
            n[1] += x in used
        return check(self, layer, disk, ahead_used, stats)

    Guesser.read_ahead, Guesser.check = spy_read_ahead, spy_check
    store = open_store(cfg)
    try:
        rn = open_runner(cfg, store)
        ds4 = rn.session.file.config.ds4
        n_hash = ds4.n_hash_layers if ds4 is not None else 0
        for p in range(a.prompts):
            kv = rn.new_cache(a.decode + 32)
            tok = int(rn.forward([int(x) for x in np.random.default_rng(5 + p).integers(3, rn.mcfg.n_vocab, 24)],
                                 kv)[0][-1].argmax())
            rn.settle()
            for _ in range(a.decode):
                tok = int(rn.forward([tok], kv, consolidate=False)[0][-1].argmax())
            rn.request_done(kv, others_running=False)
        rn.close()
    finally:
        store.close()
    k = rn.mcfg.n_expert_used
    print(f"{a.preset}: hit rate by rank 1..{k} (guessed on disk), depth 3, {a.prompts} x {a.decode} decode steps")
    for exact in (False, True):
        for d in (1, 2, 3):
            got = [tries.get((exact, d, r)) for r in range(k)]
            if any(got):
                print(f"  {'hash ' if exact else 'routed'} depth {d}: " + " ".join(
                    f"{h / n:.2f}" if n else "-" for n, h in (g or (0, 0) for g in got))
                    + f"   ({sum(g[0] for g in got if g)} guesses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
