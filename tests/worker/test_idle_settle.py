"""The serving engine settles the store while idle (LLMEngine._settle_idle, StoreSession.settle_step), through a real
store process whose disk reads are slowed (BETELGEUSE_TEST_READ_JITTER), pool routing, no VRAM backing copies:

- after a cold request and an idle gap, the same request again reads nothing from disk: its consolidation was
  applied and the VRAM tier it placed filled (from disk: no host copies) while the engine had nothing to do. Without
  idle settling the repeated request's pass pays those fills itself (fill_disk > 0): the check can fail.
- a request that arrives while the engine settles waits for at most one settle step (one layer's fills): its pass
  fills the layers that were left.
Pool routing depends on the placement, not on where (or when) an expert was filled: in all three cases the repeated
request's tokens and logprobs are the same."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from betelgeuse.api import FinalEvent, GenerateRequest, SamplingParams, TokenEvent
from betelgeuse.assembly import open_engine
from betelgeuse.config import EngineConfig
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.store.reader import JITTER_ENV
from services.assembly import open_store

PROMPT = [(7 * i + 3) % 500 for i in range(64)]


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    path = tmp_path_factory.mktemp("idle_settle") / "ds4-16.gguf"
    write_model(path, replace(spec_from_preset("ds4-tiny"), n_expert=16, n_expert_used=4, seed=2), progress=False)
    return path


def _engine(path, monkeypatch):
    monkeypatch.setenv(JITTER_ENV, "21:20")        # every disk read held back up to 20 ms: fills take a while
    cfg = EngineConfig(model_path=str(path), vram_slots=3, host_slots=5, routing="pool", read_threads=2,
                       vram_backing=False, max_context=128, prefix_cache_bytes=0, prefix_host_bytes=0)
    store = open_store(cfg, "process")
    try:
        return open_engine(cfg, store), store
    except BaseException:
        store.close()
        raise


def _ask(eng, passes: list, queued=None, n: int = 3) -> tuple[list, list]:
    """The prompt, greedy, n tokens -> ([(token, logprob)], the PassStats of its passes). queued(): called once the
    request is in the engine's queue. A cold request of n = 1 ends on its prefill's consolidation still filling in
    the store (no decode pass applied it), the case idle settling is for."""
    passes.clear()
    req = GenerateRequest(prompt_ids=PROMPT, max_tokens=n, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0, logprobs=True))
    handle = eng.submit(req)
    if queued is not None:
        queued()
    toks = []
    for ev in handle:
        if isinstance(ev, TokenEvent):
            toks.append((ev.token_id, ev.logprob))
        assert not isinstance(ev, FinalEvent) or ev.finish_reason == "length", ev
    return toks, list(passes)


def _wait_settled(eng, timeout: float = 60.0):
    t = time.monotonic()
    while eng._unsettled:
        assert time.monotonic() - t < timeout, "the engine did not settle while idle"
        time.sleep(0.01)


def _cold_gap_warm(eng, settle: bool) -> tuple[list, list]:
    """A cold request, an idle gap (until the engine settled, or 1 s without idle settling), the same request again
    -> (its tokens, its passes' PassStats)."""
    eng.settle_idle = settle
    passes: list = []
    eng.on_pass = passes.append
    _ask(eng, passes, n=1)
    if settle:
        _wait_settled(eng)
    else:
        time.sleep(1.0)                              # the same idle gap: the consolidation's reads land meanwhile
    return _ask(eng, passes)


@pytest.fixture(scope="module")
def unsettled(ds4):
    """The repeated request without idle settling (the engine's behaviour before it): (tokens, passes)."""
    mp = pytest.MonkeyPatch()
    try:
        eng, store = _engine(ds4, mp)
        try:
            return _cold_gap_warm(eng, False) + (eng.settle_steps,)
        finally:
            eng.close()
            store.close()
    finally:
        mp.undo()


def test_a_repeated_request_after_an_idle_gap_reads_nothing(ds4, monkeypatch, unsettled):
    # without idle settling the repeated request's prefill pays the VRAM fills (no host copies: from disk)
    want, st, steps = unsettled
    assert steps == 0 and st[0].kind == "prefill"
    assert st[0].fill_disk > 0 and st[0].disk_bytes > 0, (st[0].fill_disk, st[0].disk_bytes)
    eng, store = _engine(ds4, monkeypatch)
    try:
        got, st = _cold_gap_warm(eng, True)
        assert eng.settle_steps > 0
    finally:
        eng.close()
        store.close()
    # pool routing depends on the placement, which is the same: the tokens are bit-identical
    assert got == want
    assert st[0].kind == "prefill" and st[0].vram_filled == 0 and st[0].reads["vram"] > 0
    for p in st:
        assert p.fill_disk == 0 and p.reads["disk"] == 0 and p.disk_bytes == 0, (p.kind, p.fill_disk, p.reads,
                                                                                  p.disk_bytes)


def test_a_request_arriving_while_settling_waits_one_step_at_most(ds4, monkeypatch, unsettled):
    """The first settle step that fills a layer holds until the request is queued: the engine then takes no further
    step (it checks the queue between steps), and the request's first pass fills the layers that were left."""
    eng, store = _engine(ds4, monkeypatch)
    try:
        passes: list = []
        eng.on_pass = passes.append
        steps: list = []                             # (result, layers still unfilled after it) per settle step
        first, queued = threading.Event(), threading.Event()
        real, s = eng.runner.settle_step, eng.runner.session

        late: list = []                              # settle steps between the request's arrival and its first pass

        def step():                                  # on the engine thread
            if queued.is_set() and not passes:
                late.append(True)
            got = real()
            steps.append((got, len(s.cache.unsynced_layers(s.directory.snapshot(), s.directory.epoch))))
            if got == "step" and not first.is_set():
                first.set()
                assert queued.wait(60)
            return got
        eng.runner.settle_step = step
        _ask(eng, passes, n=1)
        assert first.wait(60), steps
        n = len(steps)
        warm, st = _ask(eng, passes, queued.set)
        assert warm == unsettled[0]                  # the same placement, partly filled while idle: the same tokens
        assert steps[n - 1][0] == "step" and steps[n - 1][1] > 0, steps     # layers were left to fill ...
        assert st[0].kind == "prefill" and st[0].fill_disk > 0, (st[0].fill_disk, steps)   # ... by the request
        assert not late, steps                       # it waited for the one step in progress, no further one
    finally:
        eng.close()
        store.close()
