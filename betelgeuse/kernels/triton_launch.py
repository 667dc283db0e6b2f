"""Triton launches without the JIT's per-call specialization.

`kernel[grid](*args, **consts)` goes through JITFunction.run on every call: it binds the arguments, specializes each
one in C++ (native_specialize_impl: dtype, 16-byte alignment of pointers, ==1 / %16 of ints), builds a string cache key
and looks the compiled kernel up: ~100 us of host per launch on the H200 machine (Triton 3.6), more than a decode
expert launch's GPU time. Launcher does that once per key and then calls the CompiledKernel the first call returned
(Triton's public `compiled[grid](*args, stream=...)`, all parameters in signature order, the launcher skipping the
constexprs), keyed by what the JIT specializes on, taken conservatively:

  tensor   (dtype, data_ptr % 16 == 0)      the JIT's pointer specialization (element type, 16-byte divisibility)
  int      the value itself                 covers ==1 (a constexpr), %16 and the i32/i64 range; the kernels here
                                            take geometry ints only (H, F, row bytes, experts, k, chunk), a handful
                                            of values per model; past MAX_KEYS keys a kernel launches through the JIT
  float    float                            fp32, never specialized on the value
  other    the value (None, bool, constexprs); a tuple or list argument (its members specialized one by one) makes
           the kernel launch through the JIT from then on

plus the launch options (num_warps, num_stages, ...) and the current device. Under TRITON_INTERPRET=1 (the kernel
is not a JITFunction), or where the first call does not hand back a CompiledKernel, every launch takes the ordinary
path. The bits are the same either way: the same compiled binary with the same arguments (check_cuda.py --only
launch checks it).

COUNTS counts launches per kernel name (both paths, the interpreter's included): the tests bound launches per layer;
DIRECT those that took the direct path. $BETELGEUSE_TRITON_DIRECT=0 (or ENABLED = False) launches everything through
the JIT (the check's baseline, a way out should a Triton release change the launcher's calling convention).
"""

from __future__ import annotations

import os
from collections import Counter

import torch

try:                                      # public since Triton 3.0 (compiled kernels, the active driver)
    from triton.compiler import CompiledKernel
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:                       # pragma: no cover - an older or newer layout: the JIT path only
    CompiledKernel = JITFunction = driver = None

MAX_KEYS = 64                             # direct-launch keys per kernel; past it the JIT path (unbounded int args)
COUNTS: Counter = Counter()               # launches per kernel name (tests, profiles)
DIRECT: Counter = Counter()               # of those, launched through the compiled kernel directly
ENABLED = os.environ.get("BETELGEUSE_TRITON_DIRECT", "1") != "0"


def _spec(a):
    """What the JIT specializes an argument on (module doc), as a hashable key part."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if isinstance(a, float):
        return float
    if isinstance(a, (tuple, list)):
        raise TypeError("a tuple argument: the JIT specializes its members")
    return a.__class__, a                 # True and 1 apart (u1 vs the constexpr 1)


class Launcher:
    """kernel[grid](*args, **kw) with the JIT's binding and specialization done once per key (module doc).
    `args` positional (in signature order), `kw` the remaining parameters by name and the launch options."""

    __slots__ = ("kernel", "name", "names", "params", "direct", "_compiled")

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
        self.direct = JITFunction is not None and isinstance(kernel, JITFunction)   # not the interpreter's
        self.names = [p.name for p in kernel.params] if self.direct else []
        self.params = frozenset(self.names)
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args: tuple, kw: dict):
        COUNTS[self.name] += 1
        if not (self.direct and ENABLED):
            return self.kernel[grid](*args, **kw)
        try:
            vals = [*args, *(kw[n] for n in self.names[len(args):])]
        except KeyError:                  # a parameter left to its default: the JIT binds it
            return self.kernel[grid](*args, **kw)
        dev = driver.active.get_current_device()
        try:
            key = (dev, *[(k, v) for k, v in kw.items() if k not in self.params], *map(_spec, vals))   # options too
        except TypeError:
            self.direct = False
            return self.kernel[grid](*args, **kw)
        ck = self._compiled.get(key)
        if ck is None:
            ck = self.kernel[grid](*args, **kw)
            if isinstance(ck, CompiledKernel) and len(self._compiled) < MAX_KEYS:
                self._compiled[key] = ck
            return ck
        g = tuple(grid) + (1,) * (3 - len(grid))
        ck[g](*vals, stream=driver.active.get_current_stream(dev))
        DIRECT[self.name] += 1
        return ck


def launcher(kernel) -> Launcher:
    """A Launcher for a @triton.jit kernel (module doc)."""
    return Launcher(kernel)


def stream_key(device: torch.device) -> tuple:
    """(device, its current raw CUDA stream, 0 on the CPU), without making a torch Stream object per call."""
    if device.type != "cuda":
        return device, 0
    i = device.index if device.index is not None else torch.cuda.current_device()
    return device, torch.cuda.current_stream(i).cuda_stream if driver is None else driver.active.get_current_stream(i)
