"""Token sampling: greedy, or temperature -> top-k -> top-p (nucleus) -> multinomial draw."""

from __future__ import annotations

import math

import torch

from betelgeuse.api import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, SamplingParams
from betelgeuse.errors import InternalError, InvalidRequestError


def validate(params: SamplingParams) -> None:
    """Raise InvalidRequestError naming the first bad field."""
    t, k, p = params.temperature, params.top_k, params.top_p
    if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or not 0 <= t <= MAX_TEMPERATURE:
        raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}")
    if not isinstance(k, int) or k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {k}")
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {p}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise InvalidRequestError(f"seed must be a non-negative integer, got {params.seed}")
    validate_features(params)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_features(params: SamplingParams) -> None:
    """min_p, the penalties and logprobs (OpenAI's ranges)."""
    if not _finite(params.min_p) or not 0 <= params.min_p <= 1:
        raise InvalidRequestError(f"min_p must be in [0, 1], got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not _finite(v) or not -2 <= v <= 2:
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}")
    r = params.repetition_penalty
    if not _finite(r) or not 0.01 <= r <= 10:     # a tiny divisor would overflow the logits to inf
        raise InvalidRequestError(f"repetition_penalty must be in [0.01, 10] (1 = off), got {r}")
    n = params.top_logprobs
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n}")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    out_ids: list[int]) -> torch.Tensor:
    """logits [n_vocab] -> penalised copy. presence/frequency (OpenAI) count the completion's tokens;
    repetition (HF's CTRL rule: divide positive logits, multiply negative ones) covers prompt + completion."""
    pres, freq, rep = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
    if not (pres or freq or rep != 1.0):
        return logits
    logits = logits.reshape(-1).float().clone()
    n = logits.numel()
    if (pres or freq) and out_ids:
        counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=n)[:n].to(logits.device, logits.dtype)
        logits -= freq * counts + pres * (counts > 0).to(logits.dtype)
    if rep != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(out_ids)), dtype=torch.long, device=logits.device)
        if seen.numel():
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / rep, v * rep)
    return logits


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Grammar mask: allowed [n_vocab] bool (None = everything); disallowed tokens get -inf."""
    if allowed is None:
        return logits
    return logits.reshape(-1).float().masked_fill(~allowed.to(logits.device), float("-inf"))


def token_logprobs(logits: torch.Tensor, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """log-softmax of the model's raw logits [n_vocab] (before penalties, temperature and masks, as vLLM
    reports them): the chosen token's logprob and the n_top most likely (token, logprob), best first."""
    lp = torch.log_softmax(logits.reshape(-1).float(), dim=-1)
    top = []
    if n_top:
        v, i = torch.topk(lp, min(n_top, lp.numel()))
        top = [(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist())]
    return float(lp[token]), top


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    """A generator seeded from params.seed, or None (torch's global RNG) when no seed is given."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """logits [n_vocab] -> one token id.

    Numerically safe for every value validate() accepts: the logits are shifted by their maximum before
    the division, so a temperature as small as 5e-324 gives 0 for the best token and -inf (never NaN)
    for the others, and a huge one gives a uniform draw. NaN or +inf logits (a model with NaN weights), or all -inf,
    raise InternalError: the request is not at fault, and only its own sequence fails."""
    validate(params)
    logits = logits.reshape(-1).float()
    # -inf is a masked token (a grammar, a penalty); NaN / +inf, or nothing left, is the model's fault
    broken = torch.isnan(logits) | torch.isposinf(logits)
    if bool(broken.any()) or not bool(torch.isfinite(logits).any()):
        raise InternalError(f"the model produced {int(broken.sum())} non-finite logits (NaN or +inf) for this "
                            "sequence" if bool(broken.any()) else "every token is masked (-inf) for this sequence")
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # shift, then divide in float64 (a float32 temperature of 5e-324 would be 0, and 0/0 NaN): <= 0 everywhere,
    # the max exactly 0, the others finite or -inf
    logits = ((logits.double() - float(logits.max())) / params.temperature).float()
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))      # ties with the k-th survive
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:                                              # vLLM/llama.cpp min-p: relative to the top token
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
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
