"""Run under TRITON_INTERPRET=1 (tests/test_kernels.py): the engine with the Triton expert kernels on the CPU.

Prints one JSON line: per slot configuration and pass, whether the logits are bit-identical to the first
configuration's, the max |diff| against the torch reference engine, and greedy tokens of a short decode.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth  # noqa: E402

model = write_synth(sys.argv[1], **ENGINE_SPEC)
E = ENGINE_SPEC["n_expert"]
P = prompt(40, ENGINE_SPEC["n_vocab"], seed=3)
out = {"configs": {}}


def run(kernels, vram, host):
    rn, st = in_process_runner(model, vram, host, kernels=kernels)
    assert rn.kern.backend == kernels, rn.kern.backend
    res = []
    try:
        for consolidate in (False, True, False):          # cold, warm, after consolidation
            lg, s = rn.forward(P, rn.new_cache(64), all_logits=True, consolidate=consolidate)
            rn.settle()
            res.append((lg, dict(s.reads)))
        kv = rn.new_cache(64)
        lg, _ = rn.forward(P, kv, consolidate=True)
        toks, steps = [], []
        for _ in range(4):                                 # decode keeps the store pass open
            t = int(lg[-1].argmax())
            toks.append(t)
            lg, s = rn.forward([t], kv, consolidate=False)
            steps.append(lg)
        rn.consolidate()
        return res, toks, steps
    finally:
        close_runner(rn, st)


ref, ref_toks, ref_steps = run("torch", 0, 0)
base = None
for vram, host in [(0, 0), (5, 15), (E, 0)]:
    res, toks, steps = run("triton", vram, host)
    if base is None:
        base = (res, steps)
    key = f"{vram}v{host}h"
    out["configs"][key] = {
        "bit_identical": all(torch.equal(a[0], b[0]) for a, b in zip(res, base[0]))
        and all(torch.equal(a, b) for a, b in zip(steps, base[1])),
        "max_abs_vs_torch": max(float((a[0] - b[0]).abs().max()) for a, b in zip(res, ref)),
        "max_logit": float(ref[0][0].abs().max()),
        "greedy_equal_torch": toks == ref_toks,
        "reads": [r[1] for r in res],
    }
print(json.dumps(out))
