"""The approximate routing modes in the static decode form (what the CUDA graphs capture), on the CPU.

The captured graphs route with MoEStep.route_static: per layer either the approximate choice over fixed resident
buffers or the exact one (the graphs are keyed by which: MoEStep.static_variant). Checked, for qwen3moe, deepseek4 and deepseek41: route_static is
bit-identical to the eager route with MoEStep.residency() on every layer kind (cold, all resident, partial;
deepseek4's hash layers too) in both modes, and a pool decode in the static form (solo and lanes) is
location-invariant (the same resident SET in different tiers -> the same bits), reads nothing from disk once warm,
and picks the same tokens as the eager (sliced) pool decode; and route_static launches one selection per layer. The CUDA graph replay itself is checked on the device (deploy/device/check_ds4.py, decode step).
"""

import numpy as np
import pytest
import torch

from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
from engine_helpers import (ENGINE_SPEC, close_runner, counted_pool_runner, in_process_runner, prompt, synth_reference,
                            write_synth)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("static_pool") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return synth_reference(tmp_path_factory, "ds4-tiny", [1, 2, 3], 8, seed=3)[0]


@pytest.fixture(scope="module")
def ds41(tmp_path_factory):
    return synth_reference(tmp_path_factory, "ds41-tiny", [1, 2, 3], 8, seed=3)[0]


# (model fixture, n_expert, two slot configurations of one resident count in different tiers)
ENGINES = {"qwen3moe": ("qwen", 32, (2, 6), (6, 2)), "deepseek4": ("ds4", 8, (2, 3), (4, 1)),
           "deepseek41": ("ds41", 8, (2, 3), (4, 1))}


@pytest.mark.parametrize("mode", ["pool", "resident"])
@pytest.mark.parametrize("arch", list(ENGINES))
def test_route_static_is_the_eager_route(request, arch, mode):
    name, E, _, _ = ENGINES[arch]
    rn, st = in_process_runner(request.getfixturevalue(name), 2, 2, routing=mode)
    try:
        m, moe = rn.model, rn.moe
        L = rn.mcfg.n_layer
        g = torch.Generator().manual_seed(7)
        tier = np.full((L, E), TIER_DISK, dtype=np.int8)
        tier[1 % L] = TIER_HOST                                  # all resident: exact
        for l in range(2, L):
            tier[l, torch.randperm(E, generator=g)[:1 + l % (E - 1)].numpy()] = TIER_VRAM   # partial
        on = [0 < n < E for n in (tier != TIER_DISK).sum(axis=1)]
        assert not on[0] and any(on), on                         # layer 0 cold: exact
        h = torch.randn(5, rn.mcfg.n_embd, generator=g).to(m.dtype)
        tok = torch.tensor([3, 17, 4, 250, 9])
        for snap in ({"tier": tier}, {"tier": tier[::-1].copy()}):   # a refresh overwrites the same buffers
            buf = moe._static_mask.data_ptr()
            moe.refresh_static(snap)
            assert moe._static_mask.data_ptr() == buf
            for l in range(L):
                want = m.route(l, h, tok, moe.residency(snap, l))
                got = moe.route_static(m, l, h, tok)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (arch, mode, l)
    finally:
        close_runner(rn, st)


def _decode(path, vram, host, static, lanes=False, steps=4):
    """A prompt, settled (the slots filled from it), then `steps` greedy pool-routed decode tokens -> (logits
    [steps, V], the last step's reads, tiers)."""
    rn, st = in_process_runner(path, vram, host, routing="pool")
    rn._static_decode = static
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(24, 300, seed=5), kv)
        rn.settle()
        tiers = rn.session.directory.snapshot()["tier"].copy()
        outs = []
        for _ in range(steps):
            tok = int(lg[-1].argmax())
            lg, s = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            outs.append(lg[-1:])
        return torch.cat(outs), s.reads, tiers
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("arch", list(ENGINES))
def test_static_pool_decode_location_invariant(request, arch):
    name, E, cfg_a, cfg_b = ENGINES[arch]
    path = request.getfixturevalue(name)
    sliced, _, _ = _decode(path, *cfg_a, static=False)
    for lanes in (False, True):
        a, reads_a, tiers_a = _decode(path, *cfg_a, static=True, lanes=lanes)
        b, reads_b, tiers_b = _decode(path, *cfg_b, static=True, lanes=lanes)
        assert np.array_equal(tiers_a != TIER_DISK, tiers_b != TIER_DISK)
        assert (tiers_a == TIER_VRAM).sum() != (tiers_b == TIER_VRAM).sum()
        assert torch.equal(a, b), (lanes, f"max |diff| {(a - b).abs().max():.3e}")
        assert reads_a["disk"] == 0 and reads_b["disk"] == 0, (reads_a, reads_b)
        # the static form's own attention differs from the sliced one's within float32 noise, not its routing
        assert torch.equal(a.argmax(-1), sliced.argmax(-1)), lanes
        assert (a - sliced).abs().max() <= 1e-3 * sliced.abs().max(), lanes


def test_route_static_launches_one_selection(monkeypatch, ds4):
    """The captured decode graphs hold ONE selection per layer (MoEStep.static_variant keys them): a pool layer's
    route_static launches what exact routing launches (the router matmul and one fused selection kernel,
    TritonOps.route_approx), never the exact top-k beside it; a layer that routes exactly (cold, all resident) only
    the exact one. ds4-tiny with TritonOps whose Triton launches are counted, not run."""
    with counted_pool_runner(monkeypatch, ds4) as (rn, count):
        m, moe = rn.model, rn.moe
        L, E = rn.mcfg.n_layer, rn.mcfg.n_expert
        tier = np.full((L, E), TIER_DISK, dtype=np.int8)
        tier[1] = TIER_HOST                                      # all resident: exact
        tier[2:, :3] = TIER_VRAM                                 # partial: pool (layer 2 hash-routed in ds4-tiny)
        moe.refresh_static({"tier": tier})
        on = [0 < n < E for n in (tier != TIER_DISK).sum(axis=1)]
        assert moe.static_variant() == ("pool", np.array(on).tobytes())
        h, tok = torch.randn(3, rn.mcfg.n_embd).to(m.dtype), torch.tensor([3, 17, 4])
        for l in range(L):
            exact, ex_kernels = count(lambda: m.route(l, h, tok, None))
            got, kernels = count(lambda: moe.route_static(m, l, h, tok))
            assert got == exact, (l, on[l], got, exact, kernels)
            assert kernels == ({"_route_approx_kernel": 1} if on[l] else ex_kernels), (l, kernels)


def test_approx_selection_launched_at_attach(monkeypatch, ds4):
    """Triton compiles a kernel variant at its first launch (~0.3 s of host time each on the device): an approximate
    mode runs every layer's selection once at attach (MoEStep.warm_routes), so no pass pays a compile (the first warm
    pool pass of ds4-flash spent ~590 of its 698 ms of host time compiling: docs/benchmarks/gpu-run25-ds4). A variant
    is what the JIT specializes TritonOps.route_approx's launch on: the constexprs, the weights' dtype, E % 16 and each
    pointer's dtype and 16-byte alignment; recorded here on TorchOps.route_approx, which gets the same arguments."""
    from betelgeuse.model.deepseek4 import TorchOps
    real, seen = TorchOps.route_approx, []

    def spy(logits, bias, tid2eid, token_ids, k, resident, norm, scale, dtype):
        ptrs = (logits, bias, tid2eid, token_ids, resident.mask)
        seen.append((k, tid2eid is not None, resident.mode, bool(norm), dtype, logits.shape[1] % 16 == 0,
                     tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in ptrs)))
        return real(logits, bias, tid2eid, token_ids, k, resident, norm, scale, dtype)
    monkeypatch.setattr(TorchOps, "route_approx", staticmethod(spy))
    rn, st = in_process_runner(ds4, 2, 3, routing="pool")
    try:
        at_attach = set(seen)
        seen.clear()
        kv = rn.new_cache(40)
        lg, _ = rn.forward(prompt(24, 300, seed=5), kv)       # cold: routes exactly, fills the slots
        rn.settle()
        assert not seen
        _, warm = rn.forward(prompt(24, 300, seed=5), rn.new_cache(40), consolidate=False)
        rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
        in_pass = set(seen)
        assert warm.reads["disk"] == 0 and len(in_pass) >= 2, (warm.reads, in_pass)   # hash and top-k layers
        assert in_pass <= at_attach, in_pass - at_attach
    finally:
        close_runner(rn, st)
