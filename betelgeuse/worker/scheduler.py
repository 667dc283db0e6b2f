"""The scheduler: what one engine step does, decided before any of it runs (vLLM v1's Scheduler, nano-vllm's).

    schedule() -> StepPlan   1. end the cancelled and expired sequences (queued or running)
                             2. admit queued sequences, oldest first, while fewer than max_running run; each starts
                                after its longest cached prefix (the prefix cache's hit: n_done tokens already in).
                                An idle engine first holds admission for up to admission_window seconds after the
                                oldest arrival (StepPlan.hold), so requests arriving together share one prefill pass
                             3. one prefill pass: a piece of each prompt still to prefill, oldest first, in whole
                                chunks, at most max_batched_tokens in all while others decode (chunked prefill) and
                                prefill_pass_tokens while none do; the standard schedule prefills one prompt a pass
                             4. one decode pass: a token for every sequence that was decoding when the step began

Policy only: no torch, no runner, no events. The engine carries a plan out (worker/engine.py: KV caches, the passes,
the outputs); a sequence that ends meanwhile (its first token was its last) simply leaves the later pass
(StepPlan.passes). The unit tests drive it on fake sequences (tests/worker/test_scheduler.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol


class Seq(Protocol):
    """What the scheduler reads and writes of a sequence (worker/sequence.py's Sequence)."""
    prompt_ids: list[int]
    n_done: int                 # prompt tokens whose K/V are in its cache (the scheduler sets a prefix hit's)
    arrival: float              # time.monotonic() when it was queued
    cancelled: bool
    finished: bool              # its final event (or error) is out
    t_prefill_start: float      # time.monotonic() at admission

    @property
    def expired(self) -> bool: ...

    @property
    def prefilling(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Limits:
    max_running: int            # sequences with a KV cache at once: a number, never "auto" (the slot plan resolves
                                # auto, store/plan.py plan_running; the engine passes the runner's resolved config)
    max_batched_tokens: int     # prompt tokens of a prefill pass while others decode
    prefill_pass_tokens: int    # ... while none do
    chunk: int = 1              # a piece that is cut ends on a chunk boundary (position-aligned prefill chunks)
    one_prefill: bool = False   # the standard schedule: one prompt a prefill pass
    admission_window: float = 0.0   # seconds an idle engine waits after the oldest arrival before admitting

    def __post_init__(self):
        assert self.max_running >= 1 and self.chunk >= 1 and self.max_batched_tokens >= 1, self
        assert self.admission_window >= 0, self


@dataclass(slots=True)
class Pass:
    """One runner pass of a step: `kind` "prefill" (pieces of prompts), "batch" (one decode token each, in one
    batched pass) or "solo" (one decode token of a lone sequence, forward()'s one-row decode)."""
    kind: str
    seqs: list
    tokens: list[int]           # prompt tokens of each piece (prefill); 1 each (decode)

    @property
    def pieces(self) -> list[tuple]:
        return list(zip(self.seqs, self.tokens))


@dataclass(slots=True)
class StepPlan:
    ended: list = field(default_factory=list)       # 1. cancelled or past their deadline (finish "cancelled")
    admitted: list = field(default_factory=list)    # 2. in the running set now, oldest first: their KV caches to make
    cached: list = field(default_factory=list)      #    admitted with the whole prompt cached: first token, no pass
    prefill: list = field(default_factory=list)     # 3. [(sequence, prompt tokens)] of one pass, oldest first
    decode: list = field(default_factory=list)      # 4. one token each in one pass
    lanes: bool = False                             # a lone sequence decodes in the batched form too
    hold: float = 0.0                               # > 0: nothing admitted; wait this many seconds (or for a
                                                    #   new arrival), then schedule again (Scheduler._hold)

    def decode_form(self, n: int) -> str:
        """How n sequences decode: "batch" (decode_batch; a lone one too in the static form) or "solo"."""
        return "" if n == 0 else "batch" if n > 1 or self.lanes else "solo"

    def passes(self) -> Iterator[Pass]:
        """The step's passes in order, each without the sequences that finished by the time it is due (the engine
        processes one pass's outputs before the next pass starts)."""
        pieces = [(s, t) for s, t in self.prefill if not s.finished]
        if pieces:
            yield Pass("prefill", [s for s, _ in pieces], [t for _, t in pieces])
        seqs = [s for s in self.decode if not s.finished]
        if seqs:
            yield Pass(self.decode_form(len(seqs)), seqs, [1] * len(seqs))


class Scheduler:
    """The queue (waiting, oldest first) and the running set; schedule() moves sequences between them.

    prefix_hit(seq) -> prompt tokens the prefix cache holds for a sequence being admitted (and now holds FOR it:
    the engine copies them into its KV cache before any pass); None: no prefix cache. lanes() -> whether a lone
    sequence decodes in the batched form too (the runner's decodes_in_lanes: the static form's lanes, read each
    step). The caller serialises add/schedule/finish (the engine holds its lock around add and schedule; finish
    runs on the engine thread)."""

    def __init__(self, limits: Limits, prefix_hit: Callable[[Seq], int] | None = None,
                 lanes: Callable[[], bool] = lambda: False):
        self.limits = limits
        self.prefix_hit = prefix_hit
        self.lanes = lanes
        self.waiting: deque = deque()
        self.running: list = []

    def add(self, seq: Seq):
        self.waiting.append(seq)

    def finish(self, seq: Seq):
        """The sequence leaves the running set (or the queue), whatever ended it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def abort_waiting(self) -> list:
        """Empty the queue (the store went away) -> the sequences that were in it."""
        out = list(self.waiting)
        self.waiting.clear()
        return out

    def schedule(self, now: float | None = None) -> StepPlan:
        """The next step's plan; `now` is time.monotonic() (tests pass their own clock)."""
        lim = self.limits
        now = time.monotonic() if now is None else now
        plan = StepPlan(lanes=self.lanes())
        # 1. the engine stops working on cancelled and expired sequences now
        for q in (self.running, self.waiting):
            for seq in [s for s in q if s.cancelled or s.expired]:
                q.remove(seq)
                plan.ended.append(seq)
        # 4. decided first: the sequences decoding when the step begins (a prompt this step completes decodes next)
        plan.decode = [s for s in self.running if not s.prefilling]
        # 2. admission (an idle engine may first wait for the rest of a burst)
        plan.hold = self._hold(now)
        while not plan.hold and self.waiting and len(self.running) < lim.max_running:
            seq = self.waiting.popleft()
            seq.t_prefill_start = now
            if self.prefix_hit is not None:
                seq.n_done = self.prefix_hit(seq)
                assert 0 <= seq.n_done <= len(seq.prompt_ids), (seq.n_done, len(seq.prompt_ids))
            self.running.append(seq)
            plan.admitted.append(seq)
            if not seq.prefilling:
                plan.cached.append(seq)
        # 3. the prefill pass
        plan.prefill = self._pieces([s for s in self.running if s.prefilling], decoding=bool(plan.decode))
        return plan

    def _hold(self, now: float) -> float:
        """Seconds to wait before admitting anyone: while nothing runs and fewer than max_running wait, until the
        oldest waiting one has waited admission_window. Requests that arrive together (a client's parallel calls:
        milliseconds apart, each through HTTP, gRPC and the tokenizer) then share one layer-major prefill pass, whose
        disk reads are about one prompt's, instead of the first starting a pass alone and the rest waiting for all of
        it (seconds when its experts come from disk). Never while something runs: no decode waits for it."""
        lim = self.limits
        if not lim.admission_window or self.running or not self.waiting or len(self.waiting) >= lim.max_running:
            return 0.0
        return max(0.0, self.waiting[0].arrival + lim.admission_window - now)

    def _pieces(self, seqs: list, decoding: bool) -> list[tuple]:
        """Pieces of whole chunks, oldest first, so that they give the bits of one pass: the first takes its rest,
        or at most max_batched_tokens of it while others decode; the next join while the pass holds at most
        max_batched_tokens prompt tokens (prefill_pass_tokens while nothing decodes)."""
        lim = self.limits
        cap, c = (lim.max_batched_tokens if decoding else lim.prefill_pass_tokens), lim.chunk
        pieces: list[tuple] = []
        for seq in seqs:
            rest = len(seq.prompt_ids) - seq.n_done
            room = cap - sum(t for _, t in pieces)
            if not pieces:
                take = rest if not decoding or rest <= cap else max(c, cap // c * c)
            elif rest <= room:
                take = rest
            else:
                take = room // c * c
                if take <= 0:
                    continue
            pieces.append((seq, take))
            if lim.one_prefill:
                break
        return pieces
