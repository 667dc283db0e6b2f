"""A chat completion's output as every API front needs it: reasoning, answer text and tool calls, split in the
model's own dialect (betelgeuse.reasoning), whole or streamed. Chat Completions, Anthropic Messages and OpenAI
Responses differ only in how they spell these parts.

    ans = collect(engine, req)                        # the whole completion (blocking: run it on a worker thread)
    ans = await answer(engine, req, request)          # the same from an endpoint: the client leaving cancels it
    async for kind, x in parts(engine, req, handle):  # "reasoning" | "content" (str), "tool_call" (ToolCall),
        ...                                           # "token" (TokenEvent), "final" (FinalEvent), "error" (exc)
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import anyio

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


async def events(handle):
    """The handle's events, pulled on worker threads (the engine's queue blocks); an exception is yielded, not
    raised (a bug is logged here, on one line: the stream's error event only points at the log). Leaving early
    (client gone) cancels the request in the engine."""
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
            if isinstance(ev, BaseException) and not isinstance(ev, BetelgeuseError):
                log.error("internal error in a streamed answer", exc_info=ev)
            yield ev
            if isinstance(ev, BaseException):
                return
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
