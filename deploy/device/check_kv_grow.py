#!/usr/bin/env python3
"""A sequence state grown mid-decode gives the bits of one allocated large, on the device (tests/worker/test_kv_grow.py
checks the CPU's forms; CUDA adds the SDPA kernels over a longer cache, the Triton deepseek4 ops and graph capture).

    python3 deploy/device/check_kv_grow.py [--device cuda]      # ~1 min; needs gguf (the carried wheels)

For the tiny qwen3moe and ds4-tiny synth models: a prompt prefilled into a small state and into a large one, then the
same forced tokens decoded into both, the small one grown x2 (runner.grow_cache, through the host too) whenever
full; in the static one-row form (SoloDecode: eager, captured, replayed graphs) and in the batched lanes (both in
one step). Prints one row per (model, form, growth path): steps, growths, max |diff|, PASS/FAIL; exit 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, write_synth  # noqa: E402


def run(path, device: str, form: str, via_host: bool, n_prompt: int, n_decode: int, small: int, full: int):
    rn, st = in_process_runner(path, 3, 5, max_running=3, device=device)
    rn._static_decode = True
    try:
        V = rn.mcfg.n_vocab
        rng = np.random.default_rng(4)
        P = [int(x) for x in rng.integers(0, V, n_prompt)]
        toks = [int(x) for x in rng.integers(0, V, n_decode)]
        a, b = rn.new_cache(small), rn.new_cache(full)
        for kv in (a, b):
            rn.forward(P, kv, consolidate=False)
        grown, diff, same = 0, 0.0, True
        for t in toks:
            if a.length == a.max_len:
                if via_host:              # the path a growth takes when the other states are full
                    rn._kv_reserved = lambda: 0
                a = rn.grow_cache(a, 2 * a.max_len)
                grown += 1
            if form == "lanes":
                lg, _ = rn.decode_batch([t, t], [a, b])
                la, lb = lg[0], lg[1]
            else:
                la = rn.forward([t], a, consolidate=False)[0][-1]
                lb = rn.forward([t], b, consolidate=False)[0][-1]
            same &= torch.equal(la, lb)
            diff = max(diff, (la.float() - lb.float()).abs().max().item())
        rn.release(a), rn.release(b)
        return grown, diff, same and grown > 0
    finally:
        close_runner(rn, st)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    tmp = Path(tempfile.mkdtemp(prefix="kvgrow-"))
    qwen = write_synth(tmp / "qwen.gguf", **ENGINE_SPEC)
    ds4 = tmp / "ds4.gguf"
    write_model(ds4, spec_from_preset("ds4-tiny"), progress=False)
    cases = [("qwen3moe", qwen, 40, 30, 48, 256), ("deepseek4", ds4, 100, 40, 104, 256)]
    print(f"device {a.device}\n\n| model | form | growth | steps | growths | max abs diff | bits |\n|---|---|---|---|---|---|---|")
    bad = 0
    for name, path, n_p, n_d, small, full in cases:
        for form in ("solo", "lanes"):
            for via_host in (False, True):
                grown, diff, ok = run(path, a.device, form, via_host, n_p, n_d, small, full)
                bad += not ok
                print(f"| {name} | {form} | {'via host' if via_host else 'on device'} | {n_d} | {grown} | {diff:.3g} | "
                      f"{'PASS' if ok else 'FAIL'} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
