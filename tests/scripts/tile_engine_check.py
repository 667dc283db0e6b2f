"""Run under TRITON_INTERPRET=1 (tests/worker/test_tile_experts.py): engine.tile_experts on the CPU, the Triton
expert kernels interpreted.

    tile_engine_check.py MODEL.gguf [QTYPE]     # a qwen3moe ENGINE_SPEC model (Q8_0, or QTYPE: Q4_K 256 wide)

The same engine (triton kernels, act_quant off, 3 VRAM + 2 host slots a layer of 8 experts: a layer's launches mix
VRAM, host and disk experts) with tile_experts off and on, each over three passes of the prompt (cold, warm, after
consolidation: VRAM slots filled, evicted and refilled), 3 decode steps, then 2 steps of it and a second sequence
in one batch (decode_batch); the torch engine beside them (the reference path). Prints one JSON line: whether every pass and decode step of the tiled engine is bit-identical to the
untiled one's, the max |diff| of both against the torch engine, the layers tiled and their VRAM experts flagged, the
reads per tier (the tiers really used), and the expert launches told `tiled`.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from betelgeuse.kernels import triton_moe  # noqa: E402
from betelgeuse.worker.expert_cache import TILED  # noqa: E402
from engine_helpers import ENGINE_SPEC, close_runner, greedy_steps, in_process_runner, prompt, write_synth  # noqa: E402

QTYPE = sys.argv[2] if len(sys.argv) > 2 else "Q8_0"
# 8 experts, 2 layers, 64 wide (Q8_0: gate/up [64, 64] 2 blocks a row, whole 64-row tiles); Q4_K: K 256 / 512 (down's
# rows two super-blocks: the tiles move them). The interpreter runs every program of a launch's grid: small is fast
SPEC = {**ENGINE_SPEC, "n_layer": 2, "n_expert": 8, "n_expert_used": 2}
if QTYPE == "Q4_K":
    SPEC.update(qtype="Q4_K", n_embd=256, head_dim=64, n_ff_exp=512)
model = write_synth(sys.argv[1], **SPEC)
P, CTX = prompt(6, SPEC["n_vocab"], seed=3), 32

tiled_launches = 0
for name, at in (("gate_up", 13), ("down", 11)):     # the launches told `tiled` (positional: MoEKernels.apply's)
    def counted(*a, _f=getattr(triton_moe, name), _at=at):
        global tiled_launches
        tiled_launches += len(a) > _at and bool(a[_at])
        return _f(*a)
    setattr(triton_moe, name, counted)


def run(kernels, tile):
    rn, st = in_process_runner(model, 3, 2, kernels=kernels, tile_experts=tile, max_running=2)
    assert rn.kern.backend == kernels, rn.kern.backend
    info = {}
    try:
        res = []
        for consolidate in (False, True, False):          # cold, warm, after consolidation
            kv = rn.new_cache(CTX)
            lg, s = rn.forward(P, kv, all_logits=True, consolidate=consolidate)
            rn.settle()
            res.append((lg, dict(s.reads)))
        steps = []
        for _ in range(3):
            lg, s = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            steps.append(lg)
        kv2 = rn.new_cache(CTX)                 # a second sequence: both decoded in one batch (decode_batch)
        lg2, _ = rn.forward(P[:4], kv2, consolidate=False)
        steps += list(greedy_steps(rn, [int(lg[-1].argmax()), int(lg2[-1].argmax())], [kv, kv2], "batch", 2)[0])
        c = rn.session.cache
        info["layers_tiled"] = 0 if c.layouts is None else int((c.layouts == TILED).sum())
        held = c.vram_base >= 0
        info["vram_experts"] = int(held.sum())
        info["flagged"] = int((c.vram_base[held] & 1).sum())
        info["kern_tiled"] = rn.kern.tiled.tolist()
        return res, steps, info
    finally:
        close_runner(rn, st)


ref, ref_steps, _ = run("torch", False)
off, off_steps, off_info = run("triton", False)
n0 = tiled_launches
on, on_steps, on_info = run("triton", True)
assert n0 == 0, n0
def diff(a, b) -> float:
    """max |a - b|; inf where a NaN is in either (max() of floats would drop it)."""
    d = float((a - b).abs().max())
    return float("inf") if d != d else d


out = {
    "bit_identical": all(torch.equal(a[0], b[0]) for a, b in zip(on, off))
    and all(torch.equal(a, b) for a, b in zip(on_steps, off_steps)),
    "max_abs_vs_torch": max(diff(a[0], b[0]) for a, b in zip(on + off, ref + ref)),
    "decode_max_abs_vs_torch": max(diff(a, b) for a, b in zip(on_steps + off_steps, ref_steps + ref_steps)),
    "max_logit": float(ref[0][0].abs().max()),
    "greedy_equal_torch": [a.argmax(-1).tolist() for a in on_steps] == [a.argmax(-1).tolist() for a in ref_steps],
    "reads": [r[1] for r in on],
    "on": on_info, "off": off_info, "tiled_launches": tiled_launches,
    "n_layer": SPEC["n_layer"],
}
print(json.dumps(out))
