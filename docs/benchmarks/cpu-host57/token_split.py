#!/usr/bin/env python3
"""deploy/device/decode_host.py with a decode token's host time split by where it runs, and its CUDA-side host calls
counted over the WHOLE token (issue 21, docs/benchmarks/cpu-host57): its JSON plus "token_split".

The bench splits a token's host time into store messages, the expert steps (MoEStep.partial: moe_host_s) and the
rest (other_host_s). This splits the rest. Each region below is a function wrapped at its class (either checkout's:
ab.py runs this script on both sides); a region's time is its own (self) time, less the regions it encloses, so the
regions add up to the token's wall:

  excluded (not the rest)  store (PassClock.message / reply), blocked (PassClock.wait: syncs, the disk, copies),
                           moe (MoEStep.partial: the bench's expert step)
  rest                     forward (ModelRunner.forward / prefill_batch / _pass / _layer_major's own lines: the ids'
                           tensor, the logits' float), pass.begin (StoreSession.begin: pass_begin, the counts'
                           zero_), hash_ahead, step.refresh (refresh_static, hand_refresh: the at-hand table), kv
                           (begin_static, commit), solo (SoloDecode.decode's own lines: LayerStats, the graphs' key,
                           eager_part's dispatch, the logits' clone), segment (the capturable work between two host
                           parts: a next() of SoloDecode._ops; on CUDA a graph REPLAY, graph.replay, on the CPU the
                           dense compute itself, so its CPU time is not the device's), hand_start (the routing sync's
                           copies and event), hand_misses (its own lines: stale, the table's re-upload; partial
                           inside it is moe), mark (PassClock.mark: --gpu-marks' events), pass.end (ModelRunner._end:
                           the usage, StoreSession.end, the clock's finish), end_counts (its own lines, the sync is
                           blocked), lanes (decode_batch's own lines: --form lanes, not split further; its
                           segments are its lane parts and attention graphs: _wrap_lanes)
  rest_us = the rest's regions summed; other_host_us = the bench's own figure (PassStats.other_host_s) beside it.

Counted calls (per token and per region): cpu-host54/cuda_calls.py's (Tensor.copy_, _foreach_copy_, Event.record /
query / synchronize, Stream.wait_event / wait_stream, set_stream, CUDAGraph.replay, MoEKernels.apply) over the whole
token, not a miss layer's window, plus `segments` (next() of _ops: the graph replays CUDA makes, yields + 1 a
step) and, on the CPU, "derived:" rows for what the code's CUDA branches call (cuda_calls.py's DERIVED, and
RoutingSync.start: the counts' and guesses' copy and its event; StoreSession.end_counts: a D2H copy and its sync).
Calls inside a segment are captured in a graph on CUDA: counted apart (in_segments), not in eager_calls.
--gpu-marks: the bench's (PassClock.marks on: the solo graphs cut at each layer's attention, marks recorded).
--py-calls: Python function calls by region (sys.setprofile), outside segments as inside.
--torch-ops-where: the same, each op named with the line of betelgeuse/ that called it.
--torch-ops: every torch API call (TorchFunctionMode) by region too, outside segments: what costs a CUDA host a few
us each (the mode slows them: read its timings with care; the A/B runs without it).

    python3 docs/benchmarks/cpu-host57/token_split.py --preset ds4-tiny --form solo --flex on --flex-slots 3
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

from betelgeuse.kernels import moe as kmoe
from betelgeuse.worker import decode_graphs, expert_cache, moe_step, runner, stats as wstats, store_session

CUDA = torch.cuda.is_available()
EXCLUDED = ("store", "blocked", "moe")
STACK: list = []                          # [region, t0, children's seconds]
SELF: collections.Counter = collections.Counter()        # region -> self seconds, this token
CALLS: collections.Counter = collections.Counter()       # (region, call) -> n, this token
OPS: collections.Counter = collections.Counter()         # --torch-ops: (region, op name) -> n, all tokens
TOKENS: list = []                          # per token: (self {region: us}, calls {(region, call): n})
ON = [0]                                   # inside a token (ModelRunner.forward / decode_batch)


def _enter(name):
    STACK.append([name, time.perf_counter(), 0.0])


def _leave():
    name, t0, child = STACK.pop()
    dt = time.perf_counter() - t0
    SELF[name] += dt - child
    if STACK:
        STACK[-1][2] += dt


def _region() -> str:
    """The region a call is counted in: the innermost one other than a wait or a message (they are the caller's)."""
    for name, _, _ in reversed(STACK):
        if name not in ("blocked", "store"):
            return name
    return "outside"


def _opens(name) -> bool:
    """Regions nest as the bench's accounting does: inside the expert step (moe) only its store messages and blocked
    waits are carved out (PassStats.moe_host_s excludes them), the rest of it (a group graph's replay, a mark) stays
    moe; nothing opens inside a message, a wait or a segment."""
    if not STACK:
        return True
    top = STACK[-1][0]
    if top in ("blocked", "store", "segment"):    # a segment is one graph on CUDA: what runs in it is captured
        return False
    return top != "moe" or name in ("blocked", "store")


def _wrap_region(owner, attr, name):
    # a class's own function (not a bound one), or an inherited one (torch.cuda.CUDAGraph.replay may be torch._C's)
    fn = (owner.__dict__.get(attr) or getattr(owner, attr, None)) if isinstance(owner, type) else getattr(owner, attr,
                                                                                                            None)
    if fn is None:
        return

    def wrapper(*a, **k):
        if not ON[0] or not _opens(name):
            return fn(*a, **k)
        _enter(name)
        try:
            return fn(*a, **k)
        finally:
            _leave()
    setattr(owner, attr, wrapper)


def _wrap_token(owner, attr):
    fn = owner.__dict__[attr]

    def wrapper(*a, **k):
        if ON[0]:                          # forward -> prefill_batch: one token
            return fn(*a, **k)
        SELF.clear()
        CALLS.clear()
        ON[0] = 1
        _enter("forward" if attr == "forward" else "lanes")
        try:
            return fn(*a, **k)
        finally:
            _leave()
            ON[0] = 0
            TOKENS.append(({r: s * 1e6 for r, s in SELF.items()}, dict(CALLS)))
    setattr(owner, attr, wrapper)


def _wrap_ops():
    """SoloDecode._ops' generator: each next() is the capturable work up to the next host part (a graph on CUDA)."""
    fn = decode_graphs.SoloDecode.__dict__["_ops"]

    def ops(*a, **k):
        gen = fn(*a, **k)

        def it():
            while True:
                on = ON[0] and _opens("segment")
                if on:
                    _enter("segment")
                _count("segments")
                try:
                    item = next(gen)
                except StopIteration:
                    return
                finally:
                    if on:
                        _leave()
                yield item
        return it()
    decode_graphs.SoloDecode._ops = ops


def _wrap_lanes():
    """The lanes' graphs (--form lanes, worker/lanes.py): each lane part (Lanes._run: pre[l], post[l], a "hand" part,
    the head) and each sequence's attention (Lanes._attend) is one graph on CUDA, where its replay is counted as
    graph.replay (and timed as its region); on the CPU each is a segment, as a next() of SoloDecode._ops is (what
    runs inside is captured on CUDA: the folded start in post[l] too)."""
    if CUDA:
        return
    from betelgeuse.worker import lanes
    for attr in ("_run", "_attend"):
        fn = lanes.Lanes.__dict__[attr]

        def wrapper(*a, _fn=fn, **k):
            on = ON[0] and _opens("segment")
            if on:
                _count("segments")
                _enter("segment")
            try:
                return _fn(*a, **k)
            finally:
                if on:
                    _leave()
        setattr(lanes.Lanes, attr, wrapper)


def _count(key, n=1):
    if ON[0]:
        CALLS[(_region(), key)] += n


def _wrap_count(owner, attr, before):
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def wrapper(*a, **k):
        if ON[0]:
            before(*a, **k)
        return fn(*a, **k)
    setattr(owner, attr, wrapper)


def _beyond(held, keep: int) -> int:
    """MoEStep._release(excess=True) on CUDA: how many of the oldest held (event, slots) it waits for."""
    n, left = 0, sum(len(s) for _, s in held)
    for _, s in held:
        if left <= max(keep, 0):
            break
        left -= len(s)
        n += 1
    return n


def _kind(t):
    return "D" if t.device.type == "cuda" else "H"


def _foreach(dsts, srcs, non_blocking=False):
    _count("foreach_copy_")
    _count("foreach_copy_.tensors", len(dsts))


def _flag(name: str) -> bool:
    if name in sys.argv:
        sys.argv.remove(name)
        return True
    return False


def main():
    ops_mode, py_calls, marks = _flag("--torch-ops"), _flag("--py-calls"), _flag("--gpu-marks")
    where = _flag("--torch-ops-where")
    ops_mode = ops_mode or where
    if marks:              # the bench's --gpu-marks: PassClock.marks on from attach (the solo graphs cut at attention)
        attach = runner.ModelRunner.__dict__["attach"]

        def attach_marks(self, *a, **k):
            out = attach(self, *a, **k)
            self.gpu_marks = True
            return out
        runner.ModelRunner.attach = attach_marks
    skip = 3
    if "--skip" in sys.argv:
        skip = int(sys.argv[sys.argv.index("--skip") + 1])
    # the token: one decode step (solo: forward; lanes: decode_batch)
    _wrap_token(runner.ModelRunner, "forward")
    _wrap_token(runner.ModelRunner, "decode_batch")
    # counted (cuda_calls.py's set)
    _wrap_count(torch.Tensor, "copy_", lambda *a, **k: _count("copy_"))
    _wrap_count(torch, "_foreach_copy_", _foreach)
    if CUDA:
        _wrap_count(torch.cuda.Event, "record", lambda *a, **k: _count("event.record"))
        _wrap_count(torch.cuda.Event, "query", lambda *a, **k: _count("event.query"))
        _wrap_count(torch.cuda.Event, "synchronize", lambda *a, **k: _count("event.synchronize"))
        _wrap_count(torch.cuda.Stream, "wait_event", lambda *a, **k: _count("stream.wait_event"))
        _wrap_count(torch.cuda.Stream, "wait_stream", lambda *a, **k: _count("stream.wait_stream"))
        _wrap_count(torch.cuda, "set_stream", lambda *a, **k: _count("set_stream"))
        _wrap_count(torch.cuda.CUDAGraph, "replay", lambda *a, **k: _count("graph.replay"))
    _wrap_count(kmoe.MoEKernels, "apply", lambda *a, **k: _count("kern.apply"))
    if not CUDA:           # derived: what the CUDA branches call (cuda_calls.py's DERIVED and the token's own)
        derived = {
            (expert_cache.ExpertCache, "bank_next"): lambda self, *a, **k: {"stream.wait_event": 1},
            (expert_cache.ExpertCache, "bank_copy"): lambda self, b, at, srcs, timing=None, wait=True, table=None,
            offs=None: {"set_stream": 2, "event.record": 1, "stream.wait_event": int(wait)},
            (expert_cache.ExpertCache, "bank_done"): lambda self, b: {"event.record": 1},
            (expert_cache.ExpertCache, "mark"): lambda self: {"event.record": 1},
            (moe_step.MoEStep, "_release"): lambda self, held, keep, later=False, excess=False:
                {"event.synchronize": len(held)} if later and hasattr(expert_cache.ExpertCache, "mark") else
                # excess (flush57's early flush): no query, a wait for each oldest slot set beyond `keep`
                {"event.synchronize": _beyond(held, keep)} if excess else
                {"event.query": len(held), "event.synchronize": len(held) if later else 0},
            (moe_step.RoutingSync, "finish"): lambda self: {"event.synchronize": 1},
            # the counts' (and guesses') copy to the pinned buffer: one call (copy_ or one foreach), and its event
            (moe_step.RoutingSync, "start"): lambda self, counts, guess:
                {"copy_" if guess is None else "foreach_copy_": 1, "event.record": 1},
            # counts.cpu(): a D2H copy the host waits for
            (store_session.StoreSession, "end_counts"): lambda self: {"copy_.D2H_sync": 1},
        }
        try:
            from betelgeuse.worker import at_hand
            derived[(at_hand.AtHand, "_upload")] = lambda self, tab: {
                "event.query": 1, "event.record": 0 if getattr(self, "_defer", 0) else 1}
        except ImportError:
            pass
        for (cls, name), f in derived.items():
            def before(*a, _f=f, **k):
                for key, n in _f(*a, **k).items():
                    _count("derived:" + key, n)
            _wrap_count(cls, name, before)
    # the regions, wrapped over the counts (a call is counted in the region it runs in)
    for owner, attr, name in [
            (wstats.PassClock, "message", "store"), (wstats.PassClock, "reply", "store"),
            (wstats.PassClock, "wait", "blocked"), (wstats.PassClock, "mark", "mark"),
            (moe_step.MoEStep, "partial", "moe"), (moe_step.MoEStep, "hash_ahead", "hash_ahead"),
            (moe_step.MoEStep, "refresh_static", "step.refresh"), (moe_step.MoEStep, "hand_refresh", "step.refresh"),
            (moe_step.MoEStep, "hand_start", "hand_start"), (moe_step.MoEStep, "hand_misses", "hand_misses"),
            (store_session.StoreSession, "begin", "pass.begin"),
            (store_session.StoreSession, "end_counts", "end_counts"),
            (runner.ModelRunner, "_end", "pass.end"), (decode_graphs.SoloDecode, "decode", "solo")]:
        _wrap_region(owner, attr, name)
    from betelgeuse.model import deepseek4, kv_cache
    for cls in (deepseek4.CompressedCache, kv_cache.KVCache):
        _wrap_region(cls, "begin_static", "kv")
        _wrap_region(cls, "commit", "kv")
    _wrap_ops()
    _wrap_lanes()
    if CUDA:
        _wrap_region(torch.cuda.CUDAGraph, "replay", "graph.replay")
    mode = None
    if ops_mode:
        from torch.overrides import TorchFunctionMode

        class Ops(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if ON[0] and _region() != "segment":
                    CALLS[(_region(), "torch_ops")] += 1
                    if len(TOKENS) >= 1 + skip:     # the timed steps only (not the prefill's, the skipped ones)
                        name = getattr(func, "__qualname__", str(func))
                        if where:          # --torch-ops-where: the calling line in our code
                            f = sys._getframe(1)
                            while f is not None and "betelgeuse" not in f.f_code.co_filename:
                                f = f.f_back
                            if f is not None:
                                name += f" @{Path(f.f_code.co_filename).name}:{f.f_lineno}"
                        OPS[(_region(), name)] += 1
                return func(*args, **(kwargs or {}))
        mode = Ops()
    if py_calls:           # Python function calls by region (sys.setprofile: slows everything, as --torch-ops)
        def prof(frame, event, arg):
            if ON[0] and event == "call":
                CALLS[(_region(), "py_calls")] += 1
        sys.setprofile(prof)
    script = Path(__file__).resolve().parents[3] / "deploy" / "device" / "decode_host.py"    # one measure, both sides
    sys.argv = [str(script)] + sys.argv[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), (mode if mode is not None else contextlib.nullcontext()):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
    sys.setprofile(None)
    res = json.loads(out.getvalue())
    res["token_split"] = summary(TOKENS[1 + skip:] if len(TOKENS) > 1 + skip else TOKENS)   # [0]: the prefill
    if ops_mode:           # (region, op) -> calls a timed token
        n = max(1, len(TOKENS) - 1 - skip)
        res["torch_ops"] = {f"{r}:{k}": round(v / n, 2) for (r, k), v in OPS.most_common(60)}
    print(json.dumps(res))


def summary(tokens: list) -> dict:
    """Per region: median self us a token; rest_us (the rest's regions summed, median); calls: mean per token."""
    regions = sorted({r for s, _ in tokens for r in s})
    us = {r: round(statistics.median(s.get(r, 0.0) for s, _ in tokens), 1) for r in regions}
    rest = [sum(v for r, v in s.items() if r not in EXCLUDED) for s, _ in tokens]
    n = len(tokens)
    keys = sorted({k for _, c in tokens for k in c})
    calls = {f"{r}:{k}": round(sum(c.get((r, k), 0) for _, c in tokens) / n, 3) for r, k in keys}
    eager, token = collections.Counter(), collections.Counter()   # the rest's; the token's (the expert step too)
    for r, k in keys:
        # a segment is a graph replay on CUDA (counted there as graph.replay; the CPU's are its stand-in: on CUDA
        # a replayed step calls no _ops), the calls inside it are captured
        if k == "segments" or (r != "segment" and k not in ("torch_ops", "py_calls", "foreach_copy_.tensors")):
            v = sum(c.get((r, k), 0) for _, c in tokens) / n
            k = "graph.replay" if k == "segments" else k.removeprefix("derived:")
            token[k] += v
            if r != "moe":
                eager[k] += v
    return {"tokens": n, "self_us": us, "rest_us": round(statistics.median(rest), 1),
            "rest_less_segments_us": round(statistics.median(
                sum(v for r, v in s.items() if r not in EXCLUDED + ("segment",)) for s, _ in tokens), 1),
            "calls": calls, "rest_eager_calls": {k: round(v, 3) for k, v in sorted(eager.items())},
            "rest_eager_calls_total": round(sum(eager.values()), 3),
            "token_eager_calls": {k: round(v, 3) for k, v in sorted(token.items())},
            "token_eager_calls_total": round(sum(token.values()), 3)}


if __name__ == "__main__":
    main()
