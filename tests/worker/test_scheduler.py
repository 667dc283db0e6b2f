"""The scheduler alone (worker/scheduler.py) on fake sequences: no torch, no runner, no engine thread (in the
manner of vLLM's tests/v1/core/test_scheduler.py). The engine tests run the same policy end to end
(test_prefix_cache.py: pieces beside decodes, prompts sharing a pass, prefix hits)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from betelgeuse.worker.scheduler import Limits, Scheduler, StepPlan


@dataclass(eq=False)
class FakeSeq:
    prompt_ids: list[int]
    max_tokens: int = 3
    name: str = ""
    n_done: int = 0
    out: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    deadline: float | None = None
    arrival: float = 0.0
    t_prefill_start: float = 0.0

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.prompt_ids)

    def __repr__(self):
        return self.name or f"seq({len(self.prompt_ids)})"


def seqs(*lengths: int) -> list[FakeSeq]:
    return [FakeSeq(list(range(n)), name=f"s{i}") for i, n in enumerate(lengths)]


def sched(max_running=4, max_batched=16, pass_tokens=64, chunk=8, hits=None, **kw) -> Scheduler:
    hit = (lambda s: hits.get(s.name, 0)) if hits is not None else None
    return Scheduler(Limits(max_running, max_batched, pass_tokens, chunk, **kw), hit)


def run_plan(s: Scheduler, plan: StepPlan):
    """What the engine does with a plan, on fakes: prefill pieces advance, a completed prompt or a decode gives a
    token, a sequence with max_tokens tokens ends."""
    def token(q):
        q.out.append(0)
        if len(q.out) >= q.max_tokens:
            q.finished = True
            s.finish(q)
    for q in plan.ended:
        q.finished = True
    for q in plan.cached:
        token(q)
    for p in plan.passes():
        for q, n in p.pieces:
            if p.kind == "prefill":
                q.n_done += n
                if q.prefilling:
                    continue
            token(q)


def test_the_scheduler_imports_no_torch():
    code = "import sys, betelgeuse.worker.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_is_oldest_first_up_to_max_running():
    s = sched(max_running=2)
    a, b, c = seqs(5, 6, 7)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert plan.admitted == [a, b] and s.running == [a, b] and list(s.waiting) == [c]
    assert a.t_prefill_start > 0 and c.t_prefill_start == 0
    assert plan.prefill == [(a, 5), (b, 6)] and plan.decode == [] and plan.ended == []
    run_plan(s, plan)
    plan = s.schedule()                             # both decode now; c still waits for a slot
    assert plan.admitted == [] and plan.decode == [a, b] and plan.decode_form(2) == "batch"


def test_cancelled_and_expired_end_and_free_their_slots_in_the_same_step():
    s = sched(max_running=2)
    a, b, c, d = seqs(5, 6, 7, 8)
    for q in (a, b, c, d):
        s.add(q)
    run_plan(s, s.schedule())                       # a, b run
    a.cancelled = True
    c.deadline = time.monotonic() - 1               # expired while waiting
    plan = s.schedule()
    assert plan.ended == [a, c]                     # the running ones first, then the queued ones
    assert plan.admitted == [d] and s.running == [b, d] and not s.waiting
    assert plan.decode == [b]                       # a no longer decodes


def test_decodes_are_the_sequences_decoding_when_the_step_begins():
    s = sched(max_batched=8, chunk=4)
    a, b = seqs(3, 10)
    a.max_tokens = 10
    s.add(a)
    run_plan(s, s.schedule())                       # a prefilled: it decodes from the next step
    s.add(b)
    plan = s.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 8)]     # a piece beside the decode: max_batched whole chunks
    run_plan(s, plan)
    plan = s.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 2)]     # b completes its prompt now, decodes next step
    run_plan(s, plan)
    assert s.schedule().decode == [a, b]


def test_prompts_share_a_pass_within_its_budget_and_a_cut_piece_ends_on_a_chunk():
    # tests/worker/test_prefix_cache.py's four prompts: 48 tokens a pass while nothing decodes, then 24 beside decodes
    s = sched(max_running=4, max_batched=24, pass_tokens=48, chunk=8)
    qs = seqs(14, 20, 25, 16)
    for q in qs:
        s.add(q)
    plan = s.schedule()
    assert [n for _, n in plan.prefill] == [14, 20, 8]          # the 4th finds no whole chunk of room
    run_plan(s, plan)
    plan = s.schedule()
    assert plan.decode == qs[:2] and [(q.name, n) for q, n in plan.prefill] == [("s2", 17)]
    assert sum(n for _, n in plan.prefill) <= 24
    run_plan(s, plan)
    assert s.schedule().prefill == [(qs[3], 16)]


def test_the_first_piece_takes_whole_chunks_of_a_long_prompt_beside_decodes():
    s = sched(max_batched=16, chunk=8)
    a, b = seqs(2, 50)
    s.add(a)
    run_plan(s, s.schedule())
    s.add(b)
    takes = []
    while b.prefilling:
        plan = s.schedule()
        takes += [n for _, n in plan.prefill]
        run_plan(s, plan)
        if a.finished:                              # keep something decoding beside b's pieces
            a = FakeSeq([1], max_tokens=100, n_done=1, out=[0])
            s.running.insert(0, a)
    assert takes == [16, 16, 16, 2]


def test_with_nothing_decoding_a_prompt_is_prefilled_whole():
    s = sched(max_batched=16, pass_tokens=64, chunk=8)
    (a,) = seqs(60)
    s.add(a)
    assert s.schedule().prefill == [(a, 60)]


def test_the_standard_schedule_prefills_one_prompt_a_pass():
    s = sched(one_prefill=True)
    qs = seqs(5, 6, 7)
    for q in qs:
        s.add(q)
    plan = s.schedule()
    assert plan.admitted == qs and plan.prefill == [(qs[0], 5)]


def test_a_lone_decode_is_solo_unless_the_lanes_decode_it():
    lanes = {"on": False}
    s = Scheduler(Limits(4, 16, 64, 8), lanes=lambda: lanes["on"])
    a, b = seqs(3, 4)
    a.max_tokens = b.max_tokens = 10
    s.add(a)
    run_plan(s, s.schedule())
    assert [p.kind for p in s.schedule().passes()] == ["solo"]
    lanes["on"] = True                              # read at every step (the runner's static form decides)
    assert [p.kind for p in s.schedule().passes()] == ["batch"]
    lanes["on"] = False
    s.add(b)
    run_plan(s, s.schedule())
    assert [(p.kind, p.seqs) for p in s.schedule().passes()] == [("batch", [a, b])]
    assert StepPlan().decode_form(0) == ""


def test_prefix_hits_set_where_a_prompt_starts_and_a_whole_hit_needs_no_pass():
    hits = {"s0": 16, "s1": 20, "s2": 0}
    asked = []
    s = sched(hits=hits)
    s.prefix_hit = lambda q: asked.append(q.name) or hits[q.name]
    a, b, c = seqs(21, 20, 9)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert asked == ["s0", "s1", "s2"]
    assert plan.cached == [b] and b.n_done == 20                  # the whole prompt: its first token from the cache
    assert plan.prefill == [(a, 5), (c, 9)] and a.n_done == 16
    assert plan.decode == []                                        # b decodes from the next step
    run_plan(s, plan)
    plan = s.schedule()
    assert asked == ["s0", "s1", "s2"]                              # asked once, at admission
    assert plan.decode == [a, b, c]


def test_passes_leave_out_sequences_that_finished_meanwhile():
    s = sched()
    a, b, c = seqs(2, 3, 4)
    s.add(a)
    s.add(b)
    run_plan(s, s.schedule())
    s.add(c)
    plan = s.schedule()
    assert plan.decode == [a, b] and plan.prefill == [(c, 4)]
    c.finished = True                                               # ended in a step before the prefill pass ran
    b.finished = True                                               # ... or before the decode pass
    passes = list(plan.passes())
    assert [(p.kind, p.seqs) for p in passes] == [("solo", [a])]


def test_finish_and_abort_waiting_take_sequences_out():
    s = sched(max_running=1)
    a, b, c = seqs(3, 4, 5)
    for q in (a, b, c):
        s.add(q)
    s.schedule()
    s.finish(a)
    s.finish(b)
    assert s.running == [] and list(s.waiting) == [c]
    assert s.abort_waiting() == [c] and not s.waiting


@pytest.mark.parametrize("seed", range(4))
def test_a_random_workload_keeps_the_limits_and_finishes_every_request(seed):
    """Requests arrive at random, some cancel: every step keeps max_running, the pass budgets and whole-chunk cuts,
    admits oldest first, never prefills and decodes one sequence in a step, and every request ends."""
    rng = random.Random(seed)
    C, MB, PT, MR = 4, 12, 40, 3
    s = sched(max_running=MR, max_batched=MB, pass_tokens=PT, chunk=C)
    made, admitted = [], []
    for step in range(400):
        if len(made) < 40 and rng.random() < 0.3:
            q = FakeSeq(list(range(rng.randint(1, 30))), max_tokens=rng.randint(1, 6), name=f"r{len(made)}")
            made.append(q)
            s.add(q)
        if rng.random() < 0.05 and s.running:
            rng.choice(s.running).cancelled = True
        plan = s.schedule()
        admitted += plan.admitted
        assert len(s.running) <= MR
        pre = [q for q, _ in plan.prefill]
        assert not set(pre) & set(plan.decode) and not set(plan.cached) & set(plan.decode)
        budget = MB if plan.decode else PT
        total = sum(n for _, n in plan.prefill)
        assert total <= budget or len(plan.prefill) == 1 and total == len(pre[0].prompt_ids) - pre[0].n_done
        for i, (q, n) in enumerate(plan.prefill):
            assert 0 < n <= len(q.prompt_ids) - q.n_done
            if n < len(q.prompt_ids) - q.n_done:
                assert n % C == 0, (q, n)                # a cut piece is whole chunks
        run_plan(s, plan)
    assert admitted == [q for q in made if q in admitted]      # admitted in arrival order
    assert all(q.finished for q in made), [q for q in made if not q.finished]
    assert not s.running and not s.waiting


# ---- the admission window: a burst of requests shares one prefill pass ------------------------------------------

def burst(s: Scheduler, lengths, t0: float, gap: float) -> list[FakeSeq]:
    """Requests arriving `gap` seconds apart from t0 (a client's parallel calls reach the engine milliseconds apart)."""
    qs = seqs(*lengths)
    for i, q in enumerate(qs):
        q.arrival, q.max_tokens = t0 + i * gap, 6
    return qs


def drive(s: Scheduler, arrivals: list[FakeSeq], t: float, step_s: float) -> tuple[list, list]:
    """The engine on a fake clock: requests join the queue at their arrival, a step with work takes step_s, a hold
    waits its time (or until the next arrival). -> the prefill passes' pieces and the order of tokens [(name, k)]."""
    pending, passes, tokens = list(arrivals), [], []
    while pending or s.waiting or s.running:
        while pending and pending[0].arrival <= t:
            s.add(pending.pop(0))
        plan = s.schedule(now=t)
        if plan.hold:
            assert not plan.admitted and not plan.prefill and not plan.decode
            t = min([t + plan.hold] + [q.arrival for q in pending[:1]])
            continue
        if not plan.admitted and not plan.prefill and not plan.decode:
            t = pending[0].arrival                  # idle, nothing queued
            continue
        passes += [[n for _, n in p.pieces] for p in plan.passes() if p.kind == "prefill"]
        before = {q.name: len(q.out) for q in s.running}
        run_plan(s, plan)
        tokens += [(q.name, len(q.out)) for q in arrivals if len(q.out) > before.get(q.name, len(q.out))]
        t += step_s
    return passes, tokens


def test_an_idle_engine_holds_admission_for_the_window_after_the_first_arrival():
    s = sched(max_running=8, admission_window=0.02)
    a, b, c = burst(s, (16, 16, 16), t0=100.0, gap=0.006)
    s.add(a)
    plan = s.schedule(now=100.005)
    assert plan.hold == pytest.approx(0.015) and plan.admitted == [] and list(s.waiting) == [a]
    s.add(b)
    s.add(c)
    assert s.schedule(now=100.019).hold == pytest.approx(0.001)     # timed from the OLDEST arrival, not the newest
    plan = s.schedule(now=100.020)
    assert plan.hold == 0 and plan.admitted == [a, b, c] and a.t_prefill_start == 100.020
    assert plan.prefill == [(a, 16), (b, 16), (c, 16)]              # one pass for the burst


def test_the_window_never_holds_while_something_runs_or_a_full_batch_waits():
    s = sched(max_running=2, admission_window=0.02)
    a, b, c = burst(s, (4, 4, 4), t0=10.0, gap=0.0)
    s.add(a)
    s.add(b)                                        # as many waiting as may run: nothing to gather
    plan = s.schedule(now=10.0)
    assert plan.hold == 0 and plan.admitted == [a, b]
    run_plan(s, plan)
    s.finish(b)
    s.add(c)                                        # a decodes: c joins at once, a's decode never waits
    plan = s.schedule(now=10.001)
    assert plan.hold == 0 and plan.admitted == [c] and plan.decode == [a]
    off = sched(max_running=8)                      # admission_window 0: the first arrival starts a pass at once
    (d,) = burst(off, (4,), t0=10.0, gap=0.0)
    off.add(d)
    assert off.schedule(now=10.0).admitted == [d]


@pytest.mark.parametrize("window", [0.02, 0.0])
def test_a_burst_gets_every_first_token_before_anyone_gets_a_third(window):
    """Eight 16-token prompts arriving 1 ms apart at an idle engine whose passes take 50 ms (beside decodes a prefill
    pass takes 8 tokens). With the window: one prefill pass, and all first tokens come from it. Without it (the
    contrast: this is what the window fixes) the first arrival's pass runs alone and the other seven are prefilled
    8 tokens a step beside its decodes: it has its 6th token before the last of them has a first."""
    s = sched(max_running=8, max_batched=8, pass_tokens=256, chunk=8, admission_window=window)
    qs = burst(s, [16] * 8, t0=0.0, gap=0.001)
    passes, tokens = drive(s, qs, t=0.0, step_s=0.05)
    firsts = [i for i, (_, k) in enumerate(tokens) if k == 1]
    thirds = [i for i, (_, k) in enumerate(tokens) if k == 3]
    assert len(firsts) == 8 and all(q.finished for q in qs)
    if window:
        assert passes == [[16] * 8]
        assert max(firsts) < min(i for i, (_, k) in enumerate(tokens) if k == 2)
    else:
        assert passes[0] == [16] and len(passes) > 2
        assert max(firsts) > min(thirds)
