"""Where the chain's `store` link (the store took a load -> its first preadv started) goes, in process: an ExpertStore
over chain_latency.py's synth model (2 read threads, 8 staging slots, every load a disk read), one load at a time,
its first steps timed from the message log's `taken` stamp (ExpertStore._mark): store.load returned, the load's
reads started (the generator's `started` item: what the session reader does before it answers anything), the
first preadv started (the message log's [1]); and the summed time inside the calls of that path, per load.

    PYTHONPATH=$PWD python3 docs/benchmarks/cpu-chain58/store_link.py [--n 400]
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main() -> int:
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.gguf.synth import PRESETS, write_model
    from betelgeuse.store.plan import plan_slots
    from betelgeuse.store.store import ExpertStore
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=400)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        path = Path(d) / "chain.gguf"
        write_model(path, replace(PRESETS["tiny"], n_layer=2, n_embd=256, n_ff_exp=512, n_expert=32, seed=5),
                    progress=False)
        f = GGUFModelFile.open(str(path))
        cfg = EngineConfig(model_path=str(path), vram_slots=0, host_slots=0, staging_slots=8)
        st = ExpertStore(f, plan_slots(f, cfg, None), read_threads=2)
        spent = collections.defaultdict(float)
        for obj, name in ((st, "_check"), (st, "_alloc_slot"), (st, "_ranges"), (st.reader, "read"),
                          (st, "_start_read")):
            fn = getattr(obj, name)

            def timed(*args, fn=fn, name=name, **kw):
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    spent[name] += time.perf_counter() - t
            setattr(obj, name, functools.wraps(fn)(timed))
        session, _ = st.attach(1)
        st.begin_pass(session, False)
        keys = [(l, e) for l in (0, 1) for e in range(32)]
        rows = collections.defaultdict(list)
        for i in range(a.n + 20):
            if i == 20:
                spent.clear()
            it = st.load(session, [keys[i % len(keys)]], started=True)
            t_load = time.monotonic()
            next(it)
            t_started = time.monotonic()
            m = st._msgs[-1]
            got = next(it)
            for _ in it:
                pass
            st.release(session, [got.slot])
            time.sleep(0.002)
            if i >= 20:
                rows["store.load returned"].append(t_load - m[0])
                rows["the reads started (started item)"].append(t_started - m[0])
                rows["first preadv started"].append(m[1] - m[0])
        st.close()
    print("| from the message taken | median µs | p90 µs |\n|---|---|---|")
    for k, v in rows.items():
        v = sorted(v)
        print(f"| {k} | {statistics.median(v) * 1e6:.0f} | {v[int(0.9 * (len(v) - 1))] * 1e6:.0f} |")
    print("\n| inside (per load) | µs |\n|---|---|")
    for k, v in spent.items():
        print(f"| {k} | {v / a.n * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
