"""What a piece of torch code allocates and launches, measured on any device (the CPU included).

PeakLive: peak bytes of the tensors it allocates: a TorchDispatchMode that counts each op's fresh output storages
and drops them when the last tensor viewing them is collected.

Storages that existed before (weights, caches: in-place writes into them, views of them) are not counted, nor an
op's internal temporaries that never reach Python: what it measures is the live activations, the thing the slot
plan's activation estimate must bound (tests/store/test_vram_plan.py). shapes_only=True skips the arithmetic of the
matrix products (their outputs are allocated, not computed): the allocation pattern of a pass at full model shapes
in a fraction of the time, its values meaningless.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


aten = torch.ops.aten
_MATMUL = {aten.mm.default: lambda a, b: (a.shape[0], b.shape[1]),
           aten.addmm.default: lambda c, a, b: (a.shape[0], b.shape[1]),
           aten.bmm.default: lambda a, b: (a.shape[0], a.shape[1], b.shape[2])}


class PeakLive(TorchDispatchMode):
    def __init__(self, shapes_only: bool = False):
        super().__init__()
        self.shapes_only = shapes_only
        self.refs: dict[int, list] = {}        # storage data_ptr -> [bytes, tensors alive that view it]
        self.current = 0
        self.peak = 0

    def _drop(self, key: int):
        ent = self.refs.get(key)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] == 0:
            self.current -= ent[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shape = _MATMUL.get(func) if self.shapes_only else None
        if shape is not None:
            a = args[-1]
            out = torch.empty(shape(*args[:3]), dtype=a.dtype, device=a.device)
        else:
            out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.refs:                   # a view of a counted storage: one more owner
                self.refs[key][1] += 1
            elif key in seen or key == 0:          # in place / a view of a storage from before
                continue
            else:
                n = t.untyped_storage().nbytes()
                self.refs[key] = [n, 1]
                self.current += n
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._drop, key)
        return out


# ops that make a view or only allocate: no kernel runs on CUDA for them
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "slice", "select", "expand", "transpose", "t", "unsqueeze", "squeeze",
              "as_strided", "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "lift_fresh",
              "empty", "empty_like", "empty_strided", "new_empty"}


class KernelCount(TorchDispatchMode):
    """Ops that launch a kernel on CUDA (views and bare allocations excluded), by name; with stub_triton, the Triton
    launches too: an estimate of a CUDA step's launches from a CPU run."""

    def __init__(self, triton_launches: collections.Counter | None = None):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.triton = triton_launches if triton_launches is not None else collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _Launcher:
    """A Triton kernel whose launches only count (the wrapper's output allocations still happen)."""

    def __init__(self, name: str, counter: collections.Counter):
        self.name, self.counter = name, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[self.name] += 1
        return launch


def stub_triton(monkeypatch) -> collections.Counter:
    """deepseek4's Triton kernels (kernels/triton_ds4.py, triton_norm's RMSNorm) replaced by counters: TritonOps runs
    on the CPU with CUDA's allocations and launch count, its values meaningless. Returns the launch counter."""
    from betelgeuse.kernels import triton_ds4, triton_norm
    counter: collections.Counter = collections.Counter()
    monkeypatch.setattr(triton_norm, "_rms_kernel", _Launcher("_rms_kernel", counter))
    for name in dir(triton_ds4):
        if name.startswith("_") and name.endswith("_kernel"):
            monkeypatch.setattr(triton_ds4, name, _Launcher(name, counter))
    return counter
