"""kernels/triton_launch.py: the key a direct launch is reused under must separate whatever the JIT specializes on
(a pointer's dtype and 16-byte alignment, an int's value: ==1, %16, the i32/i64 range; bool apart from int), else a
compiled kernel would run on arguments it was not compiled for. The direct launch itself needs CUDA
(deploy/device/check_cuda.py --only launch: the same bits as the JIT's)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from betelgeuse.kernels.triton_launch import _spec  # noqa: E402


def test_key_separates_what_the_jit_specializes_on():
    a = torch.zeros(64, dtype=torch.float32)
    assert _spec(a) == _spec(a[4:]) and _spec(a[4:]) != _spec(a[1:])       # 16-byte aligned or not
    assert _spec(a) != _spec(a.view(torch.int32))                            # the element type
    assert len({_spec(x) for x in (1, 16, 17, 2 ** 31, True)}) == 5          # ==1, %16, ranges, u1
    assert _spec(0.5) == _spec(2.0) != _spec(2)                              # floats: fp32, never the value
