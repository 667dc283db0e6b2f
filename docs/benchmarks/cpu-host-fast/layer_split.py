"""A decode layer's expert-step host time split by function, in place (not cProfile: each wrapped call timed with
perf_counter inside the real decode, so the caches are as cold as the decode leaves them): the tiny engine model,
an in-process store (20 VRAM + 12 host slots: nearly every routed expert at hand), the static form on the CPU,
decode_at_hand, and --gate for decode_gate. Prints the median microseconds per call of each function the checkout
has (main lacks the branch's _hand_all / on_disk), over 280 steps after 20 warm ones.

    PYTHONPATH=<checkout> python3 docs/benchmarks/cpu-host-fast/layer_split.py [--gate]
"""
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth  # noqa: E402

from betelgeuse.worker import gate as gate_mod, guess as guess_mod, moe_step  # noqa: E402

gate = "--gate" in sys.argv
with tempfile.TemporaryDirectory() as d:
    rn, st = in_process_runner(write_synth(Path(d) / "e.gguf", **ENGINE_SPEC), 20, 12, decode_at_hand=True,
                               decode_gate="on" if gate else "off", decode_consolidate_every=0, read_threads=1)
    kv = rn.new_cache(512)
    lg, _ = rn.forward(prompt(64, ENGINE_SPEC["n_vocab"], seed=5), kv)
    rn.settle()
    rn._static_decode = True
    T = defaultdict(list)

    def wrap(owner, name, key):
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            return
        if isinstance(fn, classmethod):
            fn = fn.__func__.__get__(owner)

        def timed(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            T[key].append(time.perf_counter() - t)
            return r
        setattr(owner, name, classmethod(lambda cls, *a, **k: timed(*a, **k)) if key == "Marks.from_ids" else timed)

    moe = rn.moe
    for owner, name in [(moe, "gate_drain" if gate else "hand_misses"), (moe, "partial"), (moe, "_partial"),
                        (moe, "_hand_all"), (moe_step.RoutingSync, "finish"), (gate_mod.DecodeGate, "wait"),
                        (guess_mod.Marks, "from_ids"), (guess_mod.Marks, "on_disk"), (guess_mod.Guesser, "unused"),
                        (guess_mod.Guesser, "read_ahead"), (guess_mod.Guesser, "check"), (moe.kern, "weight_reads")]:
        wrap(owner, name, f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
    tok = int(lg[-1].argmax())
    for i in range(300):
        if i == 20:
            T.clear()
        lg, s = rn.decode_batch([tok], [kv]) if gate else rn.forward([tok], kv, consolidate=False)
        tok = int(lg.reshape(-1, ENGINE_SPEC["n_vocab"])[-1].argmax())
    for k, v in T.items():
        print(f"| {k} | {len(v)} | {statistics.median(v) * 1e6:.1f} |")
    close_runner(rn, st)
