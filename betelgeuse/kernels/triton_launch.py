"""Triton launches, counted per kernel name.

`launcher(kernel)` wraps a @triton.jit kernel (or the interpreter's, under TRITON_INTERPRET=1): `wrapped[grid](*args,
**kw)` adds one to COUNTS[kernel name] and calls `kernel[grid](*args, **kw)`, Triton's own JIT dispatch, unchanged.
COUNTS is what the tests and profiles bound launches per layer with (tests/scripts/triton_engine_check.py,
deploy/device/profile_pass.py).

`cdiv` / `pow2`: triton.cdiv / triton.next_power_of_2 for the host's grid and constexpr arithmetic. Triton's are
constexpr functions (for kernels too): called from the host, each unwraps its arguments first, ~9 us a call on the
CPU here (a launch took four: 36 us of Python per expert group's two launches); these are the same integer formulas.

Triton's dispatch (argument binding, per-argument specialization, the cache key) costs ~36 us of host a launch on the
H200 machine (Triton 3.6). Launching the CompiledKernel directly, keyed by our own copy of the JIT's specialization
rules, was measured there and saved nothing (one gate_up launch 35.9 us through the JIT, 35.5 us direct; decode steps
8.5 ms either way), so the launches go through the JIT: no copy of its rules to fall out of step with a release.
"""

from __future__ import annotations

from collections import Counter

COUNTS: Counter = Counter()               # launches per kernel name (tests, profiles)


class Launcher:
    """`launcher(kernel)[grid](*args, **kw)`: counted, then `kernel[grid](*args, **kw)` (module doc)."""

    __slots__ = ("kernel", "name")

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kw):
            COUNTS[self.name] += 1
            return launch(*args, **kw)
        return counted


def cdiv(x: int, y: int) -> int:
    """triton.cdiv on host ints: ceil(x / y)."""
    return (x + (y - 1)) // y


def pow2(n: int) -> int:
    """triton.next_power_of_2 on a host int n >= 1: the smallest power of two >= n."""
    assert n >= 1, n
    return 1 << (n - 1).bit_length()


def launcher(kernel) -> Launcher:
    """A counted launcher for a @triton.jit kernel (module doc)."""
    return Launcher(kernel)

