"""The approximate `pool` routing mode (routing_approx.py; DESIGN.md §3.1, off by default): every rank chooses
among the layer's resident experts (VRAM and host slots alike), the reference report's routing.

Checked: the selection against a brute force (both approximate modes, ranks in order), location invariance on the
engine (the same resident SET held in different tiers -> bit-identical logits), a cold store routes exactly, a warm
repeated prompt reads nothing from disk, deepseek4/deepseek41 route their scored layers within the pool and keep
their hash layers, and the divergence helper against a hand computation; the divergence of pool routing from exact
on the CPU oracle model is printed.
"""

import math

import numpy as np
import pytest
import torch

from betelgeuse.routing_approx import Divergence, Residency, approx_topk, divergence
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, synth_reference, write_synth


def _brute_force(score: np.ndarray, k: int, resident: np.ndarray, mode: str) -> list[list[int]]:
    out = []
    for row in score:
        key = lambda e: (not resident[e], -row[e], e)       # noqa: E731 resident first, by score, ties by id
        if mode == "pool":
            out.append(sorted(range(len(row)), key=key)[:k])
        else:
            first = min(range(len(row)), key=lambda e: (-row[e], e))
            out.append([first] + sorted((e for e in range(len(row)) if e != first), key=key)[:k - 1])
    return out


@pytest.mark.parametrize("mode", ["pool", "resident"])
@pytest.mark.parametrize("n_resident", [0, 2, 4, 9, 16])
def test_selection_matches_brute_force(mode, n_resident):
    g = torch.Generator().manual_seed(n_resident)
    score = torch.randn(40, 16, generator=g)
    score[:5, :4] = 0.25                                    # ties: broken by the lower expert id
    mask = torch.zeros(16, dtype=torch.bool)
    mask[torch.randperm(16, generator=g)[:n_resident]] = True
    got = approx_topk(score, 4, Residency(mode, mask)).tolist()
    assert got == _brute_force(score.numpy(), 4, mask.numpy(), mode)


def test_divergence_by_hand():
    exact = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    approx = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    p = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    q = np.exp([0.0, 2.0, 1.0]) / np.exp([0.0, 2.0, 1.0]).sum()
    d = divergence(exact, approx)
    assert d.tokens == 2 and d.top1 == 0.5
    assert math.isclose(d.kl, float((p * np.log(p / q)).sum()) / 2, rel_tol=1e-12)
    assert divergence(exact, exact) == Divergence(2, 1.0, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        divergence(exact, approx[:1])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("pool") / "engine.gguf", **ENGINE_SPEC)


def _passes(path, vram, host, routing, ids):
    """A cold pass (consolidating), then the same prompt again -> (cold logits, warm logits, warm stats, tiers)."""
    runner, store = in_process_runner(path, vram, host, routing=routing)
    try:
        cold, _ = runner.forward(ids, runner.new_cache(len(ids) + 1), all_logits=True)
        runner.settle()
        tiers = runner.session.directory.snapshot()["tier"].copy()
        warm, st = runner.forward(ids, runner.new_cache(len(ids) + 1), all_logits=True, consolidate=False)
        return cold, warm, st, tiers
    finally:
        close_runner(runner, store)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return synth_reference(tmp_path_factory, "ds4-tiny", [1, 2, 3], 8, seed=3)[0]


# (model fixture, n_expert, k, two slot configurations of one resident count in different tiers)
ENGINES = {"qwen3moe": ("qwen", 32, 4, (2, 6), (6, 2)), "deepseek4": ("ds4", 8, 2, (2, 3), (4, 1))}


@pytest.mark.parametrize("arch", list(ENGINES))
def test_pool_location_invariant_cold_exact_warm_no_disk(request, arch):
    name, E, k, cfg_a, cfg_b = ENGINES[arch]
    path = request.getfixturevalue(name)
    ids = prompt(24, 300, seed=5)
    exact_cold, exact_warm, st_exact, _ = _passes(path, *cfg_a, "exact", ids)
    a_cold, a_warm, st_a, tiers_a = _passes(path, *cfg_a, "pool", ids)
    b_cold, b_warm, st_b, tiers_b = _passes(path, *cfg_b, "pool", ids)
    # a cold store has no resident expert: every layer routes exactly
    assert torch.equal(a_cold, exact_cold) and torch.equal(b_cold, exact_cold)
    # the same resident set in different tiers
    assert np.array_equal(tiers_a != TIER_DISK, tiers_b != TIER_DISK)
    assert (tiers_a == TIER_VRAM).sum() != (tiers_b == TIER_VRAM).sum() and (tiers_a == TIER_HOST).any()
    assert ((tiers_a != TIER_DISK).sum(axis=1) >= k).all() and ((tiers_a != TIER_DISK).sum(axis=1) < E).all()
    assert torch.equal(a_warm, b_warm), f"max |diff| {(a_warm - b_warm).abs().max():.3e}"
    # every rank within the pool (deepseek4's hash layers too): a warm repeated prompt reads nothing from disk
    assert st_a.reads["disk"] == 0 and st_b.reads["disk"] == 0 and st_exact.reads["disk"] > 0
    assert not torch.equal(a_warm, exact_warm)
    d = divergence(exact_warm, a_warm)
    print(f"\n[pool routing] {arch} {cfg_a[0]}+{cfg_a[1]} of {E} slots, CPU oracle model: disk expert loads "
          f"{st_exact.reads['disk']} -> 0; {d.label()} (random-weight router: not representative)")
    assert 0.0 < d.kl and 0.0 <= d.top1 <= 1.0


@pytest.mark.parametrize("preset", ["ds4-tiny", "ds41-tiny"])
def test_deepseek4_pool_routes_every_layer_in_the_pool(tmp_path_factory, preset):
    """deepseek4 and deepseek41 (which inherits route()): every rank within the pool, weights from the model's own
    scores. Scored layers: the brute force on scores + bias. Hash layers: the table's experts first (table order),
    then the router's scores; a token whose table experts are all resident routes exactly; `resident` mode leaves
    hash layers exact."""
    _, ref, _ = synth_reference(tmp_path_factory, preset, [1, 2, 3], 8)
    E, k = ref.cfg.n_expert, ref.cfg.n_expert_used
    h = torch.randn(20, ref.cfg.n_embd, generator=torch.Generator().manual_seed(0))
    toks = torch.arange(20)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[torch.randperm(E, generator=torch.Generator().manual_seed(1))[:k + 1]] = True
    pool, res = Residency("pool", mask), Residency("resident", mask)
    for l in range(ref.cfg.n_layer):
        exact, _ = ref.route(l, h, toks)
        ids, w = ref.route(l, h, toks, pool)
        assert bool(mask[ids].all())
        assert torch.allclose(w.float().sum(-1), torch.full((20,), ref.p.routed_scale), rtol=1e-3)
        scores = torch.nn.functional.softplus(torch.nn.functional.linear(h, ref.w[f"blk.{l}.ffn_gate_inp.weight"])
                                              .float()).sqrt()
        if l >= ref.p.n_hash_layers:
            want = _brute_force((scores + ref.w[f"blk.{l}.exp_probs_b.bias"]).numpy(), k, mask.numpy(), "pool")
            assert ids.tolist() == want
            continue
        table = exact.tolist()
        for t, row in enumerate(scores.numpy()):
            pref = table[t] + sorted((e for e in range(E) if e not in table[t]), key=lambda e: (-row[e], e))
            assert ids[t].tolist() == sorted(pref, key=lambda e: not mask[e])[:k]
        assert torch.equal(ref.route(l, h, toks, res)[0], exact)              # `resident`: hash layers stay exact
        full = Residency("pool", torch.zeros(E, dtype=torch.bool).index_fill_(0, exact[0], True))
        got, w0 = ref.route(l, h[:1], toks[:1], full)
        want_ids, want_w = ref.route(l, h[:1], toks[:1])
        assert torch.equal(got, want_ids) and torch.equal(w0, want_w)         # table experts resident: exact
    assert ref.p.n_hash_layers >= 1 or preset == "ds41-tiny"


def test_every_request_usage_names_the_routing_mode():
    """Usage (the HTTP `timings`, gRPC Usage, `generate --usage`) carries the engine's routing mode."""
    import types
    from betelgeuse import api
    from betelgeuse.worker.outputs import OutputProcessor
    from services.grpc.convert import usage_to_pb
    seq = types.SimpleNamespace(usage=api.Usage(), t_prefill_start=2.0, arrival=1.0)
    OutputProcessor(None, "pool").admitted(seq)
    assert seq.usage.routing == "pool" and usage_to_pb(seq.usage).routing == "pool"
    assert api.Usage().routing == "exact"
