"""deepseek4 GGUF: MXFP4 / I32 dequantization against gguf-py, reader validation, synth presets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT, GGUFValueType, quants

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import GGUFModelFile
from betelgeuse.gguf.quants import dequantize
from betelgeuse.gguf.synth import spec_from_preset
from betelgeuse.gguf.synth_common import write_gguf
from betelgeuse.gguf.synth_ds4 import DS4_PRESETS, model_nbytes, write_deepseek4


def test_mxfp4_is_bit_identical_to_gguf():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4096, 17), dtype=np.uint8)
    raw[:256, 0] = np.arange(256)                      # every E8M0 exponent, the subnormal ones included
    ref = quants.dequantize(raw.reshape(64, 64 * 17), GT.MXFP4)          # [64, 2048]
    ours = dequantize(torch.from_numpy(raw.copy()), GT.MXFP4, (64, 2048)).numpy()
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    # and a quantize -> dequantize round trip of float weights
    x = rng.standard_normal((8, 256)).astype(np.float32)
    q = quants.quantize(x, GT.MXFP4)
    assert np.array_equal(dequantize(torch.from_numpy(q.reshape(-1).copy()), GT.MXFP4, (8, 256)).numpy(),
                          quants.dequantize(q, GT.MXFP4))


def test_i32_tensor():
    a = np.arange(-5, 7, dtype=np.int32)
    t = dequantize(torch.from_numpy(a.view(np.uint8).copy()), GT.I32, (3, 4), torch.int64)
    assert t.dtype == torch.int64 and t.flatten().tolist() == a.tolist()


def _write(path, spec, meta_edit=None, plan_edit=None, writer=None):
    """A synth file with its metadata (meta_edit(kv dict)) or tensor plan (plan_edit(plan)) tampered with; `writer`:
    the synth module (default synth_ds4; tests/gguf/test_deepseek41_gguf.py passes synth_ds41)."""
    import betelgeuse.gguf.synth_ds4 as writer_ds4
    writer = writer or writer_ds4
    plan = writer.tensor_plan(spec)
    if plan_edit:
        plan = plan_edit(plan)

    def meta(w):
        writer.add_metadata(w, spec, tokenizer=False)
        if meta_edit:
            meta_edit(w.kv_data[0])
    write_gguf(path, writer.ARCH, plan, meta, progress=False)
    return path


@pytest.fixture(scope="module")
def spec():
    return spec_from_preset("ds4-tiny")


def test_tiny_file_opens(tmp_path, spec):
    f = GGUFModelFile.open(write_deepseek4(tmp_path / "t.gguf", spec, progress=False) or tmp_path / "t.gguf")
    c = f.config
    assert c.arch == "deepseek4" and c.ds4.compress_ratios == (0, 4, 128, 4) and c.ds4.n_hash_layers == 2
    assert c.ds4.rope_scaling == "yarn" and c.n_head_kv == 1 and c.ds4.swiglu_limit == (10.0,) * 4
    parts = f.expert_parts(1, 3)
    assert [p.qtype for p in parts] == [GT.MXFP4] * 3 and [p.shape for p in parts] == [(32, 64), (32, 64), (64, 32)]
    assert f.tensors["blk.0.ffn_gate_tid2eid.weight"].qtype == GT.I32
    assert f.tensors["blk.1.attn_q_a.weight"].qtype == GT.Q8_0 and f.tensors["blk.1.attn_output_a.weight"].qtype == GT.BF16


def test_missing_key_is_named(tmp_path, spec):
    p = _write(tmp_path / "m.gguf", spec, meta_edit=lambda kv: kv.pop("deepseek4.hyper_connection.count"))
    with pytest.raises(ModelFormatError, match="deepseek4.hyper_connection.count"):
        GGUFModelFile.open(p)


def test_unknown_gating_function(tmp_path, spec):
    def edit(kv):
        kv["deepseek4.expert_gating_func"].value = 2          # sigmoid
    with pytest.raises(UnsupportedError, match="expert_gating_func.*sqrtsoftplus.*got 2 \\(sigmoid\\)"):
        GGUFModelFile.open(_write(tmp_path / "g.gguf", spec, meta_edit=edit))


def test_unknown_compress_ratio(tmp_path, spec):
    def edit(kv):
        kv["deepseek4.attention.compress_ratios"].value = [0, 4, 64, 4]
    with pytest.raises(UnsupportedError, match="unknown deepseek4 compress ratio.*64"):
        GGUFModelFile.open(_write(tmp_path / "r.gguf", spec, meta_edit=edit))


def test_bad_shape_and_missing_tensor_are_named(tmp_path, spec):
    def reshape(plan):
        return [(n, (s[0] * 2,) if n == "blk.2.attn_sinks.weight" else s, gt,
                 (lambda s=s: iter([np.zeros(s[0] * 2, np.float32)])) if n == "blk.2.attn_sinks.weight" else g)
                for n, s, gt, g in plan]
    with pytest.raises(ModelFormatError, match="blk.2.attn_sinks.weight.*shape \\[8\\], expected \\[4\\]"):
        GGUFModelFile.open(_write(tmp_path / "s.gguf", spec, plan_edit=reshape))
    drop = lambda plan: [t for t in plan if t[0] != "blk.3.indexer.proj.weight"]     # noqa: E731
    with pytest.raises(ModelFormatError, match="required tensor 'blk.3.indexer.proj.weight' is missing"):
        GGUFModelFile.open(_write(tmp_path / "d.gguf", spec, plan_edit=drop))


def test_flash_preset_sizes():
    s = DS4_PRESETS["ds4-flash"]
    f = s.config()
    expert = 3 * f.n_ff_exp * f.n_embd // 32 * 17
    assert expert == 13_369_344                         # V4-Flash's routed expert at MXFP4 (research note §6)
    total = model_nbytes(s)
    assert 30e9 < total < 32e9, total                   # ~31 GB: what fits the GPU machine disk
    assert f.n_expert == 256 and f.n_expert_used == 6 and f.n_embd == 4096
    assert replace(s, n_layer=2, compress_ratios=()).ratios() == (0, 0)
