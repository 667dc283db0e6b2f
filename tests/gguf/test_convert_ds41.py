"""`betelgeuse convert` on a tiny DeepSeek-V4.1 checkpoint in the release layout, written from NeMo AutoModel's
weights (its `to_hf`: the release names) with the release's storage types: FP8 E4M3 matrices with ue8m0 32x32 block
scales, FP4 E2M1 routed experts with a ue8m0 scale per 32 values, FP8 Engram tables with a scale per 32 values of a
row, BF16 / F32 for the rest, in two shards. NeMo loads that checkpoint through its own decoder (`from_hf`), so the
round trip checkpoint -> convert -> our engine is compared with NeMo's logits of the same checkpoint: exactly the same
model with --outtype bf16 (e4m3 x 2^k is a bfloat16; FP4 -> MXFP4 is a repacking). With the default (Q8_0, as
llama.cpp's converter) every FP8 matrix and table must be gguf-py's own Q8_0 of NeMo's decoded values.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import nemo_oracle
from services.cli import main
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.gguf.synth_ds41 import DS41_PRESETS
from betelgeuse.model.deepseek41 import Deepseek41Reference

SPEC = replace(DS41_PRESETS["ds41-tiny"], n_vocab=320, swiglu_limit=1.0, seed=6)
PROMPT = torch.randint(0, SPEC.n_vocab, (96,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    m = nemo_oracle.build(SPEC)
    d = tmp_path_factory.mktemp("v41ckpt")
    stored = nemo_oracle.write_release_checkpoint(m, SPEC, d)
    nemo_oracle.load_release_checkpoint(m, stored)
    return d, m, nemo_oracle.logits(m, PROMPT)


def test_convert_bf16_round_trip_matches_nemo(checkpoint, tmp_path):
    d, m, ref = checkpoint
    out = tmp_path / "v41.gguf"
    assert main(["convert", str(d), str(out), "--outtype", "bf16", "--no-progress"]) == 0
    f = GGUFModelFile.open(out)
    assert f.config.arch == "deepseek41" and f.config.ds41.engram.layer_ids == (1, 4)
    model = Deepseek41Reference.from_file(f)
    ours = model.forward(PROMPT, model.new_cache(len(PROMPT)))
    diff, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    print(f"\n[convert] bf16 file vs NeMo on the checkpoint: max |logit diff| {diff:.3e} (max |logit| {scale:.2f})")
    assert scale > 0.5 and diff <= 1e-4 * scale


def test_convert_q8_0_is_gguf_quantization_of_the_checkpoint(checkpoint, tmp_path):
    from gguf import GGMLQuantizationType as GT, quants
    d, m, _ = checkpoint
    out = tmp_path / "v41q.gguf"
    assert main(["convert", str(d), str(out), "--no-progress"]) == 0
    f = GGUFModelFile.open(out)
    hf = nemo_oracle.released_state(m)                 # NeMo's decoded checkpoint values
    for gname, release in (("blk.2.attn_q_b.weight", "layers.2.attn.wq_b.weight"),
                           ("blk.4.engram_embd.weight", "layers.4.engram.embed.weight"),
                           ("blk.1.engram_wkv.weight", "layers.1.engram.wkv.weight")):
        t = f.tensors[gname]
        assert t.qtype == GT.Q8_0, gname
        want = quants.quantize(hf[release].float().numpy(), GT.Q8_0)
        assert np.array_equal(np.asarray(f.raw(gname)), want.reshape(-1)), gname
    gate = f.tensors["blk.3.ffn_gate_exps.weight"]
    assert gate.qtype == GT.MXFP4                       # FP4 experts repacked: ggml decodes NeMo's values exactly
    e5 = quants.dequantize(np.asarray(f.raw(gate.name)).reshape(gate.shape[0], -1)[5], GT.MXFP4)
    assert np.array_equal(e5.reshape(gate.shape[1:]), hf["layers.3.ffn.experts.5.w1.weight"].float().numpy())
    assert f.tensors["blk.2.hc_attn_fn.weight"].qtype == GT.F32 and f.tensors["token_embd.weight"].qtype == GT.BF16


def test_convert_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"]}')
    (tmp_path / "x.safetensors").write_bytes(b"")
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o.gguf")]) != 0
    assert "not a checkpoint directory" in capsys.readouterr().err
