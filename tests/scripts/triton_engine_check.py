"""Run under TRITON_INTERPRET=1 (tests/kernels/test_kernels.py): the engine with the Triton expert kernels on the CPU.

    triton_engine_check.py MODEL.gguf            # qwen3moe ENGINE_SPEC at 16 experts (Q8_0), 24-token prompt
    triton_engine_check.py MODEL.gguf ds4-tiny   # deepseek4 ds4-tiny (MXFP4 experts, clamped SwiGLU), 34 tokens
    triton_engine_check.py --act-quant q8_1 MODEL.gguf   # the triton engines with engine.act_quant = q8_1

Two slot configurations that put different experts in different tiers (vram + host + disk, all in vram), each
over three passes of the prompt (cold, warm, after consolidation) and 2 decode steps. Prints one JSON line: per
slot configuration, whether every pass's logits are bit-identical to the first configuration's cold pass (and its
decode steps to the first configuration's), the max |diff| against the torch reference engine, and greedy tokens
of a short decode.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from betelgeuse.kernels.triton_launch import COUNTS  # noqa: E402

ACT_QUANT = "off"
if sys.argv[1] == "--act-quant":
    ACT_QUANT = sys.argv[2]
    del sys.argv[1:3]

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth  # noqa: E402

out = {"configs": {}}
if len(sys.argv) > 2:                                      # a deepseek4 preset: windows the prompt crosses
    from dataclasses import replace

    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from betelgeuse.model import reference_model
    # a SwiGLU limit that binds on this random model (the preset's 10 never does): clamp_effect says by how much
    spec = replace(spec_from_preset(sys.argv[2]), seed=2, swiglu_limit=0.25)
    model = sys.argv[1]
    write_model(model, spec, progress=False)
    E, P, CTX = spec.n_expert, prompt(34, spec.n_vocab, seed=4), 64
    CONFIGS = [(2, 3), (E, 0)]
    write_model(model + ".noclamp", replace(spec, swiglu_limit=1e30), progress=False)
    with torch.no_grad():
        a, b = (reference_model(m) for m in (model, model + ".noclamp"))
        la = a.forward(torch.tensor(P), a.new_cache(CTX))
        out["clamp_effect"] = float((la - b.forward(torch.tensor(P), b.new_cache(CTX))).abs().max() / la.abs().max())
else:
    # 16 experts, not ENGINE_SPEC's 32: the interpreter runs every program of a launch's grid, min(rows, E) of its
    # row blocks past the filled ones, so the time goes with E; 16 still spread over three tiers in 3v8h
    spec = {**ENGINE_SPEC, "n_expert": 16}
    model = write_synth(sys.argv[1], **spec)
    E, P, CTX = spec["n_expert"], prompt(24, spec["n_vocab"], seed=3), 64
    CONFIGS = [(3, 8), (E, 0)]


def expert_launches() -> int:
    """Launches of the expert kernels so far (triton_moe: gate_up, down, their mmvq forms, combine)."""
    return sum(n for k, n in COUNTS.items() if k.split("_")[1] in ("gate", "down", "combine"))


def run(kernels, vram, host):
    rn, st = in_process_runner(model, vram, host, kernels=kernels,
                               act_quant=ACT_QUANT if kernels == "triton" else "off")
    assert rn.kern.backend == kernels, rn.kern.backend
    out["expert_act"] = list(rn.model.expert_act)
    res = []
    try:
        for consolidate in (False, True, False):          # cold, warm, after consolidation
            kv = rn.new_cache(CTX)
            lg, s = rn.forward(P, kv, all_logits=True, consolidate=consolidate)
            rn.settle()
            res.append((lg, dict(s.reads)))
        toks, steps, launches = [], [], []  # launches per decode step: (expert-kernel launches, its layers)
        for _ in range(2):              # decode from the last pass's cache, the store pass kept open since its prefill
            t = int(lg[-1].argmax())
            toks.append(t)
            n0 = expert_launches()
            lg, s = rn.forward([t], kv, consolidate=False)
            launches.append((expert_launches() - n0, [(ls.groups, ls.disk) for ls in s.layers]))
            steps.append(lg)
        out.setdefault("decode_launches", {})[f"{kernels} {vram}v{host}h"] = launches
        rn.consolidate()
        return res, toks, steps
    finally:
        close_runner(rn, st)


ref, ref_toks, ref_steps = run("torch", 0, 0)
base = None
for vram, host in CONFIGS:
    res, toks, steps = run("triton", vram, host)
    if base is None:
        base = (res, steps)
    key = f"{vram}v{host}h"
    out["configs"][key] = {
        # every pass (cold, warm, consolidated) against the first configuration's cold pass
        "bit_identical": all(torch.equal(a[0], base[0][0][0]) for a in res)
        and all(torch.equal(a, b) for a, b in zip(steps, base[1])),
        "max_abs_vs_torch": max(float((a[0] - b[0]).abs().max()) for a, b in zip(res, ref)),
        "max_logit": float(ref[0][0].abs().max()),
        "greedy_equal_torch": toks == ref_toks,
        "reads": [r[1] for r in res],
    }
print(json.dumps(out))
