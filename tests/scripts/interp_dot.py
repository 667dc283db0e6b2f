"""Triton's interpreter computes tl.dot with np.matmul, whose summation order is the BLAS kernel's: OpenBLAS picks
its kernel by CPU (DYNAMIC_ARCH: Haswell's on this AMD EPYC, SkylakeX's on an AVX-512 Intel) and by the operands'
shape, so one output can get other bits when only the launch's row block (a dot's N) changes. On the GPU a dot's
output element does not depend on the other rows (ieee: an FMA chain in K order; the MMA: a fixed order per
element). install() gives the interpreter that property: acc + sum over k of a[:, k] b[k, :], strictly in k order,
in the accumulator's dtype, the same on every CPU. Slower than one matmul; the check scripts' dots are small.
(tests/kernels/test_kernels.py::test_split_k_schedules_match_torch_and_each_other_bit_for_bit compares a row alone,
BM 1 split, with the same row in a 16-row walked launch: np.matmul broke it on Haswell's kernels.)"""
from __future__ import annotations

import numpy as np


def install():
    from triton.runtime import interpreter as interp
    orig = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dt = d.data.dtype
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating() or \
                b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating() or a.data.ndim != 2:
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(dt), b.data.astype(dt)
        acc = np.array(d.data, dtype=dt, copy=True)
        for k in range(x.shape[1]):
            acc += x[:, k:k + 1] * y[k:k + 1, :]
        return interp.TensorHandle(acc, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot
