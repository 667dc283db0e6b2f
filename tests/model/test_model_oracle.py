"""The in-process qwen3moe forward pass against Hugging Face transformers reading the same GGUF.

transformers' GGUF loader dequantizes with gguf-py's numpy code and runs its own Qwen3MoE
implementation (eager/sdpa attention, index_add MoE), so the only expected differences are float32
rounding from a different order of operations: ~1e-7 relative per op, growing to ~1e-6 relative
over a few layers. The tolerance, 1e-4 x the largest |logit|, sits ~100x above that noise and far
below any real bug (a wrong RoPE convention, a missing q/k norm, unnormalized top-k weights or a
wrong GQA head mapping each move logits by O(0.1-1)).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from betelgeuse.api import SamplingParams
from betelgeuse.kernels.torch_moe import apply_experts, expert_ffn
from betelgeuse.model.generate import generate
from betelgeuse.model.qwen3moe import Qwen3MoeReference
from services.cli import main

from conftest import ORACLE_OVERRIDES, ORACLE_QTYPES

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # local files only: never try the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REL_TOL = 1e-4
PROMPT = [5, 17, 300, 42, 9, 250, 77, 128, 3, 64, 199, 11]     # < n_vocab=320


def _hf_model(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        moe_intermediate_size=ORACLE_OVERRIDES["n_ff_exp"], norm_topk_prob=True).eval()


@pytest.fixture(scope="module")
def hf_models(oracle_models):
    return {q: _hf_model(p) for q, p in oracle_models.items()}


def _hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("qtype", ORACLE_QTYPES)
def test_cli_logits_match_transformers(qtype, oracle_models, hf_models, tmp_path):
    out = tmp_path / "logits.npy"
    rc = main(["logits", str(oracle_models[qtype]), "--token-ids", ",".join(map(str, PROMPT)), "--output", str(out)])
    assert rc == 0
    ours = np.load(out)
    ref = _hf_logits(hf_models[qtype], PROMPT)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (len(PROMPT), ORACLE_OVERRIDES["n_vocab"])
    diff = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    print(f"\n[oracle] {qtype}: max-abs logit difference vs transformers = {diff:.3e} "
          f"(max |logit| {scale:.3f}, tolerance {REL_TOL * scale:.3e})")
    assert scale > 0.5 and ref.std() > 0.1            # a live model, not all-zero logits
    assert diff <= REL_TOL * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("qtype", ORACLE_QTYPES)
def test_greedy_continuation_matches_transformers(qtype, oracle_models, hf_models):
    """16 greedy tokens: ours decode one token at a time through the KV cache; the reference
    re-runs the whole sequence each step without a cache."""
    model = Qwen3MoeReference.load(oracle_models[qtype])
    ours = list(generate(model, PROMPT, 16, SamplingParams(temperature=0.0)))
    hf, seq = hf_models[qtype], list(PROMPT)
    for _ in range(16):
        seq.append(int(_hf_logits(hf, seq)[-1].argmax()))
    print(f"\n[oracle] {qtype}: greedy continuation {ours}")
    assert ours == seq[len(PROMPT):]
    assert len(set(ours)) > 1                        # not a degenerate repeat of one token


def test_incremental_decode_matches_full_forward(oracle_models):
    model = Qwen3MoeReference.load(oracle_models["F32"])
    full = model.forward(PROMPT, model.new_cache(len(PROMPT)))
    cache = model.new_cache(len(PROMPT))
    parts = [model.forward(PROMPT[:5], cache)] + [model.forward(PROMPT[i:i + 1], cache) for i in range(5, len(PROMPT))]
    step = torch.cat(parts)
    assert cache.length == len(PROMPT)
    assert float((step - full).abs().max()) <= REL_TOL * float(full.abs().max())
    # truncate + re-run reuses the prefix and gives the same last logits
    cache.truncate(8)
    again = model.forward(PROMPT[8:], cache)
    assert float((again - full[8:]).abs().max()) <= REL_TOL * float(full.abs().max())


def _random_moe(T=45, H=32, F=24, E=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    experts = {e: (torch.randn(F, H, generator=g) / H ** .5, torch.randn(F, H, generator=g) / H ** .5,
                   torch.randn(H, F, generator=g) / F ** .5) for e in range(E)}
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return h, ids, w, experts


def test_apply_experts_is_independent_of_compute_order():
    h, ids, w, experts = _random_moe()
    needed = sorted(set(ids.flatten().tolist()))
    calls = []

    def get(e):
        calls.append(e)
        return experts[e]

    base = apply_experts(h, ids, w, get, sub_batch=16)     # T=45: several 16-row chunks per expert
    assert calls == needed
    orders = [needed[::-1], needed[1::2] + needed[0::2]]
    rnd = list(needed)
    random.Random(3).shuffle(rnd)
    orders.append(rnd)
    for order in orders:
        calls.clear()
        out = apply_experts(h, ids, w, get, sub_batch=16, order=order)
        assert calls == order                         # really computed in that order
        assert torch.equal(out, base), order          # bit-identical, not merely close
    # and it is the MoE: sum over ranks of weight x expert(h), computed naively per token
    naive = torch.stack([sum(w[t, r] * expert_ffn(h[t:t + 1], *experts[int(ids[t, r])])[0]
                             for r in range(ids.shape[1])) for t in range(h.shape[0])])
    assert torch.allclose(out, naive, rtol=1e-5, atol=1e-6)


def test_apply_experts_rejects_incomplete_order():
    h, ids, w, experts = _random_moe(T=8, E=4, k=2)
    needed = sorted(set(ids.flatten().tolist()))
    with pytest.raises(AssertionError):
        apply_experts(h, ids, w, experts.__getitem__, order=needed[:-1])


def test_generate_stop_ids_and_length(oracle_models):
    model = Qwen3MoeReference.load(oracle_models["Q8_0"])
    g = generate(model, PROMPT, 6, SamplingParams())
    free = list(g)
    assert len(free) == 6 and g.finish_reason == "length"
    stop = free[2]
    g = generate(model, PROMPT, 6, SamplingParams(), stop_ids=[stop])
    first = free[:free.index(stop)]
    assert list(g) == first and g.finish_reason == "stop"     # the stop id itself is not yielded
