"""Run under TRITON_INTERPRET=1 (tests/worker/test_decode_at_hand.py): decode's at-hand group on the Triton kernels.

    at_hand_triton_check.py MODEL.gguf

The engine (qwen3moe ENGINE_SPEC at 16 experts, Q8_0) decodes in the static form with the triton kernels on the CPU,
the at-hand table on and off, in a VRAM/host/disk mix: the table's host entries are byte offsets from the slot pool's
address into the arena (another mapping, as on CUDA), read in place by the kernels. Prints one JSON line: whether the
decode logits are the same bits, the reads per tier of both, and how many host entries the table held.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from betelgeuse.store.directory import TIER_HOST  # noqa: E402

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth  # noqa: E402

spec = {**ENGINE_SPEC, "n_expert": 16}
model = write_synth(sys.argv[1], **spec)


def run(hand: bool):
    rn, st = in_process_runner(model, 3, 8, kernels="triton", decode_at_hand=hand, decode_consolidate_every=0)
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(24, spec["n_vocab"], seed=3), kv)
        rn.settle()
        rn._static_decode = True
        out, reads, host_entries = [], [], 0
        for _ in range(3):
            lg, s = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            out.append(lg)
            reads.append(dict(s.reads))
            if hand:
                snap = rn.session.snap
                at = rn.moe.hand.host[snap["tier"] == TIER_HOST]
                pool, arena = rn.cache.pool.data_ptr(), rn.cache.host.data_ptr()
                inside = (at >= arena - pool) & (at < arena - pool + rn.cache.arena.nbytes)
                host_entries = int(inside.sum()) if (at != -1).all() else -1
        return torch.cat(out), reads, host_entries
    finally:
        close_runner(rn, st)


a, ra, n = run(True)
b, rb, _ = run(False)
print(json.dumps({"bit_identical": bool(torch.equal(a, b)), "reads_on": ra, "reads_off": rb, "host_entries": n,
                  "finite": bool(np.isfinite(a.numpy()).all())}))
