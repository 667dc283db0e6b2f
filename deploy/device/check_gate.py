#!/usr/bin/env python3
"""Decode's at-hand group (worker/at_hand.py) off and on, side by side, in this process: bits and step times.

    python3 deploy/device/check_gate.py MODEL.gguf [--device cuda] [--slots 16+35] [--max-running 4] [--prompt 256]
                                         [--decode 32] [--lanes 3] [--solo 8]

Per setting (decode_at_hand off, on, "gate" = on with decode_gate on (worker/gate.py: no per-layer sync), and with
--banked on with host experts copied through ring banks; each a fresh store and runner, real O_DIRECT reads, the flex cache at
its default): one prompt prefilled and decoded `decode` tokens twice over (the live service's lone stream: decode_batch,
the engine's form; the second round finds the first round's experts at hand: VRAM, host slots, flex copies), then
`lanes` prompts decoded together (decode_batch of 3), then `solo` tokens through forward() (the solo decode graphs).
Prints per setting: whether host slots are read in place (the arena's device mapping), and per round the mean step
time of its second half, disk MB and reads per tier per token; then whether every decoded logit of "on" is the bits of
"off" (solo, lanes and the lone stream). Exit status 1 when a logit differs.

Expected on the H200 (b16 bench model): "on: host in place: True", every "bit-identical" (gate included: a gate that
gave up raises BetelgeuseError), and round 1 (warm, disk ~0
MB/token) faster with the at-hand group on than off (off: ~8.5 ms a step, gpu-run30's profile; the GPU's work is ~4.4),
and "gate" faster again (target: near the GPU's work when nothing is missed; cold: the disk's bound).
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


def one(a, setting: str):
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       max_running=a.max_running, decode_at_hand=setting != "off",
                       decode_gate="on" if setting == "gate" else "off")
    store = open_store(cfg)
    rn = open_runner(cfg, store)
    if setting == "banked":       # host-tier experts through ring banks as before (VRAM and flex copies at hand)
        rn.moe.hand.arena_addr = None
    cuda = rn.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(a.seed)
    V = rn.mcfg.n_vocab
    try:
        ids = [int(x) for x in rng.integers(3, V, a.prompt)]
        logits, rows = {"stream": [], "lanes": [], "solo": []}, []
        for r in range(2):
            kv = rn.new_cache(a.prompt + a.decode + 8)
            lg, _ = rn.forward(ids, kv)
            tok = int(lg[-1].argmax())
            times, disk, reads = [], 0, {"vram": 0, "host": 0, "disk": 0}
            for i in range(a.decode):
                sync()
                t = time.perf_counter()
                lg, st = rn.decode_batch([tok], [kv])
                sync()
                times.append(time.perf_counter() - t)
                disk += st.disk_bytes
                for k in reads:
                    reads[k] += st.reads[k]
                logits["stream"].append(lg[-1:].float().cpu())
                tok = int(lg[-1].argmax())
            rn.request_done(kv, others_running=False)
            half = times[len(times) // 2:]
            rows.append((r, 1e3 * sum(half) / len(half), disk / a.decode / MB,
                         {k: round(v / a.decode, 1) for k, v in reads.items()}))
        # lanes: several prompts decoded together
        kvs = [rn.new_cache(a.prompt + 24) for _ in range(a.lanes)]
        toks = []
        for kv in kvs:
            lg, _ = rn.forward([int(x) for x in rng.integers(3, V, a.prompt // 2)], kv, consolidate=False)
            toks.append(int(lg[-1].argmax()))
        for _ in range(16):
            lg, _ = rn.decode_batch(toks, kvs)
            logits["lanes"].append(lg.float().cpu())
            toks = [int(x) for x in lg.argmax(-1)]
        for kv in kvs:
            rn.request_done(kv, others_running=True)
        # solo: forward() of one token (the solo decode graphs)
        kv = rn.new_cache(a.prompt + a.solo + 8)
        lg, _ = rn.forward(ids, kv, consolidate=False)
        for _ in range(a.solo):
            lg, _ = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            logits["solo"].append(lg[-1:].float().cpu())
        rn.request_done(kv, others_running=False)
        in_place = rn.moe.hand is not None and rn.moe.hand.zero_copy
        return {k: torch.cat(v) for k, v in logits.items()}, rows, in_place
    finally:
        rn.close()
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="16+35", slots_help="VRAM+host slots per layer (the serve plan's, bench geometry)")
    for flag, n in (("--max-running", 4), ("--prompt", 256), ("--decode", 32), ("--lanes", 3), ("--solo", 8),
                    ("--seed", 7)):
        ap.add_argument(flag, type=int, default=n)
    ap.add_argument("--settings", help="comma-separated, off first (default off,on,gate[,banked])")
    ap.add_argument("--banked", action="store_true", help="also: at hand with the host experts through ring banks "
                    "(is reading them in place over PCIe the faster?)")
    a = ap.parse_args()
    names = a.settings.split(",") if a.settings else ["off", "on", "gate"] + (["banked"] if a.banked else [])
    assert names[0] == "off" and set(names) <= {"off", "on", "gate", "banked"}, names
    res = {s: one(a, s) for s in names}
    for setting, (_, rows, in_place) in res.items():
        print(f"decode_at_hand {setting}: host in place: {in_place}")
        for r, ms, mb, reads in rows:
            print(f"  round {r} ({'cold' if r == 0 else 'warm'}): step {ms:.2f} ms (second half), disk {mb:.1f} "
                  f"MB/token, reads/token {reads}")
    ok = True
    for setting in res:
        for k in ("stream", "lanes", "solo") if setting != "off" else ():
            x, y = res["off"][0][k], res[setting][0][k]
            same = torch.equal(x, y)
            ok &= same
            print(f"{k}: logits {setting} == off:", "bit-identical" if same else
                  f"DIFFER (max |diff| {(x - y).abs().max().item():.3e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
