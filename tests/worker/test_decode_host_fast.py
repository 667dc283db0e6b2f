"""Decode's short host paths (issues 21, 24): a layer whose routed experts the at-hand group computed, all of them
(MoEStep._hand_all), and guesses none of which sits on disk (Guesser.read_ahead: Marks.on_disk, Marks counted
only when read) must be observably the general path's.

On the CPU with a real store, the static form (solo decode through forward(), the batched lanes through
decode_batch, decode_gate on and off), the same decode is run with the short paths on and off (MoEStep.fast = False:
every layer through the general partial(hand=True) and every guess through the general read-ahead loop), and
compared step by step: the logits' bits, every non-timing PassStats field (reads per tier, flex hits, prefetched,
guess counters, in-place bytes, store messages per kind) and LayerStats field (tier counts, groups, synced), every
store message with its arguments (keys, read-ahead keys, drop lists; how many staging slots it hands back) in order,
and the guesser's hit-rate tables. The slot configurations put every routed expert at hand (the short path's case,
which the test asserts it took) and mix at-hand layers with layers that miss (both paths in one step).

One difference on purpose (issue 21): a miss layer's short path (MoEStep._hand_misses) computes its banked host
experts in the first disk group's bank where they fit, so it runs fewer groups (apply calls) than the general path:
each miss layer's apply calls are counted against what its tiers, bank size and staging limit say (_miss_groups), and
its LayerStats.groups plus the groups saved must be the general path's; the merge must have happened (main's code,
one group per bank of host experts and per disk batch, fails here).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import fields

import numpy as np
import pytest
import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_tiny_pair

V = ENGINE_SPEC["n_vocab"]
# the client's messages -> where their staging slots (handed back) are among the arguments: the slots' numbers are
# the store's choice (its free list, shaped by the prefill's landing order), so how many are handed back is compared
MESSAGES = {"load": 1, "prefetch": 1, "prefetch_start": 1, "release": 0, "begin_pass": None, "end_pass": 2}
TIMING = {"seconds", "disk_wait_s", "open_s", "host_s", "blocked_s", "store_wait_s", "store_reply_wait_s", "moe_host_s",
          "store_rpc", "layers", "engram", "sends", "routed", "landed", "store_sleeps"}
# (vram, host, extra): as many slots as experts (VRAM + host slots read in place: every expert the prompt used is at
# hand), and misses beside at-hand layers (10 + 18: some layers miss although none of their guesses was on disk, so
# they were guessed on the short path and scored on the general one), host experts banked (never in place: a layer
# with one is a miss), with the flex cache too (one read thread everywhere: disk experts land in the order asked for)
CONFIGS = {"qwen3moe": [(20, 12, {}), (20, 12, dict(host_in_place="never")), (5, 15, {}), (10, 18, {}),
                        (2, 3, dict(flex_cache=True, max_running=2, max_context=1024, staging_slots=6,
                                    prefix_cache_bytes=0)),
                        # banks of 2 slots: the banked host experts fit in the first disk group, in part or not at all
                        (2, 3, dict(host_in_place="never", ring_slots=4))],
           "deepseek4": [(4, 4, {}), (2, 3, {}), (2, 3, dict(host_in_place="never"))]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("hostfast"))


def _plain(x):
    """Message arguments as plain Python (numpy ints, tuples and lists alike), for comparing."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (np.integer, np.bool_, np.ndarray)):
        return x.tolist()
    return x


def _message(name: str, args: tuple, kw: dict):
    """A store message as compared: plain arguments, the staging slots handed back as their number."""
    args = _plain(args)
    i = MESSAGES[name]
    if i is not None and i < len(args):
        args[i] = len(args[i])
    assert not kw or set(kw) == {"release"}, (name, kw)
    return name, args, {k: len(v) for k, v in kw.items()}


def record_messages(monkeypatch, client, store) -> list:
    """The store messages `client` sends from now on, as _message gives them (the list returned fills as they go);
    each lands in full (_quiet on `store`) before the worker goes on."""
    sent = []

    def landed(it):                     # a load's experts, each once every read the store started has landed
        try:
            for x in it:
                _quiet(store)
                yield x
        finally:
            it.close()
    for name in MESSAGES:
        fn = getattr(client, name)

        def rec(*args, _fn=fn, _name=name, **kw):
            sent.append(_message(_name, args, kw))
            out = _fn(*args, **kw)
            if _name == "load":
                return landed(out)
            if _name == "prefetch_start":
                out()                   # its answer: the reads it starts have started (a message on a stream is
            _quiet(store)               # answered after the store's status may be)
            return out
        monkeypatch.setattr(client, name, rec)
    return sent


def _quiet(store):
    """Wait until no read the store started is in flight: each message's reads (and a load's reads ahead) land
    before the worker goes on, as from an instant disk, so what the store answers (reads ahead started and used,
    staging slots, disk bytes) does not depend on the reads' timing and two runs can be compared exactly."""
    t = time.monotonic()
    while store.status()["reads_in_flight"]:
        assert time.monotonic() - t < 60, store.status()
        time.sleep(0.0005)


def _miss_groups(moe, l: int, used, tiers) -> tuple[int, int, str]:
    """A decode miss layer on the fast path (MoEStep._hand_misses; CPU: a bank's copies are done when to_bank returns,
    so the staging slots a layer holds never count against its limit): its hb banked host experts (host tier, not at
    hand) and d disk experts -> (apply calls after the at-hand group, groups saved against the general path, the
    case). The disk experts land in batches of `limit` (the staging slots a layer may hold at once), each its own
    group; the general path adds the host experts in groups of B (bank_size) of their own; the fast path puts as many
    as the first disk group's bank has room for (B less that batch) in that group, the rest in groups of B."""
    from betelgeuse.store.directory import TIER_DISK, TIER_HOST
    at = moe.hand.host[l]
    used, tiers = np.asarray(used, dtype=np.int64), np.asarray(tiers)      # lists on the short paths (_partial)
    hb = sum(1 for e, t in zip(used.tolist(), tiers.tolist()) if t == TIER_HOST and at[e] == -1)
    d = int((tiers == TIER_DISK).sum())
    B = moe.cache.bank_size
    limit = max(1, min(B, moe.session.plan.n_staging // 2))
    disk_groups = -(-d // limit)
    general = -(-hb // B) + disk_groups
    room = min(hb, B - min(limit, d)) if d else 0
    fast = -(-(hb - room) // B) + disk_groups
    case = "none" if not (hb and d) else "all" if room == hb else "part" if room else "full"
    return fast, general - fast, case


def _decode(path, vram, host, extra, fast: bool, lanes: bool, gate: bool, monkeypatch, steps=12):
    """A prompt, the store settled, then `steps` greedy decode steps in the static form, every store message's reads
    landed before the worker goes on (_quiet) -> (logits [steps, V], per step the observables, the store messages of
    the decode in order, the guesser's tables, the flex cache's counts, short-path counts)."""
    from betelgeuse.worker import guess as guess_mod
    monkeypatch.undo()              # the last run's wrappers (Marks.on_disk's would count into its own counter)
    rn, st = in_process_runner(path, vram, host, decode_at_hand=True, decode_gate="on" if gate else "off",
                               decode_consolidate_every=0, read_threads=1, **extra)
    took = Counter()
    try:
        moe = rn.moe
        moe.fast = fast
        assert moe.guesser.fast is fast and moe.hand is not None and (moe.gate is not None) == gate
        hand_all = moe._hand_all

        def counted(*a):
            ok = hand_all(*a)
            took["layer", ok] += 1
            return ok
        moe._hand_all = counted
        merged = {}                 # id(LayerStats) -> groups the fast path saved in that layer (_miss_groups)
        keep = []                   # those LayerStats, alive while their ids are keys
        if fast:
            hand_misses, apply = moe._hand_misses, moe.kern.apply
            applies = [0]

            def apply_counted(*a, **kw):
                applies[0] += 1
                return apply(*a, **kw)

            def misses_counted(*a):
                want, saved, case = _miss_groups(moe, a[0], a[4], a[5])
                applies[0] = 0
                hand_misses(*a)
                # a miss layer's apply calls after the at-hand group: the banked host experts in the first disk group
                assert applies[0] == want, (a[0], case, applies[0], want)
                merged[id(a[-1])] = saved
                keep.append(a[-1])
                took["merge", case] += 1
            moe.kern.apply = apply_counted
            moe._hand_misses = misses_counted
        on_disk = guess_mod.Marks.on_disk

        def disk_test(self, *a):
            hit = on_disk(self, *a)
            took["guess", hit] += 1
            return hit
        monkeypatch.setattr(guess_mod.Marks, "on_disk", disk_test)
        sent = record_messages(monkeypatch, rn.session.store, st)
        V_ = rn.mcfg.n_vocab
        kv = rn.new_cache(128)
        lg, _ = rn.forward(prompt(64, V_, seed=5), kv)
        rn.settle()                 # the prefill's consolidation placed: the decode reads VRAM and host slots
        rn._static_decode = True
        sent.clear()
        tok = int(lg[-1].argmax())
        out, seen = [], []
        for _ in range(steps):
            lg, s = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            lg = lg.reshape(-1, V_)[-1]
            row = {f.name: getattr(s, f.name) for f in fields(s) if f.name not in TIMING}
            row["store_rpc"] = {k: v[0] for k, v in s.store_rpc.items()}
            row["sends"] = [layer for _, layer in s.sends]         # which layers asked for reads (not when)
            row["routed"] = [layer for _, layer in s.routed]       # and the chain's steps (PassStats.routed, .landed)
            row["landed"] = [layer for _, layer in s.landed]
            # the groups the general path counts: the fast one's and those it saved (a test below says how many)
            row["layers"] = [(x.vram, x.host, x.disk, x.synced, x.groups + merged.get(id(x), 0)) for x in s.layers]
            seen.append(row)
            out.append(lg)
            tok = int(lg.argmax())
        g = moe.guesser
        tables = [g.hits, g.tries, g.class_hits, g.class_tries, g.class_read, g.disk_mean]
        flex = None if moe.flex is None else {f.name: getattr(moe.flex.stats, f.name) for f in fields(moe.flex.stats)}
        return torch.stack(out), seen, sent, tables, flex, took
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("form", ["solo", "lanes", "gate"])
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_short_host_paths_are_the_general_paths(models, arch, form, monkeypatch):
    lanes, gate = form != "solo", form == "gate"
    short = Counter()
    for vram, host, extra in CONFIGS[arch]:
        if gate and "staging_slots" in extra:   # a gated layer holds its disk experts' slots (MoEStep._gate_on)
            extra = {**extra, "staging_slots": 16}
        want, ref, ref_sent, ref_tables, ref_flex, ref_took = _decode(models[arch], vram, host, extra, False, lanes,
                                                                      gate, monkeypatch)
        got, seen, sent, tables, flex, took = _decode(models[arch], vram, host, extra, True, lanes, gate, monkeypatch)
        where = (arch, form, vram, host)
        assert not ref_took, (where, ref_took)              # the general paths ran: no short one was tried
        assert torch.equal(got, want), (where, (got - want).abs().max().item())
        for i, (a, b) in enumerate(zip(seen, ref)):
            assert a == b, (where, i, {k: (a[k], b[k]) for k in a if a[k] != b[k]})
        assert sent == ref_sent, (where, [(i, x, y) for i, (x, y) in enumerate(zip(sent, ref_sent)) if x != y][:3],
                                  len(sent), len(ref_sent))
        for x, y in zip(tables, ref_tables):
            assert np.array_equal(x, y, equal_nan=True), where
        assert flex == ref_flex, where
        short.update(took)
        if (vram, host) in ((20, 12), (4, 4)) and not extra:
            # as many slots as experts (those the prompt left unused stay on disk): mostly the short path
            assert took["layer", True] > 2 * took["layer", False], (where, took)
    # the short paths ran, and so did the general ones beside them (layers with a miss, guesses on disk)
    assert short["layer", True] and short["layer", False] and short["guess", False] and short["guess", True], short
    if not gate:
        # miss layers with banked host experts and disk experts: computed in fewer groups than the general path's
        # (main's code computes them in as many: the layers' groups above differ then), wholly in the first disk
        # group, in part (banks of 2), and not at all where that group fills its bank
        assert short["merge", "all"], short
        if arch == "qwen3moe":
            assert short["merge", "part"] and short["merge", "full"], short


def test_marks_on_disk_is_any_guessed_expert_on_disk():
    """guess.Marks.on_disk against a loop over the ids [T, D, k] as numpy: consecutive guessed layers and not (a wholly
    VRAM layer between), one running row and several, before the counts were made (the ids) and after (rows)."""
    from betelgeuse.worker.guess import Marks
    rng = np.random.default_rng(3)
    L, E, D, k = 12, 16, 3, 4
    seen = Counter()
    for trial in range(400):
        T = int(rng.integers(1, 4))
        g = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(D)]) for _ in range(T)])     # [T, D, k]
        disk = rng.random((L, E)) < rng.choice([0.02, 0.1, 0.3])
        layer = int(rng.integers(0, L - D))
        layers = sorted(int(x) for x in rng.choice(np.arange(layer + 1, layer + 1 + D), int(rng.integers(1, D + 1)),
                                                   replace=False))
        want = any(disk[t, e] for t in layers for e in g[:, t - layer - 1, :].reshape(-1))
        sets = [set(np.flatnonzero(row).tolist()) for row in disk]    # Guesser._disk's form
        m = Marks.from_ids(g, E)
        assert m.on_disk(layer + 1, layers, sets) == want, (g, layers)
        assert m.rows.sum() == T * D * k and m.top.sum() == T * D          # counted: the rows path
        assert m.on_disk(layer + 1, layers, sets) == want, (g, layers)
        seen[want, layers[-1] - layers[0] == len(layers) - 1] += 1
        # less held experts per depth (Marks.without_sets: flex copies), on the ids' lists: the loop without them
        held = rng.random((D, E)) < rng.choice([0.0, 0.3, 0.7])
        want_h = any(disk[t, e] and not held[t - layer - 1, e]
                     for t in layers for e in g[:, t - layer - 1, :].reshape(-1))
        mh = Marks.from_ids(g, E).without_sets([set(np.flatnonzero(h).tolist()) for h in held])
        assert mh.on_disk(layer + 1, layers, sets) == want_h, (g, layers, held)
        seen["held", want_h, want] += 1
    assert len([x for x in seen if x[0] != "held"]) == 4, seen      # on disk or not, consecutive layers or not
    assert seen["held", False, True] and seen["held", True, True], seen     # held ones that decide it, and not


@pytest.mark.parametrize("rule", ["rows", "union", "ranks"])
def test_guess_lists_are_the_general_loops(rule, monkeypatch):
    """Guesser.read_ahead's candidates and Guesser.check's scoring on the ids' lists (fast: _candidates, _score) against
    the numpy loops (fast = False), call for call over random passes: one running row and several (the batch rule's
    classes, order and cap), a budget that holds some (depth, class) back and windows that halve, disk sets of every
    density. Compared after every call: the keys sent, each guessed layer's record, the stats' guess counters and
    every table (hits, tries, class_*, disk_mean)."""
    from betelgeuse.worker import guess as guess_mod
    from betelgeuse.worker.stats import PassStats
    monkeypatch.setattr(guess_mod, "HIT_WINDOW", 6)      # halving within a few passes
    monkeypatch.setattr(guess_mod, "HIT_WARMUP", 2)
    monkeypatch.setattr(guess_mod, "RANK_FAR", 2)        # k = 3: the ranks rule's lone classes r1, r2, r3
    L, E, D, k = 8, 12, 3, 3
    rng = np.random.default_rng(11)

    class Session:
        class file:
            @staticmethod
            def expert_nbytes(layer):
                return 1000 + layer

    def tables(g):
        return [g.hits, g.tries, g.class_hits, g.class_tries, g.class_read, g.class_unused_bytes, g.disk_mean]
    gs = [guess_mod.Guesser(Session(), L, D, min_hit=0.5, rule=rule) for _ in range(2)]
    gs[1].fast = False
    seen = Counter()
    n_sent = [0, 0]                 # keys read ahead, all passes: each counted in class_read once (its class)
    for p in range(60):
        T = int(rng.integers(1, 5))
        tier = np.where(rng.random((L, E)) < rng.choice([0.1, 0.4, 0.8]), guess_mod.TIER_DISK, 0).astype(np.int8)
        snap = np.zeros((L, E), dtype=[("tier", np.int8)])
        snap["tier"] = tier
        stats = [PassStats("decode", "layer", T) for _ in gs]
        sent = [[], []]
        for l in range(L):
            layers = [t for t in range(l + 1, min(l + 1 + D, L)) if rng.random() < 0.9]
            g = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(D)]) for _ in range(T)])    # [T, D, k]
            started = int(rng.integers(0, 6))
            held = rng.random((D, E)) < rng.choice([0.0, 0.2, 0.5])     # flex copies of the guessed layers
            # the fast side's Marks.without keeps the ids' lists; the general side's marks are the counts less the
            # held ones (np.where, the reference)
            unheld = [lambda _l, m: m.without(held),
                      lambda _l, m: guess_mod.Marks(np.where(held, 0, m.rows), np.where(held, 0, m.top), m.n,
                                                    m.rank)]
            for i, gu in enumerate(gs):
                def send(keys, _i=i):
                    sent[_i].append(list(keys))
                    n_sent[_i] += len(keys)
                    return lambda: min(started, len(keys))
                gu.read_ahead(l, layers, guess_mod.Marks.from_ids(g, E), snap, stats[i], send, unheld[i])
            ref = guess_mod.Marks.from_ids(g, E)
            rows, top = np.where(held, 0, ref.rows), np.where(held, 0, ref.top)
            w = guess_mod.Marks.from_ids(g, E).without(held)
            assert w.ids is not None and w.on_disk(l + 1, layers, gs[0]._disk(snap)) == any(
                (rows[t - l - 1] * (tier[t] == guess_mod.TIER_DISK)).any() for t in layers), (p, l)
            assert np.array_equal(w.rows, rows) and np.array_equal(w.top, top), (p, l)
            more = rng.random((D, E)) < 0.2                 # without twice (sets), against the union's np.where
            w2 = guess_mod.Marks.from_ids(g, E).without_sets([set(np.flatnonzero(h).tolist()) for h in held])
            w2 = w2.without(more)
            assert w2.ids is not None and np.array_equal(w2.rows, np.where(held | more, 0, ref.rows)), (p, l)
            assert np.array_equal(w2.top, np.where(held | more, 0, ref.top)), (p, l)
            assert sent[0] == sent[1], (p, l, sent)
            assert {t: {d: [list(a) for a in v] for d, v in x.items()} for t, x in gs[0]._by_depth.items()} == \
                {t: {d: [a.tolist() for a in v] for d, v in x.items()} for t, x in gs[1]._by_depth.items()}, (p, l)
            disk = np.flatnonzero(tier[l] == guess_mod.TIER_DISK)
            used = disk[rng.random(len(disk)) < 0.5]
            ahead = int(rng.integers(0, len(used) + 1))
            for i, gu in enumerate(gs):
                gu.check(l, used.tolist(), ahead, stats[i])     # Python ints, as MoEStep's callers pass
            seen["sent", bool(sent[0])] += 1
        for a, b in zip(tables(gs[0]), tables(gs[1])):
            assert np.array_equal(a, b, equal_nan=True), p
        assert [(s.guessed, s.guess_hits, s.guess_disk, s.guess_held, s.prefetched, s.guess_bytes,
                 s.guess_wasted_bytes) for s in stats[:1]] == \
            [(s.guessed, s.guess_hits, s.guess_disk, s.guess_held, s.prefetched, s.guess_bytes,
              s.guess_wasted_bytes) for s in stats[1:]], p
        seen["batch", T > 1] += 1
        assert [int(g.class_read.sum()) for g in gs] == n_sent, (p, n_sent)
    # passes that sent nothing: the ranks rule's more classes (each with its warm-up) seldom leave one, the same code
    assert (gs[0].tries >= 3).any() and gs[0].class_read.sum() > 0 and len(seen) >= 3 + (rule != "ranks"), seen
    assert gs[0].class_unused_bytes.sum() > 0
    # a lone pass's guesses: every rank class (ranks) or the one lone class
    by_rank = gs[0].class_tries[:, [guess_mod.LONE_TOP, guess_mod.LONE_NEAR, guess_mod.LONE_FAR]].sum(axis=0)
    lone = gs[0].class_tries[:, guess_mod.LONE].sum()
    assert (by_rank > 0).all() and lone == 0 if rule == "ranks" else not by_rank.any() and lone > 0, (rule, by_rank)


def test_guess_of_is_guess_layers_test_across_all_vram_patterns():
    """MoEStep._guess_of (guess_layers' memo read inline while it holds, cpu-host61) -> the guess where
    guess_layers(l) names a layer, else None, whatever all-VRAM pattern the cache holds now (a new array each: the
    memo made again) and whether the memo was made yet. Fails where the inline read keeps a stale pattern's answer."""
    from types import SimpleNamespace

    from betelgeuse.worker.moe_step import MoEStep
    rng = np.random.default_rng(61)
    m = object.__new__(MoEStep)
    m.n_layer, m.depth, m._guess_memo = 6, 2, None
    m.cache = SimpleNamespace(all_vram=np.zeros(6, dtype=bool))
    guess = object()
    for i in range(60):
        if i % 3 == 0:                                  # a new pattern (a new array, as the cache makes)
            m.cache.all_vram = rng.random(6) < 0.5
        for l in rng.permutation(6).tolist():
            ref = object.__new__(MoEStep)                # guess_layers on a fresh memo: the answer
            ref.n_layer, ref.depth, ref._guess_memo, ref.cache = 6, 2, None, SimpleNamespace(all_vram=m.cache.all_vram)
            want = ref.guess_layers(l)
            assert m._guess_of(l, guess) is (guess if want else None), (i, l, m.cache.all_vram, want)
            assert m._guess_of(l, None) is None
        if i % 5 == 0:
            m._guess_memo = None
