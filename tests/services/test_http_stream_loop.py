"""A streamed HTTP answer is read on the event loop, not on a worker thread per token (services/http/output.events
over betelgeuse/worker/sequence.py RequestHandle.listen/ready).

- Exact count, end to end: the real engine and store in this process (the tiny synth model, CPU) behind the real
  HTTP server on a loopback socket; a streamed /v1/completions of N tokens makes exactly ONE
  anyio.to_thread.run_sync call (the submit), for N = 3 and N = 12; the same server over a handle that only
  iterates (the Engine protocol's minimum: the worker-thread path) makes 1 + N + 2 (one hop per token, the final
  event, the end): the count tells the two paths apart.
- The lost wakeup: events the engine thread queues while the reader is between its drain and its wait (injected
  exactly there, from another thread), and while the reader's consumer is suspended between two events (the loop
  running the engine's wakeup meanwhile), all arrive, in order, and the stream ends after the final event; a
  producer racing freely with the reader for 3000 events: all arrive, in order.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import anyio
import anyio.to_thread
import pytest

from betelgeuse import api
from betelgeuse.api import GenerateRequest
from betelgeuse.config import EngineConfig
from betelgeuse.errors import InvalidRequestError
from betelgeuse.worker.sequence import RequestHandle, Sequence

try:
    from tests import engine_helpers as eh
except ImportError:  # tests/ itself is on sys.path
    import engine_helpers as eh

from services.http import output


# ---- end to end: the count of worker-thread hops a streamed request ------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return eh.write_synth(tmp_path_factory.mktemp("stream-loop") / "engine.gguf", **eh.ENGINE_SPEC)


class IterOnly:
    """An engine whose handles only iterate (api.RequestHandle's required part: no listen/ready), over the real
    engine: what a plain Engine-protocol implementation gives the HTTP front."""

    class Handle:
        def __init__(self, h):
            self.h, self.reasoning, self.prompt_tokens = h, h.reasoning, h.prompt_tokens

        def __iter__(self):
            return iter(self.h)

        def cancel(self):
            self.h.cancel()

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def submit(self, req, deadline=None):
        return self.Handle(self.engine.submit(req, deadline))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def stream(port: int, n: int) -> tuple[int, str]:
    """One streamed greedy /v1/completions of n tokens over a real socket -> (token chunks, finish_reason)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "engine", "prompt": [5, 6, 7, 8], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, r.read()[:300]
        tokens, finish = 0, None
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            tokens += len((ch.get("logprobs") or {}).get("tokens") or ())
            finish = ch.get("finish_reason") or finish
        return tokens, finish
    finally:
        c.close()


def test_a_streamed_answer_makes_one_worker_thread_call(model, monkeypatch):
    from betelgeuse.settings import Settings
    from services.http.app import build_app
    from services.http.server import HttpServer, Limits
    calls = []
    real = anyio.to_thread.run_sync

    async def counted(fn, *args, **kw):
        calls.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kw)
    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    cfg = EngineConfig(model_path=str(model), vram_slots=4, host_slots=12, read_threads=1, max_context=256,
                       decode_consolidate_every=0, prefix_cache_bytes=0)
    with eh.engine_and_store(cfg) as eng:
        got = {}
        for name, engine in (("listen", eng), ("iterate", IterOnly(eng))):
            srv = HttpServer(build_app(engine), "127.0.0.1:0", Limits.of(Settings().worker))
            srv.start()
            try:
                for n in (3, 12):
                    calls.clear()
                    assert stream(srv.port, n) == (n, "length")
                    got[name, n] = list(calls)
            finally:
                srv.stop()
    # the event loop reads the engine's queue itself: the submit is the request's only worker-thread call
    assert got["listen", 3] == got["listen", 12] == ["submit"]
    # a handle that only iterates: one hop per event (n tokens + the final event) and one to see the end
    for n in (3, 12):
        assert got["iterate", n] == ["submit"] + ["nxt"] * (n + 2)


# ---- the lost wakeup -------------------------------------------------------------------------------------------

class _Flushed:
    """Sequence.finish's text stream: nothing held back."""
    stopped, text, matched = False, "", ""

    def flush(self):
        return ""


def _sequence() -> Sequence:
    return Sequence(request=GenerateRequest(prompt_ids=[1]), prompt_ids=[1], max_tokens=1 << 20,
                    stop_ids=frozenset(), stream=_Flushed())


def _token(i: int) -> api.TokenEvent:
    return api.TokenEvent(token_id=i, text=str(i), index=i)


def _on_engine_thread(fn):
    """fn() run on another thread (the engine's role: Sequence's puts and notify() there), waited for."""
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def _emit_or_finish(seq: Sequence, k: int, n: int):
    """Token k, or the final event once n tokens are out (Sequence.finish: the FinalEvent, then the end)."""
    _on_engine_thread(lambda: seq.emit(_token(k)) if k < n else seq.finish("length"))


class PutAfterDrain(RequestHandle):
    """The engine's handle, with the next event queued (from another thread, its notify() called there) right
    after each drain, i.e. exactly between the reader's drain and its wait, until n tokens and the final event are
    out: nothing else ever queues one, so a reader that lost one of these wakeups waits forever."""

    def __init__(self, seq, n):
        super().__init__(seq, lambda: None)
        self.n, self.sent = n, 0

    def ready(self):
        evs, end = super().ready()
        if not end and self.sent <= self.n:
            self.sent += 1
            _emit_or_finish(self.seq, self.sent - 1, self.n)
        return evs, end


async def _read_all(handle, between=None) -> list:
    out = []
    async for ev in output.events(handle):
        out.append(ev)
        if between is not None:
            await between(ev)
    return out


def run(coro, timeout: float = 30.0):
    """The coroutine on a fresh event loop; a reader that waits forever (a lost wakeup) fails at the timeout."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def test_an_event_queued_between_drain_and_wait_is_not_lost():
    n = 20
    seq = _sequence()
    h = PutAfterDrain(seq, n)
    evs = run(_read_all(h))
    assert [e.token_id for e in evs[:-1]] == list(range(n)) and isinstance(evs[-1], api.FinalEvent)
    assert h.sent == n + 1 and seq.notify is None and seq.cancelled      # listen(None) and cancel() at the end


def test_events_queued_while_the_consumer_is_suspended_arrive():
    """For each event the consumer gets, the engine thread queues the next one while the consumer is suspended
    (its own awaits let the loop run the engine's wakeup first): a reader that cleared its flag after handing the
    event on, not before its drain, would miss that wakeup and wait forever."""
    n = 20
    seq = _sequence()
    h = RequestHandle(seq, lambda: None)

    async def between(ev):
        if isinstance(ev, api.TokenEvent):
            _emit_or_finish(seq, ev.token_id + 1, n)
            for _ in range(3):
                await asyncio.sleep(0)          # the loop runs the waker's callback: the flag is set now

    seq.emit(_token(0))
    evs = run(_read_all(h, between))
    assert [e.token_id for e in evs[:-1]] == list(range(n))
    assert isinstance(evs[-1], api.FinalEvent) and evs[-1].finish_reason == "length"


def test_a_producer_racing_the_reader_loses_nothing():
    n = 3000
    seq = _sequence()
    h = RequestHandle(seq, lambda: None)

    def engine():
        for i in range(n):
            seq.emit(_token(i))
            if i % 7 == 0:
                time.sleep(0)                   # lets the GIL go: the reader runs mid-stream, between puts
        seq.finish("length")

    async def main():
        t = threading.Thread(target=engine)
        t.start()
        try:
            return await _read_all(h)
        finally:
            await anyio.to_thread.run_sync(t.join)
    evs = run(main())
    assert [e.token_id for e in evs[:-1]] == list(range(n)) and isinstance(evs[-1], api.FinalEvent)


def test_an_engine_error_ends_the_stream_as_its_error_event():
    seq = _sequence()
    h = RequestHandle(seq, lambda: None)
    seq.emit(_token(0))
    err = InvalidRequestError("bad")

    async def main():
        out = []
        async for ev in output.events(h):
            out.append(ev)
            if len(out) == 1:
                _on_engine_thread(lambda: seq.fail(err))
        return out
    assert run(main()) == [_token(0), err] and seq.cancelled


# ---- a client gone before the body starts --------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["2.4", "2.3"])
def test_a_client_gone_before_the_body_cancels_the_request(model, spec):
    """The response's start never reaches the client (ASGI 2.4: its send raises OSError; 2.3: the disconnect is seen
    while the start is being sent), so the stream's generator never starts and its own finally never runs:
    output.EventStream cancels the request anyway, and the real engine ends it (its final event "cancelled") instead
    of decoding its max_tokens for nobody (with Starlette's StreamingResponse: a FinalEvent after all of them,
    "length": both cases failed)."""
    cfg = EngineConfig(model_path=str(model), vram_slots=4, host_slots=12, read_threads=1, max_context=256,
                       decode_consolidate_every=0, prefix_cache_bytes=0)
    with eh.engine_and_store(cfg) as eng:
        handle = eng.submit(GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=200, ignore_eos=True))
        started = []

        async def body():
            started.append(True)
            async for ev in output.events(handle):
                yield "data: x\n\n"

        async def send(message):
            if spec == "2.4":
                raise OSError("connection reset by peer")
            await asyncio.Event().wait()                 # the start never goes out: the disconnect wins

        async def receive():
            return {"type": "http.disconnect"}

        async def run():
            resp = output.EventStream(body(), handle)
            try:
                await resp({"type": "http", "asgi": {"spec_version": spec}}, receive, send)
            except Exception:                            # noqa: BLE001 (2.4: Starlette's ClientDisconnect)
                pass
        asyncio.run(run())
        assert not started
        *tokens, final = list(handle)
        assert isinstance(final, api.FinalEvent) and final.finish_reason == "cancelled", final
        assert len(tokens) < 200
