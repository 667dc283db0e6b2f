"""Calibrated synthetic routers: a small file's routing, measured through the reference model on a random prompt,
is within the stated tolerance of the published decode statistics (synth_router.TARGET / TOLERANCE), for qwen3moe
and deepseek4 alike; the file's metadata carries the target and the simulated statistics; uniform routing (the
labelled worst case) is far from the target."""

from __future__ import annotations

import pytest

from betelgeuse.gguf.header import read_header
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.gguf.synth_router import TARGET, TARGET_NAME, TOLERANCE, read_router_metadata, summary
from betelgeuse.routing.measure import random_prompt, reference_trace
from betelgeuse.routing_stats import trace_stats

TOKENS = 512                    # the calibration's window (synth_router.SIM_TOKENS)
# the benchmark's expert ratio (128 experts, top-8) at a size the CPU reference runs in seconds
QWEN = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=128, n_expert_used=8, n_ff_exp=32,
            n_vocab=512, context_length=1024)
# V4-Flash's ratio (top-6) and a sliding window that holds the kernel; layer 0 hash-routed, 1-2 routed
DS4 = dict(n_layer=3, n_embd=128, n_expert=128, n_expert_used=6, sliding_window=64, n_hash_layers=1,
           compress_ratios=(0, 4, 128))


@pytest.fixture(autouse=True)
def one_thread():
    """The reference model's many small expert matmuls run ~10x faster on one thread when the CPU is shared."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _stats(path, skip_layers: int = 0) -> dict:
    md = read_header(path).metadata
    arch = md["general.architecture"]
    ids, w, _ = reference_trace(path, random_prompt(len(md["tokenizer.ggml.tokens"]), TOKENS))
    return summary(trace_stats(ids[:, skip_layers:], int(md[f"{arch}.expert_count"]), weights=w[:, skip_layers:]))


def _write(tmp_path, preset, router, geometry):
    p = tmp_path / f"{preset}-{router}.gguf"
    write_model(p, spec_from_preset(preset, router=router, **geometry), progress=False)
    return p


def _within(measured: dict, reference: dict, tol: dict = TOLERANCE):
    bad = {k: (round(measured[k], 3), reference[k]) for k, t in tol.items() if abs(measured[k] - reference[k]) > t}
    assert not bad, f"outside the tolerance {tol}: {bad}"


def test_qwen3moe_calibrated_router_matches_real_decode_statistics(tmp_path):
    p = _write(tmp_path, "tiny", "calibrated", QWEN)
    meta = read_router_metadata(read_header(p).metadata)
    assert meta["target"] == TARGET_NAME and meta["knobs"]["router_drift"] > 0
    assert meta["target_stats"]["repeat_next"] == pytest.approx(TARGET["repeat_next"])
    measured = _stats(p)
    _within(measured, TARGET)
    assert measured["reuse_median"] == TARGET["reuse_median"]
    _within(meta["simulated"], measured, {k: 0.05 for k in TOLERANCE})      # the simulation predicts the file
    # rank weights: the logit scale is set from an estimate of the residual's growth; rank 0 within 0.05
    assert abs(measured["rank_weight"][0] - TARGET["rank_weight"][0]) < 0.05, measured["rank_weight"]


def test_deepseek4_calibrated_router_matches_real_decode_statistics(tmp_path):
    p = _write(tmp_path, "ds4-tiny", "calibrated", DS4)
    assert read_router_metadata(read_header(p).metadata)["target"] == TARGET_NAME
    _within(_stats(p, skip_layers=1), TARGET)        # hash layers route by token id: no locality from the router


def test_uniform_router_is_the_worst_case(tmp_path):
    p = _write(tmp_path, "tiny", "uniform", QWEN)
    assert read_router_metadata(read_header(p).metadata)["target"] is None
    s = _stats(p)
    assert s["repeat_next"] < 0.15 and s["lru_hit_40"] < 0.6 and s["top_share_25"] < 0.5, s


@pytest.mark.parametrize("preset,geometry,experts", [
    ("tiny", {**QWEN, "n_ff_exp": 256, "qtype": "Q4_K_M"}, "Q4_K"),
    ("ds4-tiny", {**DS4, "n_embd": 256, "n_ff_exp": 256, "qtype": "Q2_K"}, "Q2_K")])
def test_calibrated_router_with_k_quant_experts(tmp_path, preset, geometry, experts):
    """A calibrated router and a K-quant file (synth --qtype) together: the experts in their type with the reserved
    rows zero, qwen3moe's Q4_K_M attention Q6_K except layer 0's kernel head (given rows need a quantizer: Q8_0),
    and the routing still within the tolerance."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from betelgeuse.gguf import synth, synth_ds4
    spec = spec_from_preset(preset, router="calibrated", **geometry)
    p = tmp_path / "k.gguf"
    write_model(p, spec, progress=False)
    tensors = {t.name: t for t in GGUFReader(p).tensors}
    types = {k: t.tensor_type.name for k, t in tensors.items()}
    assert {v for k, v in types.items() if "_exps." in k} == {experts}
    if preset == "tiny":
        assert types["blk.0.attn_q.weight"] == types["blk.0.attn_output.weight"] == "Q8_0"
        assert types["blk.1.attn_q.weight"] == types["blk.1.attn_output.weight"] == "Q6_K"
    held = list((synth if preset == "tiny" else synth_ds4).router_plan(spec).reserved)
    t = tensors["blk.1.ffn_down_exps.weight"]
    down = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])     # [E, H, F]
    assert (down[:, held] == 0).all() and (np.abs(down).sum(axis=2) > 0).sum() == down.shape[0] * (256 - len(held))
    _within(_stats(p, skip_layers=1 if preset.startswith("ds4") else 0), TARGET)
