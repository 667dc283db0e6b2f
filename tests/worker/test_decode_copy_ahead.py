"""Copy ahead in pool-routed decode (issue 21, engine.prefetch_host; MoEStep._ahead_start / _ahead_group).

At the end of decode layer l's host step, layer l+1's guessed host-tier experts that the step banks are copied into a
ring bank, so that layer l+1 finds the ones it routes to on the device instead of copying them after its routing
reached the host. On the CPU with a real store, in the static decode form (solo through forward(), the batched lanes
through decode_batch), host experts banked (host_in_place = never: what MXFP4's auto rule does on the device):

  - the decode's logits are the same bits with prefetch_host on and off (DESIGN.md §2: a guess moves bytes, never
    what is computed), its tier reads the same, for qwen3moe and deepseek4 (hash layers too), one row and two, a
    bank of 2 slots (guesses that fill the bank, misses copied in groups after it), a pool with disk experts, and
    prefetch_host = on in exact routing (the model's own guess; disk reads ahead beside)
  - the copies happen ahead: a host expert layer t routed to was copied into the ring BEFORE layer t's routing
    reached the host (MoEStep._partial's entry: its sync), and layer t's group read it at the offset that copy
    wrote; with prefetch_host off no routed host expert is ever copied before its layer's routing (the check fails
    on main's code); the counters (host_guessed >= host_guess_hits > 0) agree with the recorded copies
  - the bench's decode record and report carry the counters (non-zero in the pool case, 0 with it off)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from copy_ahead_log import ahead_reads, watch
from engine_helpers import (ENGINE_SPEC, close_runner, counted_pool_runner, in_process_runner, prompt, write_ds4_tiny,
                            write_synth)

STEPS = 5


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("copy_ahead") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return write_ds4_tiny(tmp_path_factory.mktemp("copy_ahead_ds4") / "ds4.gguf", seed=3)


def _decode(path, vram: int, host: int, on: bool, lanes: bool = False, rows: int = 1, log: list | None = None,
            **cfg):
    """`rows` prompts prefilled and settled, then STEPS greedy pool-routed decode steps in the static form -> (logits
    [STEPS, rows, V], summed counters, tier reads). log: a list that gets the step's events in order
    (copy_ahead_log.watch)."""
    routing = cfg.pop("routing", "pool")
    rn, st = in_process_runner(path, vram, host, routing=routing, prefetch_host="on" if on else "off",
                               host_in_place="never", max_running=rows, decode_consolidate_every=0, **cfg)
    try:
        assert rn.moe.copy_ahead is on and (routing == "exact" or rn.moe.depth == (1 if on else 0))
        kvs, toks = [], []
        for i in range(rows):
            kv = rn.new_cache(64)
            lg, _ = rn.forward(prompt(24, 300, seed=5 + i), kv)
            kvs.append(kv)
            toks.append(int(lg[-1].argmax()))
        rn.settle()
        rn._static_decode = True
        if log is not None:
            watch(rn, log)
        outs, tot = [], dict.fromkeys(("host_guessed", "host_guess_hits", "host_guess_bytes", "vram", "host",
                                       "disk"), 0)
        for _ in range(STEPS):
            if log is not None:
                log.append(("step",))
            if lanes:
                lg, s = rn.decode_batch(toks, kvs)
            else:
                lg, s = rn.forward(toks, kvs[0], consolidate=False)
            lg = lg.reshape(rows, -1)
            outs.append(lg)
            toks = [int(x) for x in lg.argmax(-1)]
            for k in ("host_guessed", "host_guess_hits", "host_guess_bytes"):
                tot[k] += getattr(s, k)
            for k in ("vram", "host", "disk"):
                tot[k] += s.reads[k]
        return torch.stack(outs), tot, rn.session.directory.snapshot()
    finally:
        close_runner(rn, st)


# (model fixture, vram slots, host slots, lanes, rows, extra config)
CASES = {"qwen-solo": ("qwen", 6, 10, False, 1, {}), "qwen-lanes2": ("qwen", 6, 10, True, 2, {}),
         "qwen-bank2": ("qwen", 6, 10, False, 1, dict(ring_slots=4)),
         "qwen-disk": ("qwen", 1, 2, False, 1, {}),
         "ds4-solo": ("ds4", 2, 3, False, 1, {}), "ds4-lanes2": ("ds4", 2, 3, True, 2, {}),
         # prefetch_host = on in exact routing: the model's own (fused) guess, disk experts read ahead beside
         "qwen-exact": ("qwen", 6, 10, False, 1, dict(routing="exact")),
         "ds4-exact-lanes2": ("ds4", 2, 3, True, 2, dict(routing="exact"))}


@pytest.mark.parametrize("case", list(CASES))
def test_copy_ahead_is_bit_identical(request, case):
    name, vram, host, lanes, rows, extra = CASES[case]
    path = request.getfixturevalue(name)
    off, t_off, _ = _decode(path, vram, host, False, lanes, rows, **extra)
    on, t_on, _ = _decode(path, vram, host, True, lanes, rows, **extra)
    assert t_on["host_guess_hits"] > 0, (case, t_on)               # copies ahead were taken: the check means it
    assert t_off["host_guessed"] == 0 and t_off["host_guess_hits"] == 0, t_off
    assert torch.equal(on, off), (case, (on - off).abs().max().item())
    assert all(t_on[k] == t_off[k] for k in ("vram", "host", "disk")), (t_on, t_off)
    if case in ("qwen-disk", "qwen-exact"):
        assert t_on["disk"] > 0, t_on                               # disk experts too (fewer resident than k; exact)


@pytest.mark.parametrize("case", ["qwen-solo", "ds4-lanes2"])
def test_copies_start_before_the_layer_routes(request, case):
    name, vram, host, lanes, rows, extra = CASES[case]
    path = request.getfixturevalue(name)
    log_off, log_on = [], []
    _, t_off, _ = _decode(path, vram, host, False, lanes, rows, log=log_off, **extra)
    _, t_on, _ = _decode(path, vram, host, True, lanes, rows, log=log_on, **extra)
    assert any(ev[0] == "route" and ev[2] for ev in log_off), "no banked host expert routed: nothing to check"
    assert ahead_reads(log_off) == 0                 # main's code: a host expert is copied after its layer routes
    n = ahead_reads(log_on)
    assert n > 0, case
    # every hit the counters report was read from a slot copied ahead, and no more were copied ahead than counted
    assert n == t_on["host_guess_hits"] <= t_on["host_guessed"], (n, t_on)
    assert t_on["host_guess_bytes"] > 0


def test_bench_decode_records_the_copies_ahead(ds4):
    """The bench's decode record (services/bench/harness.py Harness._decode, what bench.json and bench.md hold) counts
    the pool case's copies ahead under decode.guess (host_guessed, host_guess_hits, host_guess_bytes) with their hit
    rate, and the report's guess cell prints them; with prefetch_host off they are 0 and the cell says nothing of
    them. The static form forced on the CPU, as the device decodes."""
    from services.bench.harness import BenchOptions, Harness
    from services.bench.report import _guess_rate
    for on in (False, True):
        rn, st = in_process_runner(ds4, 2, 3, routing="pool", prefetch_host="on" if on else "off",
                                   host_in_place="never", decode_consolidate_every=0)
        try:
            kv = rn.new_cache(64)
            lg, _ = rn.forward(prompt(24, 300, seed=5), kv)
            rn.settle()
            rn._static_decode = True
            h = Harness(BenchOptions(model=str(ds4), engine=rn.cfg, decode=STEPS), {}, lambda final: None)
            d = h._decode(rn, kv, lg)
            slot = rn.cache.slot_bytes
        finally:
            close_runner(rn, st)
        g = d["guess"]
        assert d["tokens"] == STEPS and d["reads"]["disk"] == 0, d["reads"]
        if not on:
            assert g["host_guessed"] == g["host_guess_hits"] == 0 and d["host_guess_hit_rate"] is None, g
            assert "host" not in _guess_rate(d)
            continue
        assert 0 < g["host_guess_hits"] <= g["host_guessed"], g
        assert g["host_guess_bytes"] == g["host_guessed"] * slot
        assert d["host_guess_hit_rate"] == g["host_guess_hits"] / g["host_guessed"]
        assert f"host: {g['host_guess_hits']:,} / {g['host_guessed']:,}" in _guess_rate(d)


def test_pool_guess_launches_what_the_exact_guess_does(monkeypatch, ds4):
    """The pool guess (MoEStep.guess_route, one layer deep, inside the captured decode graphs) launches per guessed
    layer what exact routing's fused guess of one layer does (deepseek4: the mHC partial and finish, the router
    matmul, one selection: 4), so the pool case's launches per decode layer grow by the guess alone; a layer that
    routes exactly (all resident) takes the exact selection. ds4-tiny with TritonOps whose Triton launches are
    counted, not run (as test_decode_static_pool.py::test_route_static_launches_one_selection)."""
    from betelgeuse.store.directory import TIER_DISK, TIER_VRAM
    from betelgeuse.worker.guess import guess_ahead
    with counted_pool_runner(monkeypatch, ds4) as (rn, count):
        m, moe = rn.model, rn.moe
        L, E = rn.mcfg.n_layer, rn.mcfg.n_expert
        tier = np.full((L, E), TIER_DISK, dtype=np.int8)
        tier[:, :3] = TIER_VRAM
        tier[L - 1] = TIER_VRAM                                  # all resident: routes exactly
        moe.refresh_static({"tier": tier})
        x, tok = torch.randn(1, m.p.hc_mult, rn.mcfg.n_embd).to(m.dtype), torch.tensor([3])

        def guess(l, route):
            g = guess_ahead(m, l, x, tok, 1, L, route)
            assert g.shape == (1, 1, rn.mcfg.n_expert_used) and g.dtype == torch.int64, g.shape
        for l in range(L - 1):
            exact, _ = count(lambda: guess(l, None))
            pool, kernels = count(lambda: guess(l, moe.guess_route(m)))
            assert pool == exact == 4, (l, pool, exact, kernels)
            want = "_route_kernel" if l + 1 == L - 1 else "_route_approx_kernel"
            assert kernels.get(want) == 1, (l, kernels)
