"""`vram_backing = false`: VRAM experts keep no host copy, so VRAM slots add resident capacity.

The same invariants as with backing copies: logits bit-identical to the reference whatever the slots, cold,
warm and after consolidation; plus what the switch buys (capacity, fewer disk loads) and costs (a restarted
worker reads its VRAM experts from disk).
"""

import torch

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.plan import plan_slots
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, qwen3_reference, write_synth

import pytest

PROMPT = prompt(40, ENGINE_SPEC["n_vocab"], seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("backing") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def want(model):
    return qwen3_reference(model, PROMPT)[1]


@pytest.mark.parametrize("vram,host", [(5, 15), (8, 0), (12, 20)])
def test_bit_identical_without_backing(model, want, vram, host):
    runner, store = in_process_runner(model, vram, host, vram_backing=False)
    try:
        assert store.layout.host_per_layer == host                  # no backing slots in the arena
        seen_vram = 0
        for consolidate in (False, True, False, False):
            logits, st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True, consolidate=consolidate)
            runner.settle()
            assert torch.equal(logits, want), (vram, host, st.reads)
            seen_vram += st.reads["vram"]
        assert seen_vram > 0                                         # the VRAM tier was really used
        snap = store.directory.snapshot()
        assert ((snap["tier"] == 2) & (snap["host_slot"] < 0)).any()  # VRAM experts without a host slot
    finally:
        close_runner(runner, store)


def test_more_resident_experts_for_the_same_memory(model):
    """Same arena bytes (20 host slots per layer): with backing 5 VRAM + 15 host are resident, without it
    5 VRAM + 20 host; once the VRAM tier is filled (the first pass after consolidation reads its experts from
    disk when they have no backing copy), a pass reads fewer experts from disk."""
    disk = {}
    for backing, host in ((True, 15), (False, 20)):
        runner, store = in_process_runner(model, 5, host, vram_backing=backing)
        try:
            assert store.layout.host_per_layer == 20
            runner.forward(PROMPT, runner.new_cache(64))
            runner.settle()
            runner.forward(PROMPT, runner.new_cache(64), consolidate=False)   # fills the VRAM tier
            _, st = runner.forward(PROMPT, runner.new_cache(64), consolidate=False)
            assert st.vram_filled == 0
            disk[backing] = st.reads["disk"]
        finally:
            close_runner(runner, store)
    assert disk[False] < disk[True], disk


def test_restarted_worker_reads_vram_experts_from_disk(model, want):
    runner, store = in_process_runner(model, 6, 0, vram_backing=False)
    try:
        runner.forward(PROMPT, runner.new_cache(64))
        runner.settle()
        runner.attach()                                               # a new worker session: empty VRAM slots
        logits, st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True, consolidate=False)
        assert torch.equal(logits, want)
        assert st.vram_filled == 6 * ENGINE_SPEC["n_layer"] and st.reads["vram"] > 0
    finally:
        close_runner(runner, store)


def test_auto_slots_use_vram_as_capacity(model):
    f = GGUFModelFile.open(str(model))
    kw = dict(model_path=str(model), device="cuda", vram_slots="auto", host_slots="auto", vram_budget=1 << 33)
    limit = 3 << 30
    with_backing = plan_slots(f, EngineConfig(**kw), limit)
    without = plan_slots(f, EngineConfig(**kw, vram_backing=False), limit)
    assert without.n_vram + without.n_host >= with_backing.n_vram + with_backing.n_host
    assert without.host_per_layer == without.n_host


def test_promotion_to_vram_copies_from_ram_not_disk(model, want):
    """Without backing copies, an expert promoted from the host tier to VRAM keeps its host slot until the
    worker has copied it (one more consolidation round): the repeated prompt after consolidation then reads
    nothing from disk when the resident capacity holds its experts (the device run saw 46.7% of loads from disk
    again, because promotion freed the host slot first and the worker re-read the VRAM tier from disk)."""
    short = PROMPT[:6]                     # 6 tokens x top-4: at most 24 of the 32 experts of a layer
    want_short = qwen3_reference(model, short, 16)[1]
    runner, store = in_process_runner(model, 12, 20, vram_backing=False)
    try:
        _, cold = runner.forward(short, runner.new_cache(16))                # cold: consolidates
        runner.settle()
        assert cold.reads["disk"] > 0
        for _ in range(3):                                                    # warm passes, each consolidating
            logits, st = runner.forward(short, runner.new_cache(16), all_logits=True)
            runner.settle()
            assert torch.equal(logits, want_short)
            assert st.reads["disk"] == 0 and st.disk_bytes == 0, st.reads
        assert st.reads["vram"] > 0
        snap = store.directory.snapshot()
        assert ((snap["tier"] == 2) & (snap["host_slot"] < 0)).any()          # the host slots were given back
    finally:
        close_runner(runner, store)


def test_tiers_swap_with_a_full_host_tier(model):
    """Without backing copies, a consolidation that promotes host experts to VRAM while it demotes VRAM experts
    to the host tier needs host slots for the demoted ones while the promoted ones would keep theirs for one
    round: the host tier is full, so the promotions give their slots up (found on the device with 8 sequences
    decoding: the store failed its end_pass with 'pop from empty list'). And VRAM experts (no host slot) that
    fall out of both tiers go back to disk (they stayed VRAM-tier, more than the worker has VRAM slots)."""
    import numpy as np
    runner, store = in_process_runner(model, 4, 4, vram_backing=False)
    try:
        E = store.plan.n_expert
        kv = runner.new_cache(64)
        want_logits, _ = runner.forward(PROMPT, kv, all_logits=True)
        runner.settle()
        # every layer: experts 0-3 the most used, then 4-7; the next rounds the other way round
        for top, nxt in (((0, 1, 2, 3), (4, 5, 6, 7)), ((4, 5, 6, 7), (0, 1, 2, 3)), ((0, 1, 2, 3), (4, 5, 6, 7))):
            usage = np.zeros((store.plan.n_layer, E), dtype=np.int64)
            usage[:, list(top)] = 1000
            usage[:, list(nxt)] = 100
            store.score[:] = 0
            runner.session.close_pass(False)
            store.begin_pass(runner.store.session)
            store.end_pass(runner.store.session, usage, True)
            runner.settle()
            snap = store.directory.snapshot()
            for l in range(store.plan.n_layer):
                assert sorted(np.nonzero(snap["tier"][l] == 2)[0].tolist()) == sorted(top), l   # VRAM
                assert sorted(np.nonzero(snap["tier"][l] == 1)[0].tolist()) == sorted(nxt), l   # host
                slots = snap["host_slot"][l][snap["host_slot"][l] >= 0]
                assert len(set(slots.tolist())) == len(slots)                                     # one owner each
            logits, _ = runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
            runner.settle()
            assert torch.equal(logits, want_logits)
    finally:
        close_runner(runner, store)


def test_dropping_the_copies_reads_less_disk_at_the_same_budget(model):
    """One memory budget (an arena of 12 slots per layer), 4 VRAM slots per layer, 4 sequences decoding together
    through the engine: copies on (4 VRAM + 8 host = 12 distinct experts resident) against auto, which drops them
    where host RAM binds (4 + 12 = 16). The decode passes read fewer disk bytes without the copies and the tokens are
    the same bits (placement never changes a result). (Forced on in place of auto, the disk bytes of the two runs
    differ only by the timing of background consolidation fills: the comparison then fails.)"""
    from engine_helpers import backing_workload
    rounds = [[prompt(8, ENGINE_SPEC["n_vocab"], seed=100 * r + i) for i in range(4)] for r in range(2)]
    on = backing_workload(model, True, 4, 12, rounds, 8)
    off = backing_workload(model, "auto", 4, 12, rounds, 8)
    assert (on["plan"].vram_backing, on["plan"].resident_per_layer, on["plan"].host_per_layer) == (True, 12, 12)
    assert (off["plan"].vram_backing, off["plan"].resident_per_layer, off["plan"].host_per_layer) == (False, 16, 12)
    assert off["plan"].arena_bytes == on["plan"].arena_bytes                    # the same memory
    assert off["tokens"] == on["tokens"] and off["decoded"] == on["decoded"] == 4 * 7
    print("decode disk bytes off / on:", off["decode_disk_bytes"], on["decode_disk_bytes"])
    assert off["decode_disk_bytes"] < 0.9 * on["decode_disk_bytes"], (off, on)
