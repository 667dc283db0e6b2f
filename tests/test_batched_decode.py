"""Continuous batching for decode (issue 11, part): several sequences decode in ONE pass, each expert applied once
per layer to every row that chose it, and each sequence's logits are bit-identical to the same sequence decoded
alone (invariant 6), whatever else shares the batch and whatever the slot configuration."""

import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

import pytest

PROMPTS = [prompt(n, ENGINE_SPEC["n_vocab"], seed=s) for n, s in ((40, 3), (17, 5), (29, 7))]
STEPS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("batch") / "engine.gguf", **ENGINE_SPEC)


def _solo(model, P, static=False, lanes=None):
    """P decoded alone for STEPS greedy tokens -> logits [STEPS, n_vocab]. lanes: through decode_batch with one
    sequence (how the engine decodes a lone sequence in the static form) on a runner of that many lanes;
    else runner.forward, one row."""
    rn, st = in_process_runner(model, 0, 0, **({"max_running": lanes} if lanes else {}))
    rn._static_decode = static
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(P, kv)
        out = []
        for _ in range(STEPS):
            tok = int(lg[-1].argmax())
            lg, _ = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            out.append(lg[0])
        return torch.stack(out)
    finally:
        close_runner(rn, st)


# static: the CUDA decode form (device-side positions, whole-cache attention) forced on the CPU, so that the batched
# lanes of worker/lanes.py run here too (eagerly: graphs need CUDA; deploy/device/check_cuda.py checks capture and
# replay on the GPU). There a sequence alone is decoded through the same lanes (one sequence, the others idle), and
# the lanes' row-batched ops also agree with forward()'s one-row decode to rounding.
@pytest.mark.parametrize("vram,host,static", [(5, 15, False), (32, 0, False), (5, 15, True)])
def test_batched_decode_equals_solo(model, vram, host, static):
    want = [_solo(model, P, static, lanes=4 if static else None) for P in PROMPTS]
    if static:                                   # the lanes' math against the one-row decode: rounding only
        ref = [_solo(model, P, static) for P in PROMPTS]
        for w, r in zip(want, ref):
            torch.testing.assert_close(w, r, rtol=1e-4, atol=1e-4)
    rn, st = in_process_runner(model, vram, host, max_running=4)
    rn._static_decode = static
    try:
        kvs, last = [], []
        for P in PROMPTS:
            kv = rn.new_cache(64)
            lg, _ = rn.forward(P, kv)
            kvs.append(kv)
            last.append(int(lg[-1].argmax()))
        got = [[] for _ in PROMPTS]
        loads = []
        for step in range(STEPS):
            live = list(range(len(PROMPTS))) if step % 2 == 0 else [0, 2]     # sequence 1 sits out: other batches
            lg, s = rn.decode_batch([last[i] for i in live], [kvs[i] for i in live])
            loads.append((len(live), sum(s.reads.values())))
            for j, i in enumerate(live):
                got[i].append(lg[j])
                last[i] = int(lg[j].argmax())
        # sequence 1 decoded only at even steps: compare what it has
        for i, g in enumerate(got):
            assert torch.equal(torch.stack(g), want[i][:len(g)]), i
        # every expert was applied once per layer for all rows that chose it: fewer applications than rows
        if static:                               # every sequence kept its own lane; a finished one lets go of it
            lanes = rn._lanes
            assert sorted(x.lane for x in lanes.seqs.values()) == [0, 1, 2]
            rn.release(kvs[1])
            assert kvs[1].uid not in lanes.seqs and kvs[0].uid in lanes.seqs
        n, apps = loads[0]
        assert apps < n * ENGINE_SPEC["n_expert_used"] * ENGINE_SPEC["n_layer"]
    finally:
        close_runner(rn, st)
