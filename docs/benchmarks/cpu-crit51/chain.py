"""CPU: the chain of each decode idle gap a layer's message ended, through a real store process (issue 21, crit51).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-crit51/chain.py [--tokens 48] [--reps 3]
        [--vram 1 --host 1] [--handoff off,on]

ds4-tiny (deploy/device/decode_host.py's model: Q8_0 experts), 1 VRAM + 1 host slot a layer (a decode layer misses
often), a `services.store_main` child (the gRPC session stream, as on the device), the static decode form (the
at-hand group + misses, as CUDA decodes; eager here), guesses on. Greedy decode timed as the bench times it; the
store's idle gaps split between / within and each gap a layer's message ended cut into services/bench/disk_idle.py's
CHAIN (earlier / land / deliver / gpu / host / message / store), in ms per token and us per gap. The tiny experts
read in microseconds: a gap here is the chain alone. --handoff: each rep with the session stream's load hand-off
off and / or on (services/grpc/store_client.py _Stream.HANDOFF_S). CPU only: "gpu" is torch on this CPU; the
other parts are the host's own paths (threads, GIL, gRPC), on a 2-core box shared with other work.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "deploy/device"))
from decode_host import _model                                          # noqa: E402
from services.bench.disk_idle import CHAIN, split_idle                  # noqa: E402


def run(tmp: Path, tokens: int, vram: int, host: int, skip: int = 3) -> dict:
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    cfg = EngineConfig(model_path=str(_model("ds4-tiny", tmp)), vram_slots=vram, host_slots=host, read_threads=2,
                       device="cpu")
    store = open_store(cfg, "process", str(tmp / "store"))
    rn = None
    try:
        rn = open_runner(cfg, store)
        ids = [int(x) for x in np.random.default_rng(4).integers(3, rn.mcfg.n_vocab, 40)]
        kv = rn.new_cache(40 + tokens + skip + 8)
        lg, _ = rn.forward(ids, kv)
        rn.settle()
        rn._static_decode = True
        tok = int(lg[-1].argmax())
        for _ in range(skip):
            lg, _ = rn.forward([tok], kv, consolidate=False)
            tok = int(lg[-1].argmax())
        windows, sends, routed, landed = [], [], [], []
        gc.collect()
        gc.disable()
        for _ in range(tokens):
            w0 = time.monotonic()
            lg, s = rn.forward([tok], kv, consolidate=False)
            tok = int(lg[-1].argmax())
            windows.append((w0, time.monotonic()))
            sends += s.sends
            routed += s.routed
            landed += s.landed
        gc.enable()
        st = store.client.status(disk_gaps_since=windows[0][0])
        return split_idle(st["disk_gaps"], windows, sends, routed, landed, st["disk_msgs"])
    finally:
        gc.enable()
        if rn is not None:
            rn.close()
        store.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--vram", type=int, default=1)
    p.add_argument("--host", type=int, default=1)
    p.add_argument("--handoff", default="off", help="off,on: the session stream's load hand-off (services/grpc/"
                   "store_client.py _Stream; off: HANDOFF_S = 0), each rep in each, alternating")
    a = p.parse_args()
    from services.grpc.store_client import _Stream
    print("| rep | hand-off | token ms | idle between / within ms/token | chain | " + " | ".join(CHAIN)
          + " | gaps/token | "
          "own first read |")
    print("|---|---|---|---|---|" + "---|" * len(CHAIN) + "---|---|")
    for i, h in [(i, h) for i in range(a.reps) for h in a.handoff.split(",")]:
        _Stream.HANDOFF_S = 0.002 if h == "on" else 0.0
        with tempfile.TemporaryDirectory() as d:
            s = run(Path(d), a.tokens, a.vram, a.host)
        tok_ms = s["span_s"] / s["tokens"] * 1e3
        for where in ("within", "between"):
            c = s["chain"][where]
            g = c["gaps"] or 1
            per_gap = [c[k] * s["tokens"] / g * 1e3 for k in CHAIN]       # us per gap
            print(f"| {i} | {h} | {tok_ms:.2f} | {s['between_ms_per_token']:.2f} / {s['within_ms_per_token']:.2f} | "
                  f"{where} "
                  f"ms/token (us/gap) | " + " | ".join(f"{c[k]:.3f} ({u:.0f})" for k, u in zip(CHAIN, per_gap))
                  + f" | {c['gaps'] / s['tokens']:.2f} | {c['own_read']:.0f} of {c['gaps']:.0f} |")


if __name__ == "__main__":
    main()
