"""The static decode form (what CUDA decode always uses, and what its CUDA graphs capture), on the CPU.

Decode in the static form reads the position from a device tensor and attends over the whole KV cache with
the later keys masked, so that a captured graph never bakes in a sequence length. Its logits must stay
bit-identical across slot configurations (wholly VRAM-resident layers run inside the capturable part, the
others yield to the host), and equal the sliced decode within float32 noise with the same greedy tokens.
The CUDA graph replay itself is checked on the device (deploy/device/check_cuda.py: decode steps x slots).
"""

import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

import pytest

PROMPT = prompt(40, ENGINE_SPEC["n_vocab"], seed=3)
E = ENGINE_SPEC["n_expert"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("static") / "engine.gguf", **ENGINE_SPEC)


def _decode(model, vram, host, static, steps=5):
    rn, st = in_process_runner(model, vram, host)
    rn._static_decode = static
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(PROMPT, kv)
        rn.settle()      # the prefill's consolidation applied: decode passes do not wait for it (they would race it)
        outs, reads = [], []
        for _ in range(steps):
            lg, s = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            outs.append(lg)
            reads.append(s.reads)
        rn.consolidate()
        return torch.cat(outs), reads
    finally:
        close_runner(rn, st)


def test_static_decode_is_location_invariant_and_matches_sliced(model):
    sliced, _ = _decode(model, 0, 0, False)
    base, reads0 = _decode(model, 0, 0, True)
    assert reads0[-1]["disk"] > 0
    for vram, host in ((E, 0), (5, 15)):
        got, reads = _decode(model, vram, host, True)
        assert torch.equal(got, base), (vram, host)
        if vram == E:
            assert reads[-1] == {"vram": sum(reads0[-1].values()), "host": 0, "disk": 0}   # the capturable path
    assert (base - sliced).abs().max() <= 1e-4 * sliced.abs().max()
    assert torch.equal(base.argmax(-1), sliced.argmax(-1))
