#!/usr/bin/env python3
"""A lone stream with the flex expert cache off and on (worker/flex_cache.py), side by side, in this process.

    python3 deploy/device/flex_ab.py MODEL.gguf [--device cuda] [--slots 16+35] [--max-running 8] [--prompt 512]
                                      [--decode 64] [--rounds 2]

Per setting (flex_cache false, then true; each a fresh store and runner, real O_DIRECT reads): `rounds` requests of
the same prompt one after the other, as the live service's single client sends them (prefill with consolidation,
greedy decode through runner.decode_batch, the engine's form on CUDA, then release). Prints per round: decode tok/s,
disk MB per token, flex hits per token, flex slots; per setting the peak allocated VRAM against the plan's figure
(vram_fixed + VRAM slots, which reserves max_running sequences' KV); and whether every decoded logit of "on" is the
bits of "off". Exit status 1 when a logit differs or the peak is over the plan's figure.
"""

from __future__ import annotations

import argparse
import sys
import time

import _common  # first: puts this checkout on sys.path
import numpy as np
import torch

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig

MB = 1e6


def one(a, flex: bool):
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       max_running=a.max_running, flex_cache=flex)
    store = open_store(cfg)
    rn = open_runner(cfg, store)
    cuda = rn.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ids = [int(x) for x in np.random.default_rng(a.seed).integers(3, rn.mcfg.n_vocab, a.prompt)]
        out, rows = [], []
        for r in range(a.rounds):
            kv = rn.new_cache(a.prompt + a.decode + 8)
            lg, _ = rn.forward(ids, kv)
            tok = int(lg[-1].argmax())
            secs = disk = hits = 0
            for _ in range(a.decode):
                t = time.perf_counter()
                lg, st = rn.decode_batch([tok], [kv])
                secs += time.perf_counter() - t
                disk += st.disk_bytes
                hits += st.flex_hits
                out.append(lg[-1:].float().cpu())
                tok = int(lg[-1].argmax())
            rn.request_done(kv, others_running=False)   # the engine's end of a request: release, consolidation
            rows.append((r, a.decode / secs, disk / a.decode / MB, hits / a.decode,
                         rn.flex.n_slots if rn.flex is not None else 0))
        plan = rn.plan
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return (torch.cat(out), rows, peak, plan.vram_fixed + plan.vram_slot_bytes,
                rn.flex.describe() if rn.flex is not None else None)
    finally:
        rn.close()          # the cache's chunks go with the slot pool
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="16+35", slots_help="VRAM+host slots per layer (the serve plan's, bench geometry)")
    for flag, n in (("--max-running", 8), ("--prompt", 512), ("--decode", 64), ("--rounds", 2), ("--seed", 7)):
        ap.add_argument(flag, type=int, default=n)
    a = ap.parse_args()
    res = {flex: one(a, flex) for flex in (False, True)}
    bad = 0
    for flex, (_, rows, peak, plan, fc) in res.items():
        print(f"flex_cache={str(flex).lower()}: peak allocated {peak / 2**20:,.0f} MiB, plan's figure "
              f"{plan / 2**20:,.0f} MiB" + (f"; {fc}" if fc is not None else ""))
        for r, tps, mb, hits, slots in rows:
            print(f"  round {r}: decode {tps:.1f} tok/s, disk {mb:.1f} MB/token, flex hits {hits:.1f}/token, "
                  f"flex slots {slots}")
        if peak > plan:
            print("  PEAK OVER THE PLAN'S FIGURE")
            bad = 1
    same = torch.equal(res[False][0], res[True][0])
    print("decoded logits on == off:", "bit-identical" if same else
          f"DIFFER (max |diff| {(res[False][0] - res[True][0]).abs().max().item():.3e})")
    return 0 if same and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
