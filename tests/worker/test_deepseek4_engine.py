"""deepseek4 through the out-of-core engine (runner, slots, store), in one process on the CPU.

Invariant 1 for the second architecture: logits bit-identical to the deepseek4 Deepseek4Reference (experts
dequantized from the file's mmap, no store) whatever the slot configuration, cold, warm and after
consolidation; decode steps (which carry the sliding-window ring, the open compression windows and the
compressed entries) too. MXFP4 routed experts (what published files hold) and Q8_0 ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betelgeuse.model.deepseek4 import DS4Cache
from betelgeuse.routing_approx import Residency

from engine_helpers import (close_runner, close_to_reference_decode, decode_bit_identical, in_process_runner,
                            lanes_decode, synth_reference, three_passes)

E = 8
PROMPT = [int(x) for x in np.random.default_rng(4).integers(0, 512, 150)]   # crosses SWA 16, CSA 4, HCA 128
# prefill chunk of the reference and the runners here: the 150-token prompt spans 3 chunks, each layer's front running
# chunk after chunk (deepseek4's default, 256, would take it whole; tests/worker/test_prefill_chunk.py runs that one)
CHUNK = 64
CONFIGS = [(0, 0), (2, 3), (E, 0), (3, E - 3)]


def _model(tmp_path_factory, qtype):
    return synth_reference(tmp_path_factory, "ds4-tiny", PROMPT, 200, chunk=CHUNK, expert_qtype=qtype, seed=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model(tmp_path_factory, "MXFP4")


@pytest.fixture(scope="module")
def model_q8(tmp_path_factory):
    return _model(tmp_path_factory, "Q8_0")


@pytest.mark.parametrize("vram,host", CONFIGS, ids=[f"{v}v{h}h" for v, h in CONFIGS])
def test_logits_bit_identical_across_slots_and_passes(model, vram, host):
    _check_slots(model, vram, host)


def test_q8_0_experts_bit_identical(model_q8):
    _check_slots(model_q8, 2, 3)


def _check_slots(model, vram, host):
    path, _, want = model

    def check(runner, kv):
        assert type(runner.model).__name__ == "Deepseek4Model" and isinstance(kv, DS4Cache)
    stats, _ = three_passes(path, PROMPT, want, vram, host, 200, check, prefill_chunk=CHUNK)
    reads = [st.reads for st in stats]
    n = sum(reads[0].values())
    assert reads[0] == {"vram": 0, "host": 0, "disk": n}          # cold: everything from disk
    if vram:
        assert reads[2]["vram"] > 0, reads
    if host:
        assert reads[2]["host"] > 0, reads
    if vram + host >= E:
        assert reads[2]["disk"] == 0, reads


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_bit_identical(model, static):
    """Prefill 110 tokens, then 40 single-token passes (crossing the HCA window at 127); every row equals the reference's decode, whose
    rows in turn match its whole-prompt prefill within float32 noise (decode equals prefill). static: the runner's
    static decode (worker/decode_graphs.py SoloDecode, CUDA's form, eagerly here) — the same bits."""
    decode_bit_identical(model, PROMPT, 110, 3, E - 3, static, prefill_chunk=CHUNK)


def test_resident_routing_mode(model):
    """The approximate `resident` mode: rank 0 is the exact choice, later ranks among resident experts;
    weights still renormalised x routed_scale; hash-routed layers keep their static choice."""
    _, ref, _ = model
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    resident = torch.zeros(E, dtype=torch.bool)
    resident[[1, 5, 6]] = True
    exact, _ = ref.route(3, h)
    ids, w = ref.route(3, h, None, Residency("resident", resident))
    assert torch.equal(ids[:, 0], exact[:, 0]) and bool(resident[ids[:, 1:]].all())
    assert torch.allclose(w.sum(-1), torch.full((20,), ref.p.routed_scale))
    toks = torch.arange(20)
    assert torch.equal(ref.route(0, h, toks, Residency("resident", resident))[0], ref.route(0, h, toks)[0])


def test_batched_decode_bit_identical(model):
    """runner.decode_batch (continuous batching: one pass, each expert loaded once) gives each sequence the
    reference's own decode row."""
    path, ref, _ = model
    prompts, nxt, want = (PROMPT[:35], PROMPT[40:60]), (7, 9), []
    for p, t in zip(prompts, nxt):
        kv = ref.new_cache(64)
        ref.forward(torch.tensor(p), kv)
        want.append(ref.forward(torch.tensor([t]), kv)[-1])
    runner, store = in_process_runner(path, 2, 3)
    try:
        kvs = [runner.new_cache(64) for _ in prompts]
        for p, kv in zip(prompts, kvs):
            runner.forward(list(p), kv)
        logits, _ = runner.decode_batch(list(nxt), kvs)
        assert torch.equal(logits[0], want[0]) and torch.equal(logits[1], want[1])
    finally:
        close_runner(runner, store)


def test_lanes_batch_invariant(model):
    """Batched decode in the static form (the lanes: CUDA's batched decode) crossing compressor windows: each
    sequence's logits bit-identical batched or alone and across slot configurations, and equal to the reference's
    decode within float noise (the lanes' row-batched projections may round differently from one-row ones)."""
    path, ref, _ = model
    prompts = [PROMPT[:30], PROMPT[50:63], PROMPT[70:77]]
    alone = lanes_decode(path, prompts, 6, 0, 0, together=False)
    for vram, host in ((0, 0), (E, 0), (2, 3)):
        got = lanes_decode(path, prompts, 6, vram, host, together=True)
        for a, b in zip(alone, got):
            assert torch.equal(a, b), (vram, host, (a - b).abs().max())
    close_to_reference_decode(ref, prompts, alone)
