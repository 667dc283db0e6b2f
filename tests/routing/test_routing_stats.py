"""Routing statistics on hand-made traces with known answers, and LRU against a plain cache simulation."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from betelgeuse import routing_stats as S


def test_constant_routing():
    ids = np.tile(np.array([0, 1]), (10, 2, 1))               # every token of both layers picks experts 0 and 1
    st = S.trace_stats(ids, n_expert=8)
    o = st["overall"]
    assert o["repeat_next"] == 1.0 and o["within_8"] == 1.0
    assert o["reuse_median"] == 1.0 and o["reuse_p80"] == 1.0
    # 20 accesses per layer, 2 cold; capacity 1 (10%) always misses (the other expert came in between)
    assert o["lru_hit"][0.1] == 0.0 and o["lru_hit"][0.2] == pytest.approx(0.9)
    assert o["gini"] == pytest.approx(0.75)                   # two equal experts of eight: (n - 2) / n
    assert o["top_share"][0.125] == pytest.approx(0.5) and o["top_share"][0.25] == 1.0
    assert o["distinct"] == {8: 2.0, 32: None, 128: None}


def test_cyclic_routing_defeats_lru():
    ids = np.tile(np.arange(4), 3).reshape(12, 1, 1)          # 0 1 2 3 0 1 2 3 ...: reuse distance 4, stack distance 3
    reuse, stack = S.distances(ids, 4)
    assert np.isnan(reuse[0]).all() and np.isinf(reuse[1:4]).all() and (reuse[4:] == 4).all()
    assert np.isinf(stack[:4]).all() and (stack[4:] == 3).all()
    o = S.trace_stats(ids, 4)["overall"]
    assert o["repeat_next"] == 0.0 and o["within_8"] == pytest.approx(8 / 11)
    assert o["reuse_median"] == 4.0 and o["reuse_p80"] is None    # 3 of 11 distances are first uses
    assert all(v == 0.0 for v in o["lru_hit"].values())        # capacities 1..2 < 3
    assert o["gini"] == 0.0 and o["distinct"][8] == 4.0


def _lru_hits(stream, capacity):
    cache, hits = OrderedDict(), 0
    for e in stream:
        if e in cache:
            hits += 1
            cache.move_to_end(e)
        else:
            cache[e] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def test_lru_matches_a_cache_simulation():
    rng = np.random.default_rng(3)
    T, L, k, E = 150, 3, 4, 16
    p = rng.dirichlet(np.ones(E) * 0.5, size=L)                # skewed, different per layer
    ids = np.stack([[rng.choice(E, k, replace=False, p=p[l]) for l in range(L)] for _ in range(T)])
    starts = [0, 60]
    st = S.trace_stats(ids, E, starts=starts)
    for l in range(L):
        for f in S.LRU_FRACTIONS:
            cap = max(1, round(f * E))
            hits = sum(_lru_hits(ids[a:b, l].ravel().tolist(), cap) for a, b in ((0, 60), (60, T)))
            assert st["layers"][l]["lru_hit"][f] == pytest.approx(hits / (T * k)), (l, f)


def test_sequences_are_not_neighbours():
    ids = np.array([[[0, 1]], [[2, 3]], [[2, 3]], [[0, 1]]])
    one = S.trace_stats(ids, 4)["overall"]
    two = S.trace_stats(ids, 4, starts=[2])["overall"]
    assert one["repeat_next"] == pytest.approx(1 / 3)          # only token 2 repeats token 1
    assert two["repeat_next"] == 0.0                           # token 2 starts a sequence; token 3 is new there
    assert two["lru_hit"][0.6] == 0.0 and one["lru_hit"][0.6] == pytest.approx(2 / 8)


def test_popularity_and_rank_weights():
    assert S.gini(np.array([5, 0, 0, 0])) == pytest.approx(0.75)
    assert S.gini(np.array([3, 3, 3])) == 0.0
    assert S.top_share(np.array([6, 3, 1, 0]), 0.5) == pytest.approx(0.9)
    w = np.array([[[3.0, 1.0]], [[1.0, 3.0]]])
    assert S.rank_weights(w) == pytest.approx([0.75, 0.25])
    st = S.trace_stats(np.array([[[0, 1]], [[1, 0]]]), 2, weights=w)
    assert st["overall"]["rank_weight"] == pytest.approx([0.75, 0.25])
    p = S.profile_stats(np.array([[1, 1, 1, 1], [0, 0, 0, 0], [4, 0, 0, 0]]))
    assert p["n_layer"] == 2 and p["overall"]["gini"] == pytest.approx(0.375)


@pytest.mark.parametrize("ids, n, msg", [
    (np.zeros((2, 3)), 4, "shape"),
    (np.array([[[0, 5]]]), 4, "expert id 5"),
    (np.array([[[1, 1]]]), 4, "twice"),
])
def test_bad_traces_are_named(ids, n, msg):
    with pytest.raises(ValueError, match=msg):
        S.trace_stats(ids, n)
