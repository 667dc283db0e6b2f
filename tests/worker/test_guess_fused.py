"""The decode guess all layers at once (model.guess_ids, worker/guess.py) against the per-layer form
(guess_per_layer: each guessed layer's own moe_input and unhooked route, what the guess was before): the same ids
from every layer at depths 1, 2, 3 (fewer where fewer layers remain), for qwen3moe, deepseek4 (hash layers in range)
and deepseek41 on the CPU path; and the stacked router weights are the model's own storage (views: no extra memory).
TritonOps' fused form is checked against the same reference under Triton's interpreter
(tests/kernels/test_ds4_kernels.py::test_fused_guess_picks_the_per_layer_ids)."""

from __future__ import annotations

import pytest
import torch

from betelgeuse.model.registry import reference_model
from betelgeuse.worker.guess import guess_ahead, guess_per_layer


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from engine_helpers import ENGINE_SPEC, write_synth
    d = tmp_path_factory.mktemp("guess-fused")
    out = {"qwen3moe": write_synth(d / "qwen.gguf", **dict(ENGINE_SPEC, n_layer=5, qtype="F32"))}
    for name, preset in (("deepseek4", "ds4-tiny"), ("deepseek41", "ds41-tiny")):
        out[name] = d / f"{preset}.gguf"
        write_model(out[name], spec_from_preset(preset), progress=False)
    return out


def _residual(m, T: int, g: torch.Generator) -> torch.Tensor:
    """A residual after attention in the model's form: [T,H]; deepseek4 [T,hc,H]; deepseek41 with its pre packed."""
    H = m.cfg.n_embd
    if m.cfg.arch == "qwen3moe":
        return torch.randn(T, H, generator=g)
    X = torch.randn(T, m.p.hc_mult, H, generator=g)
    return m._pack(X, torch.rand(T, m.p.hc_mult, generator=g) + 0.1) if m.cfg.arch == "deepseek41" else X


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4", "deepseek41"])
def test_guess_ids_are_the_per_layer_ids(paths, arch):
    m = reference_model(paths[arch])
    L, k = m.cfg.n_layer, m.cfg.n_expert_used
    g = torch.Generator().manual_seed(3)
    x, tok = _residual(m, 3, g), torch.tensor([5, 77, 300])
    with torch.no_grad():
        for layer in range(L):
            for depth in (1, 2, 3):
                n = min(depth, L - 1 - layer)
                got = guess_ahead(m, layer, x, tok, depth, L)
                if n == 0:
                    assert got is None
                    continue
                want = guess_per_layer(m, layer, x, tok, n)
                assert got.shape == (3, n, k) and got.dtype == torch.int64, (layer, depth, got.shape)
                assert torch.equal(got, want), (layer, depth, got, want)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_stacked_routers_are_the_model_weights(paths, arch):
    """Each layer's router (and the guess's other per-layer tensors) is a view of the stack: the dense bytes the
    VRAM plan counts are all there is."""
    m = reference_model(paths[arch])
    for l in range(m.cfg.n_layer):
        if arch == "qwen3moe":
            pairs = [(m.dense.layers[l].router, m._routers[l]), (m.dense.layers[l].ffn_norm, m._ffn_norms[l])]
        else:
            st = m.guess_stack
            pairs = [(m.w[f"blk.{l}.{n}"], t[l]) for n, t in (("ffn_gate_inp.weight", st.router),
                                                              ("hc_ffn_fn.weight", st.fn), ("ffn_norm.weight", st.norm))]
        for w, view in pairs:
            assert w.data_ptr() == view.data_ptr() and w.shape == view.shape, l


def test_qwen3moe_guess_launches(paths):
    """qwen3moe's guess of 3 layers: one norm (6 torch ops on the CPU, one Triton launch on CUDA), the ffn_norm
    multiply, one bmm, one softmax, one top-k = 10 ops here (5 launches on CUDA), whatever the depth; each layer's
    own moe_input and route (the earlier form) made 34 (19 on CUDA), which this bound fails."""
    from memtrack import KernelCount
    m = reference_model(paths["qwen3moe"])
    x, tok = torch.randn(1, m.cfg.n_embd), torch.tensor([5])
    counts = {}
    for name, fn in (("fused", lambda: guess_ahead(m, 0, x, tok, 3, m.cfg.n_layer)),
                     ("per", lambda: guess_per_layer(m, 0, x, tok, 3))):
        with torch.no_grad(), KernelCount() as k:
            fn()
        counts[name] = k.total
    assert counts["fused"] <= 10 and counts["per"] == 34, counts
