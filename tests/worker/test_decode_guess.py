"""Speculative expert reads in decode (worker/guess.py): layers l+1 .. l+D's experts guessed at layer l, read ahead.

A guess only changes when bytes arrive, never what is computed: decode logits must be the same bits with
`prefetch_decode` off and on at every `prefetch_depth` (1, 2, 3), in every decode form (the sliced one-row decode,
the static solo decode, the static batched lanes) and for every architecture. The guesses must actually be made and
read (counters > 0, the store's read-ahead counter moves) and, where the next layer's choice is predictable, hit:
deepseek4's hash-routed layers route by token id, so a guess of one is exact. At depth D the reads ahead go to the
store as the brief of the module says: a call's keys nearest layer first, at most D layers ahead of the layer that
asked, a (layer, expert) asked once per pass unless the store did not start it (its read-ahead share of the staging
slots was full), and layers further than one ahead asked for at all when D > 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import (ENGINE_SPEC, close_runner, greedy_steps, in_process_runner, prompt, write_ds4_tiny,
                            write_synth)

STEPS = 6
PROMPTS = [prompt(24, ENGINE_SPEC["n_vocab"], seed=s) for s in (5, 6)]
DS4_PROMPT = [int(x) for x in np.random.default_rng(4).integers(0, 512, 40)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("guess") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def qwen64(tmp_path_factory):
    """6 layers of 64 experts (4 used, a skewed router): 4 rows guess up to 16 of a layer's 64, most on disk."""
    return write_synth(tmp_path_factory.mktemp("guess64") / "engine64.gguf", **{**ENGINE_SPEC, "n_layer": 6,
                                                                               "n_expert": 64})


@pytest.fixture(scope="module")
def ds41(tmp_path_factory):
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = tmp_path_factory.mktemp("guess-ds41") / "ds41.gguf"
    write_model(path, spec_from_preset("ds41-tiny", expert_qtype="Q8_0", seed=2), progress=False)
    return path


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return write_ds4_tiny(tmp_path_factory.mktemp("guess-ds4") / "ds4.gguf", expert_qtype="Q8_0", seed=2)


def _decode(path, depth: int, form: str, prompts, vram=2, host=3, asks=None, steps=STEPS, drops=None, unused=None,
            classes=None, **cfg):
    """Each prompt prefilled, then `steps` (STEPS) greedy decode steps of all of them together (decode_batch: form "batch" over
    the static lanes, "rows" each sequence's dense part alone) or one at a time (form "sliced" / "static": forward()
    of one token), guessing `depth` layers ahead (0: prefetch_decode off) -> (logits [steps, n, V], the decode passes'
    stats, the store's read-ahead reads). asks: a list that gets, per decode pass, [keys, reads started] of each guessed
    read-ahead call the session sent the store (the real call runs; reads started once the guesser read the answer);
    drops (with asks): a list that gets each message's drop (a scored layer's unused guesses) beside the keys asked
    for in its pass before it; unused: a list that gets the decode's (bytes the store read ahead, of them those no
    load took); classes: a list that gets the guesser's class_tries [D, C] (guessed on disk per depth and class)."""
    rn, st = in_process_runner(path, vram, host, prefetch_decode=depth > 0, prefetch_depth=max(1, depth),
                               max_running=len(prompts), **cfg)
    rn._static_decode = form in ("static", "batch")
    if asks is not None:
        real, real_load = rn.session.prefetch_start, rn.session.load

        def record(keys, answer):
            assert asks, "a guessed read ahead outside decode"
            call = [list(keys), None]
            asks[-1].append(call)

            def started():
                call[1] = answer()
                return call[1]
            return started

        def dropping(drop):
            if drop and drops is not None:
                drops.append((list(drop), {k for keys, _ in asks[-1] for k in keys}))

        def spy(keys, drop=()):          # a layer without a miss: its guesses go alone
            dropping(drop)
            return record(keys, real(keys, drop)) if keys else real(keys, drop)

        class Riding:                    # a layer with a miss: its guesses ride on its load (worker/moe_step.py)
            def __init__(self, stream, keys):
                self.stream, self.queued = stream, record(keys, stream.queued)
                self.it = stream.it             # LoadStream's: what MoEStep's loops read the landed experts from

            def __iter__(self):
                return self

            def __next__(self):
                return next(self.stream)

        def spy_load(keys, ahead=(), drop=()):
            dropping(drop)
            stream = real_load(keys, ahead, drop)
            return Riding(stream, ahead) if ahead else stream
        rn.session.prefetch_start, rn.session.load = spy, spy_load
    try:
        kvs = [rn.new_cache(128) for _ in prompts]
        toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
        rn.settle()
        reads0, c0 = st.counters.readahead_reads, (st.counters.readahead_bytes, st.counters.readahead_used)
        # asks: one list a decode pass: one token of the one prompt, or one batched step
        outs, stats = greedy_steps(rn, toks, kvs, form, steps, None if asks is None else lambda: asks.append([]))
        if unused is not None:
            got = st.counters.readahead_bytes - c0[0]
            unused += [got, got - (st.counters.readahead_used - c0[1])]
        if classes is not None:
            classes.append(rn.moe.guesser.class_tries.copy())
        return outs, stats, st.counters.readahead_reads - reads0
    finally:
        close_runner(rn, st)


def _sum(stats, name):
    return sum(getattr(s, name) for s in stats)


def _check_asks(asks, depth: int):
    """The guessed reads ahead of each pass at this depth (module doc)."""
    spans = []
    for calls in asks:
        seen = set()
        for keys, started in calls:
            layers = [t for t, _ in keys]
            assert layers == sorted(layers), keys                       # nearest layer first
            assert layers[-1] - layers[0] < depth, (depth, keys)        # at most `depth` layers from one residual
            assert not seen.intersection(keys), (keys, seen)            # asked once per pass ...
            seen.update(keys[:len(keys) if started is None else started])   # ... unless not started
            spans.append(layers[-1] - layers[0])
    assert spans, "no guessed reads ahead"
    if depth > 1:
        assert max(spans) >= 1, "no call guessed beyond the next layer"


@pytest.mark.parametrize("form", ["sliced", "static", "batch", "rows"])
def test_qwen3moe_guesses_keep_bits_at_every_depth(qwen, form):
    prompts = PROMPTS if form in ("batch", "rows") else PROMPTS[:1]
    off, s_off, ra_off = _decode(qwen, 0, form, prompts)
    assert _sum(s_off, "guessed") == 0 and ra_off == 0            # off = as before: no read ahead in decode
    for depth in (1, 2, 3):
        asks: list = []
        on, s_on, ra_on = _decode(qwen, depth, form, prompts, asks=asks)
        assert torch.equal(on, off), depth
        guessed, prefetched = _sum(s_on, "guessed"), _sum(s_on, "prefetched")
        assert guessed > 0 and prefetched > 0 and ra_on == prefetched, (depth, guessed, prefetched, ra_on)
        assert _sum(s_on, "guess_bytes") > 0
        assert 0 < _sum(s_on, "guess_hits") <= guessed
        _check_asks(asks, depth)


def test_reads_the_store_did_not_start_are_asked_again(qwen):
    """Few staging slots (read ahead may hold 2): at depth 3 the store starts only the nearest of a call's keys, and a
    key it did not start is asked for again from a nearer layer; the bits stay those of off."""
    off, _, _ = _decode(qwen, 0, "sliced", PROMPTS[:1], staging_slots=4)
    asks: list = []
    on, s_on, ra = _decode(qwen, 3, "sliced", PROMPTS[:1], asks=asks, staging_slots=4)
    assert torch.equal(on, off)
    _check_asks(asks, 3)
    again = 0
    for calls in asks:
        skipped = set()
        for keys, started in calls:
            again += len(skipped.intersection(keys))
            skipped.update(keys[started:])
    assert again > 0 and ra == _sum(s_on, "prefetched") > 0, (again, ra)


@pytest.mark.parametrize("form", ["sliced", "static"])
@pytest.mark.parametrize("arch", ["ds4", "ds41"])
def test_deepseek_guesses_keep_bits_and_hash_layers_hit(request, arch, form):
    """deepseek4 and deepseek41 (Engram rows through the store beside the experts): depth 1 and 3 decode the bits of
    off; deepseek4's hash-routed layers are guessed exactly. The step-start reads of the hash layers (prefetch_hash,
    tests/worker/test_decode_hash_ahead.py) are off: the asks checked are the guesses' alone."""
    path = request.getfixturevalue(arch)
    off, _, _ = _decode(path, 0, form, [DS4_PROMPT])
    for depth in (1, 3):
        asks: list = []
        on, s_on, ra = _decode(path, depth, form, [DS4_PROMPT], asks=asks, prefetch_hash=False)
        assert torch.equal(on, off), depth
        assert _sum(s_on, "guessed") > 0 and ra > 0
        _check_asks(asks, depth)
        if arch == "ds4":
            # layer 1 is hash-routed (ds4-tiny: 2 hash layers): its guess at layer 0 is its choice, token for token
            hits, guessed = _sum(s_on, "guess_hits"), _sum(s_on, "guessed")
            assert hits > 0 and hits <= guessed


def test_waste_budget_holds_back_poor_depths_and_keeps_bits(qwen):
    """prefetch_min_hit (worker/guess.py, the budget): at 1.0 a (layer, depth) whose guesses ever missed stops being
    read ahead once warmed up (held, counted), at 0 every guess is read; the bits are those of off either way."""
    off, _, _ = _decode(qwen, 0, "sliced", PROMPTS[:1], steps=10)
    drops: list = []
    runs = {h: _decode(qwen, 2, "sliced", PROMPTS[:1], steps=10, prefetch_min_hit=h, asks=[],
                       drops=drops if h == 0.0 else None) for h in (0.0, 1.0)}
    for h, (on, s_on, ra) in runs.items():
        assert torch.equal(on, off), h
        assert ra == _sum(s_on, "prefetched"), h
    (_, s_all, ra_all), (_, s_few, ra_few) = runs[0.0], runs[1.0]
    assert _sum(s_all, "guess_held") == 0 and _sum(s_few, "guess_held") > 0
    assert 0 < ra_few < ra_all, (ra_few, ra_all)
    # a scored layer's unused guesses go to the store as a drop: keys of that one layer, asked for earlier in the pass
    assert drops, "no unused guess was dropped"
    for keys, asked in drops:
        assert len({t for t, _ in keys}) == 1 and asked.issuperset(keys), (keys, asked)


@pytest.mark.parametrize("arch", ["qwen", "ds4"])
def test_waste_budget_auto_is_the_architectures(request, arch):
    """prefetch_min_hit auto (the default) is the model class's guess_min_hit (qwen3moe 0.5, deepseek4 0.7: measured
    on ds4-flash, model/deepseek4.py); a number in the config overrides it."""
    want = {"qwen": 0.5, "ds4": 0.7}[arch]
    for cfg, expect in (({}, want), ({"prefetch_min_hit": 0.25}, 0.25)):
        rn, st = in_process_runner(request.getfixturevalue(arch), 2, 3, **cfg)
        try:
            assert type(rn.model).guess_min_hit == want
            assert rn.moe.guesser.min_hit == expect, (arch, cfg)
        finally:
            close_runner(rn, st)


def test_batch_rule_reads_ahead_fewer_unused_bytes_than_the_union(qwen64):
    """4 sequences decoded together over the lanes (worker/guess.py, batch rule): the guessed experts classed by the
    rows that guessed them and a layer's reads ahead capped at its expected disk experts leave far fewer bytes read
    ahead and unused than reading the union of the rows' guesses (prefetch_batch_rule = union, the rule before),
    still reading ahead bytes that get used; the bits are those of off under either rule."""
    prompts = [prompt(24, ENGINE_SPEC["n_vocab"], seed=s) for s in (5, 6, 7, 8)]
    off, _, _ = _decode(qwen64, 0, "batch", prompts, steps=10)
    got = {}
    for rule in ("union", "rows"):
        got[rule] = []
        on, stats, _ = _decode(qwen64, 3, "batch", prompts, steps=10, prefetch_batch_rule=rule, unused=got[rule])
        assert torch.equal(on, off), rule
        assert _sum(stats, "guessed") > 0, rule
    (read_u, unused_u), (read_r, unused_r) = got["union"], got["rows"]
    assert read_r - unused_r > 0, got                   # the rule still reads ahead bytes that get used
    assert unused_r < 0.7 * unused_u, got


@pytest.mark.parametrize("arch", ["qwen64", "ds4"])
def test_ranks_rule_keeps_bits(request, arch):
    """prefetch_batch_rule = ranks in a lone stream's decode (solo, depth 3): the logits are the bits of guessing off,
    so of the rows rule too; its guesses are classed by rank (qwen64 top-4: every rank class), deepseek4's
    hash-routed layer 1 (guessed exactly) as before: lone."""
    from betelgeuse.worker.guess import LONE, LONE_FAR, LONE_NEAR, LONE_TOP
    path = request.getfixturevalue(arch)
    prompts = [DS4_PROMPT] if arch == "ds4" else PROMPTS[:1]
    off, _, _ = _decode(path, 0, "static", prompts, steps=8)
    classes: list = []
    on, stats, ra = _decode(path, 3, "static", prompts, steps=8, prefetch_batch_rule="ranks", classes=classes,
                            prefetch_hash=False)
    assert torch.equal(on, off)
    assert _sum(stats, "guessed") > 0 and ra > 0
    c = classes[0].sum(axis=0)
    assert c[LONE_TOP] > 0 and c[LONE_NEAR] > 0 and (c[LONE_FAR] > 0) == (arch == "qwen64"), c
    assert (c[LONE] > 0) == (arch == "ds4"), c


def test_marks_count_the_rows_that_guessed_each_expert():
    """guess.Marks from the host copy of the ids [T, D, k] (rank 0 a row's top-1): rows and top-1 rows per (depth,
    expert), and the batch rule's classes; one running row is the lone class whatever it guessed."""
    from betelgeuse.worker.guess import LONE, MORE, ONE, TOP, TWO, Marks
    g = np.array([[[3, 1], [0, 2]],               # row 0: depth 1 top-1 3, then 1; depth 2 top-1 0, then 2
                  [[1, 3], [0, 5]],
                  [[1, 4], [2, 0]]], dtype=np.int64)                       # [T=3, D=2, k=2]
    m = Marks.from_ids(g, 6)
    assert m.n == 3
    assert m.rows.tolist() == [[0, 3, 0, 2, 1, 0], [3, 0, 2, 0, 0, 1]]
    assert m.top.tolist() == [[0, 2, 0, 1, 0, 0], [2, 0, 1, 0, 0, 0]]
    assert m.classes(1, np.array([1, 3, 4])).tolist() == [MORE, TWO, ONE]
    assert m.classes(2, np.array([0, 2, 5])).tolist() == [MORE, TWO, ONE]
    held = np.zeros((2, 6), dtype=bool)
    held[1, 2] = True
    w = m.without(held)
    assert w.rows[1, 2] == 0 and w.top[1, 2] == 0 and w.n == 3 and m.rows[1, 2] == 2
    one = Marks.from_ids(g[2:], 6)
    assert one.classes(1, np.array([1, 4])).tolist() == [LONE, LONE]
    assert Marks.from_ids(g[1:], 6).classes(2, np.array([2, 5])).tolist() == [TOP, ONE]
    # the ranks rule (by_rank) leaves a batch's classes
    assert m.classes(1, np.array([1, 3, 4]), by_rank=True).tolist() == [MORE, TWO, ONE]


def test_ranks_rule_classes_a_lone_streams_guesses_by_rank():
    """prefetch_batch_rule = ranks: a lone stream's guesses classed by their rank in its guessed top-k (rank 1, ranks
    2-3, ranks 4..k), on the counts (Marks.classes) and on the ids' lists (rank_class), held experts or not."""
    from betelgeuse.worker.guess import LONE_FAR, LONE_NEAR, LONE_TOP, Marks, rank_class
    g = np.array([[[7, 3, 5, 0, 2, 6], [1, 0, 2, 3, 4, 5]]], dtype=np.int64)     # [T=1, D=2, k=6], best first
    m = Marks.from_ids(g, 8)
    want = {7: LONE_TOP, 3: LONE_NEAR, 5: LONE_NEAR, 0: LONE_FAR, 2: LONE_FAR, 6: LONE_FAR}
    e = np.array(sorted(want))
    assert m.classes(1, e, by_rank=True).tolist() == [want[x] for x in e]
    assert [rank_class(g[0, 0].tolist().index(x)) for x in e] == [want[x] for x in e]
    assert m.classes(2, np.array([1, 0, 2, 5]), by_rank=True).tolist() == [LONE_TOP, LONE_NEAR, LONE_NEAR, LONE_FAR]
    held = np.zeros((2, 8), dtype=bool)
    held[0, 3] = True                              # held elsewhere: the others keep their rank's class
    w = m.without(held)
    assert w.classes(1, np.array([5, 7]), by_rank=True).tolist() == [LONE_NEAR, LONE_TOP]
    w = Marks(m.rows, m.top, 1, m.rank).without(held)     # the counts' form (no ids)
    assert w.classes(1, np.array([0, 5, 7]), by_rank=True).tolist() == [LONE_FAR, LONE_NEAR, LONE_TOP]


class _Session:
    """A store session for a Guesser alone: an expert's disk bytes (read_ahead's sends go to the test's `send`)."""
    class file:
        @staticmethod
        def expert_nbytes(layer):
            return 1000


@pytest.mark.parametrize("exact", [0, 2])
def test_ranks_rule_holds_the_missing_ranks_and_reads_the_rest(exact):
    """A lone stream guesses layer 1's experts 0..5 (ranks 1..6) at layer 0; layer 1 then uses 0, 1, 2 (ranks 1-3)
    every step. Under the rows rule the one lone class hits 0.5 < prefetch_min_hit 0.7: once warmed up nothing is
    read ahead. Under ranks, ranks 4..6 (hit rate 0) are held while rank 1 and ranks 2-3 (1.0) keep being read
    ahead; only the far ranks' reads (their warm-up) go unused. A layer guessed exactly (exact: hash-routed) is classed
    as the rows rule classes it."""
    from betelgeuse.worker.guess import CLASS_NAMES, HIT_WARMUP, LONE, LONE_FAR, LONE_NEAR, LONE_TOP, Guesser, Marks
    from betelgeuse.store.directory import TIER_DISK
    from betelgeuse.worker.stats import PassStats
    snap = np.zeros((3, 8), dtype=[("tier", np.int8)])
    snap["tier"] = TIER_DISK                        # every expert on disk
    ids = np.array([[[0, 1, 2, 3, 4, 5]]], dtype=np.int64)      # [T=1, D=1, k=6]
    sent = {}
    for rule in ("rows", "ranks"):
        g = Guesser(_Session(), 3, 1, min_hit=0.7, rule=rule, exact=exact)
        sent[rule] = []
        for _ in range(3 * HIT_WARMUP):
            stats = PassStats("decode", "layer", 1)
            keys: list = []
            g.read_ahead(0, [1], Marks.from_ids(ids, 8), snap, stats, lambda k, _keys=keys: _keys.extend(k) or
                         (lambda: len(k)))
            g.check(1, [0, 1, 2], 0, stats)
            sent[rule].append(sorted(e for _, e in keys))
        if rule == "rows" or exact:
            assert sent[rule][-1] == [] and g.class_tries[0, LONE] > 0, (rule, sent[rule])
            continue
        names = dict(zip(CLASS_NAMES, g.class_tries[0]))
        assert g.class_tries[0, LONE] == 0 and all(names[n] for n in ("lone-r1", "lone-r2-3", "lone-r4+")), names
        assert sent[rule][0] == [0, 1, 2, 3, 4, 5] and sent[rule][-1] == [0, 1, 2], sent[rule]
        assert g.class_unused_bytes[0, LONE_FAR] > 0 == g.class_unused_bytes[0, [LONE_TOP, LONE_NEAR]].sum()
        assert stats.guess_held == 3 and stats.prefetched == 3 and stats.guess_hits == 3
