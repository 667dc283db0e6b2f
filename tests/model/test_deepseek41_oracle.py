"""The deepseek41 forward pass against NeMo AutoModel 0.7.0's `deepseek_v41` reading the same weights
(tests/nemo_oracle.py), Engram included.

A tiny seeded random NeMo model (the ds41-tiny geometry: sliding-only layers, a ratio-2 KV source and its reuse
layer, a ratio-1 KV source that is also the candidate layer, a re-indexing layer; Engram before layers 1 and 4)
has its weights rounded through the type each is stored in, is written as a `deepseek41` GGUF in llama.cpp's
layout, and read back by our Deepseek41Reference. NeMo derives its own Engram token map, primes and multipliers from the
tokenizer and config; we read ours from the file. Logits are compared over a whole 150-token prompt, token-by-token
decode and odd-sized chunked prefill, for an all-F32 file and a release-typed one (Q8_0/BF16 dense, MXFP4 experts,
Q8_0 Engram table). Top-k choices (experts, indexer, candidate blocks) must be far from ties (margins), so float32
noise cannot flip one. Tolerance 1e-4 x max |logit|: a wrong lag of the mHC mix, a missing Engram gate or a
mis-shared compressed stream moves logits by O(0.1-1). Decode runs the static form (fixed-shape state, the position on
the device: what CUDA captures in graphs); its bits must not depend on the size the state was allocated for.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import nemo_oracle
from betelgeuse.gguf.synth_ds41 import DS41_PRESETS, qtype_of, write_deepseek41
from betelgeuse.model.deepseek41 import Deepseek41Reference
from oracle_checks import check_logits, check_margins, chunked_logits, decode_logits, prefill_margins

REL_TOL = 1e-4
PROMPT_LEN = 150
DECODE_FROM = 40
SPEC = replace(DS41_PRESETS["ds41-tiny"], n_vocab=320, swiglu_limit=1.0, seed=5)
VARIANTS = {"F32": dict(expert_qtype="F32", dense="F32", engram_qtype="F32"),
            "release": dict(expert_qtype="MXFP4", dense="release", engram_qtype="Q8_0")}


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, SPEC.n_vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, prompt):
    """(variant, NeMo logits [T, V], our Deepseek41Reference) for one set of stored types."""
    spec = replace(SPEC, **VARIANTS[request.param])
    m = nemo_oracle.build(spec)
    stored = nemo_oracle.round_trip(m, spec, lambda n, s: qtype_of(spec, n, s))
    path = tmp_path_factory.mktemp("ds41") / f"ds41-{request.param}.gguf"
    write_deepseek41(path, spec, source=lambda n: stored[n], progress=False)
    return request.param, nemo_oracle.logits(m, prompt), Deepseek41Reference.load(path)


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    return check_logits(ours, ref, f"{what} vs NeMo", "ds41-oracle", REL_TOL)


def test_prefill_matches_nemo(pair, prompt):
    q, ref, model = pair
    ours, margins = prefill_margins(model, prompt)
    _check(ours, ref, f"{q} prefill")
    check_margins(margins, {"experts", "indexer", "candidates"}, q, "ds41-oracle")
    assert model.engram_rows.rows_read > 0


def test_decode_matches_nemo(pair, prompt):
    q, ref, model = pair
    _check(decode_logits(model, prompt, DECODE_FROM), ref, f"{q} token-by-token decode")


def test_chunked_prefill_matches_nemo(pair, prompt):
    q, ref, model = pair
    # odd sizes crossing ratio-2 windows, candidate blocks, the sliding window
    _check(chunked_logits(model, prompt, (1, 3, 7, 13, 29, 61, 5, 31)), ref, f"{q} chunked prefill")


def test_decode_bits_do_not_depend_on_the_cache_size(pair, prompt):
    """A static decode row is the same bits whatever max_len the state was sized for (entries and indexer keys have
    ceil(max_len / ratio) + 1 rows; only the visible ones may be scored or attended): decode from 13 crosses the
    window ring's wrap (16), closes ratio-2 windows and grows the ratio-1 stream past the top-k and a candidate block."""
    q, _, model = pair
    with torch.no_grad():
        a, b = (decode_logits(model, prompt[:21], 13, n) for n in (21, 321))
    assert torch.equal(a, b), f"{q}: decode rows differ by cache size, max |diff| {float((a - b).abs().max()):.3e}"
