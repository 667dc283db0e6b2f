"""Our deepseek4 writer against llama.cpp's own converter (`convert_hf_to_gguf.py`, DeepseekV4Model).

The converter reads DeepSeek's *release* checkpoint layout, not transformers' save_pretrained output, so the
tiny model is written that way: FP8 e4m3 matrices with one ue8m0 scale per 128x128 block, BF16 matrices,
F32 norms / mHC / sinks / ape / bias, routed experts as FP4 e2m1 codes (two per byte) with one ue8m0 scale per
32 values, tid2eid as int; legacy config keys (compress_ratios, num_hash_layers, qk_rope_head_dim...). The
converter's output is compared with what `write_deepseek4` writes from the same values: the same set of
tensor names, shapes (ggml ne), types, the same bytes for every tensor, and the same `deepseek4.*` metadata
(values and GGUF value types), architecture and file type. (Tensor order is not compared: the converter
writes tid2eid and the experts first.)

The converter comes from the llama-cpp-python 0.3.36 sdist, which vendors llama.cpp with `deepseek4`
(76 MB; not built here). CI does not download it, so the test skips unless BETELGEUSE_LLAMA_CPP_SDIST
names the sdist (.tar.gz) or its unpacked directory:
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    BETELGEUSE_LLAMA_CPP_SDIST=/tmp/sdist/llama_cpp_python-0.3.36.tar.gz pytest tests/model/test_deepseek4_layout.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from betelgeuse.gguf import ds4layout
from betelgeuse.gguf.header import read_header
from betelgeuse.gguf.synth_ds4 import write_deepseek4

from test_deepseek4_oracle import SPEC, random_hf_model

SDIST = os.environ.get("BETELGEUSE_LLAMA_CPP_SDIST")

# GGUF kind -> release checkpoint name (inverse of the converter's _map_dsv4_tensor_name)
_RELEASE = {
    "token_embd": "embed.weight", "output": "head.weight", "output_norm": "norm.weight",
    "output_hc_fn": "hc_head_fn", "output_hc_base": "hc_head_base", "output_hc_scale": "hc_head_scale",
    "hc_attn_fn": "hc_attn_fn", "hc_attn_base": "hc_attn_base", "hc_attn_scale": "hc_attn_scale",
    "hc_ffn_fn": "hc_ffn_fn", "hc_ffn_base": "hc_ffn_base", "hc_ffn_scale": "hc_ffn_scale",
    "attn_sinks": "attn.attn_sink", "attn_q_a": "attn.wq_a.weight", "attn_q_b": "attn.wq_b.weight",
    "attn_q_a_norm": "attn.q_norm.weight", "attn_kv": "attn.wkv.weight", "attn_kv_a_norm": "attn.kv_norm.weight",
    "attn_output_a": "attn.wo_a.weight", "attn_output_b": "attn.wo_b.weight",
    "attn_compressor_ape": "attn.compressor.ape", "attn_compressor_kv": "attn.compressor.wkv.weight",
    "attn_compressor_gate": "attn.compressor.wgate.weight", "attn_compressor_norm": "attn.compressor.norm.weight",
    "indexer.attn_q_b": "attn.indexer.wq_b.weight", "indexer.proj": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape": "attn.indexer.compressor.ape", "indexer_compressor_kv": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm": "attn.indexer.compressor.norm.weight",
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight", "ffn_gate_inp": "ffn.gate.weight",
    "exp_probs_b": "ffn.gate.bias", "ffn_gate_tid2eid": "ffn.gate.tid2eid",
    "ffn_gate_shexp": "ffn.shared_experts.w1.weight", "ffn_down_shexp": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp": "ffn.shared_experts.w3.weight",
}
_EXPERT_W = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}


def _sdist_dir(tmp: Path) -> Path:
    if not SDIST:
        pytest.skip("BETELGEUSE_LLAMA_CPP_SDIST is not set (the llama-cpp-python 0.3.36 sdist; see the module doc)")
    p = Path(SDIST)
    if p.is_file():
        with tarfile.open(p) as t:
            members = [m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name and
                       ("/gguf-py/" in m.name or "/conversion/" in m.name or m.name.endswith("convert_hf_to_gguf.py")
                        or "/models/templates/" in m.name)]
            t.extractall(tmp, members=members, filter="data")
        p = next(tmp.glob("*/vendor/llama.cpp"))
    elif (p / "vendor" / "llama.cpp").is_dir():
        p = p / "vendor" / "llama.cpp"
    assert (p / "convert_hf_to_gguf.py").is_file(), f"no convert_hf_to_gguf.py under {p}"
    return p


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [out, in] -> (e4m3 weight, ue8m0 scales [ceil(out/128), ceil(in/128)] uint8, dequantized float)."""
    o, i = w.shape
    bo, bi = -(-o // 128), -(-i // 128)
    pad = torch.zeros(bo * 128, bi * 128)
    pad[:o, :i] = w
    amax = pad.view(bo, 128, bi, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scale = torch.exp2(e)
    s_full = scale.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
    w8 = (w / s_full).to(torch.float8_e4m3fn)
    return w8, (e + 127).to(torch.uint8), w8.float() * s_full


def _fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, cols] -> release FP4 (packed uint8 [rows, cols/2]: element 2j low nibble, 2j+1 high;
    ue8m0 scales [rows, cols/32]) holding exactly what gguf's MXFP4 quantizer stores for w."""
    from gguf import GGMLQuantizationType as GT, quants
    rows, cols = w.shape
    q = quants.quantize(w.astype(np.float32), GT.MXFP4).reshape(rows, cols // 32, 17)
    e, qs = q[..., 0], q[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)       # ggml order -> elements
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, e.copy()


def _tokenizer(dir_: Path, n_vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from betelgeuse.gguf.synth_common import CORPUS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=n_vocab - 2, special_tokens=["<bos>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(dir_ / "tokenizer.json"))
    (dir_ / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>"}))


def _release_checkpoint(dir_: Path, spec) -> dict[str, np.ndarray]:
    """Write the tiny model in release layout; -> {gguf name: the values the converter will see}."""
    from safetensors.torch import save_file
    from gguf import GGMLQuantizationType as GT
    from betelgeuse.gguf.synth_ds4 import qtype_of
    hf = random_hf_model(spec)
    src = ds4layout.hf_to_gguf({k: v.detach() for k, v in hf.state_dict().items() if "inv_freq" not in k})
    tensors, ours = {}, {}
    for name, t in src.items():
        k, parts = ds4layout.kind(name), name.split(".")
        pre = f"layers.{parts[1]}." if parts[0] == "blk" else ""
        gt = qtype_of(spec, name, tuple(t.shape))
        if k in _EXPERT_W:
            a = t.float().numpy()
            ours[name] = a
            for e in range(a.shape[0]):
                packed, scale = _fp4(a[e])
                base = f"{pre}ffn.experts.{e}.{_EXPERT_W[k]}"
                tensors[base + ".weight"] = torch.from_numpy(packed).view(torch.int8)
                tensors[base + ".scale"] = torch.from_numpy(scale)
            continue
        rel = pre + _RELEASE[k]
        if gt == GT.I32:
            tensors[rel] = t.to(torch.int32)
            ours[name] = t.numpy().astype(np.int32)
        elif gt == GT.Q8_0:
            w8, s, deq = _fp8(t.float())
            tensors[rel], tensors[rel.removesuffix(".weight") + ".scale"] = w8, s
            ours[name] = deq.numpy()
        elif gt == GT.BF16:
            tensors[rel] = t.to(torch.bfloat16).contiguous()
            ours[name] = tensors[rel].float().numpy()
        else:
            tensors[rel] = t.float().contiguous()
            ours[name] = tensors[rel].numpy()
    save_file(tensors, str(dir_ / "model.safetensors"))
    (dir_ / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": spec.n_vocab, "hidden_size": spec.n_embd, "moe_intermediate_size": spec.n_ff_exp,
        "num_hidden_layers": spec.n_layer, "num_attention_heads": spec.n_head, "num_key_value_heads": 1,
        "head_dim": spec.head_dim, "qk_rope_head_dim": spec.rope_dim, "q_lora_rank": spec.q_lora_rank,
        "o_groups": spec.o_groups, "o_lora_rank": spec.o_lora_rank, "n_routed_experts": spec.n_expert,
        "num_experts_per_tok": spec.n_expert_used, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": spec.routed_scale, "num_hash_layers": spec.n_hash_layers,
        "compress_ratios": list(spec.ratios()), "sliding_window": spec.sliding_window,
        "index_n_heads": spec.index_n_heads, "index_head_dim": spec.index_head_dim, "index_topk": spec.index_topk,
        "hc_mult": spec.hc_mult, "hc_sinkhorn_iters": spec.hc_sinkhorn_iters, "hc_eps": spec.hc_eps,
        "rope_theta": spec.rope_theta, "compress_rope_theta": spec.compress_rope_theta,
        "rope_scaling": {"type": "yarn", "factor": spec.rope_factor,
                         "original_max_position_embeddings": spec.rope_orig_ctx,
                         "beta_fast": spec.yarn_beta_fast, "beta_slow": spec.yarn_beta_slow},
        "swiglu_limit": spec.swiglu_limit, "rms_norm_eps": spec.rms_eps,
        "max_position_embeddings": spec.context_length, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16"}))
    _tokenizer(dir_, spec.n_vocab)
    return ours


# the converter registers no pre-tokenizer hash for a home-made tokenizer: name it (llama.cpp's own advice)
_RUNNER = """
import sys
sys.argv = sys.argv[1:]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_writer_matches_llama_cpp_converter(tmp_path):
    from dataclasses import replace
    lcpp = _sdist_dir(tmp_path / "sdist")
    spec = replace(SPEC, expert_qtype="MXFP4", dense="release")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    values = _release_checkpoint(ckpt, spec)
    theirs = tmp_path / "llama-cpp.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lcpp / "gguf-py"), str(lcpp)]), NO_LOCAL_GGUF="1")
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(lcpp / "convert_hf_to_gguf.py"), str(ckpt),
                        "--outfile", str(theirs), "--outtype", "bf16"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    ours = tmp_path / "ours.gguf"
    write_deepseek4(ours, spec, source=lambda n: values[n], progress=False)

    a, b = read_header(theirs), read_header(ours)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb), (sorted(set(ta) ^ set(tb)))
    with open(theirs, "rb") as fa, open(ours, "rb") as fb:
        ba, bb = fa.read(), fb.read()
    for name in tb:
        x, y = ta[name], tb[name]
        assert (x.ne, x.qtype) == (y.ne, y.qtype), (name, x.ne, x.qtype, y.ne, y.qtype)
    from betelgeuse.gguf.qtypes import tensor_nbytes
    for name in tb:
        x, y = ta[name], tb[name]
        nb = tensor_nbytes(x.qtype, tuple(reversed(x.ne)))
        assert ba[x.offset:x.offset + nb] == bb[y.offset:y.offset + nb], f"{name}: bytes differ"
    keys_a = {k: v for k, v in a.metadata.items() if k.startswith("deepseek4.")}
    keys_b = {k: v for k, v in b.metadata.items() if k.startswith("deepseek4.")}
    missing, extra = sorted(set(keys_a) - set(keys_b)), sorted(set(keys_b) - set(keys_a))
    assert not missing and not extra, (missing, extra)
    for k in keys_a:
        va, vb = keys_a[k], keys_b[k]
        same = np.allclose(va, vb, rtol=1e-7) if isinstance(va, (float, list)) else va == vb
        assert same and a.value_types[k] == b.value_types[k], (k, va, a.value_types[k], vb, b.value_types[k])
    assert a.metadata["general.architecture"] == b.metadata["general.architecture"] == "deepseek4"
    assert a.metadata["general.file_type"] == b.metadata["general.file_type"]
    # and the converter's file runs: our reader validates it and the forward pass gives our file's bits
    from betelgeuse.model.deepseek4 import Deepseek4Reference
    ids = torch.arange(40) * 7 % spec.n_vocab
    logits = []
    for path in (theirs, ours):
        m = Deepseek4Reference.load(path)
        logits.append(m.forward(ids, m.new_cache(40)))
    assert torch.equal(logits[0], logits[1])
    print(f"\n[ds4-layout] {len(tb)} tensors: names, shapes, types and bytes equal; "
          f"{len(keys_a)} deepseek4.* keys equal (values and types)")
