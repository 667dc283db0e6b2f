"""kernels/triton_launch.cdiv / pow2, the host-side grid arithmetic of the expert launches, are Triton's own
triton.cdiv / triton.next_power_of_2 (constexpr functions, slow to call from the host) on every int they get."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from betelgeuse.kernels.triton_launch import cdiv, pow2  # noqa: E402


def test_cdiv_is_tritons():
    for x in list(range(0, 600)) + [2**31 - 1, 2**31, 2**40 + 3]:
        for y in (1, 2, 3, 7, 16, 32, 64, 128, 256, 1000):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)


def test_pow2_is_tritons():
    for n in list(range(1, 5000)) + [2**k + d for k in range(12, 62) for d in (-1, 0, 1)]:
        assert pow2(n) == triton.next_power_of_2(n), n
    with pytest.raises(AssertionError):
        pow2(0)
