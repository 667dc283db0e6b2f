"""The prefill chunk a run uses (`[engine] prefill_chunk`, model/chunks.py): `auto`, the default, is the
architecture's (its model class's prefill_chunk: qwen3moe 64, the prefix cache's block; deepseek4 and deepseek41 256,
where every chunk launches the attention front's kernels again), at most max_batched_tokens; a number is kept as
given. The runner resolves it (EngineConfig.chunk_for) and the engine, its scheduler and its prefix cache run with the
result, which ModelInfo (gRPC, /v1/models meta) reports. The reference models default to the same chunk, so at the
defaults a deepseek4 prompt of two chunks gives the reference's bits; its snapshot resume at 256 against
transformers is tests/model/test_deepseek4_oracle.py, through the engine tests/worker/test_snapshot_cache.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from betelgeuse.config import EngineConfig, engine_config
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.model import reference_model
from betelgeuse.settings import Settings

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, metered_engine, write_synth

DEFAULTS = {"qwen3moe": 64, "deepseek4": 256, "deepseek41": 256}      # tokens: the model classes' prefill_chunk


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("chunk")
    out = {"qwen3moe": write_synth(d / "qwen3moe.gguf", **ENGINE_SPEC)}
    for arch, preset in (("deepseek4", "ds4-tiny"), ("deepseek41", "ds41-tiny")):
        out[arch] = d / f"{preset}.gguf"
        write_model(out[arch], replace(spec_from_preset(preset), expert_qtype="Q8_0", seed=2), progress=False)
    return out


def test_the_setting_defaults_to_auto():
    assert Settings().engine.prefill_chunk == "auto" == engine_config(Settings(), use_torch=False).prefill_chunk
    cfg = EngineConfig(model_path="m", max_batched_tokens=100)
    assert (cfg.chunk_for(64), cfg.chunk_for(256)) == (64, 100)          # the architecture's, within a pass
    assert EngineConfig(model_path="m", prefill_chunk=32).chunk_for(256) == 32


@pytest.mark.parametrize("arch", list(DEFAULTS))
def test_a_runner_left_at_the_default_runs_its_architectures_chunk(models, arch):
    want = DEFAULTS[arch]
    for kw, chunk in (({}, want), ({"prefill_chunk": 32}, 32), ({"max_batched_tokens": 100}, min(want, 100))):
        rn, st = in_process_runner(models[arch], 0, 0, **kw)
        try:
            assert type(rn.model).prefill_chunk == want and rn.mcfg.arch == arch
            assert rn.chunk == rn.cfg.prefill_chunk == chunk, (arch, kw)
        finally:
            close_runner(rn, st)
    assert reference_model(models[arch]).chunk == want       # the reference's default: the same chunk


@pytest.mark.parametrize("arch", ["deepseek4", "deepseek41"])
def test_at_the_defaults_two_chunks_give_the_references_bits(models, arch):
    """A 300-token prompt on the default settings: 2 chunks of 256, logits bit-identical to the reference model's on
    its default; an engine's scheduler grid and snapshot checkpoints are that chunk, and ModelInfo (its gRPC message
    too) says 256."""
    from services.grpc.convert import model_info_to_pb
    ids = [int(x) for x in np.random.default_rng(7).integers(3, 512, 300)]
    ref = reference_model(models[arch])
    with torch.no_grad():
        want = ref.forward(torch.tensor(ids), ref.new_cache(320)).float()
    rn, st = in_process_runner(models[arch], 3, 5)
    try:
        got, _ = rn.forward(ids, rn.new_cache(320), all_logits=True)
        assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3e}"
    finally:
        close_runner(rn, st)
    eng, close = metered_engine(EngineConfig(model_path=str(models[arch]), vram_slots=3, host_slots=5, read_threads=2,
                                             max_context=512))
    try:
        assert eng.cfg.prefill_chunk == eng.runner.chunk == eng.scheduler.limits.chunk == 256
        assert eng.prefix_cache.block == 256
        mi = eng.model_info()
        assert mi.prefill_chunk == model_info_to_pb(mi).prefill_chunk == 256
    finally:
        close()
