"""One request's state inside the worker: prompt, KV cache, sampler, text stream, outgoing events."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from betelgeuse.api import Event, FinalEvent, GenerateRequest, ToolCall, Usage
from betelgeuse.errors import BetelgeuseError, CancelledError
from betelgeuse.textstream import TextStream

_ids = itertools.count(1)
_END = object()


@dataclass(slots=True, eq=False)         # a sequence is itself: found in the running set by identity, not by value
class Sequence:
    request: GenerateRequest
    prompt_ids: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    stream: TextStream
    deadline: float | None = None                 # time.monotonic() seconds
    generator: object = None                      # torch.Generator | None
    kv: object = None                             # KVCache while running
    n_done: int = 0                               # prompt tokens whose K/V are in kv (cached prefix + prefilled)
    blocks: list = field(default_factory=list)    # prefix-cache blocks this sequence holds (its prompt's chain)
    seq_id: int = field(default_factory=lambda: next(_ids))
    out_ids: list[int] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)   # unbounded: the engine never waits on a reader
    # called after each put (on the engine thread; RequestHandle.listen): quick, never blocks, never raises
    notify: Callable[[], None] | None = None
    cancelled: bool = False
    arrival: float = field(default_factory=time.monotonic)
    t_prefill_start: float = 0.0                  # admitted (Scheduler.schedule)
    t_first: float = 0.0
    t_last: float = 0.0
    usage: Usage = field(default_factory=Usage)
    finished: bool = False
    constraint: object = None                     # grammar.Constraint | None (response_format, forced tool call)
    parse_tools: bool = False                     # the request has tools: parse its calls at the end
    dialect: object = None                        # reasoning.Dialect: how the model writes reasoning and tool calls
    reasoning: bool = False                       # the output starts inside a think block (the prompt opened it)

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.prompt_ids)

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _put(self, x):
        self.events.put(x)
        n = self.notify                     # read once: the reader may drop it (listen(None)) meanwhile
        if n is not None:
            n()

    def emit(self, ev: Event):
        self._put(ev)

    def fail(self, err: BetelgeuseError):
        self.finished = True
        self.events.put(err)
        self._put(_END)

    def finish(self, reason: str, stop_reason: str = "", stop_token_id: int | None = None):
        self.finished = True
        tail = self.stream.flush() if not self.stream.stopped else ""
        calls: list[ToolCall] = []
        if self.parse_tools and reason in ("stop", "length"):
            # calls in the answer only: a call written while reasoning is never executed
            from betelgeuse.reasoning import QWEN3, parse_output
            calls = parse_output(self.dialect or QWEN3, self.stream.text, self.reasoning, tools=True).calls
            if calls and reason == "stop":
                reason = "tool_calls"
        self.emit(FinalEvent(finish_reason=reason, text=self.stream.text, token_ids=list(self.out_ids),
                             usage=self.usage, tail=tail, stop_reason=stop_reason,
                             stop_string=self.stream.matched if stop_reason == "stop_string" else "",
                             stop_token_id=stop_token_id, tool_calls=calls))
        self._put(_END)


class RequestHandle:
    """What submit() returns: iterate for events; cancel() stops the engine's work on it."""

    def __init__(self, seq: Sequence, wake):
        self.seq, self._wake = seq, wake

    @property
    def prompt_tokens(self) -> int:
        return len(self.seq.prompt_ids)

    @property
    def reasoning(self) -> bool:
        """The output starts inside a think block (the rendered prompt opened it)."""
        return self.seq.reasoning

    def __iter__(self):
        """The events, blocking this thread for each (gRPC, collect, the CLI); ends after the FinalEvent or
        raises the BetelgeuseError that ended the request."""
        while True:
            ev = self.seq.events.get()
            if ev is _END:
                return
            if isinstance(ev, BaseException):
                raise ev
            yield ev

    def listen(self, notify: Callable[[], None] | None):
        """For a reader that waits on something else than a thread (an event loop): notify() is called on the
        engine thread after each event is queued (it must be quick, never block, never raise: e.g.
        loop.call_soon_threadsafe), and ready() takes what is queued. None stops the calls. Events queued before
        listen() are not announced: a reader drains once after listen(), then waits for notify, clearing its own
        flag BEFORE each drain (an event put between the drain and the wait has then set the flag again: no
        event is lost, however the two threads interleave)."""
        self.seq.notify = notify

    def ready(self) -> tuple[list, bool]:
        """(what is queued now, in order, without blocking; whether the stream ended with it): Events, and the
        BetelgeuseError that ended the request as a value (last), where __iter__ would raise it. The same stream
        as __iter__'s: use one or the other."""
        out: list = []
        q = self.seq.events
        while True:
            try:
                ev = q.get_nowait()
            except queue.Empty:
                return out, False
            if ev is _END:
                return out, True
            out.append(ev)

    def cancel(self):
        self.seq.cancelled = True
        self._wake()


def check_alive(seq: Sequence):
    if seq.cancelled:
        raise CancelledError("request cancelled by the client")
    if seq.expired:
        raise CancelledError("request deadline exceeded")
