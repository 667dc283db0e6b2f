"""Speculative expert reads in decode (worker/guess.py): layer l+1's experts guessed at layer l and read ahead.

A guess only changes when bytes arrive, never what is computed: decode logits must be the same bits with
`prefetch_decode` on and off, in every decode form (the sliced one-row decode, the static solo decode, the static
batched lanes) and for both architectures. The guesses must actually be made and read (counters > 0, the store's
read-ahead counter moves) and, where the next layer's choice is predictable, hit: deepseek4's hash-routed layers
route by token id, so a guess of one is exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

STEPS = 6
PROMPTS = [prompt(24, ENGINE_SPEC["n_vocab"], seed=s) for s in (5, 6)]
DS4_PROMPT = [int(x) for x in np.random.default_rng(4).integers(0, 512, 40)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("guess") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = tmp_path_factory.mktemp("guess-ds4") / "ds4.gguf"
    write_model(path, spec_from_preset("ds4-tiny", expert_qtype="Q8_0", seed=2), progress=False)
    return path


def _decode(path, on: bool, form: str, prompts, vram=2, host=3):
    """Each prompt prefilled, then STEPS greedy decode steps of all of them together (decode_batch: form "batch" over
    the static lanes, "rows" each sequence's dense part alone) or one at a time (form "sliced" / "static": forward()
    of one token) -> (logits
    [steps, n, V], the decode passes' stats, the store's read-ahead reads)."""
    rn, st = in_process_runner(path, vram, host, prefetch_decode=on, max_running=len(prompts))
    rn._static_decode = form in ("static", "batch")
    try:
        kvs = [rn.new_cache(128) for _ in prompts]
        toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
        rn.settle()
        reads0 = st.counters.readahead_reads
        outs, stats = [], []
        for _ in range(STEPS):
            if form in ("batch", "rows"):
                lg, s = rn.decode_batch(toks, kvs)
                stats.append(s)
            else:
                rows = []
                for i, kv in enumerate(kvs):
                    lg1, s = rn.forward([toks[i]], kv, consolidate=False)
                    rows.append(lg1[-1:])
                    stats.append(s)
                lg = torch.cat(rows)
            outs.append(lg)
            toks = [int(x) for x in lg.argmax(-1)]
        return torch.stack(outs), stats, st.counters.readahead_reads - reads0
    finally:
        close_runner(rn, st)


def _sum(stats, name):
    return sum(getattr(s, name) for s in stats)


@pytest.mark.parametrize("form", ["sliced", "static", "batch", "rows"])
def test_qwen3moe_guesses_keep_bits_and_are_read(qwen, form):
    prompts = PROMPTS if form in ("batch", "rows") else PROMPTS[:1]
    off, s_off, ra_off = _decode(qwen, False, form, prompts)
    on, s_on, ra_on = _decode(qwen, True, form, prompts)
    assert torch.equal(on, off)
    assert _sum(s_off, "guessed") == 0 and ra_off == 0            # off = as before: no read ahead in decode
    guessed, prefetched = _sum(s_on, "guessed"), _sum(s_on, "prefetched")
    assert guessed > 0 and prefetched > 0 and ra_on == prefetched, (guessed, prefetched, ra_on)
    assert _sum(s_on, "guess_bytes") > 0
    assert 0 < _sum(s_on, "guess_hits") <= guessed


@pytest.mark.parametrize("form", ["sliced", "static"])
def test_deepseek4_guesses_keep_bits_and_hash_layers_hit(ds4, form):
    off, _, _ = _decode(ds4, False, form, [DS4_PROMPT])
    on, s_on, ra = _decode(ds4, True, form, [DS4_PROMPT])
    assert torch.equal(on, off)
    assert _sum(s_on, "guessed") > 0 and ra > 0
    # layer 1 is hash-routed (ds4-tiny: 2 hash layers): its guess at layer 0 is its choice, token id for token id
    hits, guessed = _sum(s_on, "guess_hits"), _sum(s_on, "guessed")
    assert hits > 0 and hits <= guessed
