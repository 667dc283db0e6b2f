"""The deepseek4 forward pass against transformers 5.24 `DeepseekV4ForCausalLM` reading the same weights.

A tiny seeded random HF model (layers: sliding-only, ratio-4 CSA with the indexer, ratio-128 HCA, CSA; the
first two hash-routed; sliding window 16, so a 200-token prompt crosses the window, 50 CSA windows and an
HCA window) has its weights rounded through the quantizer of the type each one is stored in (so the
reference computes exactly the model the file holds), is written as a `deepseek4` GGUF in llama.cpp's layout,
and read back by our Deepseek4Reference. Logits are compared over the whole prompt, token-by-token decode and
odd-sized chunked prefill (the reference in prefill chunks of 64: the prompt spans 4), and at deepseek4's default chunk
(256) a 300-token prompt in 2 chunks, resumed at 256 from the state kept there as the snapshot cache does, for F32,
Q8_0 and MXFP4 routed experts. Expert and indexer top-k choices turn
1e-7 noise into different selections near ties, so the test asserts the selection margins are far from ties.
Tolerance: 1e-4 x max |logit| (float32 noise is ~1e-6 relative; a wrong RoPE pairing, a missing clamp or a
mis-ordered Sinkhorn move logits by O(0.1-1)).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from betelgeuse.gguf import ds4layout
from betelgeuse.gguf.synth_ds4 import DS4Spec, qtype_of, write_deepseek4
from betelgeuse.model.deepseek4 import Deepseek4Model, Deepseek4Reference

from oracle_checks import (check_logits, check_margins, chunked_logits, decode_logits, prefill_and_resume,
                           prefill_margins)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REL_TOL = 1e-4
PROMPT_LEN = 200
DECODE_FROM = 64          # decode: a 64-token prefill, then one token at a time (crossing the HCA window at 127)
CHUNK = 64                # the reference's prefill chunk but in the default-chunk test: PROMPT_LEN spans 4 chunks
LONG_LEN = 300            # the default-chunk test's prompt: 2 chunks of deepseek4's default (256)
SEED = 3
SPEC = DS4Spec(n_layer=4, n_embd=64, n_head=4, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32,
               n_expert=8, n_expert_used=2, n_ff_exp=32, n_vocab=320, compress_ratios=(0, 4, 128, 4),
               n_hash_layers=2, sliding_window=16, index_n_heads=16, index_head_dim=32, index_topk=4,
               context_length=4096, rope_factor=4.0, rope_orig_ctx=64, swiglu_limit=1.0, routed_scale=1.5,
               seed=SEED)
VARIANTS = {"F32": dict(expert_qtype="F32", dense="F32"), "Q8_0": dict(expert_qtype="Q8_0", dense="release"),
            "MXFP4": dict(expert_qtype="MXFP4", dense="release")}


def hf_config(spec: DS4Spec):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(
        vocab_size=spec.n_vocab, hidden_size=spec.n_embd, moe_intermediate_size=spec.n_ff_exp,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=1,
        head_dim=spec.head_dim, q_lora_rank=spec.q_lora_rank, qk_rope_head_dim=spec.rope_dim,
        num_experts_per_tok=spec.n_expert_used, n_routed_experts=spec.n_expert, n_shared_experts=1,
        routed_scaling_factor=spec.routed_scale, compress_ratios=list(spec.ratios()),
        num_hash_layers=spec.n_hash_layers, sliding_window=spec.sliding_window, o_groups=spec.o_groups,
        o_lora_rank=spec.o_lora_rank, index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk, hc_mult=spec.hc_mult, hc_sinkhorn_iters=spec.hc_sinkhorn_iters,
        hc_eps=spec.hc_eps, rope_theta=spec.rope_theta, compress_rope_theta=spec.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": spec.rope_factor,
                         "original_max_position_embeddings": spec.rope_orig_ctx,
                         "beta_fast": spec.yarn_beta_fast, "beta_slow": spec.yarn_beta_slow},
        swiglu_limit=spec.swiglu_limit, rms_norm_eps=spec.rms_eps, max_position_embeddings=spec.context_length,
        attn_implementation="eager")


def random_hf_model(spec: DS4Spec):
    """A DeepseekV4ForCausalLM with seeded non-trivial weights (HF's init zeroes sinks, ape and biases)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(spec.seed)
    model = transformers.DeepseekV4ForCausalLM(hf_config(spec)).eval()
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                t.copy_(torch.argsort(torch.rand(t.shape[0], spec.n_expert, generator=g), dim=1)[:, :t.shape[1]])
            elif name.endswith(("fn", "hc_fn")):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1 and name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1 or name.endswith("position_bias"):       # sinks, hc bases, score bias, ape
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    return model


def round_through_quantizer(model, spec: DS4Spec) -> dict[str, np.ndarray]:
    """Quantize every weight to its stored type and back, load that into `model`; -> {gguf name: array}."""
    from gguf import GGMLQuantizationType as GT, quants
    state = {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}
    stored = {}
    for name, t in ds4layout.hf_to_gguf(state).items():
        a = t.detach().numpy()
        gt = qtype_of(spec, name, tuple(a.shape))
        if gt not in (GT.F32, GT.I32):
            a = quants.dequantize(quants.quantize(a.astype(np.float32), gt), gt).reshape(a.shape)
        stored[name] = a.astype(np.int32) if gt == GT.I32 else a.astype(np.float32)
    back = {}
    for hf_name in state:
        if hf_name.endswith("gate_up_proj"):
            i = hf_name.split(".")[2]
            back[hf_name] = np.concatenate([stored[f"blk.{i}.ffn_gate_exps.weight"],
                                            stored[f"blk.{i}.ffn_up_exps.weight"]], axis=1)
        else:
            back[hf_name] = stored[ds4layout.hf_to_gguf({hf_name: state[hf_name]}).popitem()[0]]
    with torch.no_grad():
        sd = model.state_dict()
        for k, v in back.items():
            sd[k].copy_(torch.from_numpy(v).to(sd[k].dtype))
    return stored


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, SPEC.n_vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request, tmp_path_factory):
    """(variant, the HF model with its weights rounded to the stored types, our GGUF of them) for one quant variant."""
    from dataclasses import replace
    spec = replace(SPEC, **VARIANTS[request.param])
    hf = random_hf_model(spec)
    stored = round_through_quantizer(hf, spec)
    path = tmp_path_factory.mktemp("ds4") / f"ds4-{request.param}.gguf"
    write_deepseek4(path, spec, source=lambda n: stored[n], progress=False)
    return request.param, hf, path


@pytest.fixture(scope="module")
def pair(built, prompt):
    """(variant, HF logits [T, V], our Deepseek4Reference prefilling in chunks of CHUNK) for one quant variant."""
    q, hf, path = built
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0].float()
    return q, ref, Deepseek4Reference.load(path, chunk=CHUNK)


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    return check_logits(ours, ref, f"{what} vs transformers", "ds4-oracle", REL_TOL)


def test_prefill_matches_transformers(pair, prompt):
    q, ref, model = pair
    ours, margins = prefill_margins(model, prompt)
    _check(ours, ref, f"{q} prefill")
    check_margins(margins, {"experts", "indexer"}, q, "ds4-oracle")


def test_decode_matches_transformers(pair, prompt):
    q, ref, model = pair
    _check(decode_logits(model, prompt, DECODE_FROM), ref, f"{q} token-by-token decode")


def test_chunked_prefill_matches_transformers(pair, prompt):
    q, ref, model = pair
    # odd sizes crossing windows of 4, 16 and 128
    _check(chunked_logits(model, prompt, (1, 3, 7, 13, 29, 61, 5, 81)), ref, f"{q} chunked prefill")


def test_the_default_chunk_matches_transformers_and_resumes_at_its_boundary(built):
    """deepseek4's default chunk (Deepseek4Model.prefill_chunk, 256: the reference's default and what a runner with
    prefill_chunk auto runs): a 300-token prompt prefills in 2 chunks to transformers' logits, and the state its pass
    kept at 256 (state.mark: the snapshot cache's checkpoint), restored into a fresh state, prefills the other 44
    tokens to the bits of the unbroken prefill."""
    q, hf, path = built
    model = Deepseek4Reference.load(path)
    assert model.chunk == Deepseek4Model.prefill_chunk == 256
    long = torch.randint(0, SPEC.n_vocab, (LONG_LEN,), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = hf(long[None]).logits[0].float()
    whole, margins, rest = prefill_and_resume(model, long, 256)
    check_margins(margins, {"experts", "indexer"}, f"{q} {LONG_LEN} tokens", "ds4-oracle")
    _check(whole, want, f"{q} prefill in chunks of 256")
    assert torch.equal(rest, whole[256:]), f"{q}: resumed at 256, max |diff| {(rest - whole[256:]).abs().max():.3e}"


def test_decode_bits_do_not_depend_on_the_cache_size(pair, prompt):
    """A decode row is the same bits whatever max_len the sequence's state was sized for (its compressed-entry
    tensors have ceil(max_len / ratio) rows; only the visible ones may take part): decode from 13 crosses the
    window ring's wrap (16) and closes CSA windows; the caches differ in their HCA rows (1 vs 3)."""
    q, _, model = pair
    start, steps = 13, prompt[13:21]

    def rows(max_len):
        kv = model.new_cache(max_len)
        with torch.no_grad():
            model.forward(prompt[:start], kv)
            return torch.cat([model.forward(t.view(1), kv) for t in steps])

    a, b = rows(start + len(steps)), rows(start + len(steps) + 300)
    assert torch.equal(a, b), f"{q}: decode rows differ by cache size, max |diff| {float((a - b).abs().max()):.3e}"
