"""Calibrated synthetic routers: expert popularity plus temporal locality, fitted to published decode statistics.

Random routers route almost uniformly and without memory: consecutive tokens of a random-weight model choose
unrelated experts. Real decode does not (DESIGN.md §4; research/data-candidates.md §4): for Qwen3-30B-A3B 45% of a
token's experts were chosen by the token before, 80% within 8 tokens, and an LRU cache of 40% of a layer's experts
hits 90-95%. A calibrated router reads three parts of the residual stream, each a set of dimensions that no layer
writes to after the embedding (zero rows in every attention output and expert down projection), so all three keep
their size relative to each other at any depth:

  noise      N: random dims of the token's own embedding, read through random rows: std sqrt(1 - drift) in logit
             units; independent from token to token (for independent tokens)
  drift      D: dims holding z_t, a slowly drifting vector (below), read through a random matrix G_l [E, |D|] per
             layer: std sqrt(drift) at the reference position REF_POS
  popularity the constant channel j (synth.py), read with weight router_skew * c_e, c_e = -log(1 + rank_e) centred

Every layer's RMSNorm scales the three alike, so the experts chosen (a top-k) do not depend on how the residual
grows with depth; only the weights do, through the overall logit scale (router_scale, and the calibrated estimate
of the residual's growth). The whole row is multiplied by router_scale: it sets the weights' spread by rank.

How z_t drifts: in layer 0 one attention head reads only the constant channel for its query and key, so after
the per-head q/k RMSNorm both are fixed vectors and its scores depend on the distance Delta = t - s alone, through
RoPE: score(Delta) = sum_i A_i cos(Delta theta_i) / sqrt(head_dim), with A_i >= 0 chosen per frequency pair
(`kernel_design`, a non-negative least-squares fit) so that score(Delta) - score(0) ~ -decay * log(1 + Delta /
window) up to HORIZON tokens: attention weights ~ (1 + Delta / window)^-decay, a power law over recent tokens.
Its values are the tokens' own random projections, so its output is a weighted average of the recent tokens'
vectors: it changes a little with each token. The head writes only D (gain: unit variance per dimension at REF_POS;
earlier tokens average fewer tokens, so their z is larger until ~REF_POS).

Calibration (`calibrate`): a simulation of exactly this construction (the file's realised kernel, Gaussian token
vectors, the same projections and popularity profile) picks router_skew and drift so that the simulated
repeat_next and top_share_25 over SIM_TOKENS tokens hit the target, then router_scale so that rank 0's mean weight
does; the other statistics follow from the mechanism and are reported beside the target (metadata
`betelgeuse.routing.*`, and `betelgeuse bench` measures them on the engine). Uniform routing (skew 0, drift 0)
stays available as the worst case.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

from betelgeuse.routing_stats import trace_stats

# What real Qwen3-30B-A3B decode routing looks like (per layer, 128 experts, top-8), with sources:
#  repeat_next, within_8, reuse_median, lru_hit_40: kekzl/imp PR #1359 (3 prompts x 512 decode tokens; LRU at 40%
#    residency 94.7 / 90.0 / 95.3%)
#  top_share_25, top_share_50: WestWaters/pollard-weights profiles/qwen3-30b-a3b.json (6 prompts x ~2000 decode
#    tokens, temperature 0.8): top-25% of experts carry 70-78% per prompt (68.7% merged), top-50% 93.0% merged.
#    We compare over SIM_TOKENS = 512 tokens: a shorter window is at least as concentrated (Qwen3-235B over 155
#    decode tokens: 78%, brontoguana/krasis tests/qwen235b_heatmap.json), so 0.74 errs towards less popularity
#  rank_weight: BELLS docs (mean normalised router weight by rank)
TARGET_NAME = "qwen3-30b-a3b-decode"
TARGET = {"repeat_next": 0.45, "within_8": 0.80, "reuse_median": 2.0, "lru_hit_40": 0.925,
          "top_share_25": 0.74, "top_share_50": 0.93,
          "rank_weight": [0.229, 0.170, 0.139, 0.118, 0.102, 0.089, 0.080, 0.073]}
# How close a calibrated file's measured statistics must be (absolute; CI checks them on a small file through the
# reference model)
TOLERANCE = {"repeat_next": 0.07, "within_8": 0.07, "lru_hit_40": 0.07, "top_share_25": 0.08, "top_share_50": 0.06}

WINDOW, DECAY = 8.0, 1.0        # default kernel: attention ~ (1 + Delta / 8)^-1
HORIZON = 4096                  # tokens over which the kernel follows the power law
REF_POS = 256                   # position where z has unit variance per dimension
SIM_TOKENS, SIM_LAYERS = 512, 8


# ---- the attention kernel ------------------------------------------------------------------------------------

def rope_freqs(head_dim: int, theta: float) -> np.ndarray:
    """[head_dim/2] float64: the RoPE angle per position of each frequency pair (as the models' inv_freq)."""
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x, p = np.zeros(n), np.zeros(n, bool)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if p.all() or (w[~p] <= 1e-12).all():
            break
        p[np.argmax(np.where(p, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[p] = np.linalg.lstsq(a[:, p], b, rcond=None)[0]
            if (z[p] > 0).all():
                x = z
                break
            neg = p & (z <= 0)
            x = x + np.min(x[neg] / (x[neg] - z[neg])) * (z - x)
            p &= x > 1e-12
            x[~p] = 0.0
        w = a.T @ (b - a @ x)
    return x


def kernel_design(head_dim: int, theta: float, window: float = WINDOW, decay: float = DECAY,
                  horizon: int = HORIZON) -> np.ndarray:
    """A [head_dim/2] >= 0: score(Delta) = sum_i A_i cos(Delta theta_i) / sqrt(head_dim) with score(Delta) - score(0)
    ~ -decay log(1 + Delta / window) for Delta in 1..horizon (log-spaced points, so every decade counts)."""
    th = rope_freqs(head_dim, theta)
    d = np.unique(np.r_[np.arange(1, 17), np.round(np.logspace(0, math.log10(horizon), 150))])
    m = (np.cos(d[:, None] * th[None, :]) - 1.0) / math.sqrt(head_dim)
    return _nnls(m, -decay * np.log1p(d / window))


def kernel_scores(a: np.ndarray, head_dim: int, theta: float, n: int) -> np.ndarray:
    """score(Delta) for Delta = 0..n-1 [n] of coefficients A (what the head computes, before the softmax)."""
    d = np.arange(n, dtype=np.float64)
    return np.cos(d[:, None] * rope_freqs(head_dim, theta)[None, :]) @ a / math.sqrt(head_dim)


def kernel_weights(scores: np.ndarray, t: int) -> np.ndarray:
    """The head's attention weights [t+1] of token t over tokens 0..t (index s)."""
    s = scores[: t + 1][::-1]
    e = np.exp(s - s.max())
    return e / e.sum()


def drift_gain(scores: np.ndarray) -> float:
    """Gain that gives z unit variance per dimension at REF_POS (value vectors of unit variance)."""
    return 1.0 / math.sqrt(float((kernel_weights(scores, REF_POS) ** 2).sum()))


def pair_vectors(a: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, budget: float):
    """Per RoPE frequency pair: the query and key values on the pair's first dim (the second stays 0) whose products
    give the kernel A with the file's norm weights (q_norm, k_norm [pairs]: the weights on those first dims), scaled
    down if their squares exceed `budget` (the query's norm to spend); and two free pairs (no signal) for padding,
    one per vector, so the rest of each vector's norm adds nothing to any score. -> (xq, xk [pairs], pad pairs
    (for q, for k), A realised)."""
    x2 = a / (q_norm * k_norm)
    free = np.flatnonzero(a == 0)
    assert free.size >= 2, "the kernel uses every frequency pair: no room for the norm padding"
    if x2.sum() > budget - 1e-3:
        x2 = x2 * ((budget - 1e-3) / x2.sum())
    return np.sqrt(x2), np.sqrt(x2), (int(free[-1]), int(free[-2])), x2 * q_norm * k_norm


# ---- simulation and calibration -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _draws(n_expert: int, n_noise: int, n_drift: int, kernel: tuple, T: int, L: int, seed: int):
    """The random parts of a simulation, independent of skew, drift and scale: noise and drift logits [T, L, E] (unit
    variance; drift at REF_POS), popularity profiles c [L, E]."""
    scores = np.array(kernel)
    rng = np.random.default_rng([seed, n_expert, n_noise, n_drift, T, L])
    e = rng.standard_normal((T, n_noise))                                              # the tokens' N coordinates
    v = rng.standard_normal((T, n_drift))                                              # the kernel head's values
    z = np.stack([kernel_weights(scores, t) @ v[: t + 1] for t in range(T)]) * drift_gain(scores)
    GN = rng.standard_normal((L, n_expert, n_noise)) / math.sqrt(n_noise)
    GD = rng.standard_normal((L, n_expert, n_drift)) / math.sqrt(n_drift)
    c = np.stack([-np.log1p(rng.permutation(n_expert).astype(np.float64)) for _ in range(L)])
    return np.einsum("td,led->tle", e, GN), np.einsum("td,led->tle", z, GD), c - c.mean(1, keepdims=True)


def simulate(n_expert: int, k: int, skew: float, drift: float, scores: np.ndarray, gate: str = "softmax",
             dims: tuple[int, int] = (64, 64), scale: float = 1.0, T: int = SIM_TOKENS, L: int = SIM_LAYERS,
             seed: int = 0):
    """ids, weights [T, L, k] of the router of the module doc (dims = (|N|, |D|)), logits times `scale`: top-k of
    the logits; weights softmax over the k ("softmax", qwen3moe) or sqrt(softplus) normalised ("sqrtsoftplus",
    deepseek4)."""
    noise, dr, c = _draws(n_expert, dims[0], dims[1], tuple(np.round(scores[:T], 12)), T, L, seed)
    logits = scale * (math.sqrt(1.0 - drift) * noise + math.sqrt(drift) * dr + skew * c[None])
    ids = np.argpartition(-logits, k - 1, axis=-1)[..., :k]
    top = np.take_along_axis(logits, ids, -1)
    order = np.argsort(-top, axis=-1, kind="stable")
    ids, top = np.take_along_axis(ids, order, -1), np.take_along_axis(top, order, -1)
    w = np.exp(top - top[..., :1]) if gate == "softmax" else np.sqrt(np.logaddexp(0.0, top))
    return ids, w / w.sum(-1, keepdims=True)


def summary(st: dict) -> dict:
    """The calibration's view of trace_stats: flat keys as in TARGET."""
    o = st["overall"]
    out = {"repeat_next": o["repeat_next"], "within_8": o["within_8"], "reuse_median": o["reuse_median"],
           "reuse_p80": o["reuse_p80"], "lru_hit_40": o["lru_hit"][0.4], "top_share_25": o["top_share"][0.25],
           "top_share_50": o["top_share"][0.5], "gini": o["gini"]}
    if "rank_weight" in o:
        out["rank_weight"] = [round(x, 4) for x in o["rank_weight"]]
    return out


def simulated_stats(n_expert: int, k: int, skew: float, drift: float, scores: np.ndarray, gate: str = "softmax",
                    dims: tuple[int, int] = (64, 64), scale: float = 1.0) -> dict:
    ids, w = simulate(n_expert, k, skew, drift, scores, gate, dims, scale)
    return summary(trace_stats(ids, n_expert, weights=w))


def _quick(ids: np.ndarray, n_expert: int) -> dict:
    """repeat_next and top_share_25 of a one-sequence trace [T, L, k] (as routing_stats computes them), vectorised."""
    T, L, k = ids.shape
    onehot = np.zeros((T, L, n_expert), bool)
    np.put_along_axis(onehot, ids, True, axis=-1)
    rep = (onehot[1:] & onehot[:-1]).sum(-1).mean() / k
    counts = np.sort(onehot.sum(0), axis=-1)[:, ::-1]
    m = max(1, int(round(0.25 * n_expert)))
    return {"repeat_next": float(rep), "top_share_25": float((counts[:, :m].sum(1) / counts.sum(1)).mean())}


def _bisect(f, lo: float, hi: float, goal: float, steps: int) -> float:
    """x in [lo, hi] with f(x) ~ goal for an increasing f."""
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < goal else (lo, mid)
    return 0.5 * (lo + hi)


def calibrate(n_expert: int, k: int, scores: np.ndarray, gate: str = "softmax", dims: tuple[int, int] = (64, 64),
              target: dict = TARGET) -> dict:
    """{"router_skew", "router_drift", "router_scale", "simulated": stats}: skew and drift such that the simulated
    repeat_next and top_share_25 hit the target (a bisection on drift around one on skew: both statistics increase
    with both knobs; where no skew is small enough, the drift that errs least on both; the simulated statistics
    say how close it got); then, for a
    softmax top-8 router, the logit scale (it moves the weights, not the choice) that gives rank 0 its target mean
    weight."""
    def quick(skew, drift):
        return _quick(simulate(n_expert, k, skew, drift, scores, gate, dims)[0], n_expert)

    def skew_for(drift):
        return _bisect(lambda s: quick(s, drift)["top_share_25"], 0.0, 3.0, target["top_share_25"], 9)

    drift = _bisect(lambda d: quick(skew_for(d), d)["repeat_next"], 0.0, 0.98, target["repeat_next"], 8)
    skew = skew_for(drift)
    if skew < 0.01:
        # the drift alone concentrates the choices beyond the target (many experts, few chosen, a short window):
        # trade locality for popularity, the drift with the smallest worst error in units of the tolerance
        def err(d):
            q = quick(0.0, d)
            return max(abs(q[k] - target[k]) / TOLERANCE[k] for k in ("repeat_next", "top_share_25"))
        drift, skew = min(np.linspace(0.4 * drift, drift, 9), key=err), 0.0

    def rank0(sc):
        return float(simulate(n_expert, k, skew, drift, scores, gate, dims, sc)[1][..., 0].mean())
    # the rank weights were measured on a softmax top-8 router; other gates and k keep the scale
    scale = _bisect(rank0, 0.05, 5.0, target["rank_weight"][0], 10) if gate == "softmax" and k == 8 else 1.0
    return {"router_skew": round(skew, 4), "router_drift": round(drift, 4), "router_scale": round(scale, 4),
            "simulated": simulated_stats(n_expert, k, skew, drift, scores, gate, dims, scale)}


# ---- the wiring of a file (architecture-independent parts) ---------------------------------------------------

@dataclass(slots=True)
class RouterPlan:
    """Where a calibrated router's inputs live in a file (module doc)."""
    j: int                      # the constant channel (popularity; the kernel head's query and key read it)
    drift_dims: np.ndarray      # D [d] int64, sorted: residual dims holding z
    noise_dims: np.ndarray      # N [n] int64, sorted: residual dims holding the token's own random coordinates
    head: int                   # the kernel's query head in layer 0
    head_dim: int
    uq: np.ndarray              # [head_dim] its query / key vectors (RMS 1) before the per-head norm
    uk: np.ndarray
    a: np.ndarray               # [head_dim/2] the kernel coefficients realised
    scores: np.ndarray          # [SIM_TOKENS] score(Delta) realised
    gain: float                 # head output -> z gain
    proj: np.ndarray            # [d, head_dim] orthonormal rows: head output -> D

    @property
    def reserved(self) -> tuple[int, ...]:
        """j, D and N: the rows no layer may write (D: only the kernel head)."""
        return tuple(int(x) for x in np.r_[self.j, self.drift_dims, self.noise_dims])

    @property
    def dims(self) -> tuple[int, int]:
        return self.noise_dims.size, self.drift_dims.size

    def head_cols(self) -> range:
        return range(self.head * self.head_dim, (self.head + 1) * self.head_dim)

    def _rows(self, first: int, u: np.ndarray, width: int) -> dict:
        out = {}
        for r in range(self.head_dim):
            v = np.zeros(width, np.float32)
            v[self.j] = u[r]
            out[first + r] = v
        return out

    def query_rows(self, n_embd: int) -> dict:
        """{row of the query projection: [n_embd]}: the kernel head reads only the constant channel."""
        return self._rows(self.head * self.head_dim, self.uq, n_embd)

    def key_rows(self, n_embd: int, group: int) -> dict:
        """The same for its KV head (query heads per KV head = group)."""
        return self._rows(self.head // group * self.head_dim, self.uk, n_embd)

    def output_rows(self, width: int) -> dict:
        """{dim of D: [width] row of the output projection}: gain x proj on the head's columns, zeros elsewhere."""
        out = {}
        for i, d in enumerate(self.drift_dims):
            v = np.zeros(width, np.float32)
            v[self.head_cols().start:self.head_cols().stop] = self.gain * self.proj[i]
            out[int(d)] = v
        return out

    def router(self, n_expert: int, n_embd: int, skew: float, drift: float, scale: float, x_scale: float,
               c: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The router [E, n_embd] float32: reads N, D and j only. x_scale: the expected RMS of a reserved coordinate
        at this layer's router input per unit in the residual (1 / the residual's RMS); c [E] the popularity profile."""
        w = np.zeros((n_expert, n_embd), np.float64)
        n, d = self.dims
        w[:, self.noise_dims] = math.sqrt(1.0 - drift) * rng.standard_normal((n_expert, n)) / math.sqrt(n)
        w[:, self.drift_dims] = math.sqrt(drift) * rng.standard_normal((n_expert, d)) / math.sqrt(d)
        w[:, self.j] = skew * c
        return (w * (scale / x_scale)).astype(np.float32)


def pick_dims(seed: int, n_embd: int, j: int, d: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """(D [d], N [min(256, n_embd / 4)], the rng for the rest of the wiring): seeded, disjoint, without j."""
    rng = np.random.default_rng([seed, 11])
    pick = rng.permutation(np.setdiff1d(np.arange(n_embd), [j]))
    return np.sort(pick[:d]), np.sort(pick[d:d + min(256, n_embd // 4)]), rng


def plan_router(seed: int, n_embd: int, j: int, head_dim: int, theta: float, q_norm: np.ndarray, k_norm: np.ndarray,
                head: int, window: float = WINDOW, decay: float = DECAY) -> RouterPlan:
    """The wiring for a qwen3moe geometry (NEOX pairs (i, i + hd/2), per-head q/k RMSNorm with norm weights): |D| =
    min(head_dim, n_embd / 8), the kernel fitted to (window, decay) and realised with the file's layer-0 q/k norm
    weights; query and key vectors of RMS 1 (the pad on a free pair's second dim)."""
    D, N, rng = pick_dims(seed, n_embd, j, min(head_dim, n_embd // 8))
    h = head_dim // 2
    qn, kn = q_norm.astype(np.float64), k_norm.astype(np.float64)
    xq, xk, (pq, pk), a = pair_vectors(kernel_design(head_dim, theta, window, decay), qn[:h], kn[:h], head_dim)
    uq, uk = np.zeros(head_dim), np.zeros(head_dim)
    uq[:h], uk[:h] = xq, xk
    uq[h + pq] = math.sqrt(head_dim - (xq ** 2).sum())
    uk[h + pk] = math.sqrt(head_dim - (xk ** 2).sum())
    scores = kernel_scores(a, head_dim, theta, SIM_TOKENS)
    proj = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))[0][:D.size]
    return RouterPlan(j=j, drift_dims=D, noise_dims=N, head=head, head_dim=head_dim, uq=uq, uk=uk, a=a, scores=scores,
                      gain=drift_gain(scores), proj=proj)


def router_report(spec, plan: RouterPlan | None, gate: str) -> dict | None:
    """What a file records about its router: the knobs and the simulated statistics (and the target and tolerance
    when calibrated); None for a plain skew router (nothing beyond betelgeuse.synth.router_skew)."""
    if plan is None and not spec.router_target and spec.router_scale == 1.0:
        return None
    out = {"knobs": {"router_drift": spec.router_drift, "router_scale": spec.router_scale,
                     "router_window": spec.router_window, "router_decay": spec.router_decay}}
    if plan is not None:
        out["simulated"] = simulated_stats(spec.n_expert, spec.n_expert_used, spec.router_skew, spec.router_drift,
                                           plan.scores, gate, plan.dims, spec.router_scale)
        out["dims"] = {"drift_dims": plan.drift_dims.tolist(), "noise_dims": plan.noise_dims.tolist()}
        out["drift_head"] = plan.head
    if spec.router_target:
        out["target"] = {"name": spec.router_target, **TARGET}
        out["tolerance"] = TOLERANCE
    return out


def add_router_metadata(w, spec, plan: RouterPlan | None, gate: str) -> None:
    """Our own keys: betelgeuse.synth.router_* (knobs), .drift_dims / .noise_dims / .drift_head (the wiring),
    betelgeuse.routing.target (name) with .target.* and .tolerance.* (calibrated files), and
    betelgeuse.routing.simulated.* (the simulation of this file's router over SIM_TOKENS tokens; `betelgeuse bench`
    reports what the engine measured)."""
    r = router_report(spec, plan, gate)
    if r is None:
        return
    for k, v in r["knobs"].items():
        w.add_float32(f"betelgeuse.synth.{k}", float(v))
    for k, v in r.get("dims", {}).items():
        w.add_array(f"betelgeuse.synth.{k}", [int(x) for x in v])
    if "drift_head" in r:
        w.add_uint32("betelgeuse.synth.drift_head", int(r["drift_head"]))
    groups = [("simulated", r["simulated"])] if "simulated" in r else []
    if "target" in r:
        w.add_string("betelgeuse.routing.target", r["target"]["name"])
        groups += [("target", {k: v for k, v in r["target"].items() if k != "name"}), ("tolerance", r["tolerance"])]
    for group, vals in groups:
        for k, v in vals.items():
            if v is None:
                continue
            key = f"betelgeuse.routing.{group}.{k}"
            if isinstance(v, list):
                w.add_array(key, [float(x) for x in v])
            else:
                w.add_float32(key, float(v))


def read_router_metadata(md: dict) -> dict:
    """{"target": name or None, "knobs", "target_stats", "tolerance", "simulated"} from a file's metadata (a reader's
    key -> value dict); empty dicts where the file has none."""
    out = {"target": md.get("betelgeuse.routing.target"), "knobs": {}}
    for group, name in (("target", "target_stats"), ("tolerance", "tolerance"), ("simulated", "simulated")):
        pre = f"betelgeuse.routing.{group}."
        out[name] = {k[len(pre):]: v for k, v in md.items() if k.startswith(pre)}
    for k in ("router_skew", "router_drift", "router_scale", "router_window", "router_decay"):
        if f"betelgeuse.synth.{k}" in md:
            out["knobs"][k] = md[f"betelgeuse.synth.{k}"]
    return out
