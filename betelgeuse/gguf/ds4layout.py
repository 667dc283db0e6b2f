"""llama.cpp's `deepseek4` tensor layout (src/models/deepseek4.cpp `load_arch_tensors`; research note §3.1):
every tensor's name and torch-order shape (= reversed ggml ne) for a config. One table shared by the reader
(validation: a missing tensor or a bad shape is named) and the writer (synth), so the two cannot drift.

Also the map from transformers' `DeepseekV4ForCausalLM` parameter names to these names (the oracle test
writes a GGUF from an HF model), and the quant-type classes of the release checkpoint as llama.cpp's
converter writes them: FP8 matrices -> Q8_0, BF16 matrices stay BF16, FP32 (norms, mHC, sinks, ape,
bias) stay F32, FP4 routed experts -> MXFP4, tid2eid -> I32.
"""

from __future__ import annotations

from typing import Iterator

TOKEN_EMBD, OUTPUT, OUTPUT_NORM = "token_embd.weight", "output.weight", "output_norm.weight"
HC_HEAD = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")

# the release checkpoint's storage class of each tensor kind (what the converter keys its output type on)
FP8 = ("attn_q_a", "attn_q_b", "attn_kv", "attn_output_b", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
       "indexer.attn_q_b")
BF16 = ("token_embd", "output", "attn_output_a", "attn_compressor_kv", "attn_compressor_gate",
        "indexer_compressor_kv", "indexer_compressor_gate", "indexer.proj", "ffn_gate_inp")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# kinds the engine keeps in float32 whatever the compute dtype (transformers' _keep_in_fp32_modules_strict)
FP32_KINDS = ("attn_norm", "ffn_norm", "output_norm", "attn_sinks", "attn_q_a_norm", "attn_kv_a_norm",
              "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
              "output_hc_fn", "output_hc_base", "output_hc_scale", "attn_compressor_ape", "attn_compressor_norm",
              "indexer_compressor_ape", "indexer_compressor_norm", "exp_probs_b")


def kind(name: str) -> str:
    """'blk.3.attn_q_a.weight' -> 'attn_q_a'; 'token_embd.weight' -> 'token_embd'."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return ".".join(parts[:-1])


def attention_tensors(cfg, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Layer i's attention projections and mHC mixers (V4 and V4.1 alike)."""
    p, D, H, hd = cfg.ds4, cfg.n_embd, cfg.n_head, cfg.head_dim
    mix, hcD = (2 + p.hc_mult) * p.hc_mult, p.hc_mult * D
    b = f"blk.{i}."
    yield b + "attn_norm.weight", (D,)
    yield b + "attn_sinks.weight", (H,)
    yield b + "attn_q_a.weight", (p.q_lora_rank, D)
    yield b + "attn_q_a_norm.weight", (p.q_lora_rank,)
    yield b + "attn_q_b.weight", (H * hd, p.q_lora_rank)
    yield b + "attn_kv.weight", (hd, D)
    yield b + "attn_kv_a_norm.weight", (hd,)
    yield b + "attn_output_a.weight", (p.o_groups * p.o_lora_rank, H * hd // p.o_groups)
    yield b + "attn_output_b.weight", (D, p.o_groups * p.o_lora_rank)
    for s in ("attn", "ffn"):
        yield b + f"hc_{s}_fn.weight", (mix, hcD)
        yield b + f"hc_{s}_base.weight", (mix,)
        yield b + f"hc_{s}_scale.weight", (3,)


def expert_tensors(cfg, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Layer i's FFN norm, routed experts (merged, expert-major) and shared expert (V4 and V4.1 alike)."""
    p, D, E, F = cfg.ds4, cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    b = f"blk.{i}."
    yield b + "ffn_norm.weight", (D,)
    yield b + "ffn_gate_exps.weight", (E, F, D)
    yield b + "ffn_down_exps.weight", (E, D, F)
    yield b + "ffn_up_exps.weight", (E, F, D)
    yield b + "ffn_gate_shexp.weight", (p.n_shared * F, D)
    yield b + "ffn_down_shexp.weight", (D, p.n_shared * F)
    yield b + "ffn_up_shexp.weight", (p.n_shared * F, D)


def layer_tensors(cfg, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of layer i's tensors, in llama.cpp's load order."""
    p, D, hd = cfg.ds4, cfg.n_embd, cfg.head_dim
    E, k = cfg.n_expert, cfg.n_expert_used
    b = f"blk.{i}."
    yield from attention_tensors(cfg, i)
    ratio = p.compress_ratios[i]
    if ratio:
        coff = 2 if ratio == 4 else 1
        yield b + "attn_compressor_kv.weight", (coff * hd, D)
        yield b + "attn_compressor_gate.weight", (coff * hd, D)
        yield b + "attn_compressor_ape.weight", (ratio, coff * hd)
        yield b + "attn_compressor_norm.weight", (hd,)
        if ratio == 4:
            ihd = p.index_head_dim
            yield b + "indexer.proj.weight", (p.index_n_heads, D)
            yield b + "indexer.attn_q_b.weight", (p.index_n_heads * ihd, p.q_lora_rank)
            yield b + "indexer_compressor_kv.weight", (2 * ihd, D)
            yield b + "indexer_compressor_gate.weight", (2 * ihd, D)
            yield b + "indexer_compressor_ape.weight", (ratio, 2 * ihd)
            yield b + "indexer_compressor_norm.weight", (ihd,)
    yield b + "ffn_gate_inp.weight", (E, D)
    if i < p.n_hash_layers:
        yield b + "ffn_gate_tid2eid.weight", (cfg.n_vocab, k)
    else:
        yield b + "exp_probs_b.bias", (E,)
    yield from expert_tensors(cfg, i)


def tensors(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a `deepseek4` file for `cfg` (a ModelConfig with .ds4), in llama.cpp's order."""
    D, V, hc = cfg.n_embd, cfg.n_vocab, cfg.ds4.hc_mult
    out = [(TOKEN_EMBD, (V, D)), (OUTPUT_NORM, (D,)), (OUTPUT, (V, D)),
           (HC_HEAD[0], (hc, hc * D)), (HC_HEAD[1], (hc,)), (HC_HEAD[2], (1,))]
    for i in range(cfg.n_layer):
        out += list(layer_tensors(cfg, i))
    return out


# ---- transformers DeepseekV4ForCausalLM <-> GGUF -------------------------------------------------

_HF_GLOBAL = {"model.embed_tokens.weight": TOKEN_EMBD, "lm_head.weight": OUTPUT, "model.norm.weight": OUTPUT_NORM,
              "model.hc_head.hc_fn": HC_HEAD[0], "model.hc_head.hc_base": HC_HEAD[1], "model.hc_head.hc_scale": HC_HEAD[2]}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn_sinks.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight", "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight", "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "attn_hc.fn": "hc_attn_fn.weight", "attn_hc.base": "hc_attn_base.weight", "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight", "ffn_hc.base": "hc_ffn_base.weight", "ffn_hc.scale": "hc_ffn_scale.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    # mlp.experts.gate_up_proj [E, 2F, D] (gate rows first) -> ffn_gate_exps + ffn_up_exps
}


def hf_to_gguf(state: dict) -> dict:
    """An HF DeepseekV4ForCausalLM state dict (name -> tensor) -> {gguf name: tensor} (same shapes, torch
    order; gate_up_proj split into gate and up)."""
    out = {}
    for name, t in state.items():
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
            continue
        parts = name.split(".")
        assert parts[:2] == ["model", "layers"], name
        i, rest = int(parts[2]), ".".join(parts[3:])
        if rest == "mlp.experts.gate_up_proj":
            F = t.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = t[:, :F], t[:, F:]
        elif rest in _HF_LAYER:
            out[f"blk.{i}.{_HF_LAYER[rest]}"] = t
        else:
            raise KeyError(f"no GGUF name for HF tensor {name!r}")
    return out


# ---- memory (the store's slot plan) ----------------------------------------------------------------

QUERY_CHUNK = 128        # = model.deepseek4.QUERY_CHUNK (attention queries per block); no torch import here


def comp_rows(ratio: int) -> int:
    """Rows of a compressor's open-window buffer (model.deepseek4.CompState): ratio 4 keeps two windows (the next
    entry pools the previous window's first half), ratio 128 one."""
    return 2 * ratio if ratio == 4 else ratio


def state_bytes(cfg, max_len: int, dtype_bytes: int) -> int:
    """One sequence's cache state for `max_len` tokens (model.deepseek4.DS4Cache, fixed shapes allocated whole):
    per layer the window ring [window, hd]; per compressor its open-window rows (kv + gate) [comp_rows, C] and its
    entries [ceil(max_len / ratio), d]; the indexer's compressor the same at its width."""
    p, hd = cfg.ds4, cfg.head_dim
    n = 0
    for r in p.compress_ratios:
        n += p.sliding_window * hd
        if r:
            n += 2 * comp_rows(r) * (2 if r == 4 else 1) * hd + -(-max_len // r) * hd
            if r == 4:
                ihd = p.index_head_dim
                n += 2 * comp_rows(r) * 2 * ihd + -(-max_len // r) * ihd
    return n * dtype_bytes


def dense_elem_bytes(name: str, dtype_bytes: int) -> int:
    """Bytes per element of a non-expert tensor once loaded (model.deepseek4 load_dense): the FP32_KINDS in float32,
    tid2eid as int64, the rest in the compute dtype."""
    k = kind(name)
    return 8 if k == "ffn_gate_tid2eid" else (4 if k in FP32_KINDS else dtype_bytes)


def activation_bytes(cfg, n_tokens: int, dtype_bytes: int) -> int:
    """Peak activations of a prefill pass of n_tokens (one chunk: deepseek4 prefills whole), beyond the attention
    scratch (attention_scratch_bytes). Per token, the larger of the two phases of a layer (CUDA's fused kernels):
      attention: the residual streams in [hc, D]; q, the attention output and its de-rotated copy [3, H, hd]; the
        indexer's queries [nh, ihd]; the compressors' kv + gate rows [2 (2 hd + 2 ihd)]; K=V [hd] (compute dtype);
        the de-rotation's float32 rope part [2, H, r] and the indexer's head weights [nh]
      MoE: the residual streams in and out [2, hc, D] and the expert input [D] (compute dtype); the routed rows
        [k, D] and their sum [D] in float32; the shared expert's gate | up and activation [3 F_shared]
    Checked against the allocations of a pass at V4-Flash shapes (tests/store/test_vram_plan.py)."""
    p, D, H, hd = cfg.ds4, cfg.n_embd, cfg.n_head, cfg.head_dim
    nh, ihd, r, hc = p.index_n_heads, p.index_head_dim, p.rope_dim, p.hc_mult
    csa = 4 in p.compress_ratios
    attn = dtype_bytes * (hc * D + 3 * H * hd + hd + (2 * (2 * hd + 2 * ihd) + nh * ihd if csa else 2 * hd)) \
        + 4 * (2 * H * r + nh)
    moe = dtype_bytes * (2 * hc * D + D + 3 * p.n_shared * cfg.n_ff_exp) + 4 * (cfg.n_expert_used + 1) * D
    return n_tokens * max(attn, moe) + cfg.n_vocab * 4 * 4


def attention_scratch_bytes(cfg, max_len: int) -> int:
    """Peak float32 scratch of one attention block: scores, their copy with the sinks and the probabilities
    [H, Q, Q + window - 1 + N] for a block of Q queries, plus the indexer's [Q, heads, N] scores."""
    p = cfg.ds4
    n_comp = -(-max_len // 4) if 4 in p.compress_ratios else (-(-max_len // 128) if 128 in p.compress_ratios else 0)
    q = min(QUERY_CHUNK, max_len)
    keys = q + p.sliding_window - 1 + n_comp
    return 4 * (3 * cfg.n_head * q * keys + 2 * q * p.index_n_heads * n_comp)
