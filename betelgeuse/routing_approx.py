"""The approximate routing modes (off by default; DESIGN.md §3.1): the router's choice bent toward the experts
that are resident (in a VRAM or a host slot), so that fewer of them come from disk. Outputs then depend on what
is resident: every figure they produce is printed beside its divergence from exact routing (divergence()).

  exact     the model's own top-k (the default, and the reference every other mode is measured against)
  resident  the milder mode: rank 0 is the model's own first choice; ranks 1..k-1 among the resident experts
            first (by the model's score), non-resident ones only when fewer than k-1 are resident. A rank-0 miss
            still reads the disk
  pool      the reference report's routing: EVERY rank among the resident experts first (by the model's score),
            non-resident ones only when fewer than k are resident. A warm repeated prompt reads nothing from disk

deepseek4's hash-routed layers (experts = a table row of the token id): `resident` leaves them exact; `pool` ranks
the table's experts first (in table order), then the rest by the router's score, and takes resident ones first
(approx_hash): a layer whose table experts are resident routes exactly, and a warm repeated prompt reads nothing.

Both are location-invariant: the choice depends on the resident SET, never on which tier (VRAM or host) holds an
expert. A layer with no resident expert (cold start), or with all of them resident, routes exactly (the runner
passes no Residency for it: MoEStep.residency). The selection is a stable sort on the model's own score (no
arithmetic on the scores): resident experts first, each group by score, ties by lower expert id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUTING_MODES = ("exact", "resident", "pool")
APPROXIMATE = {
    "resident": "APPROXIMATE routing `resident`: rank 0 exact, ranks >= 1 among resident experts",
    "pool": "APPROXIMATE routing `pool`: every rank among resident experts (the reference report's)",
}


def routing_label(mode: str) -> str:
    """'exact', or the APPROXIMATE line every output of an approximate mode carries."""
    return APPROXIMATE.get(mode, mode)


@dataclass(slots=True, frozen=True)
class Residency:
    """One layer's resident set for an approximate routing mode."""
    mode: str                       # "resident" | "pool"
    mask: torch.Tensor              # [n_expert] bool on the router's device: in a VRAM or a host slot

    def __post_init__(self):
        assert self.mode in APPROXIMATE, self.mode


def approx_topk(score: torch.Tensor, k: int, res: Residency) -> torch.Tensor:
    """score [T,E] (higher = preferred: the model's selection score) -> ids [T,k] int64 (module doc)."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices          # [T,E] by score, ties by id
    if res.mode == "pool":
        return _resident_first(order, res.mask, k)
    first, rest = order[:, :1], order[:, 1:]
    return torch.cat([first, _resident_first(rest, res.mask, k - 1)], dim=-1)


def approx_hash(table_ids: torch.Tensor, score: torch.Tensor, res: Residency) -> torch.Tensor:
    """A hash-routed layer: table_ids [T,k] (the table row of each token), score [T,E] -> ids [T,k] (module doc)."""
    if res.mode != "pool":
        return table_ids
    T, E = score.shape
    k = table_ids.shape[1]
    by_score = torch.sort(score, dim=-1, descending=True, stable=True).indices                 # [T,E]
    key = torch.empty_like(by_score).scatter_(1, by_score, torch.arange(k, k + E, device=score.device).expand(T, E))
    key.scatter_(1, table_ids, torch.arange(k, device=score.device).expand(T, k))            # table experts first
    order = torch.sort(key, dim=-1, stable=True).indices
    return _resident_first(order, res.mask, k)


def _resident_first(order: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """order [T,m] expert ids by preference -> the first n of them with the resident ones moved ahead (stable)."""
    away = (~mask[order]).to(torch.uint8)                                            # [T,m] 0 = resident
    pos = torch.sort(away, dim=-1, stable=True).indices[:, :n]
    return order.gather(1, pos)


@dataclass(slots=True, frozen=True)
class Divergence:
    """An approximate routing's outputs against exact routing's on the same tokens."""
    tokens: int
    top1: float                     # share of tokens whose argmax agrees
    kl: float                       # mean KL(exact || approximate) per token, nats

    def label(self) -> str:
        return f"top-1 agreement {self.top1:.1%}, mean KL {self.kl:.4f} nats/token over {self.tokens} tokens"

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "top1": self.top1, "kl": self.kl}


def divergence(exact: torch.Tensor, approx: torch.Tensor) -> Divergence:
    """exact, approx [T, n_vocab] logits of the same T tokens (teacher-forced) -> their divergence (float64)."""
    if exact.shape != approx.shape or exact.dim() != 2 or exact.shape[0] == 0:
        raise ValueError(f"divergence needs two [T, n_vocab] logits of one shape, T >= 1 (got {tuple(exact.shape)} "
                         f"and {tuple(approx.shape)})")
    p = torch.log_softmax(exact.double(), dim=-1)
    q = torch.log_softmax(approx.double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)                             # [T]
    top1 = (exact.argmax(dim=-1) == approx.argmax(dim=-1)).double().mean()
    return Divergence(int(exact.shape[0]), float(top1), float(kl.mean()))
