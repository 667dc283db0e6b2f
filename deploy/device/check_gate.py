#!/usr/bin/env python3
"""Decode's at-hand group and where it reads host-tier experts, side by side in this process: step times, bytes over
PCIe and bits, per lanes count.

    python3 deploy/device/check_gate.py [MODEL.gguf] [--device cuda] [--slots 16+35] [--settings off,always,never,auto]
                                         [--lanes 1,4,8] [--prompt 64] [--decode 16] [--solo 8]

Settings (each a fresh store and runner, real O_DIRECT reads, the flex cache at its default):
    off      decode_at_hand false: the partial path per layer (the reference for the bits)
    always   the at-hand group, host slots read in place over PCIe by the kernels (engine.host_in_place = always;
             alias "on")
    never    the at-hand group for VRAM and flex experts, host experts copied into ring banks (host_in_place = never;
             alias "banked")
    auto     host_in_place = auto: in place for steps of at most at_hand.IN_PLACE_MAX_ROWS rows, banked above
    gate     always + decode_gate on (worker/gate.py; it gave up on its first CUDA step in gpu-run35)
For each lanes count n (1, 4, 8 sequences decoded together: decode_batch, the engine's form) n prompts are prefilled and
decoded `decode` steps twice: round 0 "cold" (the prompts' experts partly on disk), round 1 "warm" (the same prompts
again: their experts at hand, the prompt from the prefix cache); then `solo` tokens through forward() (the solo decode
graphs). Prints per lanes count and setting: the mean step time of each round's second half, and per step the bytes
over PCIe: read in place by the kernels (PassStats.in_place_bytes: each host expert's slot once per row block of the
kernel, i.e. once for <= 16 rows) + copied by the copy engine (h2d_bytes: ring banks, flex copies, VRAM fills) and
the disk's; then whether every logit of each setting is the bits of "off". Exit status 1 when a logit differs.

MODEL defaults to /var/tmp/g/b16.gguf, written first where missing (the bench preset at 16 layers, Q8_0, 32 GB / 3 =
~10.8 GB: gpu-run35's model). Expected on the H200: every "bit-identical"; lanes 1: always (in place) at or below
never; lanes 4 and 8: the question this answers, "in place" against "banked" (the auto rule's IN_PLACE_MAX_ROWS
follows the crossover). Runs in < 3 minutes with the model written (about 1 without).
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
DEFAULT_MODEL = "/var/tmp/g/b16.gguf"
SETTINGS = {"off": "always", "always": "always", "never": "never", "auto": "auto", "gate": "always"}
ALIASES = {"on": "always", "banked": "never"}


def one(a, setting: str, lanes: list[int]):
    """-> ({(n, round): logits [steps, n, V]} + "solo", {(n, round): row}, in_place per n)."""
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       max_running=max(lanes), decode_at_hand=setting != "off", host_in_place=SETTINGS[setting],
                       decode_gate="on" if setting == "gate" else "off")
    store = open_store(cfg)
    rn = open_runner(cfg, store)
    cuda = rn.device.type == "cuda"
    if not cuda:
        rn._static_decode = True        # the CPU (a check of this script): the lanes, as on CUDA (the tests do the same)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    V = rn.mcfg.n_vocab
    logits, rows, in_place = {}, {}, {}
    try:
        for n in lanes:
            rng = np.random.default_rng(a.seed + n)           # the same prompts for every setting
            prompts = [[int(x) for x in rng.integers(3, V, a.prompt)] for _ in range(n)]
            for r in range(2):
                kvs = [rn.new_cache(a.prompt + a.decode + 8) for _ in range(n)]
                toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
                times, inb, h2d, disk, out = [], [], [], [], []
                for _ in range(a.decode):
                    sync()
                    t = time.perf_counter()
                    lg, st = rn.decode_batch(toks, kvs)
                    sync()
                    times.append(time.perf_counter() - t)
                    inb.append(st.in_place_bytes)
                    h2d.append(st.h2d_bytes)
                    disk.append(st.disk_bytes)
                    out.append(lg.float().cpu())
                    toks = [int(x) for x in lg.argmax(-1)]
                for i, kv in enumerate(kvs):
                    rn.request_done(kv, others_running=i + 1 < n)
                h = len(times) // 2
                rows[n, r] = (1e3 * float(np.mean(times[h:])), np.mean(inb) / MB, np.mean(h2d) / MB,
                              np.mean(disk) / MB)
                logits[n, r] = torch.stack(out)
            in_place[n] = rn.moe.hand is not None and rn.moe.hand.in_place
        # solo: forward() of one token (the solo decode graphs)
        ids = [int(x) for x in np.random.default_rng(a.seed).integers(3, V, a.prompt)]
        kv = rn.new_cache(a.prompt + a.solo + 8)
        lg, _ = rn.forward(ids, kv, consolidate=False)
        solo = []
        for _ in range(a.solo):
            lg, _ = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            solo.append(lg[-1:].float().cpu())
        rn.request_done(kv, others_running=False)
        logits["solo"] = torch.cat(solo)
        return logits, rows, in_place
    finally:
        rn.close()
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="16+35", slots_help="VRAM+host slots per layer (the serve plan's, bench geometry)",
                           model_optional=True)
    for flag, n in (("--prompt", 64), ("--decode", 16), ("--solo", 8), ("--seed", 7)):
        ap.add_argument(flag, type=int, default=n)
    ap.add_argument("--settings", default="off,always,never,auto",
                    help="comma-separated, off first: off, always (on), never (banked), auto, gate")
    ap.add_argument("--lanes", default="1,4,8", help="comma-separated: sequences decoded together")
    ap.add_argument("--banked", action="store_true", help="(kept for old commands: never is in the default list)")
    a = ap.parse_args()
    names = [ALIASES.get(s.strip(), s.strip()) for s in a.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    lanes = [int(x) for x in a.lanes.split(",") if x.strip().isdigit()]
    if bad or not names or names[0] != "off" or not lanes or min(lanes) < 1 or len(lanes) != len(a.lanes.split(",")):
        ap.error(f"--settings {a.settings!r} (off first, then of {', '.join([*SETTINGS, *ALIASES])}) or --lanes "
                 f"{a.lanes!r} (positive integers)")
    if a.model is None:
        from betelgeuse.gguf.synth import spec_from_preset
        a.model = str(_common.synth_if_missing(DEFAULT_MODEL, spec_from_preset("bench", n_layer=16),
                                               say="wrote {path} in {secs:.0f} s"))
    t0 = time.perf_counter()
    res = {s: one(a, s, lanes) for s in dict.fromkeys(names)}
    print(f"{len(res)} settings in {time.perf_counter() - t0:.0f} s; per step: ms = mean of each round's second half, "
          f"PCIe MB = read in place + copied (h2d), disk MB")
    for n in lanes:
        print(f"lanes {n}:")
        for s, (_, rows, in_place) in res.items():
            cells = []
            for r, name in ((0, "cold"), (1, "warm")):
                ms, inb, h2d, disk = rows[n, r]
                cells.append(f"{name} {ms:7.2f} ms, PCIe {inb:6.1f} + {h2d:6.1f} = {inb + h2d:6.1f} MB, disk "
                             f"{disk:6.1f} MB")
            print(f"  {s:7s} host in place: {str(in_place[n]):5s} | " + " | ".join(cells))
    ok = True
    for s in list(res)[1:]:
        differ = []
        for k in [*((n, r) for n in lanes for r in (0, 1)), "solo"]:
            x, y = res["off"][0][k], res[s][0][k]
            if not torch.equal(x, y):
                differ.append(f"{'solo' if k == 'solo' else f'lanes {k[0]} round {k[1]}'} (max |diff| "
                              f"{(x - y).abs().max().item():.3e})")
        ok &= not differ
        print(f"logits {s} == off:", "DIFFER in " + ", ".join(differ) if differ else
              f"bit-identical (lanes {a.lanes}, both rounds, solo)")
    print("verdict:", "PASS (every logit bit-identical)" if ok else "FAIL (a logit differs)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
