"""The `deepseek41` file format (gguf/ds41layout.py): llama.cpp's names and keys (dialect A, PR #28696), the CSA2
roles read from the tensors, and a clear refusal, naming the problem, of what we cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds41layout
from betelgeuse.gguf.header import read_header
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.gguf import synth_ds41
from betelgeuse.gguf.synth_ds41 import DS41_PRESETS, engram_table_bytes, model_nbytes, write_deepseek41

# llama.cpp PR #28696's converter (DeepseekV41Model._map_dsv4_tensor_name's V4.1 entries, and V4's map it
# inherits): release checkpoint name -> GGUF name, for layer 14 of the released model
LLAMA_CPP_NAMES = {
    "layers.14.engram.embed.weight": "blk.14.engram_embd.weight",
    "layers.14.engram.k_weight": "blk.14.engram_k.weight",
    "layers.14.engram.q_weight": "blk.14.engram_q.weight",
    "layers.14.engram.wkv.weight": "blk.14.engram_wkv.weight",
    "layers.14.attn.indexer.k_norm.weight": "blk.14.indexer.k_norm.weight",
    "layers.14.attn.indexer.wk.weight": "blk.14.indexer.attn_k.weight",
    "layers.14.attn.indexer.wq_b.weight": "blk.14.indexer.attn_q_b.weight",
    "layers.14.attn.indexer.weights_proj.weight": "blk.14.indexer.proj.weight",
    "layers.14.attn.compressor.wkv.weight": "blk.14.attn_compressor_kv.weight",
    "layers.14.attn.compressor.wgate.weight": "blk.14.attn_compressor_gate.weight",
    "layers.14.attn.compressor.norm.weight": "blk.14.attn_compressor_norm.weight",
    "layers.14.attn.attn_sink": "blk.14.attn_sinks.weight",
    "layers.14.attn.wo_a.weight": "blk.14.attn_output_a.weight",
    "layers.14.hc_attn_fn": "blk.14.hc_attn_fn.weight",
    "layers.14.ffn.gate.bias": "blk.14.exp_probs_b.bias",
    "layers.14.ffn.gate.bias_vl": "blk.14.exp_probs_b_vl.bias",
    "layers.14.ffn.shared_experts.w2.weight": "blk.14.ffn_down_shexp.weight",
    "embed.weight": "token_embd.weight", "head.weight": "output.weight", "norm.weight": "output_norm.weight",
}


def test_release_names_are_llama_cpp_names():
    for release, gguf in LLAMA_CPP_NAMES.items():
        assert ds41layout.released_to_gguf(release) == (gguf, None), release
    assert ds41layout.released_to_gguf("layers.3.ffn.experts.17.w3.weight") == ("blk.3.ffn_up_exps.weight", 17)
    assert ds41layout.released_to_gguf("mtp.0.ffn.gate.weight") is None           # DSpark draft: not text inference
    assert ds41layout.released_to_gguf("vision.blocks.0.attn.qkv.weight") is None
    with pytest.raises(KeyError):
        ds41layout.released_to_gguf("layers.3.attn.compressor.ape")


def _write(path, spec, meta_edit=None, plan_edit=None):
    from test_deepseek4_gguf import _write as write_edited
    return write_edited(path, spec, meta_edit, plan_edit, writer=synth_ds41)


@pytest.fixture(scope="module")
def spec():
    return DS41_PRESETS["ds41-tiny"]


def test_tiny_file_opens(tmp_path, spec):
    write_deepseek41(tmp_path / "t.gguf", spec, progress=False)
    f = GGUFModelFile.open(tmp_path / "t.gguf")
    c, p = f.config, f.config.ds41
    assert c.arch == "deepseek41" and c.ds4.compress_ratios == (0, 0, 2, 2, 1, 1) and c.ds4.n_hash_layers == 0
    assert c.rms_eps < 1e-19                                        # the file's eps (V4.1: 1e-20), not a default
    assert p.kv_sources == {2, 4} and p.key_owners == {2, 4} and p.index_sources == {2, 4, 5}
    assert p.kv_source == (-1, -1, 2, 2, 4, 4) and p.topk_source == (-1, -1, 2, 2, 4, 5)
    assert (p.candidate_layer, p.candidate_blocks, p.candidate_block_size) == (4, 4, 4)
    g = p.engram
    assert g.layer_ids == (1, 4) and g.n_cols == 4 and g.key_length == 32 and len(g.token_map) == c.n_vocab
    assert f.tensors["blk.1.engram_embd.weight"].qtype == GT.Q8_0 and "output_hc_fn.weight" not in f.tensors
    assert f.tensors["blk.2.attn_compressor_kv.weight"].qtype == GT.F32
    assert "blk.4.attn_compressor_gate.weight" not in f.tensors     # ratio 1: a projection, nothing to pool
    md = read_header(tmp_path / "t.gguf").metadata
    assert md["deepseek41.engram.pad_id"] == g.token_map[2]        # stored already mapped, as llama.cpp reads it
    # llama.cpp's value types (its loader reads the multipliers / primes / offsets as uint64 arrays)
    from gguf import GGUFReader, GGUFValueType as VT
    r = GGUFReader(tmp_path / "t.gguf")
    assert r.fields["deepseek41.engram.primes"].types == [VT.ARRAY, VT.UINT64]
    assert r.fields["deepseek41.engram.token_map"].types == [VT.ARRAY, VT.INT32]
    assert r.fields["deepseek41.engram.layer_ids"].types == [VT.ARRAY, VT.INT32]


@pytest.mark.parametrize("key", ["deepseek41.engram.primes", "deepseek41.engram.token_map",
                                 "deepseek41.engram.key_length", "deepseek41.hyper_connection.count"])
def test_missing_key_is_named(tmp_path, spec, key):
    with pytest.raises(ModelFormatError, match=key.replace(".", "\\.")):
        GGUFModelFile.open(_write(tmp_path / "m.gguf", spec, meta_edit=lambda kv: kv.pop(key)))


def test_other_dialect_is_refused(tmp_path, spec):
    def edit(kv):
        from gguf import GGUFValueType as VT
        from gguf.gguf_writer import GGUFValue
        kv["deepseek41.engram.encoding"] = GGUFValue("e4m3_e8m0_32_row264", VT.STRING)
    with pytest.raises(UnsupportedError, match="engram.encoding 'e4m3_e8m0_32_row264'"):
        GGUFModelFile.open(_write(tmp_path / "e.gguf", spec, meta_edit=edit))


def test_unknown_ratio_and_role_errors(tmp_path, spec):
    def ratio(kv):
        kv["deepseek41.attention.compress_ratios"].value = [0, 0, 4, 4, 1, 1]
    with pytest.raises(UnsupportedError, match="unknown deepseek41 compress ratio.*4"):
        GGUFModelFile.open(_write(tmp_path / "r.gguf", spec, meta_edit=ratio))

    def mismatch(kv):                          # layer 3 would read layer 2's ratio-2 stream at ratio 1
        kv["deepseek41.attention.compress_ratios"].value = [0, 0, 2, 1, 1, 1]
    with pytest.raises(ModelFormatError, match="layer 3 compresses at ratio 1 but reads layer 2"):
        GGUFModelFile.open(_write(tmp_path / "x.gguf", spec, meta_edit=mismatch))


def test_bad_engram_table_is_named(tmp_path, spec):
    name = "blk.4.engram_embd.weight"

    def shrink(plan):                            # fewer rows than the buckets need
        out = []
        for n, s, gt, g in plan:
            if n == name:
                s = (s[0] - 8, s[1])
                g = (lambda s=s: iter([np.zeros((s[0], 34 * s[1] // 32), np.uint8)]))
            out.append((n, s, gt, g))
        return out
    with pytest.raises(ModelFormatError, match=f"{name}.*too few for the Engram buckets"):
        GGUFModelFile.open(_write(tmp_path / "s.gguf", spec, plan_edit=shrink))
    drop = lambda plan: [t for t in plan if t[0] != "blk.1.engram_wkv.weight"]     # noqa: E731
    with pytest.raises(ModelFormatError, match="required tensor 'blk.1.engram_wkv.weight' is missing"):
        GGUFModelFile.open(_write(tmp_path / "d.gguf", spec, plan_edit=drop))


def test_engram_constants_are_the_released_ones():
    """The release's layout (research note §4.3 b, c): 384,006,168 and 384,016,682 rows, the first and last primes,
    the multipliers; derived here the way the writers derive them."""
    mult, primes, offs = ds41layout.engram_constants((1, 14), 4, 8, 16_000_000, 99_092)
    assert [o[-1] + p[-1] for o, p in zip(offs, primes)] == [384_006_168, 384_016_682]
    assert (primes[0][0], primes[0][-1], primes[1][0], primes[1][-1]) == (16_000_057, 16_000_463, 16_000_477,
                                                                          16_000_889)
    assert mult[0] == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert mult[1] == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_flash_preset_sizes():
    s = DS41_PRESETS["ds41-flash"]
    c = s.config()
    assert 3 * c.n_ff_exp * c.n_embd // 32 * 17 == 18_800_640        # V4.1-Flash's routed expert at MXFP4
    assert c.n_expert == 384 and c.n_embd == 5120 and c.ds41.engram.n_cols == 24
    rows = c.ds41.engram.rows
    assert 6.0e6 < rows[0] < 6.1e6                                   # 1/64 of the release's 384M rows
    assert 3.2e9 < engram_table_bytes(s) < 3.3e9 and 35e9 < model_nbytes(s) < 37e9


@pytest.mark.parametrize("router", ["calibrated", None])
def test_calibrated_router_is_refused(tmp_path, router):
    """synth_ds4's calibrated-router wiring assumes V4's mHC: a deepseek41 file with one is refused by name."""
    from betelgeuse.errors import InvalidRequestError
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    extra = {} if router else {"router_skew": 1.0}
    with pytest.raises(InvalidRequestError, match="not implemented for deepseek41"):
        write_model(tmp_path / "r.gguf", spec_from_preset("ds41-tiny", router=router, **extra), progress=False)
