"""The slot plan's VRAM accounting (store/plan.py vram_fixed_bytes) against what the worker really allocates,
measured on the CPU by tests/memtrack.py (the live tensors a piece of code allocates):

- dense weights: the plan's dense_bytes equals the bytes load_dense allocates, per architecture (deepseek4 keeps
  its norms / mHC / sinks in float32 and tid2eid in int64: counted at the compute dtype they were under-counted);
- deepseek4's prefill activations: a pass through a ratio-4 (CSA + indexer) and a ratio-128 layer at V4-Flash's
  shapes, CUDA's allocation pattern (TritonOps with the kernel launches stubbed, the matrix products allocated
  but not computed), stays within Arch.activation_bytes + the attention scratch, which is not a wild over-estimate
  either (each VRAM slot the estimate takes is 13 MB of experts that do not fit).

The per-sequence state (state_bytes == DS4Cache.nbytes) is tests/model/test_model_interface.py's; graph pools and the
CUDA context are measured on the device (deploy/device/check_ds4.py, step vram).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from betelgeuse.gguf import ds4layout
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.model.registry import ARCHS
from betelgeuse.store.plan import dense_bytes
from memtrack import PeakLive, stub_triton


def test_plan_counts_the_dense_weights_exactly(tiny_model, tmp_path):
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    ds4 = tmp_path / "ds4-tiny.gguf"
    write_model(ds4, spec_from_preset("ds4-tiny"), progress=False)
    for path in (tiny_model, ds4):
        with GGUFModelFile.open(str(path)) as f:
            with PeakLive() as pl:
                dense = ARCHS[f.config.arch].engine_class().load_dense(f, "cpu", torch.bfloat16)
            assert pl.current == dense_bytes(f, 2), (f.config.arch, pl.current, dense_bytes(f, 2))
            assert pl.current > 0
            del dense


@pytest.fixture
def stubbed_triton(monkeypatch):
    pytest.importorskip("triton")
    from betelgeuse.kernels.triton_ds4 import TritonOps
    stub_triton(monkeypatch)
    return TritonOps()


def test_ds4_activation_estimate_bounds_a_prefill_pass(stubbed_triton):
    from betelgeuse.gguf.synth import spec_from_preset
    from betelgeuse.model.deepseek4 import Deepseek4Model
    spec = replace(spec_from_preset("ds4-flash"), n_layer=2, compress_ratios=(4, 128), n_vocab=256, n_expert=8,
                   n_hash_layers=0)
    c = spec.config()
    dt = torch.bfloat16
    w = {}
    for name, shape in ds4layout.tensors(c):          # zeros: the values do not matter to what is allocated
        if ds4layout.kind(name) not in ds4layout.EXPERTS:
            w[name] = torch.zeros(shape, dtype={8: torch.int64, 4: torch.float32, 2: dt}[ds4layout.dense_elem_bytes(name, 2)])
    m = Deepseek4Model(c, w)
    m.ops = stubbed_triton
    m.ops.prepare(m.w, c.n_layer)
    a = ARCHS["deepseek4"]
    T = 1024
    cache = m.new_cache(T)
    with torch.no_grad():
        x = m.embed(torch.arange(T) % c.n_vocab)
        pos = cache.begin(T)
        with PeakLive(shapes_only=True) as pl:
            for layer in range(c.n_layer):
                x = m.attention_block(layer, x, cache, pos)
                h, aux = m.moe_input(layer, x)
                routed = torch.empty(T, c.n_embd, dtype=dt)
                routed = routed.unsqueeze(1).expand(-1, c.n_expert_used, -1).float().sum(1).to(dt)   # the MoE's rows
                x = m.moe_output(layer, x, aux, h, routed)
                del h, aux, routed
    measured = pl.peak + T * c.ds4.hc_mult * c.n_embd * 2          # + the pass's input streams (made before)
    estimate = a.activation_bytes(c, T, 2) + a.scratch_bytes(c, T)
    assert measured <= estimate, (measured, estimate)
    assert estimate <= 1.5 * measured, (measured, estimate)
