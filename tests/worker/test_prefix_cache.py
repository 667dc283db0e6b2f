"""Prefix KV reuse and the scheduler (issue 11): a prompt that starts with a cached prefix prefills only the rest,
and its logits are bit-identical to the same prompt computed from scratch (DESIGN.md §2's cache-state invariance,
extended to the KV cache); a prompt prefilled in pieces beside running decodes gives the bits of one pass; the
cache stays within its budget, evicts least recently used unreferenced blocks, never those of a running request.

Why exact is possible: dense ops run in position-aligned chunks of `prefill_chunk` tokens (chunks.pass_chunks) and
the experts' rows never depend on their neighbours (torch: sub-batches inside one chunk; triton: row-invariant), so
a token's K/V are the same bits whichever pass, and whichever request, computed them. The comparison is the same
engine in another cache state (as the slot-configuration invariance is); the miss path itself is checked against
Qwen3MoeReference (chunked the same way), and that against transformers, in test_engine_invariance / test_model_oracle.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError
from betelgeuse.model.qwen3moe import Qwen3MoeReference
from betelgeuse.worker.prefix_cache import PrefixCache

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, metered_engine, prompt, write_synth

V = ENGINE_SPEC["n_vocab"]
C = 8                                           # prefill_chunk = block size, small so that prompts span blocks
SYSTEM = prompt(27, V, seed=1)                  # a fixed "system prompt": 3 whole blocks + 3 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("prefix") / "engine.gguf", **ENGINE_SPEC)


def _pc(runner, nbytes=1 << 22) -> PrefixCache:
    c = runner.mcfg
    return PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, runner.chunk, nbytes, runner.device, runner.dtype)


# ---- the runner: pieces and cached prefixes give the bits of one pass --------------------------------------------

@pytest.mark.parametrize("vram,host", [(5, 15), (0, 0)])
def test_prefix_hit_and_pieces_are_bit_identical_to_one_pass(model, vram, host):
    turn1 = SYSTEM + prompt(9, V, seed=2)                       # 36 tokens
    turn2 = turn1 + prompt(21, V, seed=3)                       # 57 tokens: resends turn 1
    rn, st = in_process_runner(model, vram, host, prefill_chunk=C)
    try:
        whole, _ = rn.forward(turn2, rn.new_cache(96), all_logits=True)
        # the engine's own miss path against the reference model, chunked the same way (bit-identical)
        ref = Qwen3MoeReference.load(model, chunk=C)
        with torch.no_grad():
            want = ref.forward(torch.tensor(turn2), ref.new_cache(96))
        assert torch.equal(whole, want)
        pc = _pc(rn)
        kv1 = rn.new_cache(96)
        rn.forward(turn1, kv1)
        held = pc.insert(kv1, turn1, len(turn1), [])
        assert len(held) == len(turn1) // C == 4
        blocks = pc.lookup(turn2)
        assert blocks == held                                   # 32 of turn 2's 57 tokens are cached
        kv2 = rn.new_cache(96)
        n = pc.load(kv2, blocks)
        assert n == 32 and kv2.length == 32
        for l in range(rn.mcfg.n_layer):                        # the copied K/V are the computed ones, bit for bit
            assert torch.equal(kv2.k[l][:, :n], kv1.k[l][:, :n]) and torch.equal(kv2.v[l][:, :n], kv1.v[l][:, :n])
        hit, stats = rn.forward(turn2[n:], kv2)
        assert stats.n_tokens == len(turn2) - n
        miss, _ = rn.forward(turn2, rn.new_cache(96))
        assert torch.equal(hit, miss), f"prefix hit differs from a miss: max |diff| {(hit - miss).abs().max():.3e}"
        # a prompt prefilled in whole-chunk pieces (chunked prefill beside decodes): the same bits again
        kv3, a = rn.new_cache(96), 0
        for piece in (16, 8, 24, 9):
            out, _ = rn.forward(turn2[a:a + piece], kv3)
            a += piece
        assert a == len(turn2) and torch.equal(out, miss)
        # and the decode after a hit continues exactly as after a miss
        t = int(miss[-1].argmax())
        d_hit, _ = rn.forward([t], kv2, consolidate=False)
        kvm = rn.new_cache(96)
        rn.forward(turn2, kvm)
        d_miss, _ = rn.forward([t], kvm, consolidate=False)
        assert torch.equal(d_hit, d_miss)
    finally:
        close_runner(rn, st)


def test_lookup_leaves_a_token_and_checks_the_whole_prefix(model):
    rn, st = in_process_runner(model, 0, 0, prefill_chunk=C)
    try:
        pc = _pc(rn)
        P = SYSTEM[:24]                                         # exactly 3 blocks
        kv = rn.new_cache(64)
        rn.forward(P, kv)
        pc.release(pc.insert(kv, P, len(P), []))
        assert len(pc.lookup(P)) == 2                           # the last token is always computed
        assert len(pc.lookup(P + [5])) == 3
        other = [P[0] ^ 1] + P[1:] + [5]                        # same blocks 2 and 3, another first token
        assert pc.lookup(other) == []
        assert pc.stats.hits == 2 and pc.stats.queries == 3 and pc.stats.tokens_reused == 5 * C
        # cache_salt: another salt's chain never matches the shared one, nor the shared one a salted chain
        assert pc.lookup(P + [5], salt="tenant-b") == []
        pc.release(pc.insert(kv, P, len(P), [], salt="tenant-b"))
        assert len(pc.lookup(P + [5], salt="tenant-b")) == 3 and pc.lookup(P + [5], salt="tenant-c") == []
        assert pc.lookup(P + [5]) == pc.lookup(P + [5], salt="")
    finally:
        close_runner(rn, st)


def test_eviction_is_lru_bounded_and_spares_held_blocks(model):
    rn, st = in_process_runner(model, 0, 0, prefill_chunk=C)
    try:
        c = rn.mcfg
        block_bytes = c.n_layer * 2 * c.n_head_kv * C * c.head_dim * 4
        pc = _pc(rn, nbytes=6 * block_bytes + block_bytes // 2)     # room for 6 blocks
        assert pc.n_blocks == 6 and pc.capacity_bytes == 6 * block_bytes

        def cached(P, hold=False):
            kv = rn.new_cache(64)
            rn.forward(P, kv)
            chain = pc.insert(kv, P, len(P), [])
            if not hold:
                pc.release(chain)
            return chain

        a, b, d = (prompt(17, V, seed=s) for s in (10, 11, 12))        # 2 blocks each
        held = cached(a, hold=True)                              # a running request holds its 2 blocks
        cached(b)
        cached(d)                                                # 6 of 6 blocks used
        assert pc.bytes_used == pc.capacity_bytes and pc.stats.evictions == 0
        pc.lookup(b + [1])                                       # b recently used: d is now the oldest
        e = prompt(17, V, seed=13)
        cached(e)                                                # needs 2 blocks: d's go (the LRU), not a's (held)
        assert pc.stats.evictions == 2
        assert len(pc.lookup(a + [1])) == 2 and len(pc.lookup(b + [1])) == 2 and len(pc.lookup(e + [1])) == 2
        assert pc.lookup(d + [1]) == []
        assert pc.bytes_used <= pc.capacity_bytes
        # all 6 blocks held: nothing can be evicted, an insert caches nothing (and fails nothing)
        hb, he = pc.lookup(b + [1]), pc.lookup(e + [1])
        pc.acquire(hb), pc.acquire(he)
        assert cached(prompt(17, V, seed=14)) == [] and pc.stats.evictions == 2
        pc.release(hb), pc.release(he), pc.release(held)
        # a prompt whose blocks were evicted is a miss: nothing is loaded, it is prefilled whole (a miss's bits are
        # those of a hit: test_prefix_hit_and_pieces_are_bit_identical_to_one_pass)
        kv = rn.new_cache(64)
        got = pc.load(kv, pc.lookup(d))
        assert got == 0 and kv.length == 0
    finally:
        close_runner(rn, st)


def test_a_whole_prompt_entry_serves_an_exact_repeat_only(model):
    """After its last pass a prompt also keeps its last partial block and its last logits: the same prompt again
    loads everything (no token left to compute) and gets those logits; a longer or different prompt does not
    match it; the logits rows are bounded and the oldest unreferenced entry makes room."""
    rn, st = in_process_runner(model, 0, 0, prefill_chunk=C)
    try:
        c = rn.mcfg
        block_bytes = c.n_layer * 2 * c.n_head_kv * C * c.head_dim * 4
        pc = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, C, 8 * block_bytes, rn.device, rn.dtype, V)
        assert pc.tail_logits.shape == (2, V)                   # one row per 4 blocks' budget
        assert pc.n_blocks == (8 * block_bytes - 2 * V * 4) // block_bytes == 7
        for P in (SYSTEM, SYSTEM[:24]):                          # a partial last block; exactly 3 blocks
            kv = rn.new_cache(64)
            logits, _ = rn.forward(P, kv)
            held = pc.insert(kv, P, len(P), [])
            held = pc.insert_tail(kv, P, held, logits[-1])
            assert len(held) == len(P) // C + 1                # its whole blocks + the entry
            pc.release(held)
            blocks = pc.lookup(P)
            kv2 = rn.new_cache(64)
            assert pc.load(kv2, blocks) == len(P) == kv2.length
            for l in range(c.n_layer):                           # every position's K/V, bit for bit
                assert torch.equal(kv2.k[l][:, :len(P)], kv.k[l][:, :len(P)])
                assert torch.equal(kv2.v[l][:, :len(P)], kv.v[l][:, :len(P)])
            assert torch.equal(pc.logits(blocks), logits[-1])
            more = pc.lookup(P + [7])                            # a longer prompt: whole blocks only
            assert pc.logits(more) is None and len(more) == len(P) // C
        assert len(pc.tail_row) == 2 and pc.bytes_used <= pc.capacity_bytes
        third = prompt(12, V, seed=9)                            # a third entry: the oldest one goes
        kv = rn.new_cache(64)
        logits, _ = rn.forward(third, kv)
        pc.release(pc.insert_tail(kv, third, pc.insert(kv, third, len(third), []), logits[-1]))
        assert len(pc.tail_row) == 2
        assert pc.logits(pc.lookup(SYSTEM)) is None and pc.logits(pc.lookup(third)) is not None
    finally:
        close_runner(rn, st)


# ---- the engine: agent turns, metrics, chunked prefill beside decodes --------------------------------------------

def _engine(model, **kw):
    cfg = EngineConfig(model_path=str(model), vram_slots=5, host_slots=15, prefill_chunk=C, read_threads=2, **kw)
    return metered_engine(cfg)


def _gen(eng, ids, n=6):
    req = GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
    evs = list(eng.submit(req))
    toks = [(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in evs[:-1]]
    return toks, evs[-1]


def _sample(reg, name, **labels):
    v = reg.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


def test_agent_turns_reuse_the_conversation_exactly(model):
    """Each turn resends the conversation: with the cache only the new tokens are prefilled, and every token and
    logprob equals the same turn on an engine without a prefix cache."""
    turns, conv = [], list(SYSTEM)
    for t in range(4):
        conv = conv + prompt(11 + 3 * t, V, seed=20 + t)
        turns.append(list(conv))
        conv = conv + prompt(6, V, seed=40 + t)                   # "the assistant's reply" resent next turn
    on, close_on = _engine(model)
    off, close_off = _engine(model, prefix_cache_bytes=0)
    try:
        assert on.prefix_cache is not None and off.prefix_cache is None
        for i, P in enumerate(turns):
            got, fin = _gen(on, P)
            want, fin0 = _gen(off, P)
            assert got == want, f"turn {i}: tokens/logprobs differ with the prefix cache"
            u = fin.usage
            assert fin0.usage.cached_tokens == 0
            # turn i > 0 reuses every whole block of turn i-1's prompt (prompt blocks only, never decode K/V)
            assert u.cached_tokens == (0 if i == 0 else (len(turns[i - 1])) // C * C), (i, u.cached_tokens)
            assert u.prompt_n == len(P) and u.queue_ms >= 0 and u.ttft_ms >= u.queue_ms
        reg = on.metrics.registry
        assert _sample(reg, "betelgeuse_prefix_cache_queries_total") == 4
        assert _sample(reg, "betelgeuse_prefix_cache_hits_total") == 3
        reused = sum(len(turns[i]) // C * C for i in range(3))
        assert _sample(reg, "betelgeuse_prefix_cache_reused_tokens_total") == reused
        assert 0 < _sample(reg, "betelgeuse_prefix_cache_used_bytes") <= _sample(reg, "betelgeuse_prefix_cache_capacity_bytes")
        # prompt tokens actually prefilled: the miss engine prefilled everything, the cached one the rest
        assert _sample(reg, "betelgeuse_prompt_tokens_total") == sum(map(len, turns)) - reused
    finally:
        close_on()
        close_off()


def test_a_repeated_prompt_runs_no_pass_and_matches_a_miss(model):
    """The same prompt twice: the second request's first token comes from the cached logits (no prompt token
    computed), and every token and logprob equals an engine without a prefix cache; a prompt one token longer
    prefills only from its last whole block."""
    P = SYSTEM + prompt(14, V, seed=70)                          # 41 tokens: 5 whole blocks + 1
    on, close_on = _engine(model)
    off, close_off = _engine(model, prefix_cache_bytes=0)
    try:
        reg = on.metrics.registry
        want, _ = _gen(off, P)
        first, fin1 = _gen(on, P)
        computed = _sample(reg, "betelgeuse_prompt_tokens_total")
        again, fin2 = _gen(on, P)
        assert first == want and again == want
        assert fin1.usage.cached_tokens == 0 and fin2.usage.cached_tokens == len(P)
        assert _sample(reg, "betelgeuse_prompt_tokens_total") == computed        # no prompt token computed
        longer, fin3 = _gen(on, P + [3])
        want3, _ = _gen(off, P + [3])
        assert longer == want3 and fin3.usage.cached_tokens == len(P) // C * C
    finally:
        close_on()
        close_off()


def test_a_long_prompt_is_prefilled_in_pieces_beside_running_decodes(model):
    """max_batched_tokens = one chunk: a 57-token prompt arriving while another request decodes is prefilled in
    8-token passes, the decoding request gets a token after every piece, and both give their solo outputs."""
    short, long_ = prompt(10, V, seed=60), SYSTEM + prompt(30, V, seed=61)
    eng, close = _engine(model, max_batched_tokens=C, prefix_cache_bytes=0)
    try:
        solo_short, _ = _gen(eng, short, n=24)
        solo_long, _ = _gen(eng, long_, n=4)
        times: dict[str, list] = {"short": [], "long": []}
        res = {}

        def run(name, ids, n):
            req = GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
            evs = []
            for e in eng.submit(req):
                times[name].append(time.monotonic())
                evs.append(e)
            res[name] = [(e.token_id, e.logprob, tuple(e.top_logprobs))
                         for e in evs[:-1]]
        a = threading.Thread(target=run, args=("short", short, 24))
        a.start()
        while len(times["short"]) < 2:                      # the short one is decoding
            time.sleep(0.001)
        b = threading.Thread(target=run, args=("long", long_, 4))
        b.start()
        a.join(60), b.join(60)
        assert res["short"] == solo_short and res["long"] == solo_long
        first_long = times["long"][0]
        during = [t for t in times["short"] if t < first_long]
        # 57 tokens in 8-token pieces = 8 passes; the short request kept decoding between them
        assert len(during) >= 2 + 5, (len(during), len(times["short"]))
    finally:
        close()


@pytest.mark.parametrize("max_batched", [80, 24])
def test_prompts_arriving_together_share_prefill_passes(model, max_batched):
    """Four prompts submitted at once are prefilled together: in one pass when it can hold them all
    (prefill_pass_tokens = max(max_context, max_batched_tokens) while nothing decodes), else the first pass takes
    whole prompts and whole chunks of the next, and the rest follow in max_batched_tokens pieces beside the decodes;
    every request's tokens and logprobs equal its solo run."""
    prompts = [SYSTEM[:11] + prompt(n, V, seed=90 + n) for n in (3, 9, 14, 5)]          # 14 .. 25 tokens, 75 in all
    eng, close = _engine(model, max_running=4, max_context=48, max_batched_tokens=max_batched, prefix_cache_bytes=0)
    try:
        solo = [_gen(eng, P, n=5)[0] for P in prompts]
        passes = []
        real = eng.runner.prefill_batch

        def spy(parts, *a, **k):                         # records each shared pass's pieces, then runs it
            if sum(len(ids) for ids, _ in parts) > len(parts):     # a prefill (a lone decode comes here too)
                passes.append([len(ids) for ids, _ in parts])
            return real(parts, *a, **k)
        eng.runner.prefill_batch = spy
        reqs = [GenerateRequest(prompt_ids=P, max_tokens=5, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)) for P in prompts]
        with eng.cv:                                     # the engine loop waits: all four are queued before a step
            handles = [eng.submit(r) for r in reqs]
        got = [[(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in list(h)[:-1]] for h in handles]
        assert got == solo
        assert sum(map(sum, passes)) == sum(map(len, prompts)), passes
        if max_batched == 80:                            # 75 tokens in all: one pass
            assert passes == [[len(P) for P in prompts]]
        else:                                            # 48 then 24 a pass; a cut piece ends on a chunk boundary
            assert passes[0] == [14, 20, 8] and all(sum(p) <= 24 for p in passes[1:]), passes
    finally:
        close()


def test_scheduler_limits_are_validated_with_numbers(model):
    with pytest.raises(BetelgeuseError, match="prefill_chunk"):
        EngineConfig(model_path="m", prefill_chunk=0)
    with pytest.raises(BetelgeuseError, match="max_batched_tokens .*prefill_chunk"):
        EngineConfig(model_path="m", prefill_chunk=64, max_batched_tokens=32)
    with pytest.raises(BetelgeuseError, match="prefix_cache_bytes"):
        EngineConfig(model_path="m", prefix_cache_bytes=-1)
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.store.plan import plan_slots
    f = GGUFModelFile.open(str(model))
    try:
        cfg = EngineConfig(model_path=str(model), vram_budget=64 << 20, prefix_cache_bytes=256 << 20)
        with pytest.raises(BetelgeuseError, match=r"VRAM budget 0\.06 GiB .*prefix cache 0\.25 GiB"):
            plan_slots(f, cfg, None)
    finally:
        f.close()


# static: the CUDA decode form forced on the CPU, so decodes (solo ones too) run on the lanes of worker/lanes.py,
# which 12 clients share 4 at a time (a lane is given back when its request ends, cancels or times out)
@pytest.mark.parametrize("static", [False, True])
def test_streams_stay_whole_with_clients_joining_cancelling_and_timing_out(model, static):
    """12 clients sharing a system prompt join a 4-slot engine at staggered times (prefix hits, pieces of 8 tokens
    beside batched decodes); 3 cancel after 2 tokens, 3 have a deadline that expires mid-generation. Every stream
    ends with exactly one final event; the others' tokens equal their solo runs, the cut ones' are a prefix of theirs;
    no block stays referenced afterwards."""
    eng, close = _engine(model, max_running=4, max_batched_tokens=C)
    eng.runner._static_decode = static
    try:
        prompts = [SYSTEM + prompt(5 + 3 * i, V, seed=80 + i) for i in range(12)]
        solo = [_gen(eng, P, n=10)[0] for P in prompts]
        res: dict[int, tuple] = {}

        def client(i):
            time.sleep(0.01 * i)
            req = GenerateRequest(prompt_ids=prompts[i], max_tokens=10, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
            deadline = time.monotonic() + 0.05 if i % 4 == 1 else None
            h = eng.submit(req, deadline=deadline)
            toks, finals = [], []
            for e in h:
                if hasattr(e, "finish_reason"):
                    finals.append(e)
                    continue
                toks.append((e.token_id, e.logprob, tuple(e.top_logprobs)))
                if i % 4 == 2 and len(toks) == 2:
                    h.cancel()
            res[i] = (toks, finals)
        ts = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert sorted(res) == list(range(12))
        for i, (toks, finals) in res.items():
            assert len(finals) == 1, i
            if i % 4 in (1, 2) and finals[0].finish_reason == "cancelled":
                assert toks == solo[i][:len(toks)], i
            else:
                assert finals[0].finish_reason == "length" and toks == solo[i], i
        assert any(res[i][1][0].finish_reason == "cancelled" for i in range(12) if i % 4 == 2)
        assert int(eng.prefix_cache.refs.sum()) == 0 and eng.prefix_cache.stats.hits >= 11
        if static:       # every finished request gave its lane back (request_done runs just after the final event)
            t_end = time.monotonic() + 10
            while eng.runner._lanes is not None and eng.runner._lanes.seqs and time.monotonic() < t_end:
                time.sleep(0.02)
            assert eng.runner._lanes is not None and not eng.runner._lanes.seqs
    finally:
        close()


def test_held_blocks_go_back_when_a_burst_is_cancelled(model):
    """betelgeuse_prefix_cache_held_blocks: the blocks running requests hold (unevictable). Requests sharing a
    prefix hold it while they run; a burst cancelled mid-decode and mid-queue gives every block back (the gauge 0,
    as when idle), and the next request's tokens equal those of an engine without a prefix cache."""
    eng, close = _engine(model, max_running=3)
    off, close_off = _engine(model, prefix_cache_bytes=0)
    try:
        reg = eng.metrics.registry
        P = SYSTEM + prompt(5, V, seed=90)
        want, _ = _gen(off, P)
        _gen(eng, SYSTEM + prompt(3, V, seed=91))                # the prefix cached: the burst shares its blocks
        assert _sample(reg, "betelgeuse_prefix_cache_held_blocks") == 0
        handles = [eng.submit(GenerateRequest(prompt_ids=SYSTEM + prompt(4, V, seed=100 + i), max_tokens=200,
                                              ignore_eos=True)) for i in range(6)]
        it = iter(handles[0])
        for _ in range(3):
            next(it)                                             # decoding now, with two others; three queued
        assert _sample(reg, "betelgeuse_prefix_cache_held_blocks") >= len(SYSTEM) // C
        for h in handles:
            h.cancel()
        finals = [list(h)[-1] for h in handles[1:]] + [list(it)[-1]]
        assert all(f.finish_reason == "cancelled" for f in finals), [f.finish_reason for f in finals]
        t0 = time.monotonic()
        while _sample(reg, "betelgeuse_prefix_cache_held_blocks") and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert _sample(reg, "betelgeuse_prefix_cache_held_blocks") == 0
        assert eng.prefix_cache.held_blocks == 0 and not eng.running and not eng.waiting
        got, fin = _gen(eng, P)
        assert got == want and fin.usage.cached_tokens == len(SYSTEM) // C * C
    finally:
        close()
        close_off()
