"""A consolidation does not stall decode: its slots fill in the background while decode passes run on the
placement they have, and it is applied at a later BeginPass once its bytes landed (a prefill still waits).

On the benchmark geometry a consolidation reads 1-3 s from disk (gpu-agents6's store log: 2,979 ms after the
measured prompt), and the first decode pass used to wait for all of it. The invariants that keep this exact: a host
slot that changes hands leaves its old owner in the directory before its new bytes are written (no pass ever reads
a slot being filled), and the new placement appears in one directory change between passes."""

import threading
import time

import numpy as np
import torch

from betelgeuse.store.store import TIER_DISK, TIER_VRAM
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

import pytest

PROMPT = prompt(40, ENGINE_SPEC["n_vocab"], seed=3)
STEPS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("async") / "engine.gguf", **ENGINE_SPEC)


def _gate_fills(store):
    """Hold every consolidation's fill (its reads and copies into host slots) until gate.set()."""
    gate, orig = threading.Event(), store._fill_consolidation

    def fill(moves):
        gate.wait(30)
        orig(moves)
    store._fill_consolidation = fill
    return gate


def _decode(rn, kv, lg, steps):
    out = []
    for _ in range(steps):
        lg, st = rn.decode_batch([int(lg[-1].argmax())], [kv])
        out.append(lg[0])
    return torch.stack(out), st


@pytest.mark.parametrize("backing", [True, False])
def test_decode_runs_while_a_consolidation_fills(model, backing):
    # the reference: the same prompt and decode with every consolidation applied before the next pass
    rn, st = in_process_runner(model, 4, 8, vram_backing=backing)
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(PROMPT, kv)
        rn.settle()
        want, _ = _decode(rn, kv, lg, STEPS)
    finally:
        close_runner(rn, st)

    rn, store = in_process_runner(model, 4, 8, vram_backing=backing)
    try:
        warm = rn.new_cache(64)
        rn.forward(prompt(24, ENGINE_SPEC["n_vocab"], seed=11), warm)       # a placement to move away from
        rn.settle()
        gate = _gate_fills(store)
        kv = rn.new_cache(64)
        lg, _ = rn.forward(PROMPT, kv)                                        # consolidates: fills are held
        assert store.consolidating
        epoch = store.directory.epoch
        # no slot being filled is referenced by the directory while its bytes are written
        moves = store._moves
        filling = {(l, s) for l, e, _, s in moves if s >= 0 and store._host_owner[l, s] < 0}
        assert filling
        snap = store.directory.snapshot()
        for l, s in filling:
            assert not (snap["host_slot"][l] == s).any(), (l, s)
        got, st = _decode(rn, kv, lg, STEPS // 2)                             # decode does not wait
        assert store.consolidating and store.directory.epoch == epoch      # nothing applied mid-fill
        # while the fill runs (the directory's header says so) a decode keeps its store pass: no pass messages
        assert store.directory.filling and not {"begin_pass", "end_pass"} & set(st.store_rpc), st.store_rpc
        gate.set()
        store._consolidating.join(30)
        rest, _ = _decode(rn, kv, got[-1:], STEPS - STEPS // 2)
        assert not store.consolidating and store.directory.epoch > epoch   # applied at a later BeginPass
        assert torch.equal(torch.cat([got, rest]), want)                   # the same bits throughout
        snap = store.directory.snapshot()
        for l in range(store.plan.n_layer):                                 # one holder per host slot
            slots = snap["host_slot"][l][snap["host_slot"][l] >= 0]
            assert len(set(slots.tolist())) == len(slots)
            owners = store._host_owner[l]
            for e in np.nonzero(snap["host_slot"][l] >= 0)[0]:
                assert owners[snap["host_slot"][l][e]] == e
        if not backing:                                                     # VRAM experts keep no slot
            assert ((snap["tier"] == TIER_VRAM) & (snap["host_slot"] < 0)).any()
        assert (snap["tier"] != TIER_DISK).any()
    finally:
        close_runner(rn, store)


def test_a_prefill_waits_for_the_fill(model):
    """A prefill's BeginPass waits for a consolidation still filling (its experts are what it places)."""
    rn, store = in_process_runner(model, 4, 8)
    try:
        rn.forward(prompt(24, ENGINE_SPEC["n_vocab"], seed=11), rn.new_cache(64))
        rn.settle()
        gate = _gate_fills(store)
        rn.forward(PROMPT, rn.new_cache(64))
        assert store.consolidating
        applied = store.counters.consolidations
        threading.Timer(0.3, gate.set).start()
        t = time.perf_counter()
        rn.forward(PROMPT[:8], rn.new_cache(64))                              # waits, then applies it
        assert time.perf_counter() - t >= 0.25 and store.counters.consolidations == applied + 1
    finally:
        close_runner(rn, store)


def test_request_end_consolidation_does_not_wait_for_a_fill(model):
    """A request's end (runner.consolidate, store pass closed or open) returns while the prefill's consolidation is
    still filling: waiting held the engine thread for its disk reads (~1.4 s before a repeated prompt's cached first
    token on the GPU, gpu-agents12-loop); its usage goes into a later consolidation, and settle() still waits."""
    rn, store = in_process_runner(model, 4, 8)
    gate = _gate_fills(store)
    try:
        kv = rn.new_cache(64)
        rn.forward(PROMPT, kv)                           # closes with a consolidation: its fill is held
        assert store.consolidating
        for open_pass in (False, True):
            if open_pass:
                rn.forward([5], kv, consolidate=False)   # a decode pass keeps the store pass open
            t = time.perf_counter()
            rn.consolidate()
            assert time.perf_counter() - t < 5 and store.consolidating and not rn.session.pass_open
        done = threading.Thread(target=rn.settle)
        done.start()
        done.join(0.5)
        assert done.is_alive()                          # settle waits for the held fill
        gate.set()
        done.join(30)
        assert not done.is_alive() and not store.consolidating
    finally:
        gate.set()
        close_runner(rn, store)


def test_request_done_consolidates_only_when_no_other_sequence_runs(model):
    """runner.request_done (the engine's end of a request): the sequence lets go of its lane at once; its decode usage
    is consolidated only when it decoded and nothing else runs, else the open store pass goes on (the running
    batch's periodic decode consolidation counts that usage); when nothing else runs the pass closes either way."""
    rn, store = in_process_runner(model, 4, 8, max_running=2)
    rn._static_decode = True                             # the lanes, as CUDA decodes (eagerly on the CPU)
    try:
        kvs, toks = [], []
        for s in (3, 4):
            kv = rn.new_cache(64)
            lg, _ = rn.forward(prompt(20, ENGINE_SPEC["n_vocab"], seed=s), kv)
            kvs.append(kv)
            toks.append(int(lg[-1].argmax()))
        rn.settle()
        rn.decode_batch(toks, kvs)
        assert rn.session.pass_open and kvs[0].uid in rn._lanes.seqs
        rn.request_done(kvs[0], others_running=True)
        assert rn.session.pass_open and kvs[0].uid not in rn._lanes.seqs and kvs[1].uid in rn._lanes.seqs
        score = store.score.copy()
        rn.request_done(kvs[1], others_running=False, decoded=False)     # cancelled: nothing consolidated, but
        assert not rn.session.pass_open and not rn._lanes.seqs          # an idle worker never holds a pass open
        assert store._usage.sum() > 0 and np.array_equal(store.score, score)   # the usage sent, not consolidated
        rn.request_done(kvs[1], others_running=False)
        assert not rn.session.pass_open and store._usage.sum() == 0     # sent and consolidated:
        assert not np.array_equal(store.score, score)                   # the scores took the decode usage
    finally:
        close_runner(rn, store)
