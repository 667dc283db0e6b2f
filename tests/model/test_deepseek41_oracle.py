"""The deepseek41 forward pass against NeMo AutoModel 0.7.0's `deepseek_v41` reading the same weights
(tests/nemo_oracle.py), Engram included.

A tiny seeded random NeMo model (the ds41-tiny geometry: sliding-only layers, a ratio-2 KV source and its reuse
layer, a ratio-1 KV source that is also the candidate layer, a re-indexing layer; Engram before layers 1 and 4)
has its weights rounded through the type each is stored in, is written as a `deepseek41` GGUF in llama.cpp's
layout, and read back by our Deepseek41Reference. NeMo derives its own Engram token map, primes and multipliers from the
tokenizer and config; we read ours from the file. Logits are compared over a whole 150-token prompt, token-by-token
decode and odd-sized chunked prefill (the reference in prefill chunks of 64: the prompt spans 3), and at deepseek41's
default chunk (256) a 300-token prompt in 2 chunks, resumed at 256 from the state kept there as the snapshot cache
does, for an all-F32 file and a release-typed one (Q8_0/BF16 dense, MXFP4 experts,
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
from betelgeuse.model.deepseek41 import Deepseek41Model, Deepseek41Reference
from oracle_checks import (check_logits, check_margins, chunked_logits, decode_logits, prefill_and_resume,
                           prefill_margins)

REL_TOL = 1e-4
PROMPT_LEN = 150
DECODE_FROM = 40
CHUNK = 64                # the reference's prefill chunk but in the default-chunk test: PROMPT_LEN spans 3 chunks
LONG_LEN = 300            # the default-chunk test's prompt: 2 chunks of deepseek41's default (256)
LONG_SEED = 16            # its tokens' seed: one whose top-k choices are far from ties (margins) in both variants
SPEC = replace(DS41_PRESETS["ds41-tiny"], n_vocab=320, swiglu_limit=1.0, seed=5)
VARIANTS = {"F32": dict(expert_qtype="F32", dense="F32", engram_qtype="F32"),
            "release": dict(expert_qtype="MXFP4", dense="release", engram_qtype="Q8_0")}


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, SPEC.n_vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request, tmp_path_factory):
    """(variant, the NeMo model with its weights rounded to the stored types, our GGUF of them) for one set of types."""
    spec = replace(SPEC, **VARIANTS[request.param])
    m = nemo_oracle.build(spec)
    stored = nemo_oracle.round_trip(m, spec, lambda n, s: qtype_of(spec, n, s))
    path = tmp_path_factory.mktemp("ds41") / f"ds41-{request.param}.gguf"
    write_deepseek41(path, spec, source=lambda n: stored[n], progress=False)
    return request.param, m, path


@pytest.fixture(scope="module")
def pair(built, prompt):
    """(variant, NeMo logits [T, V], our Deepseek41Reference prefilling in chunks of CHUNK) for one set of types."""
    q, m, path = built
    return q, nemo_oracle.logits(m, prompt), Deepseek41Reference.load(path, chunk=CHUNK)


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


def test_the_default_chunk_matches_nemo_and_resumes_at_its_boundary(built):
    """deepseek41's default chunk (Deepseek41Model.prefill_chunk, 256: the reference's default and what a runner with
    prefill_chunk auto runs): a 300-token prompt prefills in 2 chunks to NeMo's logits, and the state its pass kept at
    256 (state.mark: the snapshot cache's checkpoint, the Engram history with it), restored into a fresh state,
    prefills the other 44 tokens to the bits of the unbroken prefill."""
    q, m, path = built
    model = Deepseek41Reference.load(path)
    assert model.chunk == Deepseek41Model.prefill_chunk == 256
    long = torch.randint(0, SPEC.n_vocab, (LONG_LEN,), generator=torch.Generator().manual_seed(LONG_SEED))
    want = nemo_oracle.logits(m, long)
    whole, margins, rest = prefill_and_resume(model, long, 256)
    check_margins(margins, {"experts", "indexer", "candidates"}, f"{q} {LONG_LEN} tokens", "ds41-oracle")
    _check(whole, want, f"{q} prefill in chunks of 256")
    assert torch.equal(rest, whole[256:]), f"{q}: resumed at 256, max |diff| {(rest - whole[256:]).abs().max():.3e}"
