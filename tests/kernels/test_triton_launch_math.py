"""kernels/triton_launch.cdiv / pow2, the host-side grid arithmetic of the expert launches, are Triton's own
triton.cdiv / triton.next_power_of_2 (constexpr functions, slow to call from the host) on every int they get."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

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


def test_launch_plans_follow_in_place_tuning_edits(monkeypatch):
    """triton_moe's launch plans (_plan, memoized by shapes and types): a repeated launch takes the arguments a fresh
    plan gives, and an in-place edit of TUNING or TYPE_CONFIG (the tuning scripts make them) reaches the next launch
    (stand-in launchers record each launch: no kernel runs)."""
    import torch

    from betelgeuse.gguf.qtypes import row_nbytes
    from betelgeuse.kernels import triton_moe as tk
    rec = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **kw: rec.append((grid, [x if not torch.is_tensor(x) else tuple(x.shape) for x in a],
                                                dict(kw)))
    for name in ("_GATE_UP", "_DOWN", "_GATE_UP_MV", "_DOWN_MV"):
        monkeypatch.setattr(tk, name, Rec())
    monkeypatch.setattr(tk, "_PLANS", {})
    E, H, F, R, qt_ggml = 64, 512, 256, 6, 8                          # Q8_0, decode's rows bucket
    qt = tk.QT_CODES[qt_ggml]
    monkeypatch.setitem(tk.TUNING, qt, {"reduce": {"MV": 0}, 1: {"BN_GATE_UP": 64}})

    def launch(R=R):
        tk.gate_up(torch.zeros(1, H), torch.zeros(64, dtype=torch.uint8), torch.zeros(E, dtype=torch.int64),
                   torch.zeros(E, 3, dtype=torch.int64), torch.zeros(R, dtype=torch.int32),
                   torch.zeros(E + 1, dtype=torch.int32), torch.zeros(R, F), F, R, qt, None, row_nbytes(qt_ggml, H),
                   True)
        return rec[-1]
    first = launch()
    assert launch() == first and len(tk._PLANS) == 1                   # memo hit: the same arguments
    tk._PLANS.clear()
    assert launch() == first                                           # a fresh plan: the same
    assert first[0][0] == cdiv(F, 64) and first[2]["BN"] == 64
    tk.TUNING[qt][1]["BN_GATE_UP"] = 32                                # in place, as the tuning scripts do
    edited = launch()
    assert edited[0][0] == cdiv(F, 32) and edited[2]["BN"] == 32
    monkeypatch.setitem(tk.TYPE_CONFIG, qt, {**tk.TYPE_CONFIG.get(qt, {}), "num_warps": 2})
    assert launch()[2]["num_warps"] == 2
    launch(R=12)
    assert len(tk._PLANS) == 2
    monkeypatch.setattr(tk, "PLANS_MAX", 2)                           # bounded: past it the memo starts over
    launch(R=18)
    assert len(tk._PLANS) == 1


@triton.jit
def _row_sum(x_ptr, row, j, BD: tl.constexpr):
    """Half the sum of row `row`'s j-th BD elements (x [rows, 4 BD]): tl.zeros and tl.sum are tl.core's functions."""
    acc = tl.zeros((BD,), tl.float32)
    acc += tl.load(x_ptr + row * 4 * BD + j * BD + tl.arange(0, BD))
    return tl.sum(acc * 0.5, 0)


@triton.jit
def _half_sums(x_ptr, y_ptr, BD: tl.constexpr):
    """y[row] = half the sum of x's row, one program a row, in 4 device calls."""
    row = tl.program_id(0)
    tot = 0.0
    for j in range(4):
        tot += _row_sum(x_ptr, row, j, BD)
    tl.store(y_ptr + row, tot)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU's interpreter (CUDA compiles)")
def test_interpreter_device_calls_patch_the_language_once_a_launch(monkeypatch):
    """triton_launch.interpreter_shortcuts: a launch's device-function calls (ours, and tl.sum / tl.zeros: tl.core's
    module) re-patch triton.language only where the launch has not (twice a launch here: the grid's, tl.core's first
    call) rather than at each of the 3 programs x 4 steps x 3 calls; the kernel's outputs are the bits of Triton's
    own calls (each device call patching again) and numpy's sums."""
    import numpy as np
    import torch
    from triton.runtime import interpreter as it

    from betelgeuse.kernels import triton_launch as TL
    assert TL.interpreter_shortcuts()

    x = torch.randn(3, 4 * 16, generator=torch.Generator().manual_seed(5))
    patches = []
    orig = it._patch_lang
    monkeypatch.setattr(it, "_patch_lang", lambda fn: patches.append(fn.__name__) or orig(fn))
    y = torch.zeros(3)
    TL.launcher(_half_sums)[(3,)](x, y, BD=16)
    assert len(patches) == 2, patches                   # the launch's, then tl.core's (tl.zeros) once
    patches.clear()
    grid_call, fn_call, _ = TL._INTERP_STATE["triton"]
    monkeypatch.setattr(it.GridExecutor, "__call__", grid_call)
    monkeypatch.setattr(it.InterpretedFunction, "__call__", fn_call)
    y0 = torch.zeros(3)
    _half_sums[(3,)](x, y0, BD=16)
    assert len(patches) > 3 * 4 * 3, len(patches)       # Triton's calls: each device call patches again
    assert torch.equal(y, y0)
    want = (x.numpy().reshape(3, 4, 16) * np.float32(0.5)).sum(-1, dtype=np.float64).sum(-1)
    # float32 sums of 64 terms of either sign: the error scales with the terms' magnitudes, not with a sum that may
    # cancel to near 0 (CI at 3601739: a sum of 0.042 off by 5.7e-6 of itself under a relative 1e-6, unseeded input)
    mag = 0.5 * x.abs().sum(-1).double().numpy()
    assert (np.abs(y.numpy() - want) <= 1e-6 * mag).all(), (y, want, mag)


@triton.jit
def _add_i32(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(z_ptr + i, tl.load(x_ptr + i) + tl.load(y_ptr + i))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU's interpreter (CUDA compiles)")
def test_interpreter_overflow_check_was_never_asserted(monkeypatch):
    """triton_launch.interpreter_shortcuts turns the interpreter's sanitize_overflow off: with Triton's options (debug
    off) an int32 add that overflows runs without an error and wraps, as it does without the check -- the check's
    device_assert is dropped -- so nothing is lost; with debug on the check does assert (and is left on)."""
    import dataclasses

    import torch
    from triton.runtime import interpreter as it

    from betelgeuse.kernels import triton_launch as TL
    assert TL.interpreter_shortcuts()
    triton_opts = TL._INTERP_STATE["triton"][2]
    assert not triton_opts.debug and triton_opts.sanitize_overflow
    assert not it.interpreter_builder.options.sanitize_overflow
    x = torch.tensor([2**31 - 1, 5, -2**31, 7], dtype=torch.int32)
    y = torch.tensor([1, 6, -1, -7], dtype=torch.int32)
    want = (x.long() + y.long() + 2**31) % 2**32 - 2**31
    outs = []
    for opts in (it.interpreter_builder.options, triton_opts):
        monkeypatch.setattr(it.interpreter_builder, "options", opts)
        z = torch.zeros(4, dtype=torch.int32)
        _add_i32[(1,)](x, y, z, N=4)
        outs.append(z)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0].long(), want), outs
    monkeypatch.setattr(it.interpreter_builder, "options", dataclasses.replace(triton_opts, debug=True))
    with pytest.raises(Exception, match="overflow"):
        _add_i32[(1,)](x, y, torch.zeros(4, dtype=torch.int32), N=4)
