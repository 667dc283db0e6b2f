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
