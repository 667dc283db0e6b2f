"""Token sampling: greedy, or temperature -> top-k -> top-p (nucleus) -> multinomial draw."""

from __future__ import annotations

import math

import torch

from betelgeuse.errors import InvalidRequestError
from betelgeuse.worker.api import SamplingParams


def validate(params: SamplingParams) -> None:
    """Raise InvalidRequestError naming the first bad field."""
    t, k, p = params.temperature, params.top_k, params.top_p
    if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t}")
    if not isinstance(k, int) or k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {k}")
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {p}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise InvalidRequestError(f"seed must be a non-negative integer, got {params.seed}")


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    """A generator seeded from params.seed, or None (torch's global RNG) when no seed is given."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """logits [n_vocab] -> one token id."""
    validate(params)
    logits = logits.reshape(-1).float()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))      # ties with the k-th survive
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p           # mass strictly above each token
        drop_sorted = before >= params.top_p                          # keeps the smallest prefix with mass >= top_p
        drop_sorted[0] = False                                        # the most likely token always survives
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    # multinomial on CPU with a CPU generator; the device's generator when the logits live there
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))
