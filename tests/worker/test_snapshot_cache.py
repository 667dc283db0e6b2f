"""deepseek4's and deepseek41's prefix cache (worker/snapshot_cache.py) through the engine: a repeated prompt runs no pass, an
agent's next turn resumes after the last chunk boundary of its previous prompt, and every token and logprob equals
an engine without a prefix cache (DESIGN.md §2: bit-identical across prefix hits); the snapshots stay within their
budget, least recently used first, never one a running request holds, a snapshot that does not fit refused.

Why exact: prefill runs in position-aligned chunks from each layer's own length, so a resumed prefill is the same
ops on the same bits (tests/model/test_deepseek4_resume.py); the miss path is the engine's, checked against
Deepseek4Reference in test_deepseek4_engine and that against transformers in test_deepseek4_oracle (deepseek41:
test_deepseek41_engine, test_deepseek41_oracle against NeMo; its snapshots carry the Engram history, and the Engram
rows of a resumed prefill come from the store as a miss's do).
"""

from __future__ import annotations

import numpy as np
import pytest

from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.config import EngineConfig
from betelgeuse.worker.snapshot_cache import SnapshotCache

from engine_helpers import close_runner, in_process_runner, metered_engine, synth_reference

C = 16                                          # prefill_chunk = checkpoint grid, small so that prompts span chunks
V = 512


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, V, n)]


SYSTEM = _ids(45, 1)


@pytest.fixture(scope="module", params=["ds4-tiny", "ds41-tiny"])
def model(request, tmp_path_factory):
    path, _, _ = synth_reference(tmp_path_factory, request.param, SYSTEM, 64, expert_qtype="Q8_0", seed=2)
    return path


def _engine(model, **kw):
    cfg = EngineConfig(model_path=str(model), vram_slots=3, host_slots=5, read_threads=2, max_context=512,
                       **{"prefill_chunk": C, **kw})
    return metered_engine(cfg)


def _gen(eng, ids, n=6, salt=""):
    req = GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True, cache_salt=salt,
                          sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
    evs = list(eng.submit(req))
    return [(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in evs[:-1]], evs[-1]


def _sample(reg, name):
    v = reg.get_sample_value(name)
    return 0.0 if v is None else v


def test_agent_turns_and_repeats_are_bit_identical_to_a_miss(model):
    """Each turn resends the conversation (+ the reply + new text): it resumes after its previous prompt's last
    chunk boundary, or at its end when that is one (the first turn: 64 tokens = 4 chunks, its whole entry); a
    repeated turn runs no pass; another salt shares nothing. Tokens and logprobs equal an engine without the cache."""
    turns, conv = [], list(SYSTEM)
    for t in range(3):
        conv = conv + _ids(19 + 5 * t, 20 + t)
        turns.append(list(conv))
        conv = conv + _ids(6, 40 + t)
    on, close_on = _engine(model)
    off, close_off = _engine(model, prefix_cache_bytes=0)
    try:
        assert isinstance(on.prefix_cache, SnapshotCache) and off.prefix_cache is None
        reg = on.metrics.registry
        for i, P in enumerate(turns):
            got, fin = _gen(on, P)
            want, fin0 = _gen(off, P)
            assert got == want, f"turn {i}: tokens/logprobs differ with the snapshot cache"
            assert fin0.usage.cached_tokens == 0
            prev = len(turns[i - 1]) if i else 0
            assert fin.usage.cached_tokens == (prev if prev % C == 0 else (prev - 1) // C * C), (i, fin.usage)
        computed = _sample(reg, "betelgeuse_prompt_tokens_total")
        again, fin = _gen(on, turns[-1])                             # a retry: no prompt token computed
        assert again == want and fin.usage.cached_tokens == len(turns[-1])
        assert _sample(reg, "betelgeuse_prompt_tokens_total") == computed
        salted, fin = _gen(on, turns[-1], salt="tenant-b")           # another tenant: a miss, the same answer
        assert salted == want and fin.usage.cached_tokens == 0
        assert len(turns[0]) % C == 0 and _sample(reg, "betelgeuse_prefix_cache_hits_total") == 3
        assert _sample(reg, "betelgeuse_prefix_cache_refused_total") == 0
        assert 0 < _sample(reg, "betelgeuse_prefix_cache_used_bytes") <= \
            _sample(reg, "betelgeuse_prefix_cache_capacity_bytes")
    finally:
        close_on()
        close_off()


def test_at_the_default_chunk_a_turn_resumes_at_256_with_the_bits_of_a_miss(model):
    """prefill_chunk left auto: deepseek4's and deepseek41's own chunk, 256, is the checkpoint grid. A 330-token turn
    keeps its state at 256 (a chunk of 64 would keep 320), and the next turn (+ 40 tokens) resumes there with the
    tokens and logprobs of an engine without the cache."""
    on, close_on = _engine(model, prefill_chunk="auto")
    off, close_off = _engine(model, prefill_chunk="auto", prefix_cache_bytes=0)
    try:
        assert on.runner.chunk == on.prefix_cache.block == off.runner.chunk == 256
        P = _ids(330, 9)
        _, fin = _gen(on, P)
        assert fin.usage.cached_tokens == 0
        ext = P + _ids(40, 10)
        got, fin = _gen(on, ext)
        want, fin0 = _gen(off, ext)
        assert got == want, "tokens/logprobs differ after a resume at the default chunk"
        assert fin.usage.cached_tokens == 256 and fin0.usage.cached_tokens == 0
    finally:
        close_on()
        close_off()


def test_refusals_are_exported_and_cost_no_copy(model):
    """A budget too small for any snapshot: the checkpoint and the whole prompt are refused (counted in
    betelgeuse_prefix_cache_refused_total), the pass marks nothing, and a repeat is a miss with the same answer."""
    eng, close = _engine(model, prefix_cache_bytes=4096)
    try:
        P = SYSTEM + _ids(20, 7)
        first, _ = _gen(eng, P)
        again, fin = _gen(eng, P)
        assert again == first and fin.usage.cached_tokens == 0
        reg = eng.metrics.registry
        assert _sample(reg, "betelgeuse_prefix_cache_refused_total") == 4 == eng.prefix_cache.stats.refused
        assert _sample(reg, "betelgeuse_prefix_cache_used_bytes") == 0
    finally:
        close()


def test_a_restarted_worker_answers_from_the_host_tier(model):
    """Snapshots are written through to the host tier the store holds: a new worker on the same store (a worker
    restarted after kill -9; a real process: tests/worker/test_two_process.py) answers a repeated
    prompt from it without a pass and resumes an agent's next turn at its checkpoint, with the bits of a miss."""
    from betelgeuse.assembly import open_engine, open_store
    from betelgeuse.metrics import make_worker_metrics
    cfg = EngineConfig(model_path=str(model), vram_slots=3, host_slots=5, prefill_chunk=C, read_threads=2,
                       max_context=512)
    store = open_store(cfg)
    try:
        eng = open_engine(cfg, store, metrics=make_worker_metrics())
        P = SYSTEM + _ids(20, 7)
        first, fin = _gen(eng, P)
        assert fin.usage.cached_tokens == 0 and eng.prefix_cache.host is not None
        eng.close()
        eng = open_engine(cfg, store, metrics=make_worker_metrics())
        try:
            assert len(eng.prefix_cache.host.index) == 2 and eng.prefix_cache.bytes_used == 0     # adopted
            again, fin = _gen(eng, P)
            assert again == first and fin.usage.cached_tokens == len(P)
            ext = P + _ids(9, 8)
            got, fin = _gen(eng, ext)
            want, fin0 = _gen(eng, ext, salt="miss")
            assert got == want and fin0.usage.cached_tokens == 0
            assert fin.usage.cached_tokens == (len(P) - 1) // C * C
            assert eng.prefix_cache.stats.host_hits == 2
            assert _sample(eng.metrics.registry, "betelgeuse_prefix_host_hits_total") == 2
        finally:
            eng.close()
    finally:
        store.close()


def test_snapshots_are_lru_within_the_budget_spare_held_ones_and_refuse_what_does_not_fit(model):
    rn, st = in_process_runner(model, 0, 0, prefill_chunk=C)
    try:
        def whole(P, sc, held=()):
            kv = rn.new_cache(128)
            logits, _ = rn.forward(P, kv)
            return sc.insert_tail(kv, P, list(held), logits[-1])

        probe = SnapshotCache(rn.model, C, 1 << 30)
        one = probe.covered(whole(SYSTEM, probe)) and probe.bytes_used       # bytes of a 45-token entry
        sc = SnapshotCache(rn.model, C, 2 * one + one // 2)                 # room for two
        a, b, c = (SYSTEM[:44] + [x] for x in (3, 4, 5))
        held_a = whole(a, sc)                                                # held: never evicted
        sc.release(whole(b, sc))
        sc.release(whole(c, sc))                                             # b (unheld, oldest) makes room
        assert sc.lookup(b) == [] and len(sc.lookup(a)) == 1 and len(sc.lookup(c)) == 1
        assert sc.stats.evictions == 1 and sc.bytes_used == 2 * one <= sc.capacity_bytes
        sc.release(whole(b, sc))                                             # now c, the oldest unheld, goes
        assert sc.lookup(c) == [] and sc.stats.evictions == 2 and len(sc.lookup(a)) == 1
        kv = rn.new_cache(128)
        sc.watch(kv, SYSTEM[:44] + [6], 0)          # room for its checkpoint is made before its pass copies it
        assert kv.mark_at == 32 and sc.lookup(b) == [] and sc.bytes_used + kv.snapshot_nbytes(32) <= sc.capacity_bytes
        sc.release(held_a)
        tiny = SnapshotCache(rn.model, C, one // 2)
        assert whole(a, tiny) == [] and tiny.stats.refused == 1 and tiny.bytes_used == 0
        kv = rn.new_cache(128)
        tiny.watch(kv, a, 0)                        # a checkpoint that cannot be kept is not even copied
        assert kv.mark_at is None and tiny.stats.refused == 2
        # nor is one that only the held entries leave no room for (a's whole entry, held, fills most of `cut`)
        cut = SnapshotCache(rn.model, C, one + one // 2)
        held = whole(a, cut)
        refused = cut.stats.refused
        kv = rn.new_cache(128)
        cut.watch(kv, b, 0)
        assert kv.mark_at is None and cut.stats.refused == refused + 1
        cut.release(held)
        cut.watch(kv, b, 0)                         # released: evictable, so the checkpoint is copied
        assert kv.mark_at == (len(b) - 1) // C * C
        # a hit holds exactly the prompt's tokens: another first token never matches, nor a shorter prompt
        assert sc.lookup([a[0] ^ 1] + a[1:]) == [] and sc.lookup(a[:-1]) == []
    finally:
        close_runner(rn, st)
