"""cpu-graphs57's table: decode graphs captured by two sequences of one size decoded in turn through the lanes (the
stand-in capture of tests/worker/test_state_recycle.py), recycling off and on, and a state's reset against a new one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-graphs57/counts.py
"""

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "worker")]

import test_state_recycle as T  # noqa: E402
from engine_helpers import ENGINE_SPEC, write_ds4_tiny, write_synth  # noqa: E402

from betelgeuse.model import reference_model  # noqa: E402
from betelgeuse.worker import decode_graphs, graphs, lanes  # noqa: E402

made = []


def capture(pool, fn):
    out = fn()
    made.append(T._Graph(fn, out))
    graphs.CAPTURED[0] += 1
    return made[-1], out


lanes.capture = decode_graphs.capture = capture
d = tempfile.mkdtemp()
paths = {"qwen3moe": write_synth(d + "/q.gguf", **ENGINE_SPEC),
         "deepseek4": write_ds4_tiny(d + "/d.gguf", expert_qtype="Q8_0", seed=2)}
for arch, p in paths.items():
    V = 320 if arch == "qwen3moe" else 512
    for recycle in (False, True):
        out, caps, kvs = T._lane_sequences(p, T._prompts(V), recycle, made)
        print(f"{arch} lanes recycle={recycle}: decode graphs captured by sequence 1 / 2: {caps}; "
              f"same state object: {kvs[1] is kvs[0]}")
for arch, p in paths.items():
    m = reference_model(p)
    kv = m.new_cache(4096)
    t = time.perf_counter()
    for _ in range(20):
        m.new_cache(4096)
    a = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(20):
        kv.reset()
    r = (time.perf_counter() - t) / 20
    print(f"{arch} state of 4096 tokens, {kv.nbytes() / 2**20:.2f} MiB: new_cache {a * 1e3:.2f} ms, "
          f"reset {r * 1e3:.2f} ms (CPU)")
