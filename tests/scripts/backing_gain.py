"""VRAM backing copies on vs off at one memory budget: disk bytes per decoded token and distinct experts resident per
layer, the same multi-sequence decode workload through the engine (CPU; the store in this process).

    .venv/bin/python tests/scripts/backing_gain.py [--preset small] [--layers 4] [--vram 8] [--arena 24]
                                                   [--clients 4] [--prompt 24] [--tokens 32]

Writes the synth preset with a calibrated router (popularity and temporal locality fitted to real decode statistics,
gguf/synth_router.py) unless --model is given. Round 1 warms the tiers (its prompts, then consolidation); round 2
(other prompts) is measured. Prints, per setting: the plan (slots, distinct experts resident per layer), the decode
passes' disk bytes per decoded token, the store's disk bytes over the round per decoded token, and whether the
tokens are the same for both settings (they must be: placement never changes a result).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_helpers import backing_workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vram", type=int, default=8)
    ap.add_argument("--arena", type=int, default=24, help="host slots per layer the memory budget holds")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from betelgeuse.gguf.synth import spec_from_preset, write_model
            model = str(Path(tmp) / "m.gguf")
            write_model(model, spec_from_preset(a.preset, router="calibrated", n_layer=a.layers), progress=False)
        from betelgeuse.gguf.reader import GGUFModelFile
        f = GGUFModelFile.open(model)
        n_vocab, n_expert = f.config.n_vocab, f.config.n_expert
        f.close()
        rng = np.random.default_rng(0)
        rounds = [[[int(x) for x in rng.integers(3, n_vocab, a.prompt)] for _ in range(a.clients)] for _ in range(2)]
        got = {}
        for backing in (True, "auto"):
            r = backing_workload(model, backing, a.vram, a.arena, rounds, a.tokens)
            p = r["plan"]
            got[backing] = r
            print(f"vram_backing={backing!s:5} -> {'on' if p.vram_backing else 'off'}: {p.n_vram} VRAM + {p.n_host} host "
                  f"slots per layer = {p.resident_per_layer} distinct experts resident of {n_expert} (arena "
                  f"{p.arena_bytes / 2**20:.1f} MiB); {r['decoded']} tokens decoded by {a.clients} sequences: decode "
                  f"passes read {r['decode_disk_bytes'] / r['decoded'] / 1e6:.3f} MB/token "
                  f"({r['decode_disk_reads']} experts), the store {r['store_disk_bytes'] / r['decoded'] / 1e6:.3f} "
                  f"MB/token over the round")
        on, off = got[True], got["auto"]
        print(f"off / on: decode disk bytes {off['decode_disk_bytes'] / max(1, on['decode_disk_bytes']):.2f}x, store "
              f"disk bytes {off['store_disk_bytes'] / max(1, on['store_disk_bytes']):.2f}x; tokens identical: "
              f"{on['tokens'] == off['tokens']}")


if __name__ == "__main__":
    main()
