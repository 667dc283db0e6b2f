#!/usr/bin/env python3
"""A ring group's host time in isolation (issue 21, helper host47): MoEStep._to_bank (its slots copied into the next
bank, its slot table, its Group) and MoEKernels.apply (its two launches), each timed call by call in a loop of the
checkout on PYTHONPATH (us a call, the median of 7 blocks of 2000): the per-group figures beside decode_host's noisier
in-situ ones. CPU: the slot copies are real memcpy, and apply's launchers are stand-ins (no kernel: the Python before
Triton's dispatch alone). --device cuda: the copies enqueued on the copy stream, apply's real Triton launches over a
table of -1 (every program returns at once), the device synchronized every 64 calls outside the timing.

    PYTHONPATH=<checkout> python3 docs/benchmarks/cpu-host47/group_host.py [--slots 1 2 4] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch


def _blocks(fn, device: str, n: int = 2000, blocks: int = 7) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(200):
        fn()
    sync()
    out = []
    for _ in range(blocks):
        tot = 0.0
        for i in range(n):
            t = time.perf_counter()
            fn()
            tot += time.perf_counter() - t
            if i % 64 == 63:
                sync()
        out.append(tot / n * 1e6)
    return round(statistics.median(out), 2)


def to_bank_us(slots: list[int], device: str) -> dict:
    from betelgeuse.assembly import open_runner, open_store
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    res = {}
    with tempfile.TemporaryDirectory(prefix="bg-group-host-") as d:
        path = Path(d) / "ds4-tiny.gguf"
        write_model(path, replace(spec_from_preset("ds4-tiny", expert_qtype="Q8_0", seed=2), n_expert=32), progress=False)
        cfg = EngineConfig(model_path=str(path), vram_slots=2, host_slots=8, read_threads=1, ring_slots=8,
                           device=device)
        store = open_store(cfg)
        try:
            rn = open_runner(cfg, store)
            moe, cache = rn.moe, rn.moe.cache
            for n in slots:
                es = list(range(3, 3 + n))
                srcs = [cache.host_slot(1, i) for i in range(n)]

                def one():
                    cache.pass_begin()            # the tables' ring from its start, as each pass
                    moe._to_bank(es, srcs, None)
                res[f"to_bank_{n}_us"] = _blocks(one, device)
            rn.close()
        finally:
            store.close()
    return res


def apply_us(device: str) -> dict:
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.moe import Group, MoEKernels

    class Idle:                 # a launcher that launches nothing: the Python before Triton's dispatch alone
        def __getitem__(self, grid):
            return lambda *a, **k: None
    if device != "cuda":
        for n in ("_GATE_UP", "_DOWN", "_GATE_UP_MV", "_DOWN_MV", "_COMBINE"):
            setattr(tk, n, Idle())
    E, F, H, k = 256, 2048, 4096, 6                         # ds4-flash's expert geometry, one decode row
    out = {}
    for name, q in (("MXFP4", 39), ("Q8_0", 8), ("Q4_K", 12)):
        kern = MoEKernels("triton", E, F, torch.zeros((4, E, 3), dtype=torch.int64, device=device), [(q, q)] * 4, 16)
        r = kern.route(torch.zeros((1, H), dtype=torch.bfloat16, device=device),
                       torch.arange(k, device=device).view(1, k), torch.zeros((1, k), device=device))
        pool = torch.zeros(1 << 12, dtype=torch.uint8, device=device)
        g = Group(None, None, torch.full((E,), -1, dtype=torch.int64, device=device))
        out[f"apply_{name}_us"] = _blocks(lambda: kern.apply(r, 1, pool, g, 1 << 20), device)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"device": a.device, **to_bank_us(a.slots, a.device), **apply_us(a.device)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
