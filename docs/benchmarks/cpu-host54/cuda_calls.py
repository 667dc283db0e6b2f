#!/usr/bin/env python3
"""deploy/device/decode_host.py with the CUDA-side host calls of each decode miss layer counted (issue 21,
docs/benchmarks/cpu-host54): its JSON plus "calls_per_miss_layer": {call: mean per miss layer} and "miss_layers".

The window is MoEStep.hand_misses of a layer with a miss (a disk expert or a banked host one: the static form's solo
and lanes paths), i.e. the sync's wait, the misses' loads, copies and groups, the staging slots' release and the
at-hand table's re-upload; the routing sync's start and the at-hand group before it are the same on both sides.

Two sources, by device:
  counted  the torch calls themselves, wrapped: Tensor.copy_ (one cudaMemcpyAsync each on CUDA), _foreach_copy_ (calls,
           and its tensors by source: host sources take the per-tensor path, one cudaMemcpyAsync each; device ones one
           multi-tensor kernel launch), Event.record / query / synchronize, Stream.wait_event / wait_stream,
           torch.cuda.set_stream, CUDAGraph.replay, and the expert groups (MoEKernels.apply: two Triton launches a
           group; under --group-graphs GroupGraphs.apply: one graph replay once captured). On CUDA this is all of it.
  derived  on the CPU the code's `if is_cuda` branches do not run (events, stream switches and waits do not exist):
           the methods holding them are wrapped and what their CUDA branch calls is added, read from the code
           (ExpertCache.bank_next / bank_copy / bank_done / mark, MoEStep._release, AtHand._upload, RoutingSync.finish;
           `DERIVED` below), so "cuda" = counted + derived is the CUDA count on the CPU path. Where a checkout lacks a
           method its row is simply never hit (either checkout's classes are wrapped: ab.py runs this script on both).
  runtime_calls: the CUDA runtime calls those make (memcpy per host-source tensor and per copy_, one launch per
           device foreach, records, queries, syncs, waits, replays, 2 launches a kernel apply); set_stream is a host
           call of torch's (no runtime call) and counted beside.

Its arguments are decode_host.py's:
    python3 docs/benchmarks/cpu-host54/cuda_calls.py --preset ds4-tiny --form solo --flex on --flex-slots 3
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import torch

from betelgeuse.kernels import moe as kmoe
from betelgeuse.worker import expert_cache, moe_step

CUDA = torch.cuda.is_available()
TALLY: collections.Counter = collections.Counter()
IN = [0]                                  # inside a hand_misses window
DEVICE_STORAGES: set = set()              # the pool's, tables', flex chunks' storages' data_ptr (CPU: the "device")
PER_LAYER: list = []


def _count(key, n=1):
    if IN[0]:
        TALLY[key] += n


def _is_device(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        return True
    return t.untyped_storage().data_ptr() in DEVICE_STORAGES


def _wrap(owner, name, before):
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*a, **k):
        if IN[0]:
            before(*a, **k)
        return fn(*a, **k)
    setattr(owner, name, wrapper)


def _copy_(dst, src, non_blocking=False):
    kind = ("D" if _is_device(src) else "H") + "2" + ("D" if _is_device(dst) else "H")
    _count(f"copy_.{kind}")


def _foreach(dsts, srcs, non_blocking=False):
    _count("foreach_copy_")
    kinds = [("D" if _is_device(s) else "H") + "2" + ("D" if _is_device(d) else "H") for d, s in zip(dsts, srcs)]
    for k in kinds:
        _count("foreach_copy_.tensor." + k)
    # runtime calls: device tensors alone take the fused multi-tensor kernel (one launch); a host source sends the call
    # down the per-tensor path (a copy_, one cudaMemcpyAsync, each)
    _count("foreach_copy_.runtime", 1 if all(k == "D2D" for k in kinds) else len(kinds))


# counted: the torch calls (CUDA's only where they run)
_wrap(torch.Tensor, "copy_", _copy_)
_wrap(torch, "_foreach_copy_", _foreach)
if CUDA:
    _wrap(torch.cuda.Event, "record", lambda *a, **k: _count("event.record"))
    _wrap(torch.cuda.Event, "query", lambda *a, **k: _count("event.query"))
    _wrap(torch.cuda.Event, "synchronize", lambda *a, **k: _count("event.synchronize"))
    _wrap(torch.cuda.Stream, "wait_event", lambda *a, **k: _count("stream.wait_event"))
    _wrap(torch.cuda.Stream, "wait_stream", lambda *a, **k: _count("stream.wait_stream"))
    _wrap(torch.cuda, "set_stream", lambda *a, **k: _count("set_stream"))
    _wrap(torch.cuda.CUDAGraph, "replay", lambda *a, **k: _count("graph.replay"))
_wrap(kmoe.MoEKernels, "apply", lambda *a, **k: _count("kern.apply"))

# derived (CPU): what each method's CUDA branch calls, read from the code
DERIVED = {
    (expert_cache.ExpertCache, "bank_next"): lambda self, *a, **k: {"stream.wait_event": 1},
    # set_stream to the copy stream and back, the ready event, the compute stream's wait (wait=True)
    (expert_cache.ExpertCache, "bank_copy"): lambda self, b, at, srcs, timing=None, wait=True, table=None, offs=None:
        {"set_stream": 2, "event.record": 1, "stream.wait_event": int(wait)},
    (expert_cache.ExpertCache, "bank_done"): lambda self, b: {"event.record": 1},
    (expert_cache.ExpertCache, "mark"): lambda self: {"event.record": 1},
    # main: an event query per held entry, and later=True: those not done (a layer's last copies, just queued:
    # counted as all of them) handed to the session, which synchronizes each at its next message; host54 (the checkout
    # with ExpertCache.mark): later=True hands them all over with no query
    (moe_step.MoEStep, "_release"): lambda self, held, keep, later=False:
        {"event.synchronize": len(held)} if later and hasattr(expert_cache.ExpertCache, "mark") else
        {"event.query": len(held), "event.synchronize": len(held) if later else 0},
    (moe_step.RoutingSync, "finish"): lambda self: {"event.synchronize": 1},
}
try:
    from betelgeuse.worker import at_hand
    # the staging buffer's reuse check, and its event's record unless the caller queues the copy (host54's deferred
    # upload: the caller's event, counted where it records it)
    DERIVED[(at_hand.AtHand, "_upload")] = lambda self, tab: {"event.query": 1,
                                                              "event.record": 0 if getattr(self, "_defer", 0) else 1}
except ImportError:
    pass
if not CUDA:
    for (cls, name), f in DERIVED.items():
        def before(*a, _f=f, **k):
            for key, n in _f(*a, **k).items():
                _count("derived:" + key, n)
        _wrap(cls, name, before)


def _window():
    fn = moe_step.MoEStep.hand_misses

    def hand_misses(self, l, r, snap, stats, ls, *a, **k):
        DEVICE_STORAGES.clear()
        c = self.cache
        DEVICE_STORAGES.update({c.pool.untyped_storage().data_ptr(), c.tables_dev.untyped_storage().data_ptr()})
        if self.hand is not None:
            DEVICE_STORAGES.add(self.hand.dev.untyped_storage().data_ptr())
        if self.flex is not None:
            DEVICE_STORAGES.update(x.untyped_storage().data_ptr() for x in self.flex.chunks if x is not None)
        TALLY.clear()
        g0 = ls.groups
        IN[0] = 1
        try:
            return fn(self, l, r, snap, stats, ls, *a, **k)
        finally:
            IN[0] = 0
            if ls.disk or ls.groups - g0 > 1:          # a miss layer (decode_host.py's rule)
                PER_LAYER.append(dict(TALLY))
    moe_step.MoEStep.hand_misses = hand_misses


def _runtime(c: dict, group_graphs: bool) -> int:
    """The CUDA runtime calls of a tally (module doc)."""
    n = 0
    for k, v in c.items():
        k = k.removeprefix("derived:")
        if k.startswith("copy_.") and k != "copy_.H2H":
            n += v
        elif k == "foreach_copy_.runtime":
            n += v
        elif k.startswith("event.") or k.startswith("stream.") or k == "graph.replay":
            n += v
        elif k == "kern.apply":
            # two launches; on the CPU under --group-graphs it stands for CUDA's replay (GroupGraphs is CUDA's only:
            # there kern.apply is counted for a launch alone, its replays as graph.replay)
            n += v if group_graphs and not CUDA else 2 * v
    return n


def main():
    _window()
    script = Path(__file__).resolve().parents[3] / "deploy" / "device" / "decode_host.py"    # one measure, both sides
    sys.argv = [str(script)] + sys.argv[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
    res = json.loads(out.getvalue())
    n = len(PER_LAYER)
    keys = sorted({k for d in PER_LAYER for k in d})
    mean = {k: round(sum(d.get(k, 0) for d in PER_LAYER) / max(n, 1), 3) for k in keys}
    gg = "--group-graphs" in sys.argv
    res["miss_layers"] = n
    res["calls_per_miss_layer"] = mean
    res["runtime_calls_per_miss_layer"] = round(sum(_runtime(d, gg) for d in PER_LAYER) / max(n, 1), 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
