"""cpu-spike56: the store's own work at a decode's pass boundaries, in process (no worker, no messages), at
ds4-flash's expert shape (decode_host.py --preset ds4-wide: 8 layers x 256 experts; 49 VRAM + 77 host slots).

Each round: a pass with a decode-like usage (6 of 256 experts a layer a token over 32 tokens, drifting from round to
round so that consolidations move experts), its EndPass with consolidation timed (plan_moves, _vacate), the fill
waited for (untimed: a thread; the worker does not wait for it), then the BeginPass that applies it timed (the
commit: a directory change per move), and an empty EndPass. Prints the median and max ms of both over the rounds
and the moves per consolidation. Run it with PYTHONPATH=<checkout> from the checkout, on both sides of an A/B.

    python3 docs/benchmarks/cpu-spike56/store_boundary.py [--rounds 12]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "deploy" / "device"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    from decode_host import _model
    from betelgeuse.assembly import open_store
    from betelgeuse.config import EngineConfig
    with tempfile.TemporaryDirectory(prefix="bg-spike56-") as d:
        cfg = EngineConfig(model_path=str(_model("ds4-wide", Path(d))), vram_slots=49, host_slots=77, read_threads=2,
                           device="cpu")
        st = open_store(cfg)
        s, c = st.store, st.client
        try:
            c.attach()
            L, E = s.plan.n_layer, s.plan.n_expert
            rng = np.random.default_rng(5)
            hot = rng.gamma(0.4, 1.0, (L, E))
            ends, begins, moves = [], [], []
            for r in range(a.rounds):
                hot = 0.7 * hot + 0.3 * rng.gamma(0.4, 1.0, (L, E))      # the working set drifts
                usage = np.zeros((L, E), np.int64)
                for _ in range(32):                                        # 32 decode tokens, top-6 a layer
                    for l in range(L):
                        p = hot[l] / hot[l].sum()
                        usage[l, rng.choice(E, 6, replace=False, p=p)] += 1
                c.begin_pass(False)
                t = time.perf_counter()
                n = c.end_pass(usage, True)
                ends.append(time.perf_counter() - t)
                moves.append(n)
                while s.directory.filling:                                 # the fill: a thread, not timed
                    time.sleep(0.002)
                t = time.perf_counter()
                c.begin_pass(False)                                        # applies the landed consolidation
                begins.append(time.perf_counter() - t)
                c.end_pass(np.zeros((L, E), np.int64), False)
            ms = lambda v: f"median {statistics.median(v) * 1e3:.2f} ms, max {max(v) * 1e3:.2f} ms"
            print(f"rounds {a.rounds}; moves per consolidation: median {statistics.median(moves)}, max {max(moves)}")
            print(f"EndPass (consolidate): {ms(ends)}")
            print(f"BeginPass (commit):    {ms(begins)}")
        finally:
            st.close()


if __name__ == "__main__":
    main()
