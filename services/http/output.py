"""A chat completion's output as every API front needs it: reasoning, answer text and tool calls, split in the
model's own dialect (betelgeuse.reasoning), whole or streamed. Chat Completions, Anthropic Messages and OpenAI
Responses differ only in how they spell these parts.

    ans = collect(engine, req)                        # the whole completion (blocking: run it on a worker thread)
    ans = await answer(engine, req, request)          # the same from an endpoint: the client leaving cancels it
    async for kind, x in parts(engine, req, handle):  # "reasoning" | "content" (str), "tool_call" (ToolCall),
        ...                                           # "token" (TokenEvent), "final" (FinalEvent), "error" (exc)
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
import weakref
from dataclasses import dataclass, field

import anyio
from fastapi.responses import StreamingResponse

from betelgeuse import api
from betelgeuse.errors import BetelgeuseError
from betelgeuse.reasoning import QWEN3, OutputParser, collect as collect_items

log = logging.getLogger("betelgeuse.http")


def parses_tools(req: api.GenerateRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def parser(engine, req: api.GenerateRequest, handle) -> OutputParser | None:
    """The output parser of a chat request (None for raw text prompts: their output is only text)."""
    if req.messages is None:
        return None
    return OutputParser(getattr(engine, "dialect", QWEN3), bool(getattr(handle, "reasoning", False)),
                        tools=parses_tools(req))


def submit(engine, req: api.GenerateRequest):
    req.request_id = req.request_id or uuid.uuid4().hex
    return engine.submit(req)


@dataclass(slots=True)
class Answer:
    final: api.FinalEvent
    reasoning: str = ""
    content: str = ""
    calls: list[api.ToolCall] = field(default_factory=list)
    tokens: list[api.TokenEvent] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """The engine's, with "tool_calls" when the answer has calls (a stop string may end a call's block)."""
        r = self.final.finish_reason
        return "tool_calls" if self.calls and r == "stop" else r


def collect(engine, req: api.GenerateRequest, handle=None) -> Answer:
    """Submit (unless given the handle) and drain one request; its output split (blocking)."""
    handle = handle or submit(engine, req)
    tokens, final = [], None
    try:
        for ev in handle:
            if isinstance(ev, api.TokenEvent):
                tokens.append(ev)
            else:
                final = ev
    finally:
        handle.cancel()
    assert final is not None
    p = parser(engine, req, handle)
    text = final.text + final.tail
    if p is None:
        return Answer(final, content=text, tokens=tokens)
    got = collect_items(p.push(text) + p.flush())
    return Answer(final, got.reasoning, got.content, final.tool_calls or got.calls, tokens)


class _Waker:
    """One per event loop: sets streams' asyncio.Events from the engine thread. notify(flag) runs on the engine
    thread after each event it queues (RequestHandle.listen): it appends the stream's flag and schedules one
    call_soon_threadsafe (one byte on the loop's self-pipe, one loop wakeup) unless one is already pending, so a
    decode step that feeds B streams before the loop runs costs the engine thread one write, not B; the loop then
    sets every flag due. No lock: `due` is one deque, never replaced (deque.append / popleft are atomic), and
    `pending` is cleared BEFORE the loop pops, so a flag appended after the pops finds pending False and schedules
    again, and one appended before them is popped. (A list swapped for a new one lost a flag: the engine thread
    could read the old list, lose the GIL, and append to it after the loop's swap had taken it.) The loop is held
    weakly (the waker is _wakers' value for that loop: a strong reference would keep the key alive)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)
        self.due: collections.deque[asyncio.Event] = collections.deque()
        self.pending = False

    def notify(self, flag: asyncio.Event):            # the engine thread
        self.due.append(flag)
        if self.pending:
            return
        self.pending = True
        loop = self.loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._run)
        except RuntimeError:                        # the loop is closed (the server stopped): no one to wake
            pass

    def _run(self):                                   # the loop
        self.pending = False
        due = self.due
        while due:
            due.popleft().set()


_wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # loop -> _Waker


def _waker() -> _Waker:
    loop = asyncio.get_running_loop()
    w = _wakers.get(loop)
    if w is None:
        w = _wakers[loop] = _Waker(loop)
    return w


def _log_bug(e: BaseException):
    """An exception that is not the engine's own error is a bug: logged here, on one line (the stream's error
    event only points at the log)."""
    if not isinstance(e, BetelgeuseError):
        log.error("internal error in a streamed answer", exc_info=e)


class EventStream(StreamingResponse):
    """A submitted request's server-sent events (`content`: the front's async generator over events(handle)). The
    request is cancelled in the engine however the response ends: the generator's own finally does it once it has
    started, but a client that leaves before the body starts (its send of the response start fails, or the
    disconnect is seen first) leaves the generator unstarted, and its finally never runs: the engine would decode it
    to max_tokens for nobody. cancel() is idempotent (a finished request ignores it)."""

    def __init__(self, content, handle):
        super().__init__(content, media_type="text/event-stream")
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()


async def events(handle):
    """The handle's events as they come; an exception is yielded, not raised (a bug is logged here, once), and
    ends the stream. Leaving early (client gone) cancels the request in the engine.

    A handle with listen()/ready() (the engine's RequestHandle) is read on the event loop itself: the engine
    thread's notify sets this stream's flag (through the loop's _Waker), the loop takes everything queued
    (ready(), never blocking) and waits again; the flag is cleared before each drain, so an event queued between
    the drain and the wait finds it set (nothing lost). No worker thread per token: one loop wakeup, at most.
    Any other handle (an Engine protocol's plain iterator) is pulled on worker threads, one hop an event."""
    if not hasattr(handle, "listen"):
        async for ev in _pulled(handle):
            yield ev
        return
    waker, flag = _waker(), asyncio.Event()
    handle.listen(lambda: waker.notify(flag))
    try:
        while True:
            flag.clear()                            # before the drain: a put after it sets the flag again
            try:
                evs, end = handle.ready()
            except Exception as e:                  # noqa: BLE001 (a bug: ready() raises nothing by contract)
                evs, end = [e], True
            for ev in evs:
                if isinstance(ev, BaseException):
                    _log_bug(ev)                    # before the yield: a consumer may stop at it
                    yield ev
                    return
                yield ev
            if end:
                return
            await flag.wait()                       # set already if anything was queued since the clear
    finally:
        handle.listen(None)
        handle.cancel()


async def _pulled(handle):
    it = iter(handle)
    done = object()

    def nxt():
        try:
            return next(it, done)
        except BaseException as e:       # noqa: BLE001 (a BetelgeuseError from the engine, or a bug)
            return e
    try:
        while True:
            ev = await anyio.to_thread.run_sync(nxt, abandon_on_cancel=True)
            if ev is done:
                return
            if isinstance(ev, BaseException):
                _log_bug(ev)
                yield ev
                return
            yield ev
    finally:
        handle.cancel()


async def answer(engine, req: api.GenerateRequest, request) -> Answer:
    """The whole answer of a non-streamed HTTP request (submit and collect on worker threads). Meanwhile the
    connection is watched: a client that leaves (ASGI http.disconnect) cancels the request in the engine at once,
    which then stops between layers; the answer (finish_reason "cancelled") goes nowhere."""
    handle = await anyio.to_thread.run_sync(submit, engine, req)    # errors before any work: a status

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()
    ans = err = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            ans = await anyio.to_thread.run_sync(collect, engine, req, handle)
        except Exception as e:         # noqa: BLE001 (raised below, outside the group: not wrapped in an ExceptionGroup)
            err = e
        finally:
            tg.cancel_scope.cancel()
    if err is not None:
        raise err
    return ans


async def parts(engine, req: api.GenerateRequest, handle):
    """The request's output as (kind, value) pairs, in order (see the module doc); the stream ends after a
    "final" or an "error". Leaving early (client gone) cancels the request in the engine."""
    p = parser(engine, req, handle)

    def split(text: str, flush: bool = False) -> list:
        if p is None:
            return [("content", text)] if text else []
        return p.push(text) + (p.flush() if flush else [])
    async for ev in events(handle):
        if isinstance(ev, BaseException):
            yield "error", ev
            return
        if isinstance(ev, api.TokenEvent):
            yield "token", ev
            for item in split(ev.text):
                yield item
            continue
        for item in split(ev.tail, flush=True):
            yield item
        yield "final", ev
