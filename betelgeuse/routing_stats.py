"""Statistics of expert routing: temporal locality (what an expert cache sees) and popularity (what a pinned
hot set sees), per MoE layer and overall. Pure numpy.

Input: a trace ids [T, L, k] of expert ids (token t, MoE layer l, rank r; a token's k ids distinct), optionally
the router weights [T, L, k] and the tokens where sequences start: tokens of different sequences are never
neighbours, and caches restart with each sequence.

- repeat_next: share of the selections of token t (t not the first of its sequence) that token t-1 also made,
  i.e. reuse distance 1.
- reuse distance of expert e at token t: t minus the last earlier token of the sequence that chose e; infinite on
  e's first use in the sequence. reuse_median / reuse_p80 (the smallest d with at least 50% / 80% of distances
  <= d; None = infinite) and within_8 (share <= 8) are over the selections of every non-first token.
- distinct[N]: mean number of distinct experts chosen in a window of N consecutive tokens (whole windows inside a
  sequence, non-overlapping).
- lru_hit[f]: hit rate of a per-layer LRU cache of round(f * E) experts on the access stream (tokens in order, ranks
  0..k-1 within a token), cold misses included: an access hits iff fewer than C other distinct experts were
  accessed since the expert's previous access (its LRU stack distance; Mattson et al. 1970).
- gini of the per-layer selection counts (0: uniform; (E-1)/E: one expert takes all) and top_share[f]: share of the
  selections taken by the round(f * E) most chosen experts, i.e. the hit rate of the best static pinned set. Both
  grow with fewer samples (counts of a uniform router are not all equal): compare traces of similar length.
- rank_weight (with weights): mean weight at rank r once each token's k weights are normalised to sum 1 and sorted
  in descending order.
Overall: rates, gini and shares are means over layers; reuse_median / reuse_p80 pool all layers' distances.
"""

from __future__ import annotations

import math

import numpy as np

LRU_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
SHARE_FRACTIONS = (0.125, 0.25, 0.5)
WINDOWS = (8, 32, 128)


def check_trace(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids [T, L, k] -> int64 copy; ValueError naming the problem (shape, range, a repeated id in one token)."""
    a = np.asarray(ids)
    if a.ndim != 3 or min(a.shape) == 0:
        raise ValueError(f"a routing trace is [tokens, layers, k] with none empty, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"expert ids must be integers, got {a.dtype}")
    a = a.astype(np.int64)
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= n_expert:
        raise ValueError(f"expert id {lo if lo < 0 else hi} is outside 0..{n_expert - 1}")
    s = np.sort(a, axis=-1)
    dup = np.argwhere((s[..., 1:] == s[..., :-1]).any(-1))
    if len(dup):
        t, l = dup[0]
        raise ValueError(f"token {t} layer {l} chooses expert {int(s[t, l][np.argmax(s[t, l, 1:] == s[t, l, :-1])])} "
                         "twice")
    return a


def _bounds(n_tokens: int, starts) -> list[int]:
    """Sequence boundaries [0, s1, ..., T] from the start tokens (None: one sequence)."""
    s = sorted({0, *(int(x) for x in (starts if starts is not None else ()))})
    if s[-1] >= n_tokens or s[0] < 0:
        raise ValueError(f"sequence starts {list(starts)} must lie in 0..{n_tokens - 1}")
    return s + [n_tokens]


def distances(ids: np.ndarray, n_expert: int, starts=None) -> tuple[np.ndarray, np.ndarray]:
    """-> (reuse [T, L, k] float: token distance to the expert's previous use in the sequence, inf on a first use,
    nan on a sequence's first token; stack [T, L, k] float: LRU stack distance, inf on a first use)."""
    ids = check_trace(ids, n_expert)
    T, L, k = ids.shape
    reuse = np.empty((T, L, k))
    stack = np.empty((T, L, k))
    before = np.tril(np.ones((k, k), bool), -1)          # before[r, r2]: rank r2 is accessed before rank r
    rows = np.arange(L)[:, None]
    bounds = _bounds(T, starts)
    for a, b in zip(bounds[:-1], bounds[1:]):
        last_tok = np.full((L, n_expert), -1, np.int64)     # token of each expert's last use
        last_acc = np.full((L, n_expert), -1, np.int64)     # access index (token * k + rank) of it
        for t in range(a, b):
            e = ids[t]                                          # [L, k]
            lt, la = last_tok[rows, e], last_acc[rows, e]       # [L, k]
            d = np.where(lt >= 0, t - lt, np.inf)
            reuse[t] = np.nan if t == a else d
            # distinct experts accessed since e's last access: all used more recently before this token, plus the
            # earlier ranks of this token that were not (they have just been accessed)
            more = (last_acc[:, None, :] > la[:, :, None]).sum(-1)
            now = ((la[:, None, :] < la[:, :, None]) & before).sum(-1)
            stack[t] = np.where(la >= 0, more + now, np.inf)
            last_tok[rows, e] = t
            last_acc[rows, e] = (t - a) * k + np.arange(k)
    return reuse, stack


def quantile(d: np.ndarray, q: float):
    """The smallest value v with at least q of `d` (nan dropped) <= v; None if that is infinite or `d` empty."""
    d = d[~np.isnan(d)]
    if d.size == 0:
        return None
    v = float(np.quantile(d, q, method="inverted_cdf"))
    return None if math.isinf(v) else v


def gini(counts: np.ndarray) -> float:
    """Gini coefficient of non-negative counts [n]: 0 when all equal, (n-1)/n when one holds everything."""
    c = np.sort(np.asarray(counts, np.float64))
    n, s = c.size, c.sum()
    if n == 0 or s == 0:
        return 0.0
    return float(((2 * np.arange(1, n + 1) - n - 1) * c).sum() / (n * s))


def top_share(counts: np.ndarray, frac: float) -> float:
    """Share of the total held by the round(frac * n) largest counts (at least one)."""
    c = np.sort(np.asarray(counts, np.float64))[::-1]
    m = max(1, int(round(frac * c.size)))
    return float(c[:m].sum() / c.sum()) if c.sum() else 0.0


def popularity(counts: np.ndarray) -> dict:
    """counts [E] -> {gini, top_share {frac: share}}."""
    return {"gini": gini(counts), "top_share": {f: top_share(counts, f) for f in SHARE_FRACTIONS}}


def _capacity(frac: float, n_expert: int) -> int:
    return max(1, int(round(frac * n_expert)))


def _distinct(ids: np.ndarray, n_expert: int, bounds: list[int], n: int) -> np.ndarray | None:
    """[L] mean distinct experts per whole window of n tokens; None if no sequence holds a window."""
    T, L, k = ids.shape
    out, count = np.zeros(L), 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        for w in range(a, b - n + 1, n):
            mask = np.zeros((L, n_expert), bool)
            np.put_along_axis(mask, ids[w:w + n].transpose(1, 0, 2).reshape(L, n * k), True, axis=1)
            out += mask.sum(1)
            count += 1
    return out / count if count else None


def _rates(reuse: np.ndarray, stack: np.ndarray, n_expert: int) -> dict:
    """Locality rates of one layer (or of pooled layers): reuse [..] with nan = no neighbour, stack [..]."""
    d = reuse[~np.isnan(reuse)]
    return {"repeat_next": float((d == 1).mean()) if d.size else None,
            "within_8": float((d <= 8).mean()) if d.size else None,
            "reuse_median": quantile(d, 0.5), "reuse_p80": quantile(d, 0.8),
            "lru_hit": {f: float((stack < _capacity(f, n_expert)).mean()) for f in LRU_FRACTIONS}}


def trace_stats(ids: np.ndarray, n_expert: int, weights: np.ndarray | None = None, starts=None) -> dict:
    """The statistics of the module doc: {"n_tokens", "n_layer", "n_expert", "k", "n_sequences", "overall": {...},
    "layers": [{...} per layer]}. Values that need more tokens than the trace has are None."""
    ids = check_trace(ids, n_expert)
    T, L, k = ids.shape
    bounds = _bounds(T, starts)
    reuse, stack = distances(ids, n_expert, starts)
    counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=n_expert) for l in range(L)])   # [L, E]
    distinct = {n: _distinct(ids, n_expert, bounds, n) for n in WINDOWS}
    layers = []
    for l in range(L):
        s = _rates(reuse[:, l], stack[:, l], n_expert)
        s.update(popularity(counts[l]))
        s["distinct"] = {n: (None if v is None else float(v[l])) for n, v in distinct.items()}
        layers.append(s)
    pooled = _rates(reuse, stack, n_expert)
    overall = {"repeat_next": _mean([s["repeat_next"] for s in layers]),
               "within_8": _mean([s["within_8"] for s in layers]),
               "reuse_median": pooled["reuse_median"], "reuse_p80": pooled["reuse_p80"],
               "lru_hit": {f: _mean([s["lru_hit"][f] for s in layers]) for f in LRU_FRACTIONS},
               "gini": _mean([s["gini"] for s in layers]),
               "top_share": {f: _mean([s["top_share"][f] for s in layers]) for f in SHARE_FRACTIONS},
               "distinct": {n: (None if v is None else float(v.mean())) for n, v in distinct.items()}}
    if weights is not None:
        overall["rank_weight"] = rank_weights(weights).tolist()
    return {"n_tokens": T, "n_layer": L, "n_expert": n_expert, "k": k, "n_sequences": len(bounds) - 1,
            "overall": overall, "layers": layers}


def profile_stats(counts: np.ndarray) -> dict:
    """Popularity only, for sources that give counts and no order: counts [L, E] -> {"n_layer", "n_expert",
    "selections_per_layer", "overall": {gini, top_share}, "layers": [...]} (layers without counts are skipped)."""
    c = np.asarray(counts, np.float64)
    if c.ndim != 2 or (c < 0).any():
        raise ValueError(f"a profile is non-negative counts [layers, experts], got shape {c.shape}")
    used = [l for l in range(c.shape[0]) if c[l].sum() > 0]
    layers = [popularity(c[l]) for l in used]
    return {"n_layer": len(used), "n_expert": c.shape[1], "selections_per_layer": float(c[used].sum(1).mean()),
            "overall": {"gini": _mean([s["gini"] for s in layers]),
                        "top_share": {f: _mean([s["top_share"][f] for s in layers]) for f in SHARE_FRACTIONS}},
            "layers": layers}


def rank_weights(weights: np.ndarray) -> np.ndarray:
    """weights [T, L, k] (any positive scale) -> [k]: mean weight by rank, each token's weights normalised to sum 1
    and sorted descending."""
    w = np.asarray(weights, np.float64)
    w = w / w.sum(-1, keepdims=True)
    return np.sort(w, axis=-1)[..., ::-1].reshape(-1, w.shape[-1]).mean(0)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None
