"""deepseek4 and deepseek41 prefill resumed after a prefix: the question behind their prefix cache
(worker/snapshot_cache.py).

A deepseek4 state is not per token (a window ring, compressors' open windows, entries pooling 4 or 128 tokens), so a
cached prefix is reused as a whole snapshot of the state after it, and the rest of the prompt is prefilled from
there. That is exact only if a prefill resumed at n gives the bits of one unbroken prefill of the whole prompt.
Measured here (ds4-tiny, ratios 4 and 128, window 16, float32 CPU): prefill in position-aligned chunks (each layer
chunk after chunk from its own length, model/chunks.py), resumed at any multiple of the chunk, is bit-identical
to the unbroken chunked prefill -- whether the chunk is a multiple of the largest ratio (128) or not (32, 64) -- and
so is a state restored from a snapshot (model.restore) or kept by the pass whose chunk ended there (state.mark).
Not exact: one unchunked pass against two (its matmuls see other row counts: ~3e-6 apart), or a resume off the
chunk grid; neither is what the engine runs. That the chunked prefill is still the model transformers computes is
tests/model/test_deepseek4_oracle.py (the reference in chunks of 64, and of deepseek4's default, 256, on a 300-token
prompt resumed at 256).

deepseek41 (ds41-tiny: ratio-2 and ratio-1 KV sources, an index layer reused by the next, the candidate filter, Engram
before layers 1 and 4 with a 3-gram history) the same way: its cross-layer masks are per chunk and its state at a
boundary is the layers' tensors plus the Engram history (the snapshot's host part): resumed, restored or marked, the
bits of the unbroken chunked prefill; tests/model/test_deepseek41_oracle.py checks that prefill against NeMo.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.model import reference_model

PROMPT = [int(x) for x in np.random.default_rng(4).integers(0, 512, 330)]   # crosses window 16, CSA 4, HCA 128 x2


@pytest.fixture(scope="module", params=["ds4-tiny", "ds41-tiny"])
def ref(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ds4resume") / f"{request.param}.gguf"
    write_model(path, replace(spec_from_preset(request.param), expert_qtype="Q8_0", seed=2), progress=False)
    return reference_model(path)


def _prefill(ref, pieces, chunk, kv=None, first=0):
    ref.chunk = chunk
    kv = kv if kv is not None else ref.new_cache(400)
    out, a = [], first
    with torch.no_grad():
        for b in pieces:
            out.append(ref.forward(torch.tensor(PROMPT[a:b]), kv))
            a = b
    return torch.cat(out), kv


@pytest.mark.parametrize("chunk", [32, 64, 128])
def test_a_prefill_resumed_at_a_chunk_boundary_is_bit_identical(ref, chunk):
    whole, _ = _prefill(ref, [len(PROMPT)], chunk)
    for cut in range(chunk, len(PROMPT), chunk):
        got, _ = _prefill(ref, [cut, len(PROMPT)], chunk)
        assert torch.equal(got, whole), f"chunk {chunk}, resumed at {cut}: max |diff| {(got - whole).abs().max():.3e}"


def test_a_restored_snapshot_and_a_marked_checkpoint_resume_bit_identically(ref):
    chunk, cut = 64, 256
    whole, kv = _prefill(ref, [len(PROMPT)], chunk, ref.new_cache(400))
    # the checkpoint the whole prompt's pass keeps at `cut` (state.mark) is the state a prefill of PROMPT[:cut] leaves
    kv = ref.new_cache(400)
    kv.mark(cut)
    again, _ = _prefill(ref, [len(PROMPT)], chunk, kv)
    assert torch.equal(again, whole)
    snap = kv.take_mark()
    assert snap is not None and snap.length == cut and kv.take_mark() is None
    _, head = _prefill(ref, [cut], chunk)
    alone = ref.snapshot(head)
    assert all(torch.equal(a, b) for la, lb in zip(snap.layers, alone.layers, strict=True) for a, b in zip(la, lb, strict=True))
    t = torch.tensor([int(whole[-1].argmax())])
    with torch.no_grad():
        step = ref.forward(t, kv)                  # the decode step after the unbroken prefill
    # restored into fresh states of other sizes (the entries' rows follow max_len), the rest prefills to the same bits
    for max_len in (len(PROMPT) + 1, 1000):
        kv2 = ref.new_cache(max_len)
        ref.restore(kv2, snap)
        assert kv2.length == cut
        rest, kv2 = _prefill(ref, [len(PROMPT)], chunk, kv2, first=cut)
        assert torch.equal(rest, whole[cut:]), f"max_len {max_len}: max |diff| {(rest - whole[cut:]).abs().max():.3e}"
        # and the decode after it continues exactly as after the unbroken prefill
        with torch.no_grad():
            assert torch.equal(ref.forward(t, kv2), step)
    # a pass whose chunks do not end at the mark keeps nothing
    ref.chunk = None
    kv3 = ref.new_cache(400)
    kv3.mark(cut)
    with torch.no_grad():
        ref.forward(torch.tensor(PROMPT), kv3)
    assert kv3.take_mark() is None
