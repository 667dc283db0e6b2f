"""Issue 9, items 1, 2, 5 and 6 in one process (fast): one request's failure is its own (invariant 7), sampling is
numerically safe for every accepted value, the work a request causes is bounded before admission, a stuck engine
is seen, and --memory-max never raises the cgroup's limit.

The engine is a real LLMEngine over a real ExpertStore (its memfd mapped twice) on the engine-test model; the
faults are injected at one sequence's boundary (its sampler, its pass) or between passes.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from betelgeuse import sampling
from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.errors import BudgetError, InternalError, InvalidRequestError
from engine_helpers import ENGINE_SPEC, prompt, write_synth

N_VOCAB = ENGINE_SPEC["n_vocab"]


# ---- item 1: the sampler -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1e-37, 1e-38, 1e-45, 5e-324, 1e-300])
def test_tiny_temperature_samples_the_best_token(t):
    """Before: logits / 1e-38 overflowed to inf, softmax gave NaN and multinomial raised inside the engine step."""
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        x = torch.randn(N_VOCAB, generator=g) * 4
        tok = sampling.sample(x, SamplingParams(temperature=t, seed=seed), sampling.make_generator(
            SamplingParams(seed=seed)))
        assert tok == int(x.argmax())


@pytest.mark.parametrize("t,top_k,top_p", [(2.0, 0, 1.0), (2.0, 5, 0.5), (1e-30, 3, 1e-9), (2.0, 10 ** 9, 1.0)])
def test_extreme_accepted_parameters_give_a_token(t, top_k, top_p):
    x = torch.randn(N_VOCAB, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, seed=3)
    tok = sampling.sample(x, p, sampling.make_generator(p))
    assert 0 <= tok < N_VOCAB


@pytest.mark.parametrize("t", [2.0000001, 9.0, 1e300, 1.7e308])
def test_temperatures_over_the_edge_limit_are_refused(t):
    """Issue 25: the limit is OpenAI's 2, on every edge (gRPC accepted 9 while HTTP refused it)."""
    with pytest.raises(InvalidRequestError, match="temperature"):
        sampling.validate(SamplingParams(temperature=t))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("t", [0.0, 0.7])
def test_non_finite_logits_are_an_internal_error(bad, t):
    x = torch.randn(N_VOCAB)
    if bad == "all -inf":
        x[:] = float("-inf")
    else:
        x[7] = bad
    with pytest.raises(InternalError, match="non-finite|masked"):
        sampling.sample(x, SamplingParams(temperature=t, seed=1), sampling.make_generator(SamplingParams(seed=1)))


@pytest.mark.parametrize("t", [0.0, 1e-38, 0.7])
def test_masked_logits_are_not_an_error(t):
    """-inf is a masked token (a grammar's mask): never sampled, never an error."""
    x = torch.randn(N_VOCAB)
    keep = [3, 11, 40]
    mask = torch.full_like(x, float("-inf"))
    mask[keep] = 0
    for seed in range(10):
        p = SamplingParams(temperature=t, seed=seed)
        assert sampling.sample(x + mask, p, sampling.make_generator(p)) in keep


# ---- an in-process engine ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("isolation") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def engine(engine_model):
    from betelgeuse.assembly import open_engine, open_store
    from betelgeuse.config import EngineConfig
    cfg = EngineConfig(model_path=str(engine_model), vram_slots=5, host_slots=15, max_running=2, max_queue=16,
                       max_prompt_bytes=4096, read_threads=2)
    store = open_store(cfg)
    eng = open_engine(cfg, store)
    eng.test_client = store.client
    yield eng
    eng.close()
    store.close()


def _run(engine, req: GenerateRequest):
    """(token ids, finish reason) or the exception the handle raised."""
    try:
        events = list(engine.submit(req))
    except Exception as e:                      # noqa: BLE001
        return e
    return list(events[-1].token_ids), events[-1].finish_reason


def _req(i: int, seed: int | None = None, temperature: float = 0.0, n: int = 4) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt(12 + i, N_VOCAB, seed=100 + i), max_tokens=n, ignore_eos=True,
                           sampling=SamplingParams(temperature=temperature, seed=seed))


def _concurrently(engine, reqs):
    out = [None] * len(reqs)

    def one(i):
        out[i] = _run(engine, reqs[i])
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


N_REQ = 8


@pytest.fixture(scope="module")
def alone(engine):
    """Each request's result sent alone (the single-client reference)."""
    return [_run(engine, _req(i)) for i in range(N_REQ)]


def test_a_failing_sequence_fails_alone(engine, alone, monkeypatch):
    """A sampler exception in one sequence (seed 666) fails that request with InternalError; the 11 others,
    running beside it and waiting behind it, finish with the tokens they give alone. Before: the engine's
    catch-all failed every running and waiting request ("internal error in the engine")."""
    reqs = [_req(i) for i in range(N_REQ)]
    reqs[4] = _req(4, seed=666, temperature=0.5)
    real = sampling.sample

    def faulty(logits, params, generator=None):
        if params.seed == 666:
            raise RuntimeError("injected sampler fault")
        return real(logits, params, generator)
    monkeypatch.setattr("betelgeuse.worker.outputs.sample", faulty)
    got = _concurrently(engine, reqs)
    assert isinstance(got[4], InternalError), got[4]
    assert [g for i, g in enumerate(got) if i != 4] == [a for i, a in enumerate(alone) if i != 4]
    monkeypatch.undo()
    assert _run(engine, reqs[0]) == alone[0]                        # and the engine still serves


def test_a_tiny_temperature_request_does_not_hurt_others(engine, alone):
    """The issue's case: temperature 1e-38 among greedy requests. All succeed; the tiny one is greedy."""
    reqs = [_req(i) for i in range(N_REQ)]
    reqs[3] = _req(3, seed=5, temperature=1e-38)
    got = _concurrently(engine, reqs)
    assert got == alone


def test_an_unattributable_step_failure_spares_the_waiting_and_the_engine(engine, alone, monkeypatch):
    """A failure between passes (not inside one sequence) fails the running sequences with InternalError, never
    the waiting ones, and the engine goes on."""
    reqs = [_req(i) for i in range(6)]
    calls = {"n": 0}
    real = type(engine)._gauges

    def faulty(self):
        if threading.current_thread().name != "engine":            # submit() calls it too
            return real(self)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault between passes")
        return real(self)
    monkeypatch.setattr(type(engine), "_gauges", faulty)
    got = _concurrently(engine, reqs)
    failed = [g for g in got if isinstance(g, Exception)]
    assert failed and all(isinstance(g, InternalError) for g in failed), got
    assert len(failed) <= engine.cfg.max_running                     # only the pass's sequences
    assert all(g == a for g, a in zip(got, alone) if not isinstance(g, Exception))
    monkeypatch.undo()
    assert _run(engine, reqs[0]) == alone[0]
    assert engine._thread.is_alive()


def test_a_pass_exception_fails_its_sequence_alone(engine, alone, monkeypatch):
    reqs = [_req(i) for i in range(4)]
    # a prompt never sent before: a repeated one is served whole from the prefix cache, with no pass to fail
    reqs[2] = GenerateRequest(prompt_ids=prompt(14, N_VOCAB, seed=999), max_tokens=4, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0))
    real = engine.runner.forward
    bad_first = reqs[2].prompt_ids[0]

    def faulty(ids, kv, **kw):
        if len(ids) > 1 and ids[0] == bad_first:
            raise FloatingPointError("injected fault in one sequence's pass")
        return real(ids, kv, **kw)
    monkeypatch.setattr(engine.runner, "forward", faulty)
    got = _concurrently(engine, reqs)
    assert isinstance(got[2], InternalError)
    assert [g for i, g in enumerate(got) if i != 2] == [a for i, a in enumerate(alone[:4]) if i != 2]


def test_a_failing_release_still_ends_the_request(engine, monkeypatch):
    """Freeing a finished sequence (its decode graphs, its prefix blocks) that raises is logged, and the request still
    gets its final event. Before: the sequence had left the running set, so the engine's catch-all could not fail it,
    and the client waited forever."""
    def boom(kv):
        raise RuntimeError("injected fault in release")
    monkeypatch.setattr(engine.runner, "release", boom)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _run(engine, _req(9, n=3))), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the request never ended"
    assert out["r"][1] == "length" and len(out["r"][0]) == 3
    # and the end-of-request rule still ran: an idle worker holds no store pass open (the directory not frozen)
    t_end = time.monotonic() + 5
    while engine.runner.session.pass_open and time.monotonic() < t_end:
        time.sleep(0.02)
    assert not engine.runner.session.pass_open


# ---- item 2: bounded work before admission ------------------------------------------------------------------------

def test_oversized_prompts_are_refused_before_tokenizing(engine, monkeypatch):
    """max_prompt_bytes (4096 here) is checked on the UTF-8 bytes before the tokenizer runs: a 3.9 MB prompt costs
    nothing. Before: it was tokenized in full (seconds of CPU, GBs of RSS) and refused only by token count."""
    calls = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    big = "word " * 800_000
    t0 = time.monotonic()
    for req in (GenerateRequest(prompt_text=big), GenerateRequest(messages=[{"role": "user", "content": big}])):
        with pytest.raises(InvalidRequestError, match="max_prompt_bytes"):
            engine.submit(req)
    with pytest.raises(InvalidRequestError, match="max_prompt_bytes"):
        engine.tokenize(big)
    assert time.monotonic() - t0 < 1.0 and not calls
    with pytest.raises(InvalidRequestError, match="does not fit the context"):
        engine.submit(GenerateRequest(prompt_ids=[5] * 100_000))
    assert engine.tokenize("hello world")                            # small ones still work
    assert calls


# ---- item 5: a stuck engine is seen (watchdog) -------------------------------------------------------------------

def test_an_engine_stuck_in_a_store_call_is_stalled(engine):
    """The worker feeds the systemd watchdog only while the engine loop turns (engine.stalled); a pass blocked in a
    store call stops it. Before: worker_main pinged the watchdog whatever the engine thread did."""
    client = engine.test_client
    gate = threading.Event()
    real = client.begin_pass
    client.begin_pass = lambda wait=True: (gate.wait(30), real(wait))[1]
    try:
        h = engine.submit(_req(0, n=2))
        time.sleep(1.5)
        assert engine.stalled(1.0)
    finally:
        gate.set()
        client.begin_pass = real
    list(h)
    time.sleep(0.6)
    assert not engine.stalled(1.0)


# ---- item 6: the effective memory budget -------------------------------------------------------------------------

def test_memory_max_above_the_cgroup_limit_does_not_replace_it(engine_model):
    """--memory-max 64G under a 64 MiB cgroup: the plan uses 64 MiB and refuses with the numbers. Before: the flag
    replaced the limit, the check passed, and the store was OOM-killed pre-faulting the arena."""
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.store.plan import plan_slots
    f = GGUFModelFile.open(str(engine_model))
    try:
        cfg = EngineConfig(model_path=str(engine_model), vram_slots=5, host_slots=15, memory_max=64 << 30,
                           worker_reserve=0)
        assert plan_slots(f, cfg, None).memory_limit == 64 << 30
        with pytest.raises(BudgetError, match="memory limit"):
            plan_slots(f, cfg, 64 << 20, 60 << 20)
        small = EngineConfig(model_path=str(engine_model), vram_slots=5, host_slots=15, memory_max=1 << 30,
                             worker_reserve=0)
        assert plan_slots(f, small, 8 << 30).memory_limit == 1 << 30    # the flag still tightens
    finally:
        f.close()
