"""Decode's at-hand group (worker/at_hand.py): every routed expert the worker holds (VRAM slots, flex copies, host slots
read in place) computed in one group right after routing, the host's partial path for the misses only.

What must hold, on the CPU with a real store and the tiny engine model, in the static form (solo decode through
forward(), and the batched lanes through decode_batch):
- the logits are the same bits as the partial path's (decode_at_hand = false, the path the transformers checks cover:
  tests/worker/test_decode_static.py, test_batched_decode.py), across slot configurations that put the routed experts
  in VRAM, host and disk slots and flex copies;
- every routed expert of every layer is computed exactly once per step (counted where its weights are dequantized):
  none skipped, none twice (a host expert in the group AND through a bank, say);
- the reads per tier (PassStats.reads, flex hits) are the partial path's, step by step.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_ds4_tiny, write_synth

V, E = ENGINE_SPEC["n_vocab"], ENGINE_SPEC["n_expert"]
# (vram, host, extra config): disk only, a VRAM/host/disk mix, all VRAM, and a mix with the flex cache (one read
# thread: disk experts land in the order asked for, so the flex copies' LRU order, hence the hits, are the same
# whichever path runs; with two the landing order varies and so may the hits, never the bits)
CONFIGS = [(0, 0, {}), (5, 15, {}), (E, 0, {}),
           (2, 3, dict(flex_cache=True, max_running=2, max_context=1024, staging_slots=6, prefix_cache_bytes=0,
                       read_threads=1))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("hand") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    """ds4-tiny with Q8_0 experts (engine_helpers.write_tiny_pair's)."""
    return write_ds4_tiny(tmp_path_factory.mktemp("hand_ds4") / "ds4.gguf", expert_qtype="Q8_0", seed=2)


def _decode(model, vram, host, extra, hand: bool, lanes: bool, steps=6, gate: bool = False):
    """Greedy decode after a prompt -> (logits [steps, V], per step: reads, flex hits, applied (layer, expert)
    counts and routed (layer, expert) set). gate: decode_gate on (worker/gate.py: on the CPU each gated layer's
    row is published and drained where its gate stands)."""
    rn, st = in_process_runner(model, vram, host, decode_at_hand=hand, decode_gate="on" if gate else "off",
                               decode_consolidate_every=0, **extra)
    try:
        assert (rn.moe.hand is not None) == hand and (rn.moe.gate is not None) == gate
        applied = Counter()
        weights = rn.cache.weights

        def counted(slot, layer, expert):         # where the torch kernels dequantize an expert: once per group
            applied[layer, expert] += 1
            return weights(slot, layer, expert)
        rn.moe.kern.weights_fn = counted
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(24, V, seed=5), kv)
        rn.settle()                 # the prefill's consolidation placed: the decode reads VRAM and host slots too
        rn._static_decode = True
        tok = int(lg[-1].argmax())
        out, steps_seen = [], []
        for _ in range(steps):
            applied.clear()
            lg, s = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            lg = lg.reshape(-1, V)[-1]
            routed = {(int(l), int(e)) for l, e in zip(*np.nonzero(rn.session.counts.numpy()))}
            steps_seen.append((dict(s.reads), s.flex_hits, dict(applied), routed))
            out.append(lg)
            tok = int(lg.argmax())
        return torch.stack(out), steps_seen
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("gate", [False, True], ids=["hand", "gate"])
@pytest.mark.parametrize("lanes", [False, True], ids=["solo", "lanes"])
def test_at_hand_decode_is_the_partial_paths_bits_and_reads(model, lanes, gate):
    tiers = Counter()
    for vram, host, extra in CONFIGS:
        if gate and "staging_slots" in extra:   # a gated layer holds its disk experts' slots (MoEStep._gate_on)
            extra = {**extra, "staging_slots": 16}
        want, ref_steps = _decode(model, vram, host, extra, hand=False, lanes=lanes)
        got, steps = _decode(model, vram, host, extra, hand=True, lanes=lanes, gate=gate)
        assert torch.equal(got, want), (vram, host, (got - want).abs().max().item())
        for i, ((reads, hits, applied, routed), (reads0, hits0, _, _)) in enumerate(zip(steps, ref_steps)):
            if gate and extra.get("flex_cache"):
                # a gated step's flex copies are made after it, within a staging budget (MoEStep.gate_end), so the
                # cache may hold other experts than the partial path's: each routed expert read once from some tier
                assert sum(reads.values()) == sum(reads0.values()) == len(routed), (vram, host, i)
            else:
                assert (reads, hits) == (reads0, hits0), (vram, host, i)
            # every routed expert computed once, nothing else
            assert applied == {le: 1 for le in routed}, (vram, host, i, applied, routed)
            tiers.update({t: n for t, n in reads.items() if n})
            tiers["flex"] += hits
    assert all(tiers[t] > 0 for t in ("vram", "host", "disk", "flex")), tiers     # every source was exercised


@pytest.mark.slow
def test_at_hand_triton_reads_host_slots_in_place(tmp_path):
    """The triton kernels (TRITON_INTERPRET=1: real addresses) read host-tier experts through table offsets from the
    slot pool into the arena, as on CUDA: the same bits and reads per tier as the partial path (~30 s)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", BETELGEUSE_TRITON_TUNING="off",
               PYTHONPATH=str(tests) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(tests / "scripts" / "at_hand_triton_check.py"), str(tmp_path / "m.gguf")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["host_entries"] > 0 and out["finite"], out              # host experts were in the table, in the arena
    assert sum(r["host"] for r in out["reads_on"]) > 0, out             # and routed
    assert out["bit_identical"] and out["reads_on"] == out["reads_off"], out


def test_gate_kernels_publish_and_bound_their_spin():
    """kernels/triton_gate.py under TRITON_INTERPRET=1: publish writes the rows per expert, guesses and misses through
    an offset into another buffer and sets the flag only when nothing is missed; a gate with nothing missed writes its
    marker and passes with an empty miss table; an armed one with misses gives up after max_iter loads with the error
    flag set when the host never opens it (a bug cannot hang the GPU); a disarmed one (an eager or captured part)
    passes at once; an armed one passes when another thread (the host's drain) writes the table and then the open
    word mid-spin, and hands that table to the misses' group."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "gate_kernel_check.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["counts_ok"] and out["guess_ok"] and out["misses"] == out["misses_want"] > 0, out
    assert out["flag"] == out["flag_want"] == 0 and (out["flag_all_at_hand"], out["misses_all_at_hand"]) == (1, 0), out
    assert out["open_gate"] == {"mark": 41, "err": 0, "spun": 0} and out["open_gate_table_empty"], out
    assert out["closed_gate"] == {"mark": 42, "err": 1, "spun": 50}, out
    assert out["disarmed_gate"] == {"mark": 43, "err": 0, "spun": 0}, out
    late = out["late_open_gate"]
    assert (late["mark"], late["err"]) == (44, 0) and late["spun"] > 0 and out["late_open_s"] >= 0.3, out
    assert out["late_open_table_copied"], out


def _lanes(model, n, vram, host, extra, steps=4, **cfg):
    """n prompts decoded together through the lanes (decode_batch of n) -> (logits [steps, n, V], per step: reads,
    flex hits, applied (layer, expert) counts, routed (layer, expert) set, PassStats.in_place_bytes in expert slots,
    h2d_bytes, whether the step's table held host slots)."""
    rn, st = in_process_runner(model, vram, host, **{"max_running": 4, "decode_consolidate_every": 0, **extra, **cfg})
    try:
        applied = Counter()
        weights = rn.cache.weights

        def counted(slot, layer, expert):
            applied[layer, expert] += 1
            return weights(slot, layer, expert)
        rn.moe.kern.weights_fn = counted
        kvs = [rn.new_cache(64) for _ in range(n)]
        toks = [int(rn.forward(prompt(16 + 4 * i, V, seed=20 + i), kv)[0][-1].argmax()) for i, kv in enumerate(kvs)]
        rn.settle()
        rn._static_decode = True
        out, seen = [], []
        for _ in range(steps):
            applied.clear()
            lg, s = rn.decode_batch(toks, kvs)
            routed = {(int(l), int(e)) for l, e in zip(*np.nonzero(rn.session.counts.numpy()))}
            in_place = rn.moe.hand is not None and rn.moe.hand.in_place
            seen.append((dict(s.reads), s.flex_hits, dict(applied), routed, s.in_place_bytes / rn.cache.slot_bytes,
                         s.h2d_bytes, in_place))
            out.append(lg)
            toks = [int(x) for x in lg.argmax(-1)]
        return torch.stack(out), seen
    finally:
        close_runner(rn, st)


def _lanes3(model, **cfg):
    """Three prompts decoded together on a VRAM/host/disk mix -> logits."""
    return _lanes(model, 3, 5, 15, dict(max_running=3), **cfg)[0]


def test_lanes_of_three_gated_and_at_hand_are_the_partial_paths_bits(model):
    want = _lanes3(model, decode_at_hand=False)
    for cfg in (dict(decode_at_hand=True), dict(decode_at_hand=True, decode_gate="on")):
        assert torch.equal(_lanes3(model, **cfg), want), cfg


# (vram, host, extra): a VRAM/host/disk mix, and one with flex copies (one read thread: the same hits on every path)
MIXES = [(5, 15, {}), (2, 6, dict(flex_cache=True, max_context=1024, staging_slots=6, prefix_cache_bytes=0,
                                  read_threads=1))]


@pytest.mark.parametrize("n", [1, 4], ids=["one-row", "four-rows"])
def test_host_experts_in_place_or_banked_are_the_partial_paths_bits_and_reads(model, n):
    """engine.host_in_place (worker/at_hand.py): always = host slots in the at-hand table, never = copied into ring
    banks by the host path, auto = in place for one-row steps only. Lanes of n rows over VRAM/host/disk (and flex)
    mixes: the partial path's logits bit for bit and its reads per tier, every routed (layer, expert) computed once,
    the host bytes read in place counted only where the table held them, and a banked step copying more."""
    tiers = Counter()
    for vram, host, extra in MIXES:
        want, ref = _lanes(model, n, vram, host, extra, decode_at_hand=False)
        h2d = {}
        for policy in ("always", "never", "auto"):
            got, steps = _lanes(model, n, vram, host, extra, decode_at_hand=True, host_in_place=policy)
            assert torch.equal(got, want), (vram, host, policy, (got - want).abs().max().item())
            in_place = policy == "always" or (policy == "auto" and n == 1)
            for i, (step, step0) in enumerate(zip(steps, ref)):
                reads, hits, applied, routed, inb, h2, held = step
                assert (reads, hits) == step0[:2], (vram, host, policy, i)
                assert applied == {le: 1 for le in routed}, (vram, host, policy, i, applied, routed)
                assert held == in_place, (policy, n, i)
                # the torch kernels read an expert once per group: one slot's bytes for each routed host expert
                assert inb == (reads["host"] if in_place else 0), (policy, n, i, inb, reads)
            h2d[policy] = sum(x[5] for x in steps)
        # banked: the routed host experts' slots go through the copy engine on top of what in place copies
        banked = sum(st[0]["host"] for st in ref) > 0
        assert (h2d["never"] > h2d["always"]) == banked and h2d["auto"] == h2d["never" if n > 1 else "always"], h2d
        tiers.update({t: x for st in ref for t, x in st[0].items()})
        tiers["flex"] += sum(st[1] for st in ref)
    assert all(tiers[t] > 0 for t in ("vram", "host", "disk", "flex")), tiers          # every source was exercised


def test_armed_gates_are_drained_before_any_launch_that_is_not_a_replay(model, monkeypatch):
    """worker/gate.py's rule (the device gate's first CUDA run gave up on its first, eager, step: it launched every
    layer while earlier layers' gates spun, and eager launches block the host on the device): a gate armed because its
    part replays is drained before the step's next launch that is not a replay (an eager or captured part, a
    sequence's attention). On the CPU every part runs eagerly; here the gate parts of odd layers say they replay, so
    the runner arms them and defers their drains as on CUDA: each must come before the next eager launch, and the bits
    stay the partial path's. Fails with the lanes' before_host hook taken out (the drains then come after the step)."""
    from betelgeuse.worker.lanes import Lanes
    from betelgeuse.worker.moe_step import MoEStep
    want = _lanes3(model, decode_at_hand=False)
    events = []
    run, attend, drain = Lanes._run, Lanes._attend, MoEStep.gate_drain

    def traced_run(self, key, fn, *args):
        def traced(*a):
            events.append(("launch", key[0], key[1] if key[0] != "head" else -1))
            return fn(*a)
        return run(self, key, traced, *args)

    def traced_attend(self, l, s):
        events.append(("launch", "attend", l))
        return attend(self, l, s)

    def traced_drain(self, l, *a, armed=True, **kw):
        events.append(("drain", l, armed))
        return drain(self, l, *a, armed=armed, **kw)
    monkeypatch.setattr(Lanes, "_run", traced_run)
    monkeypatch.setattr(Lanes, "_attend", traced_attend)
    monkeypatch.setattr(Lanes, "replays", lambda self, name, l, kvs: name == "gate" and l % 2 == 1)
    monkeypatch.setattr(MoEStep, "gate_drain", traced_drain)
    got = _lanes3(model, decode_at_hand=True, decode_gate="on")
    assert torch.equal(got, want)
    pending: set = set()
    for ev in events:
        if ev[0] == "drain":
            pending.discard(ev[1])
        elif ev[1] == "gate" and ev[2] % 2 == 1:
            pending.add(ev[2])                      # armed: its drain may wait for the next launch that is no replay
        else:
            assert not pending, (ev, pending)       # an eager launch while an armed gate waits for the host
    drains = [ev for ev in events if ev[0] == "drain"]
    assert not pending and {ev[2] for ev in drains} == {True, False}, drains
    assert all(armed == (l % 2 == 1) for _, l, armed in drains), drains


def test_auto_banks_one_row_steps_for_the_types_measured_faster_banked(model, monkeypatch):
    """host_in_place auto with an expert type in at_hand.BANKED_TYPES (MXFP4: ds4-flash's pool decode ran faster
    banked): a one-row step banks its host experts as `never` does (the same bits, no host slot in the table, the
    same copies); the rule itself: types decide only under auto, rows still bank above IN_PLACE_MAX_ROWS."""
    from betelgeuse.worker import at_hand
    assert at_hand.host_in_place("auto", 1, frozenset({8})) and not at_hand.host_in_place("auto", 1, frozenset({8, 39}))
    assert not at_hand.host_in_place("auto", 2, frozenset({8})) and at_hand.host_in_place("always", 1, frozenset({39}))
    assert not at_hand.host_in_place("never", 1, frozenset({8}))
    vram, host, extra = MIXES[0]
    want, ref = _lanes(model, 1, vram, host, extra, decode_at_hand=False)
    never, never_steps = _lanes(model, 1, vram, host, extra, decode_at_hand=True, host_in_place="never")
    monkeypatch.setattr(at_hand, "BANKED_TYPES", frozenset(range(64)))     # whatever the test model's types are
    got, steps = _lanes(model, 1, vram, host, extra, decode_at_hand=True, host_in_place="auto")
    assert torch.equal(got, want) and torch.equal(never, want)
    assert sum(st[0]["host"] for st in ref) > 0                             # host experts were routed
    assert all(not st[6] and st[4] == 0 for st in steps), [(st[6], st[4]) for st in steps]   # banked, none in place
    assert sum(st[5] for st in steps) == sum(st[5] for st in never_steps)   # the same copies as never


@pytest.mark.parametrize("lanes", [False, True], ids=["solo", "lanes"])
def test_gated_drains_read_misses_in_place_keep_flex_copies_and_return_every_slot(model, lanes):
    """decode_gate's drain (worker/gate.py) names each missed disk expert at its staging slot for the misses' group and
    holds the slot until a later layer's marker; the flex cache copies up to the staging budget's spare slots after
    the step (MoEStep.gate_end), which later steps then hit; every slot goes back to the store by the pass's end (the
    store reclaims none: a leak would starve its loads). The bits are the partial path's throughout."""
    extra = dict(flex_cache=True, max_running=2, max_context=1024, staging_slots=32, prefix_cache_bytes=0,
                 read_threads=1)
    want, _ = _decode(model, 2, 3, extra, hand=False, lanes=lanes, steps=8)
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=True, decode_gate="on", decode_consolidate_every=0, **extra)
    try:
        assert rn.moe._keep_cap == 32 // 2 - 2 * ENGINE_SPEC["n_expert_used"] > 0
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(24, V, seed=5), kv)
        rn.settle()
        rn._static_decode = True
        fills0, tok, got, hits, disk = rn.moe.flex.stats.fills, int(lg[-1].argmax()), [], 0, 0
        for _ in range(8):
            lg, s = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            lg = lg.reshape(-1, V)[-1]
            got.append(lg)
            hits, disk = hits + s.flex_hits, disk + s.reads["disk"]
            tok = int(lg.argmax())
            assert not rn.moe._held and not rn.moe._keeping          # nothing held past a step
        assert torch.equal(torch.stack(got), want)
        assert disk > 0 and rn.moe.flex.stats.fills > fills0 and hits > 0, (disk, rn.moe.flex.stats, hits)
        rn.session.close_pass(False)
        assert st.counters.staging_reclaimed == 0 and not st._handed, (st.counters.staging_reclaimed, st._handed)
    finally:
        close_runner(rn, st)


def test_gate_on_refuses_a_staging_budget_a_drain_could_exhaust(model):
    """decode_gate = on with fewer staging slots than a step's misses of one layer need (half of them: the store reads
    ahead into the rest) is refused at attach with the figures and the setting to raise."""
    from betelgeuse.errors import BetelgeuseError
    extra = dict(max_running=2, staging_slots=6, decode_at_hand=True)
    with pytest.raises(BetelgeuseError, match=r"max_running 2 x 4 routed.*half the 6 staging slots hold 3.*staging_slots"):
        in_process_runner(model, 2, 3, decode_gate="on", **extra)



def _cap_flex(rn, slots: int):
    """The flex cache capped at `slots` expert slots (deploy/device/decode_host.py --flex-slots): the tiny model's
    disk experts outgrow it, so fills evict copies as ds4-flash's finite room does."""
    f = rn.moe.flex
    f.clear()
    f.per_chunk = min(f.per_chunk, slots)
    f.reserved = f.held + slots * f.slot_bytes


# the flex cache on with one read thread (the same copies, hence hits, on every path) and a 4-slot cap
CAPPED = dict(flex_cache=True, max_running=2, max_context=1024, staging_slots=6, prefix_cache_bytes=0, read_threads=1,
              decode_consolidate_every=0)


def _capped_decode(model, hand: bool, steps: int = 8, on_runner=None, slots: int = 4, **extra):
    """Greedy solo decode after a prompt with the flex cache capped at `slots` (fills evict) -> (logits [steps, V],
    the flex stats); on_runner(rn) before the prompt; extra: more engine settings."""
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=hand, **CAPPED, **extra)
    try:
        if on_runner is not None:
            on_runner(rn)
        kv = rn.new_cache(64)
        _cap_flex(rn, slots)                # after the state took its bytes (FlexCache.hold): `slots` of room left
        lg, _ = rn.forward(prompt(24, V, seed=5), kv)
        rn.settle()
        rn._static_decode = True
        tok, logits = int(lg[-1].argmax()), []
        for _ in range(steps):
            lg, _ = rn.forward([tok], kv, consolidate=False)
            logits.append(lg[-1])
            tok = int(lg[-1].argmax())
        return torch.stack(logits), rn.moe.flex.stats
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("host", ["auto", "never"])
def test_flex_evictions_refresh_the_table_without_blocking_the_host(model, ds4, monkeypatch, arch, slots, host):
    """A decode layer whose disk expert evicts a flex copy refreshes the at-hand table inside the step
    (MoEStep.hand_misses: a later layer's group must not read the rewritten slot), and every upload of the table is
    non-blocking: a copy_ from pageable memory with non_blocking False synchronizes the CUDA stream, so the host
    waited there for the layer's bank copies and misses' group, time the pass counted as its rest (issue 21,
    docs/benchmarks/cpu-host48). On the CPU: the mid-step refreshes happen, each upload's argument, and the logits
    are the partial path's bits with the same capped cache (the partial path copies a disk expert through a ring bank
    and keeps a flex copy after its group, FlexCache.keep; the at-hand path's miss layers copy it from its staging
    slot straight into the flex slot FlexCache.take gives and compute it there, MoEStep._direct_group, which must
    have run: with 2 slots some of a layer's disk experts find none and go through a bank in the same group; with the
    host experts banked, host_in_place "never", their bank is opened before the disk experts land and the group reads
    both: that must have run too)."""
    from betelgeuse.worker.moe_step import MoEStep
    from betelgeuse.worker.flex_cache import FlexCache
    model = {"qwen3moe": model, "deepseek4": ds4}[arch]
    uploads, hands, took = [], [], Counter()
    copy_ = torch.Tensor.copy_
    take = FlexCache.take

    def counted_take(self, layer, experts, *mine):
        out = take(self, layer, experts, *mine)
        took["flex"] += sum(s is not None for s in out)
        took["bank"] += sum(s is None for s in out)
        return out
    monkeypatch.setattr(FlexCache, "take", counted_take)
    direct = MoEStep._direct_group

    def counted_direct(self, l, r, es, srcs, slots, timing, opened, ls, snap, *sent):
        took["opened"] += opened is not None
        return direct(self, l, r, es, srcs, slots, timing, opened, ls, snap, *sent)
    monkeypatch.setattr(MoEStep, "_direct_group", counted_direct)

    def recorded(self, src, non_blocking=False):
        if any(self is h.dev for h in hands):
            uploads.append(non_blocking)
        return copy_(self, src, non_blocking=non_blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    foreach_copy_ = torch._foreach_copy_

    def recorded_foreach(dsts, srcs, non_blocking=False):
        # a miss layer's upload queued with its flex copies (MoEStep._direct_group: refresh(defer=True)); on the CPU
        # those copies are plain ones, so the flag must say what CUDA gets: non_blocking there (cache.is_cuda)
        if any(d is h.dev for d in dsts for h in hands):
            uploads.append(non_blocking or not hands[0].cache.is_cuda)
        return foreach_copy_(dsts, srcs, non_blocking=non_blocking)
    monkeypatch.setattr(torch, "_foreach_copy_", recorded_foreach)
    want, _ = _capped_decode(model, hand=False, slots=slots, host_in_place=host)
    assert not took, took                   # the partial path keeps its copies after the group
    steps = 8
    got, stats = _capped_decode(model, hand=True, steps=steps, on_runner=lambda rn: hands.append(rn.moe.hand),
                                slots=slots, host_in_place=host)
    assert stats.evictions > 0 and took["flex"] > 0 and (took["opened"] > 0) == (host == "never"), (stats, took)
    n = len(uploads)
    assert n > steps + 1, (n, stats)        # the prompt's and each step's start, and at least one inside a step
    assert all(uploads), uploads
    assert torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_a_banked_layers_flex_taken_disk_experts_send_the_table_with_their_copies(model, ds4, monkeypatch, arch):
    """A decode miss layer whose host experts are banked (host_in_place "never": ds4-flash's MXFP4 path) opens their
    bank before its disk experts land (MoEStep._hand_misses); where the flex cache takes every one of a batch's disk
    experts (MoEStep._direct_group, no slot of theirs in the bank), the group's slot table goes with their flex copies
    on the compute stream and the compute stream waits for the bank's host copies (ExpertCache.bank_wait): no
    copy-stream pass carrying the table alone (bank_copy with no slots: its stream switch, copy, record and wait,
    ~8 torch calls a miss layer on CUDA; issue 21, cpu-host65). Checked at every group the direct path applies: its
    device table row equals its host table (on the CPU the torch kernels read the host one, so the bits alone would
    not see a table left out), and the logits are the partial path's. Fails with the table left out of the flex
    copies where a bank is open, and with the table-only bank copy back."""
    from betelgeuse.worker.expert_cache import ExpertCache
    from betelgeuse.worker.moe_step import MoEStep
    model = {"qwen3moe": model, "deepseek4": ds4}[arch]
    seen = Counter()
    copy, wait, direct, apply = ExpertCache.bank_copy, ExpertCache.bank_wait, MoEStep._direct_group, MoEStep._apply
    inside = [False]

    def counted_copy(self, b, at, srcs, *a, **kw):
        seen["empty_copy" if not len(srcs) else "copy"] += 1
        return copy(self, b, at, srcs, *a, **kw)

    def counted_wait(self, b):
        seen["wait"] += inside[0]
        return wait(self, b)

    def counted_direct(self, l, r, es, srcs, slots, timing, opened, ls, snap, *sent):
        seen["opened"] += opened is not None
        inside[0] = opened is not None
        try:
            return direct(self, l, r, es, srcs, slots, timing, opened, ls, snap, *sent)
        finally:
            inside[0] = False

    def checked_apply(self, r, l, g, ls, pool=None):
        if inside[0]:       # the direct group's table: the device row as the host one (its copy queued before it)
            seen["checked"] += 1
            assert torch.equal(g.base_dev, torch.from_numpy(g.base_host)), (l, g.base_host, g.base_dev)
        return apply(self, r, l, g, ls, pool)
    want, _ = _capped_decode(model, hand=False, slots=4, host_in_place="never")
    monkeypatch.setattr(ExpertCache, "bank_copy", counted_copy)
    monkeypatch.setattr(ExpertCache, "bank_wait", counted_wait)
    monkeypatch.setattr(MoEStep, "_direct_group", counted_direct)
    monkeypatch.setattr(MoEStep, "_apply", checked_apply)
    got, _ = _capped_decode(model, hand=True, slots=4, host_in_place="never")
    assert seen["opened"] > 0 and seen["wait"] > 0 and seen["checked"] >= seen["opened"], seen
    assert seen["empty_copy"] == 0, seen
    assert torch.equal(got, want), (got - want).abs().max().item()


def test_a_log_of_more_adds_than_cells_is_rebuilt_not_patched(model, monkeypatch):
    """FlexCache.changed is a set (cpu-host60: at most one entry a cell) and FlexCache.logged its adds since the table
    last read it: where the adds outnumber the table's cells (prefills filling copies with no decode step between)
    refresh rebuilds the table whole, as the log's cap had it (a patch of that many entries costs more than the
    rebuild's numpy passes); up to that, it patches. Either way the table is the rebuild's. Fails with refresh
    patching whatever the adds' count."""
    from betelgeuse.worker.at_hand import AtHand
    patched = []
    patch = AtHand._patch
    monkeypatch.setattr(AtHand, "_patch", lambda self, snap, key: (patched.append(True), patch(self, snap, key))[1])
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=True, **CAPPED)
    try:
        kv = rn.new_cache(64)
        rn.forward(prompt(24, V, seed=5), kv)
        h, f, snap = rn.moe.hand, rn.moe.flex, rn.session.snap
        h.refresh(snap, rows=1, force=True)
        want = h.host.copy()
        for adds, patches in ((f.where.size + 1, False), (f.where.size, True)):
            patched.clear()
            f.changed, f.logged = {(0, 0), (1, 3)}, adds          # copies "changed" (none did: the same table)
            f.version += 1
            assert h.refresh(snap) and patched == ([True] if patches else []), (adds, patched)
            assert np.array_equal(h.host, want) and torch.equal(h.dev, torch.from_numpy(want))
            assert f.changed == set() and f.logged == 0          # taken by either
    finally:
        close_runner(rn, st)


def test_a_patched_table_is_the_rebuilt_one(model, monkeypatch):
    """Where only flex copies changed (inside a decode step after a miss layer's fill evicted one; a step's start
    after copies were made), refresh patches the changed entries (AtHand._patch); each patched table equals the whole
    rebuild's of the same state (refresh(force=True) right after it)."""
    from betelgeuse.worker.at_hand import AtHand
    patch, refresh = AtHand._patch, AtHand.refresh
    seen = []

    def checked(self, snap, key):
        out = patch(self, snap, key)
        patched = self.host.copy()
        refresh(self, snap, force=True)
        assert np.array_equal(self.host, patched), np.argwhere(self.host != patched)
        seen.append(inside[0])
        return out
    inside = [False]
    hand_misses = None

    def on_runner(rn):
        nonlocal hand_misses
        hand_misses = rn.moe.hand_misses

        def wrapped(*a, **kw):
            inside[0] = True
            try:
                return hand_misses(*a, **kw)
            finally:
                inside[0] = False
        rn.moe.hand_misses = wrapped
    monkeypatch.setattr(AtHand, "_patch", checked)
    _, stats = _capped_decode(model, hand=True, on_runner=on_runner)   # each miss layer's fill evicts a copy
    # patched inside the steps (a later layer's copy evicted) and at their starts (earlier layers': AtHand.stale)
    assert stats.evictions > 0 and any(seen), (stats, seen)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
@pytest.mark.parametrize("lanes", [False, True], ids=["solo", "lanes"])
def test_each_at_hand_group_reads_the_rebuilt_row_when_evictions_wait(model, ds4, monkeypatch, arch, lanes):
    """A miss layer l whose fill evicts only copies of layers <= l uploads no table inside the step (AtHand.stale(
    after=l): those rows' groups ran; the next step's refresh patches them). What must hold: every at-hand group
    reads its layer's row as the whole rebuild makes it from the state at that point (refresh(force=True) on the
    same state, its row l: host table, device table and the torch kernels' sources), and such skips happened (else
    the rule is not exercised). Fails with any(...) in stale(after=) replaced by `False` (a later layer's evicted
    copy left in its row)."""
    from betelgeuse.worker.at_hand import AtHand
    from betelgeuse.worker.moe_step import MoEStep
    model = {"qwen3moe": model, "deepseek4": ds4}[arch]
    seen = Counter()
    runner = []
    group = MoEStep.hand_group

    def checked_group(self, l, r):
        h = self.hand
        host, dev, srcs = h.host[l].copy(), h.dev[l].clone(), list(h.srcs[l])
        key, forgets, changed, logged = h._key, h.forgets, set(self.flex.changed), self.flex.logged
        h.refresh(runner[0].session.snap, force=True)       # the rebuild of the state now, then its row l
        assert np.array_equal(h.host[l], host), (l, np.argwhere(h.host[l] != host))
        assert torch.equal(h.dev[l], dev) and h.srcs[l] == srcs, l
        seen["groups"] += 1
        seen["lagging"] += forgets != self.flex.forgets          # an eviction waited: the rule was exercised
        # the rebuild stands for no upload of the step's own: put the waiting state back (the rows <= l of the
        # rebuild are the same entries a later patch makes: test_a_patched_table_is_the_rebuilt_one)
        h._key, h.forgets = key, forgets
        self.flex.changed, self.flex.logged = changed, logged
        return group(self, l, r)
    monkeypatch.setattr(MoEStep, "hand_group", checked_group)
    stale = AtHand.stale

    def counted_stale(self, after=-1):
        out = stale(self, after)
        if after >= 0 and stale(self) and not out:
            seen["skipped"] += 1
        return out
    monkeypatch.setattr(AtHand, "stale", counted_stale)
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=True, **CAPPED)
    runner.append(rn)
    try:
        kv = rn.new_cache(64)
        _cap_flex(rn, 4)
        lg, _ = rn.forward(prompt(24, V, seed=5), kv)
        rn.settle()
        rn._static_decode = True
        tok = int(lg[-1].argmax())
        for _ in range(8):
            lg, _ = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            tok = int(lg.reshape(-1, rn.mcfg.n_vocab)[-1].argmax())
        assert rn.moe.flex.stats.evictions > 0
    finally:
        close_runner(rn, st)
    assert seen["groups"] > 0 and seen["skipped"] > 0 and seen["lagging"] > 0, seen


def test_uploads_reuse_their_pinned_buffers_only_after_the_copy_ran(model, monkeypatch):
    """AtHand._upload's sources are UPLOAD_RING buffers made once (pinned on CUDA: no pinned allocation per upload,
    sync48), used in turn; a buffer whose last copy has not run (its event not done: faked here, the CPU has none) is
    waited for through the pass clock (blocked time) BEFORE it is overwritten, and the device table is the host's.
    What a reuse waits for is the compute-stream point made after the buffer's copy (ExpertCache.mark: a StreamPoint
    on CUDA, faked here)."""
    from betelgeuse.worker import at_hand as AH
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=True, **CAPPED)
    try:
        h = rn.moe.hand
        log = []

        class Ev:                           # a compute-stream point whose copy is still running until waited for
            def __init__(self, i):
                self.i, self.done = i, False

            def query(self):
                return self.done

            def synchronize(self):
                log.append(("wait", self.i))
                self.done = True

        waits = []
        made = iter(range(100))
        monkeypatch.setattr(h.cache, "mark", lambda: Ev(next(made) % AH.UPLOAD_RING), raising=False)
        h._wait = lambda fn, *a: (waits.append(fn), fn(*a))[1]
        copyto = AH.np.copyto

        def logged(dst, src):
            log.append(("write", next(i for i, b in enumerate(h._stage_np) if b is dst)))
            copyto(dst, src)
        monkeypatch.setattr(AH.np, "copyto", logged)
        bufs = [b.data_ptr() for b in h._stage]
        for k in range(AH.UPLOAD_RING + 2):
            tab = np.full(h.host.shape, k, dtype=np.int64)
            h._upload(tab)
            assert torch.equal(h.dev, torch.from_numpy(tab))
        assert [b.data_ptr() for b in h._stage] == bufs          # the same buffers throughout
        R = AH.UPLOAD_RING
        want = [("write", i) for i in range(R)] + [("wait", 0), ("write", 0), ("wait", 1), ("write", 1)]
        assert log == want and len(waits) == 2 and h.upload_waits == 2, log
    finally:
        close_runner(rn, st)


def test_a_deferred_upload_never_queued_is_made_by_the_next_refresh(model):
    """AtHand.refresh(defer=True) leaves the upload's copy to its caller (MoEStep._direct_group queues it with the flex
    copies); where the caller never queued it (its step failed in between) the device's table is stale although the
    host's is current, so the next refresh uploads even where nothing changed since (else it would return at once)."""
    rn, st = in_process_runner(model, 2, 3, decode_at_hand=True, **CAPPED)
    try:
        kv = rn.new_cache(64)
        rn.forward(prompt(24, V, seed=5), kv)
        h, snap = rn.moe.hand, rn.session.snap
        h.refresh(snap, rows=1, force=True)
        assert torch.equal(h.dev, torch.from_numpy(h.host))
        assert not h.refresh(snap)                       # nothing changed: no upload
        h.dev.fill_(-1)                                  # the device's table out of date (what an upload fixes)
        h.refresh(snap, force=True, defer=True)
        assert h.deferred is not None and not torch.equal(h.dev, torch.from_numpy(h.host))
        assert h.refresh(snap) and h.deferred is None    # never queued: uploaded now
        assert torch.equal(h.dev, torch.from_numpy(h.host))
    finally:
        close_runner(rn, st)
