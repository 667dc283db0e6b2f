"""The ops of a decode step that WOULD make the host wait for the GPU on CUDA, found on the CPU (issue 21, sync48).

On CUDA torch.cuda.set_sync_debug_mode lists host-blocking ops (decode_host.py --sync-debug); with no GPU this runs
decode_host.py's decode on the CPU under a torch function mode that tells the tensors meant for the device from
host ones and records, by call site in betelgeuse/, each op that would synchronize there:

    h2d      a copy into a device tensor from a host tensor not meant to be pinned (copy_, .to(device), index_copy_,
             torch.tensor(data, device=), _foreach_copy_): pageable memory, a staged (blocking) copy
    d2h      a read of a device tensor on the host (.item(), .tolist(), .cpu(), .numpy(), bool(), int(), .to("cpu"),
             a copy_ into a host tensor)
    index    a device tensor indexed by a host tensor or a Python list (the index is uploaded from pageable memory)
    dynamic  an op on a device tensor whose output size is data-dependent (nonzero, unique, masked_select)
    pin      a pinned host allocation (.pin_memory(), pin_memory=True): cudaHostAlloc where torch's caching host
             allocator has no free block (one whose copies are done), host-synchronizing

A site inside the pass clock's counted waits (PassClock.wait / wait_store: the routing sync, the store, the bank
waits) is counted as blocked time by stats.py, so it is kept apart (`counted`), not reported as a hidden sync.

Which tensors are meant for the device: those made with an explicit device= (the runner passes its device to every
device tensor; host ones are made without one), moved with .to(device) / .to(tensor of the device), and every op's
output with a device input (views, math). Pinned-meant host tensors: made with a pin_memory= keyword (the code
passes pin_memory=is_cuda: False on the CPU, True on CUDA) or .pin_memory(), and their views.
What the CPU cannot see: branches the code takes only on CUDA (torch.cuda.* calls, events, streams, the Triton
kernels' host code where the CPU runs the torch kernels); those are read, not run (docs/benchmarks/cpu-sync48).
With --device cuda the same tool judges the tensors themselves (is_cuda, is_pinned() and non_blocking: a copy from
pinned memory without non_blocking syncs too) and adds a fourth kind, `wait`: Event / Stream synchronize and
torch.cuda.synchronize outside the counted waits, which torch.cuda.set_sync_debug_mode (decode_host --sync-debug)
does not report, nor pinned allocations.

    python3 deploy/device/sync_audit.py [decode_host.py's flags, e.g. --preset ds4-tiny --form solo --vram 2
                                         --host 3 --flex on --flex-slots 3 --tokens 12 [--device cuda]]
-> JSON: decode_host's result plus sync_audit {"hidden": {kind@file:line:function: per timed step}, "counted":
{...}}. It leaves sys.path to PYTHONPATH for betelgeuse (ab.py's --script: either checkout's code; decode_host is
this folder's). The mode's Python costs every torch op: read its sites, not its times.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

HERE = Path(__file__).resolve().parent
PKG = os.sep + "betelgeuse" + os.sep

_DEV, _PIN = "_bg_dev", "_bg_pin"          # the tags: meant for the device / a pinned host tensor


PINNED_STORAGES: set[int] = set()         # host memory registered (pinned) on CUDA: the slot pool's arena


def _is(t, tag: str) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if getattr(t, tag, False):
        return True
    return tag == _PIN and bool(PINNED_STORAGES) and t.device.type == "cpu" and \
        t.untyped_storage().data_ptr() in PINNED_STORAGES


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _tag(out, tag: str):
    for t in _tensors(out):
        try:
            setattr(t, tag, True)
        except (AttributeError, RuntimeError):
            pass


def _device_arg(args, kwargs, dev=lambda t: _is(t, _DEV)) -> bool:
    """A .to()'s target is a device (not a dtype alone): a device, a string naming one, or a device tensor."""
    for a in list(args) + [kwargs.get("device"), kwargs.get("other")]:
        if isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor) and dev(a)):
            return True
    return False


def _site() -> str:
    """The innermost frame in betelgeuse/ (file:line:function), else the innermost outside this file and torch."""
    fallback = None
    for fr in reversed(traceback.extract_stack()[:-3]):
        if PKG in fr.filename:
            return f"{Path(fr.filename).name}:{fr.lineno}:{fr.name}"
        if fallback is None and "torch" not in fr.filename and fr.filename != __file__:
            fallback = f"{Path(fr.filename).name}:{fr.lineno}:{fr.name}"
    return fallback or "?"


_T = torch.Tensor
READS = {_T.item, _T.tolist, _T.cpu, _T.numpy, _T.__bool__, _T.__int__, _T.__float__, _T.__index__}
DYNAMIC = {torch.nonzero, _T.nonzero, torch.unique, _T.unique, torch.masked_select, _T.masked_select,
           torch.argwhere, _T.argwhere}
INDEX = {_T.__getitem__, _T.__setitem__, _T.index_select, torch.index_select, _T.index_copy_, _T.index_put_,
         _T.index_fill_, _T.index_add_}
FACTORIES = {torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange,
             torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.randn, torch.rand,
             torch.eye, torch.linspace}


class SyncAudit(TorchFunctionMode):
    """Records would-sync ops while `on`, by kind@site: inside a pass clock's counted wait (waiting > 0) in
    `counted`, else in `hidden`. cuda False (the CPU): device-meant and pinned-meant tensors are told by tags (module
    doc) and non_blocking is not judged (the code passes non_blocking=is_cuda: False on the CPU); cuda True (a GPU):
    by the tensors themselves (is_cuda, is_pinned()), a copy from pinned memory syncs unless non_blocking, and the
    explicit waits (Event/Stream.synchronize, torch.cuda.synchronize) outside the counted ones are recorded too."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.cuda = cuda
        self.on = False
        self.waiting = 0
        self.hidden: dict[str, int] = {}
        self.counted: dict[str, int] = {}
        self._undo: list = []

    def dev(self, t) -> bool:
        if self.cuda:
            return isinstance(t, torch.Tensor) and t.is_cuda
        return _is(t, _DEV)

    def pin(self, t, kwargs) -> bool:
        """A host tensor a copy from / into which does not block: pinned (on CUDA: and non_blocking)."""
        if self.cuda:
            return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_pinned() and \
                bool(kwargs.get("non_blocking"))
        return _is(t, _PIN)

    def note(self, kind: str):
        if not self.on:
            return
        d = self.counted if self.waiting else self.hidden
        k = f"{kind}@{_site()}"
        d[k] = d.get(k, 0) + 1

    def __enter__(self):
        if self.cuda:                           # the explicit waits: recorded where they are not counted
            for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                                (torch.cuda, "synchronize")):
                fn = getattr(owner, name)

                def waits(*args, _fn=fn, **kw):
                    self.note("wait")
                    return _fn(*args, **kw)
                setattr(owner, name, waits)
                self._undo.append((owner, name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, fn in self._undo:
            setattr(owner, name, fn)
        self._undo = []
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cuda and not self.on:          # (no is_pinned() while decode graphs capture: the first steps)
            return func(*args, **kwargs)
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        dev_in = any(self.dev(t) for t in ins)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # ---- what would sync, judged before the op runs
        if func in (_T.copy_, torch._foreach_copy_):
            pairs = [(args[0], args[1])] if func is _T.copy_ else list(zip(args[0], args[1]))
            for dst, src in pairs:
                if self.dev(dst) and not self.dev(src) and not self.pin(src, kwargs):
                    self.note("h2d")
                elif self.dev(src) and not self.dev(dst) and not (self.pin(dst, kwargs) and
                                                                  (self.cuda or kwargs.get("non_blocking"))):
                    self.note("d2h")
        elif func is _T.to and _device_arg(args[1:], kwargs, self.dev):
            if self_t is not None and not self.dev(self_t) and not self.pin(self_t, kwargs):
                tgt = next((a for a in list(args[1:]) + [kwargs.get("device")] if a is not None), None)
                if not (self.cuda and isinstance(tgt, (str, torch.device)) and torch.device(tgt).type == "cpu"):
                    self.note("h2d")
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            if not (self.cuda and torch.device(kwargs["device"]).type == "cpu"):
                self.note("h2d")
        elif func in READS and self_t is not None and self.dev(self_t):
            self.note("d2h")
        elif func in DYNAMIC and dev_in:
            self.note("dynamic")
        elif func in INDEX and self_t is not None and self.dev(self_t):
            flat = []
            for x in args[1:] + tuple(kwargs.values()):
                flat.extend(x if isinstance(x, (tuple, list)) else [x])
            if any((isinstance(x, torch.Tensor) and not self.dev(x) and x.dim() > 0) or isinstance(x, list)
                   for x in flat):
                self.note("index")
            elif any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in flat):
                self.note("dynamic")            # a boolean mask: its True count sizes the result (a nonzero)
        elif func is _T.pin_memory or (func in FACTORIES and "pin_memory" in kwargs):
            if func is _T.pin_memory or kwargs["pin_memory"] is not False or not self.cuda:
                self.note("pin")
        out = func(*args, **kwargs)
        if not self.cuda:
            self._tags(func, args, kwargs, ins, dev_in, self_t, out)
        return out

    @staticmethod
    def _tags(func, args, kwargs, ins, dev_in, self_t, out):
        """The CPU's tags (module doc): device-meant and pinned-meant outputs."""
        if func is _T.pin_memory or (func in FACTORIES and "pin_memory" in kwargs):
            _tag(out, _PIN)
        elif func in (_T.cpu, _T.numpy, _T.tolist, _T.item):
            pass
        elif func is _T.to and _device_arg(args[1:], kwargs):
            tgt = next((a for a in list(args[1:]) + [kwargs.get("device")] if a is not None), None)
            if isinstance(tgt, torch.Tensor):
                if _is(tgt, _DEV):
                    _tag(out, _DEV)
            elif not (isinstance(tgt, str) and tgt == "cpu" and _is(self_t, _DEV)):
                _tag(out, _DEV)
        elif func in FACTORIES and kwargs.get("device") is not None:
            _tag(out, _DEV)
        elif dev_in and func not in (_T.copy_, torch._foreach_copy_):
            _tag(out, _DEV)
        elif self_t is not None and _is(self_t, _PIN) and func not in (_T.copy_, torch._foreach_copy_):
            st = self_t.untyped_storage().data_ptr()
            for o in _tensors(out):             # a view of a pinned tensor is pinned
                if o.device.type == "cpu" and o.untyped_storage().data_ptr() == st:
                    _tag(o, _PIN)


def run(argv: list[str]) -> dict:
    """decode_host.run under the audit: records in the timed decode steps only (after prefill and --skip steps)."""
    if str(HERE) not in sys.path:         # run as a script it is sys.path[0] already; imported (the test), appended
        sys.path.append(str(HERE))
    import decode_host as dh
    from betelgeuse.worker.stats import PassClock
    import services.assembly as asm

    a = dh.parser().parse_args(argv)
    audit = SyncAudit(cuda=a.device.startswith("cuda"))
    steps = [0]

    def counted(wait0):
        """A PassClock wait that the audit counts as waiting while it runs."""
        def wait(self, fn, *args):
            audit.waiting += 1
            try:
                return wait0(self, fn, *args)
            finally:
                audit.waiting -= 1
        return wait
    # wait_store has its own body (not through wait: one Python call less an expert), so both are wrapped (and put
    # back at the end)
    wait0, wait_store0 = PassClock.wait, PassClock.wait_store
    PassClock.wait, PassClock.wait_store = counted(wait0), counted(wait_store0)
    open0 = asm.open_runner

    def open_runner(*args, **kw):
        rn = open0(*args, **kw)
        # the arena (host slots, staging slots) is registered with CUDA (ExpertCache.pinned, on an H100): pinned
        PINNED_STORAGES.add(rn.moe.cache.host.untyped_storage().data_ptr())
        for name in ("forward", "decode_batch"):
            fn = getattr(rn, name)

            def step(*args, _fn=fn, **kw):
                steps[0] += 1
                audit.on = steps[0] > 1 + a.skip          # prefill, then the skipped decode steps
                try:
                    return _fn(*args, **kw)
                finally:
                    audit.on = False
            setattr(rn, name, step)
        return rn
    asm.open_runner = open_runner
    try:
        with audit, tempfile.TemporaryDirectory(prefix="bg-sync-audit-") as d:
            res = dh.run(a, Path(d))
    finally:
        PassClock.wait, PassClock.wait_store = wait0, wait_store0
        asm.open_runner = open0
    n = max(1, res["tokens"])
    res["sync_audit"] = {k: {s: round(c / n, 2) for s, c in sorted(v.items(), key=lambda kv: -kv[1])}
                         for k, v in (("hidden", audit.hidden), ("counted", audit.counted))}
    return res


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
