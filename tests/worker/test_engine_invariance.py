"""Invariant 1 (location invariance) of the out-of-core engine, in one process, on the CPU.

Same schedule: logits are bit-identical whatever the slot configuration (0/0, 0/20, 5/15, 2/3,
everything in the "VRAM" tier, everything resident), cold, warm (staged copies, no consolidation yet)
and after consolidation, and bit-identical to `Qwen3MoeReference` (all experts dequantized from the
file's mmap: no slots, no store). Each configuration must really have used the tiers it claims,
otherwise the equality would be vacuous.

Across schedules (layer-major with sub-batches of 1/5/16/64 tokens, standard with micro-batches of
3/7) only the float32 summation order inside the matmuls changes (BLAS picks blocking by the
batch size M). Each op then differs by ~1 ulp x sqrt(K) relative (K <= 64 here: ~1e-6); three
layers keep that below ~1e-5 x max|logit|. The tolerance, 1e-4 x max|logit|, is 10x above that
and far below any real bug (a wrong or missing expert, a token routed with the wrong weight, a
stale KV row each move logits by O(0.1)). Greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from betelgeuse.model.qwen3moe import Qwen3MoeReference

from engine_helpers import (ENGINE_SPEC, close_runner, in_process_runner, prompt, qwen3_reference, reference_logits,
                            write_synth)

E = ENGINE_SPEC["n_expert"]
PROMPT = prompt(40, ENGINE_SPEC["n_vocab"], seed=3)
REL_TOL = 1e-4
# (vram, host) slots per layer; (E, 0) puts every expert in the VRAM tier, (5, E-5) every one resident
CONFIGS = [(0, 0), (0, 20), (5, 15), (2, 3), (E, 0), (5, E - 5)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("inv") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def reference(model):
    return qwen3_reference(model, PROMPT)


def _three_passes(runner):
    """cold (no consolidation) -> warm (staged copies) -> after consolidation; all-token logits."""
    out = []
    for name, consolidate in (("cold", False), ("warm", True), ("consolidated", False)):
        logits, st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True, consolidate=consolidate)
        runner.settle()
        out.append((name, logits, st))
    return out


@pytest.mark.parametrize("vram,host", CONFIGS, ids=[f"{v}v{h}h" for v, h in CONFIGS])
def test_logits_bit_identical_across_slots_and_passes(model, reference, vram, host):
    _, want = reference
    runner, store = in_process_runner(model, vram, host)
    try:
        passes = _three_passes(runner)
        for name, logits, st in passes:
            assert logits.shape == want.shape
            diff = (logits - want).abs().max().item()
            assert torch.equal(logits, want), f"{vram}/{host} {name}: max |diff| {diff:.3e}, not bit-identical"
        (_, _, cold), (_, _, warm), (_, _, cons) = passes
        n_used = sum(cold.reads.values())
        # the cold pass reads every expert it needs from disk, whatever the slots
        assert cold.reads == {"vram": 0, "host": 0, "disk": n_used} and cold.disk_bytes > 0
        assert sum(cons.reads.values()) == n_used        # same routing: the same (layer, expert) set
        resident = min(vram + host, E)
        if resident == 0:
            assert cons.reads["disk"] == n_used
        if vram:
            assert cons.reads["vram"] > 0, cons.reads
        if host:
            assert cons.reads["host"] > 0, cons.reads
        if resident == E:
            assert cons.reads["disk"] == 0 and cons.disk_bytes == 0, cons.reads
        elif resident:
            assert cons.reads["disk"] > 0, cons.reads    # partial residency really mixes tiers
        # warm before consolidation: staged copies answer without new disk bytes where they survived
        assert warm.disk_bytes <= cold.disk_bytes
    finally:
        close_runner(runner, store)


def _greedy(step, ids, n):
    """n greedy tokens: step(ids, first) -> last logits row."""
    out = []
    logits = step(ids, True)
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = step([tok], False)
    return out


def test_decode_tokens_bit_identical(model, reference):
    """Prefill + 6 single-token decode passes, cold and after consolidation, in a cold-only and a
    partially resident engine. With the prefill's output head on all rows (as the reference does)
    every row is the reference's bit for bit. With the head on the last row only (what serving does)
    the head's matmul has M=1 instead of 40, which changes BLAS blocking by ~1e-6 (not a location
    effect): those rows must still be bit-identical across configurations and passes."""
    ref, _ = reference
    kv = ref.new_cache(64)
    rows = []

    def ref_step(ids, first):
        with torch.no_grad():
            r = ref.forward(torch.tensor(ids), kv)[-1].float()
        rows.append(r)
        return r
    want = _greedy(ref_step, PROMPT, 6)
    last_only = []                                           # rows of each run with all_logits=False prefill
    for vram, host in ((0, 0), (5, 15)):
        runner, store = in_process_runner(model, vram, host)
        try:
            for all_rows in (True, False, True, False):      # first two cold, last two after consolidation
                rkv = runner.new_cache(64)
                got_rows = []

                def step(ids, first):
                    logits, _ = runner.forward(ids, rkv, consolidate=first, all_logits=first and all_rows)
                    got_rows.append(logits[-1])
                    return logits[-1]
                got = _greedy(step, PROMPT, 6)
                runner.settle()
                assert got == want, (vram, host, got, want)
                if all_rows:
                    for i, (a, b) in enumerate(zip(got_rows, rows)):
                        assert torch.equal(a, b), f"{vram}/{host} row {i}: max |diff| {(a - b).abs().max():.3e}"
                else:
                    last_only.append(torch.stack(got_rows))
        finally:
            close_runner(runner, store)
    for other in last_only[1:]:
        assert torch.equal(other, last_only[0])


SCHEDULES = [("layer_major", dict(sub_batch=1)), ("layer_major", dict(sub_batch=5)),
             ("layer_major", dict(sub_batch=64)), ("standard", dict(micro_batch=3)), ("standard", dict(micro_batch=7))]


@pytest.mark.parametrize("schedule,kw", SCHEDULES, ids=[f"{s}-{list(k.values())[0]}" for s, k in SCHEDULES])
def test_schedules_agree_within_tolerance(model, reference, schedule, kw):
    _, want = reference
    runner, store = in_process_runner(model, 5, 15, schedule=schedule, **kw)
    try:
        outs = []
        for _ in range(2):                                   # cold and after consolidation: same bits
            logits, st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
            runner.settle()
            assert st.schedule == schedule
            outs.append(logits)
        assert torch.equal(outs[0], outs[1]), "same schedule, different slots: must be bit-identical"
        scale = want.abs().max().item()
        diff = (outs[0] - want).abs().max().item()
        print(f"\n[schedule] {schedule} {kw}: max |diff| vs reference {diff:.3e} (tolerance {REL_TOL * scale:.3e})")
        assert scale > 0.5 and want.std() > 0.1              # a live model
        assert diff <= REL_TOL * scale
        assert torch.equal(outs[0].argmax(-1), want.argmax(-1)), "greedy tokens differ"
    finally:
        close_runner(runner, store)


def test_tolerance_can_fail(model, reference):
    """Positive control: the tolerance is tight enough that one changed input token (whose effect on
    later positions is of the size of a real bug) exceeds it."""
    _, want = reference
    ref = Qwen3MoeReference.load(model)
    ids = list(PROMPT)
    ids[7] = (ids[7] + 1) % ENGINE_SPEC["n_vocab"]              # one token changed is a different input
    other = reference_logits(ref, ids)
    assert (other[7:] - want[7:]).abs().max().item() > REL_TOL * want.abs().max().item()


def test_decode_layer_with_its_bytes_at_hand_is_one_group(model, reference):
    """Every expert resident (5 VRAM slots, the rest host): after consolidation a decode layer's experts are in VRAM
    or host slots (those the prompt used), nothing to wait for, so a layer that has both runs ONE launch group over the VRAM slots and the ring
    bank (moe_step._partial: one gate_up + one down on the GPU, not two of each), and its logits are still the
    reference's bit for bit."""
    ref, _ = reference
    kv = ref.new_cache(64)

    def ref_step(ids, first):
        with torch.no_grad():
            return ref.forward(torch.tensor(ids), kv)[-1].float()
    rows = []
    want = _greedy(lambda ids, first: rows.append(ref_step(ids, first)) or rows[-1], PROMPT, 4)
    runner, store = in_process_runner(model, 5, E - 5)
    try:
        runner.forward(PROMPT, runner.new_cache(64), consolidate=True)
        runner.settle()
        rkv, got_rows, layers = runner.new_cache(64), [], []

        def step(ids, first):
            logits, st = runner.forward(ids, rkv, consolidate=False, all_logits=first)
            got_rows.append(logits[-1])
            if not first:
                layers.extend(st.layers)
            return logits[-1]
        assert _greedy(step, PROMPT, 4) == want
        for i, (a, b) in enumerate(zip(got_rows, rows)):
            assert torch.equal(a, b), f"row {i}: max |diff| {(a - b).abs().max():.3e}"
        mixed = [ls for ls in layers if ls.vram and ls.host and not ls.disk]       # (an expert no pass used yet
        assert len(mixed) >= 4, [(ls.vram, ls.host, ls.disk) for ls in layers]   # is still on disk: its layer waits)
        assert all(ls.groups == 1 for ls in mixed), [(ls.vram, ls.host, ls.groups) for ls in mixed]
    finally:
        close_runner(runner, store)
