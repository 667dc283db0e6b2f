"""Peak bytes of the tensors a piece of torch code allocates, on any device (the CPU included): a TorchDispatchMode
that counts each op's fresh output storages and drops them when the last tensor viewing them is collected.

Storages that existed before (weights, caches: in-place writes into them, views of them) are not counted, nor an
op's internal temporaries that never reach Python: what it measures is the live activations, the thing the slot
plan's activation estimate must bound (tests/test_vram_plan.py). shapes_only=True skips the arithmetic of the
matrix products (their outputs are allocated, not computed): the allocation pattern of a pass at full model shapes
in a fraction of the time, its values meaningless.
"""

from __future__ import annotations

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
