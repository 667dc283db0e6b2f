"""kernels/triton_mmq.py (act_quant q8_1, Triton interpreter): the q8_1 quantizer against a numpy port of llama.cpp's
quantize_row_q8_1_ref (ggml/src/ggml-quants.c), the Q8_0 int8-MMA experts against a numpy reference of the same
numerics on gguf-py's Q8_0 bytes (llama.cpp ggml-cuda/vecdotq.cuh vec_dot_q8_0_q8_1: d8_0 * d8_1 * sumi per
32-element block), against the float torch path within the int8 rounding's budget, and a row's bits alone and in 5
and 16 rows of its expert."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from gguf import quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402

E, H, FF = 3, 64, 64           # two 32-blocks per row: block scales per 32 vs per 64 differ


def ref_q8_1(x: np.ndarray):
    """numpy port of ggml-quants.c quantize_row_q8_1_ref per 32-block: d = amax / 127, id = 1/d, q = roundf(x id),
    s = sum(q) d; d and s kept as float32 (triton_mmq's doc: llama.cpp stores halves)."""
    x = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(x).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (x * inv[..., None]).astype(np.float32)
    t = np.floor(np.abs(v))
    q = (np.sign(v) * (t + (np.abs(v) - t >= 0.5))).astype(np.int32)     # roundf: half away from zero, exactly
    s = (q.sum(-1).astype(np.float32) * d).astype(np.float32)
    return q.reshape(x.shape[0], -1).astype(np.int8), d, s


def q8_0_parts(raw: np.ndarray, shape):
    """gguf-py Q8_0 bytes -> (int8 quants [N, K], float32 block scales [N, K/32]), checked against gguf-py's own
    dequantization bit for bit (so the reference multiplies gguf's weights)."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(shape[0], -1)
    q = blocks[:, 2:].copy().view(np.int8).reshape(shape)
    deq = gq.dequantize(raw.reshape(shape[0], -1), GT.Q8_0)
    assert np.array_equal(np.repeat(d, 32, 1) * q.astype(np.float32), deq)
    return q, d


def ref_mm(xq, dx, wq, dw, per: int = 32):
    """[M, N]: acc += float(int dot of block) * (dw * dx) over blocks of `per` in ascending K, fp32. per = 64: the
    wrong schedule (one block's scales for two) the tests must catch."""
    M, N = xq.shape[0], wq.shape[0]
    acc = np.zeros((N, M), np.float32)
    for kb in range(xq.shape[1] // per):
        c = slice(kb * per, (kb + 1) * per)
        dot = wq[:, c].astype(np.int32) @ xq[:, c].astype(np.int32).T
        b = kb * per // 32
        acc = (acc + dot.astype(np.float32) * (dw[:, b][:, None] * dx[:, b][None, :])).astype(np.float32)
    return acc.T


def experts(seed=0):
    """E experts' Q8_0 (gate, up, down) bytes from gguf-py's quantizer; the second 32 columns 4x the first, so a
    block's scales are not its neighbour's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(E):
        parts = []
        for shp in ((FF, H), (FF, H), (H, FF)):
            x = rng.standard_normal(shp).astype(np.float32)
            x[:, 32:] *= 4
            parts.append(gq.quantize(x, GT.Q8_0).reshape(-1))
        out.append(parts)
    return out


def moe_ref(raw, h, ids, w, per=32):
    """numpy reference of the whole layer with q8_1 activations (gate_up -> silu * up -> q8_1 -> down -> combine)."""
    T, k = ids.shape
    hq, hd, _ = ref_q8_1(h)
    out = np.zeros((T, H), np.float32)
    for t in range(T):
        for r in range(k):
            e = int(ids[t, r])
            (gq_, gd), (uq, ud), (dq, dd) = (q8_0_parts(raw[e][i], s) for i, s in
                                             enumerate(((FF, H), (FF, H), (H, FF))))
            g = ref_mm(hq[t:t + 1], hd[t:t + 1], gq_, gd, per)
            u = ref_mm(hq[t:t + 1], hd[t:t + 1], uq, ud, per)
            a = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
            aq, ad, _ = ref_q8_1(a)
            y = ref_mm(aq, ad, dq, dd, per)[0]
            out[t] = (out[t] + np.float32(w[t, r]) * y).astype(np.float32)
    return out


def run(raw, h, ids, w, act_quant="q8_1"):
    pool, starts, base, slot = pack_experts(lambda e: [torch.from_numpy(p) for p in raw[e]], range(E), E, "cpu")
    deq = [[torch.from_numpy(gq.dequantize(p.reshape(s[0], -1), GT.Q8_0)) for p, s in
            zip(raw[e], ((FF, H), (FF, H), (H, FF)))] for e in range(E)]
    backend = "torch" if act_quant == "torch" else "triton"
    k = MoEKernels(backend, E, FF, starts[None], [(8, 8)], 16, weights_fn=lambda b, l, e: deq[e],
                   act_quant="off" if act_quant == "torch" else act_quant)
    if backend == "triton":
        assert k.mmq_parts(0, H) == ((True, True) if act_quant == "q8_1" else (False, False))
    r = k.route(torch.from_numpy(h), torch.from_numpy(ids), torch.from_numpy(w))
    k.apply(r, 0, pool, Group(None, base, torch.from_numpy(base)), slot)
    return k.combine(r).numpy()


def test_quantize_q8_1_matches_llama_cpp_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.float32([[0.01], [1], [30], [1e-3], [5]])
    x[1, 32:64] = 0                                       # an all-zero block: d = 0, q = 0
    x[2, 0] = 127 * 0.25                                  # d = 0.25, id = 4: x * id = k + 1/2 exactly
    x[2, 1:32] = np.float32(0.25) * (np.arange(31) - 15) + np.float32(0.125)
    x[4, 0], x[4, 1] = 127, np.nextafter(np.float32(0.5), np.float32(0))   # d = id = 1: floor(x + 0.5) gives 1
    q, d, s = mq.quantize_q8_1(torch.from_numpy(x))
    rq, rd, rs = ref_q8_1(x)
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd) and np.array_equal(s.numpy(), rs)
    # roundf: half away from zero (-14.5 -> -15, 0.5 -> 1; numpy's round, half to even, gives -14 and 0)
    assert rd[2, 0] == np.float32(0.25) and rq[2, 1] == -15 and rq[2, 16] == 1 and rq[4, 1] == 0
    assert np.array_equal(rq[2, 1:32], np.arange(31) - 15 + (np.arange(31) >= 15) * 1)


def test_q8_0_mmq_matches_numpy_reference_and_blocks_are_32():
    raw = experts()
    rng = np.random.default_rng(2)
    T, k = 7, 2
    h = rng.standard_normal((T, H)).astype(np.float32) * np.float32(0.1)
    h[:, 32:] *= 4
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    got = run(raw, h, ids, w)
    want = moe_ref(raw, h, ids, w)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-6, err                          # the same float ops (the interpreter: numpy's, in order)
    wrong = moe_ref(raw, h, ids, w, per=64)          # one block's scales for 64 elements
    assert np.abs(wrong - want).max() / np.abs(want).max() > 1e-2


def test_q8_1_within_the_int8_budget_of_the_float_path():
    """|y_q8_1 - y_float| / max|y_float| < 3%: each activation rounds by up to amax/254 of its block (twice: h and
    the down input); the float path is the torch reference (exact)."""
    raw = experts(3)
    rng = np.random.default_rng(4)
    T, k = 6, 2
    h = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    ref = run(raw, h, ids, w, "torch")
    got = run(raw, h, ids, w)
    off = run(raw, h, ids, w, "off")
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert 1e-4 < rel < 3e-2, rel                      # approximate, but by the rounding only
    assert np.abs(off - ref).max() / np.abs(ref).max() < 1e-5       # off: the float schedules, unchanged


def test_a_rows_bits_do_not_depend_on_its_block():
    """Token 0 routed to expert 0 alone (1 row), with 4 others (5 rows) and with 15 (16 rows, a full BM block):
    its output the same bits each time."""
    raw = experts(5)
    rng = np.random.default_rng(6)
    h = rng.standard_normal((16, H)).astype(np.float32)
    outs = []
    for n in (1, 5, 16):
        ids = np.zeros((n, 1), np.int64)
        outs.append(run(raw, h[:n], ids, np.ones((n, 1), np.float32))[0])
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_act_quant_setting_and_flag():
    import argparse
    from betelgeuse.config import EngineConfig
    from betelgeuse.errors import BetelgeuseError
    from betelgeuse.settings import add_flags, flag_values, resolve_settings
    assert EngineConfig(model_path="m.gguf").act_quant == "off"
    assert EngineConfig(model_path="m.gguf", act_quant="q8_1").act_quant == "q8_1"
    with pytest.raises(BetelgeuseError, match="act_quant"):
        EngineConfig(model_path="m.gguf", act_quant="q4")
    p = argparse.ArgumentParser()
    add_flags(p, sections=["engine"])
    with pytest.raises(BetelgeuseError, match=r"--act-quant.*expected one of"):
        resolve_settings(None, env={}, flags=flag_values(p.parse_args(["--act-quant", "int4"])))


def test_compiles_to_int8_tensor_core_mma_for_sm90_without_spills():
    """triton.compile for sm_90 (no GPU: the ptxas of the triton wheel): the int8 wgmma is in the PTX, IGMMA in the
    SASS, and no register spills. In a child without TRITON_INTERPRET (which turns every jit function into an
    interpreted one that cannot compile)."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "betelgeuse.kernels.triton_mmq"], env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    reports = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in reports] == ["gate_up", "down"], p.stdout
    for r in reports:
        assert any(".s32.s8.s8" in m for m in r["mma"]), r
        assert any(m.startswith("IGMMA") or m.startswith("IMMA") for m in r["imma"]), r
        assert r["spill_bytes"] == 0 and r["regs"] <= 255, r
