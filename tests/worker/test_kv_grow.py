"""A sequence state sized to what it uses and grown when it gets there (worker/kv_manager.py, model grow_cache).

What must hold, with a real store and the tiny models on the CPU:
- a sequence decoded across a growth point (its state doubled, the old one's contents copied, its graphs and lane
  re-bound) gives the same logits, bit for bit, as one allocated at the larger size from the start: qwen3moe and
  deepseek4, in the one-row decode (sliced and static forms) and in the batched lanes;
- through the engine, unbounded requests (max_tokens unset) start small and grow, their tokens those of the same
  requests bounded; and with every one of max_running sequences running, the flex cache still holds experts in the
  bytes the short states leave, while flex + the states' bytes stay within the plan's KV reservation at every
  allocation, growth and fill (DESIGN.md invariant 3).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.config import EngineConfig
from betelgeuse.worker import kv_manager

from engine_helpers import (ENGINE_SPEC, StateBytes, close_runner, engine_and_store, in_process_runner, prompt,
                            settles, write_ds4_tiny, write_synth)

V = ENGINE_SPEC["n_vocab"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("grow") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return write_ds4_tiny(tmp_path_factory.mktemp("grow-ds4") / "ds4.gguf")


def _grown_vs_full(path, prompt_ids, tokens, small: int, full: int, form: str, vocab: int):
    """The prompt prefilled into a state of `small` tokens (grown x2 whenever a decode finds it full) and into one of
    `full`, then the forced `tokens` decoded into both -> (logits of each [steps, V], growths seen)."""
    rn, st = in_process_runner(path, 3, 5, max_running=3)
    rn._static_decode = form != "sliced"
    try:
        a, b = rn.new_cache(small), rn.new_cache(full)
        for kv in (a, b):
            rn.forward(prompt_ids, kv, consolidate=False)
        out_a, out_b, grown = [], [], 0
        for t in tokens:
            if a.length == a.max_len:
                a = rn.grow_cache(a, 2 * a.max_len)
                grown += 1
            if form == "lanes":                       # both in one batched step, each in its own lane
                lg, _ = rn.decode_batch([t, t], [a, b])
                la, lb = lg[0], lg[1]
            else:
                la = rn.forward([t], a, consolidate=False)[0][-1]
                lb = rn.forward([t], b, consolidate=False)[0][-1]
            out_a.append(la.reshape(vocab))
            out_b.append(lb.reshape(vocab))
        assert rn.kv_bytes == sum(kv.nbytes() for kv in (a, b))
        rn.release(a), rn.release(b)
        assert rn.kv_bytes == 0
        return torch.stack(out_a), torch.stack(out_b), grown
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("form", ["sliced", "static", "lanes"])
def test_qwen3moe_decode_across_growth_is_bit_identical(qwen, form):
    P = prompt(40, V, seed=7)
    toks = [int(x) for x in np.random.default_rng(8).integers(0, V, 30)]
    a, b, grown = _grown_vs_full(qwen, P, toks, 48, 256, form, V)
    assert grown == 1                                 # 48 -> 96 at token 48
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"


@pytest.mark.parametrize("form", ["sliced", "static", "lanes"])
def test_deepseek4_decode_across_growth_is_bit_identical(ds4, form):
    """ds4-tiny (sliding window 16, compressed entries of 4 and 128 tokens): 100 prompt tokens, 40 decoded, the
    state grown 104 -> 208 past its ratio-4 and ratio-128 entries' old rows (the HCA window closes at 127)."""
    from betelgeuse.gguf.reader import GGUFModelFile
    vocab = GGUFModelFile.open(ds4).config.n_vocab
    rng = np.random.default_rng(4)
    P = [int(x) for x in rng.integers(0, vocab, 100)]
    toks = [int(x) for x in rng.integers(0, vocab, 40)]
    a, b, grown = _grown_vs_full(ds4, P, toks, 104, 256, form, vocab)
    assert grown == 1
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"


def _req(ids, n):
    return GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


def test_unbounded_requests_grow_and_the_flex_cache_keeps_the_rest(qwen, monkeypatch):
    """max_running 3, max_context 192, granules of 16 tokens: three requests without max_tokens run together to the
    end of the context, their states 48 -> 96 -> 192 tokens; the same three bounded give the same tokens. The byte
    counter (flex bytes + the states' bytes) stays within the plan's KV reservation at every allocation, growth and
    fill, and the flex cache held experts while all three ran (a whole-sequence unit per state would leave it none)."""
    monkeypatch.setattr(kv_manager, "KV_GRANULE", 16)
    cfg = EngineConfig(model_path=str(qwen), read_threads=2, max_running=3, admission_window=0.3, flex_cache=True,
                       vram_slots=2, host_slots=3, max_context=192, staging_slots=6, decode_consolidate_every=0,
                       prefix_cache_bytes=0)
    with engine_and_store(cfg) as eng:
        rn = eng.runner
        flex = rn.flex
        count = StateBytes(rn)              # budget: the plan's KV bytes for max_running sequences (no graphs here)
        assert flex is not None and flex.reserved == count.budget

        prompts = [prompt(20 + i, V, seed=40 + i) for i in range(3)]

        def run(n_of):
            got = [None] * 3

            def client(i):
                got[i] = list(eng.submit(_req(prompts[i], n_of(i))))
            threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert all(g is not None and g[-1].finish_reason == "length" for g in got), got
            return [list(g[-1].token_ids) for g in got]

        unbounded = run(lambda i: None)
        assert count.grown == 6                              # each: 48 -> 96 -> 192
        assert 0 < count.via_host < 6                        # the last of them, the others' states full
        bounded = run(lambda i: 192 - len(prompts[i]))
        assert unbounded == bounded
        assert [len(t) for t in unbounded] == [192 - len(p) for p in prompts]
        assert not count.over, f"flex + state bytes over the plan's KV reservation: {count.over[:3]}"
        assert count.all_released(), (count.live, flex.describe())
        assert count.checks > 10 and count.peak <= count.budget
        assert count.most_held_running.get(3, 0) > 0, count.most_held_running


def test_a_failed_growth_ends_its_request_alone(qwen, monkeypatch):
    """The device out of memory while one state grows: that request ends with InternalError; the one decoding beside
    it (bounded: no growth) finishes with the tokens it gives alone, and the engine serves on."""
    from betelgeuse.errors import InternalError
    monkeypatch.setattr(kv_manager, "KV_GRANULE", 16)
    cfg = EngineConfig(model_path=str(qwen), read_threads=2, max_running=2, admission_window=0.3, vram_slots=2,
                       host_slots=3, max_context=128, prefix_cache_bytes=0)
    with engine_and_store(cfg) as eng:
        def run(req):
            try:
                return list(eng.submit(req))[-1].token_ids
            except InternalError as e:
                return e
        bounded = _req(prompt(20, V, seed=50), 40)                  # 64 tokens from the start
        alone = run(bounded)
        real = eng.runner.model.grow_cache

        def oom(*a, **k):
            raise RuntimeError("CUDA out of memory (injected)")
        eng.runner.model.grow_cache = oom
        got = [None, None]

        def client(i, req):
            got[i] = run(req)
        reqs = [_req(prompt(20, V, seed=51), None), bounded]         # the first grows at 48 tokens
        threads = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert isinstance(got[0], InternalError), got[0]
        assert got[1] == alone
        eng.runner.model.grow_cache = real
        assert len(run(reqs[0])) == 108                               # grown 48 -> 96 -> 128, to the context's end
        assert settles(lambda: eng.runner.kv_bytes == 0), eng.runner.kv_bytes
