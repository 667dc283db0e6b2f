"""The deepseek41 oracle: NVIDIA NeMo AutoModel 0.7.0's `deepseek_v41` (an implementation of DeepSeek-V4.1 written
against the released `inference/model.py` and `engram.py`), built tiny and random on the CPU in float32.

deploy/bootstrap.sh unpacks its pinned wheel into .venv/oracles (never pip-installed: its declared requirements
would replace torch); `nemo()` puts it on sys.path, or fails naming what to run. NeMo derives everything Engram
needs on its own (the compressed token map from the tokenizer, primes, offsets, multipliers) and reads weights by
the release checkpoint's names, so the test goes: NeMo model -> `to_hf` (release names) -> each weight rounded
through the type our file stores it in -> our GGUF writer -> our engine, and the same rounded weights back into
NeMo through its `from_hf`. The release's fake-quantized caches (`quantize_cache`) are turned off: this engine
does not mirror them (model/deepseek41.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

NEMO_DIR = Path(os.environ.get("BETELGEUSE_NEMO_DIR",
                               Path(__file__).resolve().parents[1] / ".venv/oracles/nemo_automodel-0.7.0"))


def nemo():
    """The NeMo deepseek_v41 modules (config, model, attention), with the cache fake-quantization off."""
    if not (NEMO_DIR / "nemo_automodel").is_dir():
        pytest.fail(f"NeMo AutoModel 0.7.0 is not unpacked at {NEMO_DIR}: run `bash deploy/bootstrap.sh`")
    if str(NEMO_DIR) not in sys.path:
        sys.path.insert(0, str(NEMO_DIR))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from nemo_automodel.components.models.deepseek_v41 import attention, config, engram, model
    attention.quantize_cache = lambda values, **_: values
    return config, model, engram


def tokenizer(spec):
    """Our synth file's tokenizer as a transformers fast tokenizer (NeMo builds its Engram token map from it)."""
    from transformers import PreTrainedTokenizerFast
    from betelgeuse.gguf.synth_ds41 import synth_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=synth_tokenizer(spec.n_vocab))


def build(spec):
    """A random-weight NeMo DeepseekV41ForCausalLM of `spec`'s geometry (float32, eager attention)."""
    config, model, _ = nemo()
    from nemo_automodel.components.models.common import BackendConfig
    g = spec.config().ds41.engram
    text = config.DeepseekV41TextConfig(
        vocab_size=spec.n_vocab, hidden_size=spec.n_embd, moe_intermediate_size=spec.n_ff_exp,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, head_dim=spec.head_dim,
        qk_rope_head_dim=spec.rope_dim, q_lora_rank=spec.q_lora_rank, o_lora_rank=spec.o_lora_rank,
        o_groups=spec.o_groups, swiglu_limit=spec.swiglu_limit, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=spec.context_length, rope_theta=spec.rope_theta,
        rope_scaling={"rope_type": "yarn", "factor": spec.rope_factor, "beta_fast": spec.yarn_beta_fast,
                      "beta_slow": spec.yarn_beta_slow, "original_max_position_embeddings": spec.rope_orig_ctx},
        n_routed_experts=spec.n_expert, num_experts_per_tok=spec.n_expert_used,
        routed_scaling_factor=spec.routed_scale, sliding_window=spec.sliding_window,
        compress_ratios=list(spec.ratios()), compress_rope_theta=spec.compress_rope_theta,
        kv_source_layer_ids=list(spec.kv_sources), index_source_layer_ids=list(spec.index_sources),
        index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim, index_topk=spec.index_topk,
        candidate_source_layer_id=spec.candidate_layer, candidate_topk_blocks=spec.candidate_blocks,
        candidate_block_size=spec.candidate_block_size, hc_mult=spec.hc_mult,
        hc_sinkhorn_iters=spec.hc_sinkhorn_iters, hc_eps=spec.hc_eps,
        engram_layer_ids=list(spec.engram_layers), engram_num_embeddings=list(g.rows),
        engram_max_ngram_size=spec.engram_max_ngram, engram_vocab_size=spec.engram_vocab,
        engram_n_heads=spec.engram_heads, engram_head_dim=spec.engram_key_length,
        engram_pad_token_id=spec.engram_pad_token, engram_compressed_vocab_size=spec.token_map()[1],
        num_nextn_predict_layers=0, dspark_block_size=0, dspark_noise_token_id=0, dtype="float32")
    cfg = config.DeepseekV41Config(vision_config=config.DeepseekV41VisionConfig(num_hidden_layers=0), text_config=text)
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch_mm", dispatcher="torch")
    m = model.DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=tokenizer(spec)).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, t in m.named_parameters():
            if name.endswith(("attn_hc.fn", "ffn_hc.fn")):
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale")):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("q_weight", "k_weight")) or (t.dim() == 1 and name.endswith("norm.weight")):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            elif t.dim() == 1:                                              # sinks, hc bases
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("embed_tokens.weight", "engram.embed.weight")):
                t.copy_(torch.randn(t.shape, generator=gen))
            elif name.endswith("gate_and_up_projs") or name.endswith("down_projs"):     # [E, in, out]
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[1] ** 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
        for name, t in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
    return m


def released_state(m) -> dict[str, torch.Tensor]:
    """The model's weights under the release checkpoint's names (NeMo's own adapter)."""
    hf = m.state_dict_adapter.to_hf(m.state_dict())
    if "head.weight" in hf:
        hf.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in hf.items()}


def round_trip(m, spec, qtype_of) -> dict[str, np.ndarray]:
    """Every weight through the type our file stores it in (`qtype_of(gguf name, shape)`), loaded back into `m`;
    -> {gguf name: float32 array} for the writer."""
    from gguf import GGMLQuantizationType as GT, quants
    from betelgeuse.gguf import ds41layout
    hf = released_state(m)
    groups: dict[str, dict[int, np.ndarray]] = {}
    stored: dict[str, np.ndarray] = {}
    for name, t in hf.items():
        got = ds41layout.released_to_gguf(name)
        if got is None:
            continue
        gname, expert = got
        if expert is None:
            stored[gname] = t.float().numpy()
        else:
            groups.setdefault(gname, {})[expert] = t.float().numpy()
    for gname, parts in groups.items():
        stored[gname] = np.stack([parts[e] for e in range(len(parts))])
    for gname, a in list(stored.items()):
        gt = qtype_of(gname, a.shape)
        if gt not in (GT.F32, GT.I32):
            stored[gname] = quants.dequantize(quants.quantize(a.astype(np.float32), gt), gt).reshape(a.shape)
    back = {}
    for name in hf:
        got = ds41layout.released_to_gguf(name)
        if got is None or got[0] not in stored:
            continue
        a = stored[got[0]] if got[1] is None else stored[got[0]][got[1]]
        back[name] = torch.from_numpy(np.ascontiguousarray(a)).to(hf[name].dtype)
    native = m.state_dict_adapter.from_hf(back)
    missing, unexpected = m.load_state_dict(native, strict=False)
    assert not unexpected, unexpected
    assert all("bias_vl" in k for k in missing), missing
    return stored


def logits(m, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(ids[None]).logits[0].float()


# ---- the release checkpoint layout (for `betelgeuse convert`) ---------------------------------------------

FP8_NAMES = r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight"
F32_NAMES = r"(layers\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|attn\.compressor\.(wkv|wgate)\.weight|ffn\.gate\.bias(_vl)?))"


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / top)))


def fp8_blocks(w: torch.Tensor, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, c] -> (E4M3 [r, c], ue8m0 scales [ceil(r/32), ceil(c/32)], or [r, c/32] row-wise): the release's FP8."""
    r, c = w.shape
    br = 1 if rowwise else 32
    nr, nc = -(-r // br), -(-c // 32)
    pad = torch.nn.functional.pad(w.float(), (0, nc * 32 - c, 0, nr * br - r))
    scale = _pow2_scale(pad.abs().view(nr, br, nc, 32).amax(dim=(1, 3)), 448.0)
    q = (pad / scale.repeat_interleave(br, 0).repeat_interleave(32, 1)).clamp(-448, 448)
    return q[:r, :c].to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def fp4_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, c] -> (int8 [r, c/2]: E2M1 codes, even column in the low nibble; ue8m0 scales [r, c/32])."""
    r, c = w.shape
    b = w.float().view(r, c // 32, 32)
    scale = _pow2_scale(b.abs().amax(-1), 6.0)
    x = b / scale.unsqueeze(-1)
    levels = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mag = (x.abs().unsqueeze(-1) - levels).abs().argmin(-1)
    codes = (mag | ((x < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8).view(r, c)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def write_release_checkpoint(m, spec, out) -> dict[str, torch.Tensor]:
    """NeMo's weights (its `to_hf`, the release names) written as DeepSeek's release checkpoint: FP8 32x32-block
    matrices, FP4 experts, FP8 row-scaled Engram tables, BF16 / F32 for the rest, two shards and an index,
    config.json (nested text_config + quantization_config) and tokenizer.json. -> the stored tensors."""
    import json
    import re
    from pathlib import Path
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stored = {}
    for name, t in released_state(m).items():
        if re.fullmatch(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", name):
            stored[name], stored[name[:-6] + "scale"] = fp4_packed(t)
        elif re.fullmatch(FP8_NAMES, name) or name.endswith("engram.embed.weight"):
            stored[name], stored[name[:-6] + "scale"] = fp8_blocks(t, rowwise="engram.embed" in name)
        elif re.fullmatch(F32_NAMES, name) or t.dim() == 1:
            stored[name] = t.float().contiguous()
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: stored[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    cfg = m.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [32, 32]}
    (out / "config.json").write_text(json.dumps(cfg, default=str))
    tokenizer(spec).backend_tokenizer.save(str(out / "tokenizer.json"))
    return stored


def load_release_checkpoint(m, stored: dict[str, torch.Tensor]) -> None:
    """Load the checkpoint into `m` through NeMo's own `from_hf` (its FP8 / FP4 / ue8m0 decoding, not ours)."""
    native = m.state_dict_adapter.from_hf({k: v.clone() for k, v in stored.items()})
    missing, unexpected = m.load_state_dict(native, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
