"""CPU A/B of the hash-routed layers' reads at the decode step's start (engine.prefetch_hash; issue 21, gap49).

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python docs/benchmarks/cpu-gap49/hash_ab.py [--steps 24] [--read-ms 3]

A ds4-tiny file with 32 experts (2 used, 2 hash-routed layers of 4), 2 VRAM + 3 host slots a layer and 8 staging
slots, an in-process store whose reader sleeps `--read-ms` inside each preadv (a slow disk, counted active: the page
cache would read these tiny experts in microseconds). Greedy decode, timed as the bench times it; per run the disk's
idle ms per token between tokens / within one (services/bench/disk_idle.py) and by the message that ended each gap,
hash off and on, twice. CPU only: the decode's host work is the CPU's, not the GPU's; the split moves, the tok/s
here says nothing of the device's.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import numpy as np

from betelgeuse.gguf.synth import spec_from_preset, write_model
from engine_helpers import close_runner, in_process_runner
from services.bench.disk_idle import ended_label, split_idle


def run(path, on: bool, steps: int, read_s: float):
    rn, st = in_process_runner(path, 2, 3, prefetch_hash=on, staging_slots=8)
    pre = st.reader._preadv

    def slow(p, buf, want):              # the slow disk: inside the read, so the reader counts it active
        time.sleep(read_s)
        return pre(p, buf, want)
    st.reader._preadv = slow
    try:
        kv = rn.new_cache(128)
        prompt = [int(x) for x in np.random.default_rng(4).integers(0, 512, 24)]
        tok = int(rn.forward(prompt, kv)[0][-1].argmax())
        rn.settle()
        windows, sends, toks, started = [], [], [], 0
        gc.collect()
        gc.disable()
        for _ in range(steps):
            w0 = time.monotonic()
            lg, s = rn.forward([tok], kv, consolidate=False)
            tok = int(lg[-1].argmax())
            windows.append((w0, time.monotonic()))
            sends += s.sends
            toks.append(tok)
            started += s.hash_ahead_started
        gc.enable()
        g = st.status(disk_gaps_since=windows[0][0])
        return toks, split_idle(g["disk_gaps"], windows, sends), started
    finally:
        gc.enable()
        close_runner(rn, st)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--read-ms", type=float, default=3.0)
    a = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "ds4.gguf"
    write_model(path, spec_from_preset("ds4-tiny", expert_qtype="Q8_0", seed=3, n_expert=32), progress=False)
    print("| hash ahead | tok/s | idle ms/token between / within | active ms/token | ended by (ms/token between / "
          "within) | hash reads started | tokens = off's |")
    print("|---|---|---|---|---|---|---|")
    ref = None
    for _ in range(2):
        for on in (False, True):
            toks, s, started = run(path, on, a.steps, a.read_ms / 1e3)
            ref = toks if ref is None else ref
            print(f"| {'on' if on else 'off'} | {s['tokens'] / s['span_s']:.1f} | {s['between_ms_per_token']:.2f} / "
                  f"{s['within_ms_per_token']:.2f} | {s['active_ms_per_token']:.2f} | {ended_label(s)} | {started} | "
                  f"{toks == ref} |")


if __name__ == "__main__":
    main()
