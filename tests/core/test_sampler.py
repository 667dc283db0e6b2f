"""Sampler: greedy is argmax, seeded draws reproduce, top-k / top-p restrict the support (checked
empirically against sets computed here from the probabilities), bad parameters are refused."""

import math

import pytest
import torch

from betelgeuse.api import SamplingParams
from betelgeuse.errors import InvalidRequestError
from betelgeuse.sampling import make_generator, sample

V = 50


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 2


def test_greedy_is_argmax():
    for seed in range(20):
        x = _logits(seed)
        assert sample(x, SamplingParams(temperature=0.0)) == int(x.numpy().argmax())
    # greedy ignores top-k / top-p and the generator
    x = _logits(1)
    g = torch.Generator().manual_seed(3)
    assert sample(x, SamplingParams(temperature=0, top_k=3, top_p=0.1), g) == int(x.numpy().argmax())


def test_seeded_sampling_is_reproducible_and_seed_matters():
    x = _logits(2)
    p = SamplingParams(temperature=1.5, seed=1234)
    draw = lambda params: [sample(x, params, gen) for gen in [make_generator(params)] for _ in range(64)]
    a, b = draw(p), draw(p)
    assert a == b
    c = draw(SamplingParams(temperature=1.5, seed=4321))
    assert a != c
    assert len(set(a)) > 5          # at temperature 1.5 over 50 tokens the draws really vary


def _draws(x, params, n=3000):
    gen = make_generator(params)
    return [sample(x, params, gen) for _ in range(n)]


def test_top_k_restricts_support():
    x = _logits(3)
    k = 5
    allowed = set(torch.topk(x, k).indices.tolist())
    seen = set(_draws(x, SamplingParams(temperature=2.0, top_k=k, seed=0)))
    assert seen <= allowed
    assert seen == allowed           # at high temperature every allowed token shows up in 3000 draws


def test_top_p_restricts_support_to_the_nucleus():
    x = _logits(4)
    T, top_p = 1.0, 0.6
    probs = torch.softmax(x.double() / T, -1).tolist()
    # independent computation of the nucleus: smallest prefix of the sorted tokens with mass >= top_p
    order = sorted(range(V), key=lambda i: -probs[i])
    nucleus, mass = set(), 0.0
    for i in order:
        nucleus.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    assert 1 < len(nucleus) < V
    seen = set(_draws(x, SamplingParams(temperature=T, top_p=top_p, seed=1)))
    assert seen <= nucleus
    assert seen == nucleus


def test_top_p_tiny_keeps_the_best_token():
    x = _logits(5)
    seen = set(_draws(x, SamplingParams(temperature=1.0, top_p=1e-6, seed=2), n=200))
    assert seen == {int(x.argmax())}


def test_top_k_and_top_p_together():
    x = _logits(6)
    k, top_p = 8, 0.5
    topk = torch.topk(x, k).indices.tolist()
    probs = torch.softmax(x.double()[topk], -1).tolist()        # renormalised within the top k
    nucleus, mass = set(), 0.0
    for i, p in sorted(zip(topk, probs), key=lambda t: -t[1]):
        nucleus.add(i)
        mass += p
        if mass >= top_p:
            break
    seen = set(_draws(x, SamplingParams(temperature=1.0, top_k=k, top_p=top_p, seed=3)))
    assert seen <= nucleus and len(seen) == len(nucleus)


def test_frequencies_follow_the_distribution():
    x = torch.tensor([0.0, math.log(3.0), -1e9, math.log(6.0)])
    draws = _draws(x, SamplingParams(temperature=1.0, seed=5), n=4000)
    freq = [draws.count(i) / len(draws) for i in range(4)]
    assert freq[2] == 0
    for f, p in zip(freq, [0.1, 0.3, 0.0, 0.6]):
        assert abs(f - p) < 0.03


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=2.5), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
    (SamplingParams(temperature=1.0, top_p=1.5), "top_p"),
    (SamplingParams(temperature=1.0, top_k=-1), "top_k"),
    (SamplingParams(temperature=1.0, seed=-3), "seed"),
])
def test_bad_params_raise(params, field):
    with pytest.raises(InvalidRequestError, match=field):
        sample(_logits(), params)
