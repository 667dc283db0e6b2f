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

E = 3
# per GGML type: (H, FF): Q8_0 two 32-blocks a row (block scales per 32 vs per 64 differ), Q4_K one super-block
DIMS = {8: (64, 64), 39: (64, 64), 12: (256, 256)}


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


def k4_scale_min(s12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K super-blocks [blocks, 12] -> (scale, min) [blocks, 8] int32 of the 8
    sub-blocks (ggml-quants.c get_scale_min_k4: 6-bit values, the high bits of sub-blocks 4..7 in bytes 0..7)."""
    s8 = s12.astype(np.int32)
    sc, m = np.zeros((len(s8), 8), np.int32), np.zeros((len(s8), 8), np.int32)
    for j in range(8):
        if j < 4:
            sc[:, j], m[:, j] = s8[:, j] & 63, s8[:, j + 4] & 63
        else:
            sc[:, j] = (s8[:, j + 4] & 15) | ((s8[:, j - 4] >> 6) << 4)
            m[:, j] = (s8[:, j + 4] >> 4) | ((s8[:, j] >> 6) << 4)
    return sc, m


def weight_parts(qt: int, raw: np.ndarray, shape):
    """GGUF bytes -> (int8 quants [N, K], float32 d per 32-block [N, K/32], float32 min per 32-block or zeros):
    Q8_0 (f16 d, 32 int8), MXFP4, Q4_K (f16 d, f16 dmin, 12 scale bytes as ggml's get_scale_min_k4, 128 nibble bytes;
    d sc and dmin m per 32), Q5_K (176-byte super-blocks: Q4_K's header, qh[32], qs[128]; sub-block j's quants: qs
    group j // 2, low nibble for j even, + 16 x bit j of qh[e]). Checked against gguf-py's dequantization (so the
    reference multiplies gguf's weights)."""
    N, K = shape
    if qt == 8:
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(N, -1)
        q = blocks[:, 2:].copy().view(np.int8).reshape(shape).astype(np.int8)
        mn = np.zeros_like(d)
    elif qt == 39:                  # MXFP4: E8M0 e (2^(e-128)), 16 bytes of e2m1 codes (llama.cpp kvalues_mxfp4, x2)
        blocks = raw.reshape(-1, 17)
        d = np.ldexp(np.float32(1), blocks[:, 0].astype(np.int32) - 128).astype(np.float32).reshape(N, -1)
        kv = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
        q = kv[np.concatenate([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], 1)].reshape(shape)
        mn = np.zeros_like(d)
    else:                           # Q4_K / Q5_K
        b = raw.reshape(-1, 144 if qt == 12 else 176)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = k4_scale_min(b[:, 4:16])
        if qt == 12:
            qs = b[:, 16:].reshape(-1, 4, 32)
            q = np.stack([qs & 15, qs >> 4], 2).reshape(-1, 256).astype(np.int8).reshape(shape)  # group g: 2g, 2g + 1
        else:
            qh = b[:, 16:48].astype(np.int32)                                   # [blocks, 32]
            qs = b[:, 48:].astype(np.int32).reshape(-1, 4, 32)
            q = np.stack([(qs[:, j // 2] >> (4 * (j % 2))) & 15 | ((qh >> j) & 1) << 4 for j in range(8)], 1)
            q = q.reshape(shape).astype(np.int8)
        mn = (dmin * m.astype(np.float32)).reshape(N, -1)
        d = (d * sc.astype(np.float32)).reshape(N, -1)
    deq = gq.dequantize(raw.reshape(N, -1), GT(qt))
    mine = np.repeat(d, 32, 1) * q.astype(np.float32) - np.repeat(mn, 32, 1)
    assert np.array_equal(mine, deq), np.abs(mine - deq).max()
    return q, d, mn


def chunk_sum(M: int, N: int, nb: int, per: int, kcb: int, part):
    """tot [M, N] = 0 + p_0 + p_1 + ... over K chunks of kcb blocks of `per` (the kernels' reduction key; each p_c
    accumulated from zero): part(c, b) -> p_c for element columns c and 32-block columns b."""
    tot = np.zeros((M, N), np.float32)
    for c0 in range(0, nb, kcb):
        c = slice(c0 * per, min(nb, c0 + kcb) * per)
        b = slice(c0 * per // 32, min(nb, c0 + kcb) * per // 32)
        tot = (tot + part(c, b)).astype(np.float32)
    return tot


def ref_mm(xq, dx, sx, wq, dw, mw, per: int = 32, kcb: int = 0):
    """[M, N]: acc += float(int dot of block) * (dw * dx) - mw * sx (one fma, as triton_mmq) over blocks of `per`
    in ascending K, fp32.
    per = 64: the wrong schedule (one block's scales for two) the tests must catch. kcb: blocks a K chunk
    (triton_mmq's reduction key; 0 = one chunk): tot = 0 + p_0 + p_1 + ..., each p_c accumulated from zero."""
    M, N = xq.shape[0], wq.shape[0]
    nb = xq.shape[1] // per
    if kcb and kcb < nb:
        return chunk_sum(M, N, nb, per, kcb,
                         lambda c, b: ref_mm(xq[:, c], dx[:, b], sx[:, b], wq[:, c], dw[:, b], mw[:, b], per))
    acc = np.zeros((N, M), np.float32)
    for kb in range(nb):
        c = slice(kb * per, (kb + 1) * per)
        dot = wq[:, c].astype(np.int32) @ xq[:, c].astype(np.int32).T
        b = kb * per // 32
        s = (dw[:, b][:, None] * dx[:, b][None, :]).astype(np.float32)
        p = dot.astype(np.float64) * s.astype(np.float64)          # exact: the fma's product (|dot| < 2^20)
        if mw.any():                                   # acc + fma(dot, s, -(mw sx))
            sxb = sx[:, b] if per == 32 else sx[:, b] + sx[:, b + 1]
            t = (p - (mw[:, b][:, None] * sxb[None, :]).astype(np.float32)).astype(np.float32)
            acc = (acc + t).astype(np.float32)
        else:                                          # fma(dot, s, acc)
            acc = (p + acc).astype(np.float32)
    return acc.T


def shapes(qt):
    H, FF = DIMS[qt]
    return ((FF, H), (FF, H), (H, FF))


def experts(qt, seed=0):
    """E experts' (gate, up, down) bytes: Q8_0 from gguf-py's quantizer (the second 32 columns 4x the first, so a
    block's scales are not its neighbour's), Q4_K random valid blocks (every 6-bit scale and min pattern)."""
    from betelgeuse.gguf.quants_synth import random_blocks
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(E):
        parts = []
        for shp in shapes(qt):
            if qt == 8:
                x = rng.standard_normal(shp).astype(np.float32)
                x[:, 32:] *= 4
                parts.append(gq.quantize(x, GT.Q8_0).reshape(-1))
            elif qt == 39:          # random valid blocks: every code, exponents 116..127 (block scales differ)
                b = rng.integers(0, 256, (shp[0] * shp[1] // 32, 17), dtype=np.uint8)
                b[:, 0] = rng.integers(116, 128, len(b))
                parts.append(b.reshape(-1))
            else:
                parts.append(np.ascontiguousarray(random_blocks(qt, shp[0] * shp[1] // 256, rng)).reshape(-1))
        out.append(parts)
    return out


def layer_ref(qt, raw, h, ids, w, act, mm, parts=None):
    """numpy reference of a whole layer: act(x rows) -> the activations as the kernels take them (row by row),
    mm(act, wq, dw, mw) -> [rows, N]; gate, up -> silu(g) u (float32) -> act -> down -> the weighted sum over ranks
    in order. parts: the weights' (quants, d, min) per shape (default weight_parts)."""
    parts = parts or weight_parts
    T, k = ids.shape
    out = np.zeros((T, h.shape[1]), np.float32)
    for t in range(T):
        x = act(h[t:t + 1])
        for r in range(k):
            e = int(ids[t, r])
            (gq_, gd, gm), (uq, ud, um), (dq, dd, dm) = (parts(qt, raw[e][i], s) for i, s in enumerate(shapes(qt)))
            g = mm(x, gq_, gd, gm)
            u = mm(x, uq, ud, um)
            a = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
            y = mm(act(a), dq, dd, dm)[0]
            out[t] = (out[t] + np.float32(w[t, r]) * y).astype(np.float32)
    return out


def moe_ref(qt, raw, h, ids, w, per=32, kcb=0):
    """numpy reference of the whole layer with q8_1 activations (gate_up -> silu * up -> q8_1 -> down -> combine)."""
    return layer_ref(qt, raw, h, ids, w, ref_q8_1, lambda x, *wp: ref_mm(*x, *wp, per, kcb))


def run(qt, raw, h, ids, w, act_quant="q8_1", groups=None, below=0):
    """The layer through MoEKernels (act_quant "torch": the torch reference backend); groups: lists of experts
    applied one group after another (tiers), default all at once. below (triton): the pool the kernels get starts
    at expert `below`'s slot, so experts 0 .. below - 1 lie below it at negative offsets (kernels.moe.Group: decode's
    at-hand table names flex chunks and host slots below the pool so)."""
    H, FF = DIMS[qt]
    pool, starts, base, slot = pack_experts(lambda e: [torch.from_numpy(p) for p in raw[e]], range(E), E, "cpu")
    if below:
        assert act_quant != "torch" and 0 < below < E      # the torch path slices the pool: no negative offsets
        pool, base = pool[below * slot:], base - below * slot
    deq = [[torch.from_numpy(gq.dequantize(p.reshape(s[0], -1), GT(qt))) for p, s in zip(raw[e], shapes(qt))]
           for e in range(E)]
    backend = "torch" if act_quant == "torch" else "triton"
    k = MoEKernels(backend, E, FF, starts[None], [(qt, qt)], 16, weights_fn=lambda b, l, e: deq[e],
                   act_quant="off" if act_quant == "torch" else act_quant)
    if backend == "triton":
        assert k.mmq_parts(0, H) == ((True, True) if act_quant in ("q8_1", "bf16") else (False, False))
    r = k.route(torch.from_numpy(h), torch.from_numpy(ids), torch.from_numpy(w))
    for grp in groups or [range(E)]:
        b = np.where(np.isin(np.arange(E), list(grp)), base, -1)
        k.apply(r, 0, pool, Group(None, b, torch.from_numpy(b)), slot)
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


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_mmq_matches_numpy_reference_and_blocks_are_32(qt):
    raw = experts(qt)
    H = DIMS[qt][0]
    rng = np.random.default_rng(2)
    T, k = 7, 2
    h = rng.standard_normal((T, H)).astype(np.float32) * np.float32(0.1)
    h[:, 32:64] *= 4
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    got = run(qt, raw, h, ids, w)
    want = moe_ref(qt, raw, h, ids, w)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-6, err                          # the same float ops (the interpreter: numpy's, in order)
    wrong = moe_ref(qt, raw, h, ids, w, per=64)      # one block's scales for 64 elements
    assert np.abs(wrong - want).max() / np.abs(want).max() > 1e-2


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_q8_1_within_the_int8_budget_of_the_float_path(qt):
    """|y_q8_1 - y_float| / max|y_float| < 3%: each activation rounds by up to amax/254 of its block (twice: h and
    the down input); the float path is the torch reference (exact). Experts split over two groups (tiers) give the
    bits of one group (location invariance: h quantized once, each row of the down input on its own)."""
    raw = experts(qt, 3)
    rng = np.random.default_rng(4)
    T, k = 6, 2
    h = rng.standard_normal((T, DIMS[qt][0])).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    ref = run(qt, raw, h, ids, w, "torch")
    got = run(qt, raw, h, ids, w)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert 1e-4 < rel < 3e-2, rel                      # approximate, but by the rounding only
    if qt == 8:                                        # off: the float schedules, unchanged
        off = run(qt, raw, h, ids, w, "off")
        assert np.abs(off - ref).max() / np.abs(ref).max() < 1e-5
    assert np.array_equal(run(qt, raw, h, ids, w, groups=[[1], [0, 2]]), got)


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_a_rows_bits_do_not_depend_on_its_block(qt):
    """Token 0 routed to expert 0 alone (1 row), with 4 others (5 rows) and with 15 (16 rows, a full BM block), and
    at BM 32 / BN 32: its output the same bits each time."""
    raw = experts(qt, 5)
    rng = np.random.default_rng(6)
    h = rng.standard_normal((16, DIMS[qt][0])).astype(np.float32)
    outs = []
    for n in (1, 5, 16):
        ids = np.zeros((n, 1), np.int64)
        outs.append(run(qt, raw, h[:n], ids, np.ones((n, 1), np.float32))[0])
    with pytest.MonkeyPatch.context() as mp:            # another schedule: 32 rows a block, 32 outputs a program
        mp.setitem(mq.CONFIG, "BM", 32)
        mp.setitem(mq.CONFIG, "BN", 32)
        outs.append(run(qt, raw, h[:5], np.zeros((5, 1), np.int64), np.ones((5, 1), np.float32))[0])
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_k_steps_give_the_one_block_bits_and_split_k_the_walked_bits(qt):
    """H = F = 256 (8 quant blocks). K steps of KB = 2 / 4 / 8 blocks (one MMA on block-diagonal activations, the
    block partials scaled and added in ascending order), and gate_up's gate and up rows in one MMA (FUSE), give the
    bits of the one-block-a-step kernel (KB = 1, the schedule before K steps) for 16 rows; with chunks of KCB = 2
    blocks a token's row alone (the 1-row bucket: one program per chunk, the tile's last sums the chunks) equals the
    same row among 16 (chunks walked) and the numpy reference of the chunked sums, and differs from the unchunked
    bits (so the chunks are real)."""
    rng = np.random.default_rng(7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DIMS, qt, (256, 256))
        raw = experts(qt, 8)
        h = rng.standard_normal((16, 256)).astype(np.float32)
        h[:, 32:64] *= 4
        ids, w = np.zeros((16, 1), np.int64), np.ones((16, 1), np.float32)
        code = {8: 0, 39: 4, 12: 5}[qt]

        def with_cfg(n, **cfg):
            mp.setitem(mq.TYPE_CONFIG, code, cfg)
            return run(qt, raw, h[:n], ids[:n], w[:n])
        old = with_cfg(16, KB=1, KCB=0)
        assert np.abs(old - moe_ref(qt, raw, h, ids, w)).max() / np.abs(old).max() <= 1e-6
        for kb in (2, 4, 8):
            assert np.array_equal(with_cfg(16, KB=kb, KCB=0), old), kb
        assert np.array_equal(with_cfg(16, KB=2, KCB=0, FUSE=1), old)           # gate and up rows in one MMA
        assert np.array_equal(with_cfg(1, KB=4, KCB=0)[0], old[0])
        chunked = with_cfg(16, KB=2, KCB=2)
        # split over programs == walked (KCB 2 is no multiple of MXFP4's and Q4_K's MV word group: the MMA runs, at
        # the MMA's BN 64 rather than their one-row MV's 16, a quarter of the interpreted programs; its bits do not
        # depend on BN: test_a_rows_bits_do_not_depend_on_its_block)
        assert np.array_equal(with_cfg(1, KB=2, KCB=2, BN=64)[0], chunked[0])
        assert np.array_equal(with_cfg(1, KB=1, KCB=2, FUSE=1, BN=64)[0], chunked[0])
        want = moe_ref(qt, raw, h[:1], ids[:1], w[:1], kcb=2)[0]
        assert np.abs(chunked[0] - want).max() / np.abs(want).max() <= 1e-6
        assert not np.array_equal(chunked, old)


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


def _compile_reports(argv: list[str], timeout: int) -> list[dict]:
    """`python argv` in a child without TRITON_INTERPRET (which turns every jit function into an interpreted one that
    cannot compile) -> the compile reports it printed, one JSON object a line (triton_mmq.compile_report)."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_compiles_to_int8_tensor_core_mma_for_sm90_without_spills():
    """triton.compile for sm_90 (no GPU: the ptxas of the triton wheel), each kernel at both rows buckets (1: split-K):
    the int8 wgmma is in the PTX, KB of them per commit (a K step), IGMMA in the SASS, and no register spills. In a
    child without TRITON_INTERPRET (which turns every jit function into an interpreted one that cannot compile)."""
    reports = _compile_reports(["-m", "betelgeuse.kernels.triton_mmq"], timeout=240)
    assert [(r["kernel"], r["qt"], r["bucket"]) for r in reports] == [
        (k, qt, b) for qt in sorted(mq.MMQ_TYPES) for k in ("gate_up", "down") for b in (1, 16)], reports
    for r in reports:
        assert r["config"]["SPLIT"] == (r["bucket"] == 1), r
        if (r["qt"], r["bucket"]) in mq.TYPE_BUCKET and mq.TYPE_BUCKET[r["qt"], r["bucket"]].get("MV"):
            # the shipped one-row schedule without tensor cores (triton_mmq_mv): word loads only, no MMA
            assert r["config"]["MV"] and not r["mma"] and r["spill_bytes"] == 0, r
            assert not any(w in k for k in r["loads"] for w in (".b8", ".u8", ".s8", ".b16", ".u16")), r
            continue
        assert any(".s32.s8.s8" in m for m in r["mma"]), r
        assert r["config"]["KB"] == mq.BUCKETS[r["bucket"]]["KB"], r
        # K steps: KB back-to-back k32 MMAs per commit (the block-diagonal activations: N = KB x BM per 2 warpgroups)
        n_mma = sum(v for m, v in r["mma"].items() if "mma_async" in m)
        assert n_mma == r["config"]["KB"] * r["mma"]["wgmma.commit_group.sync.aligned"], r
        assert any(m.startswith("IGMMA") or m.startswith("IMMA") for m in r["imma"]), r
        assert r["spill_bytes"] == 0 and r["regs"] <= 255, r


@pytest.mark.slow
def test_engine_with_q8_1_is_location_invariant(tmp_path):
    """The engine (qwen3moe, Q8_0 experts, kernels "triton", act_quant "q8_1" through EngineConfig): logits
    bit-identical across slot configurations (VRAM, host and disk tiers; all in VRAM), cold / warm /
    after consolidation and over decode steps; really quantized (not the torch engine's logits) and within the
    q8_1 budget of them, with the same greedy tokens (tests/scripts/triton_engine_check.py --act-quant q8_1)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", BETELGEUSE_TRITON_TUNING="off",
               PYTHONPATH=str(here.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = here / "scripts" / "triton_engine_check.py"
    p = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", str(script), "--act-quant", "q8_1",
                        str(tmp_path / "engine.gguf")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])["configs"]
    assert len(res) == 2
    for key, r in res.items():
        assert r["bit_identical"], key
        assert 1e-4 * r["max_logit"] < r["max_abs_vs_torch"] <= 0.05 * r["max_logit"], (key, r)
        assert r["greedy_equal_torch"], key
    assert res["3v8h"]["reads"][2]["host"] > 0 and res["3v8h"]["reads"][2]["vram"] > 0


def _one_expert(mp, qt: int, K: int, rows: int, seed_experts: int, seed: int):
    """The schedule tests' launch: experts of type qt at H = F = K (DIMS patched through mp), `rows` rows of
    activations (a band of columns x4: blocks of different scales) all routed to expert 0 with weight 1 ->
    (raw experts, h [rows, K], ids [rows, 1], w [rows, 1], the kernels' type code)."""
    mp.setitem(DIMS, qt, (K, K))
    raw = experts(qt, seed_experts)
    h = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)
    h[:, 64:96] *= 4
    ids, w = np.zeros((rows, 1), np.int64), np.ones((rows, 1), np.float32)
    return raw, h, ids, w, {8: 0, 39: 4, 12: 5}[qt]


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_decode_schedule_without_mma_gives_the_mma_bits(qt):
    """triton_mmq_mv (MV = 1: word loads, the block dots on the float units) gives the int8 MMA's bits: H = F = 256
    (8 blocks) in chunks of KCB = 4 blocks (Q4_K: 512, chunks of 8, its word group), a token alone (1-row bucket,
    split-K over programs) and 5 rows of one expert (walked), at 1 / 4 rows a program and 1 / 2 word groups a
    step, gate and up fused or not; the MMA's bits are the numpy reference's (within its float noise) and differ from
    the unchunked ones (the chunks are real). A launch the schedule cannot take (KCB not a multiple of its step) runs
    the MMA: the same bits."""
    K, kcb = (512, 8) if qt == 12 else (256, 4)
    with pytest.MonkeyPatch.context() as mp:
        raw, h, ids, w, code = _one_expert(mp, qt, K, rows=5, seed_experts=10, seed=9)

        def with_cfg(n, **cfg):
            mp.setitem(mq.TYPE_CONFIG, code, {"KCB": kcb, **cfg})
            return run(qt, raw, h[:n], ids[:n], w[:n])
        # the MMA at 1 row (split-K) really: MV 0 over TYPE_BUCKET's one-row MV of MXFP4 and Q4_K (with it, mma1 was
        # the decode schedule's own bits, the (1, 1, 0) case below all but the same launch), at 64 outputs a program
        # (the MMA's 16-row BN, Q8_0's one-row one; its bits do not depend on BN: test_a_rows_bits_do_not_depend_...)
        mma1, mma5 = with_cfg(1, KB=1, MV=0, BN=64), with_cfg(5, KB=2)
        assert np.array_equal(mma1[0], mma5[0])
        want = moe_ref(qt, raw, h, ids, w, kcb=kcb)
        assert np.abs(mma5 - want).max() / np.abs(want).max() <= 1e-6
        assert not np.array_equal(mma5, with_cfg(5, KCB=0))
        taken = []                                      # the launches' choice: the decode schedule or the MMA
        ok = mq.mv.mv_ok
        mp.setattr(mq.mv, "mv_ok", lambda *a: taken.append(ok(*a)) or taken[-1])
        ns = 2 if qt == 8 else 1                        # word groups a step that divide KCB
        for bm, ns_, fuse in [(1, 1, 0), (4, ns, 1)]:                   # 1 and 4 rows a program (CI's time)
            taken.clear()
            assert np.array_equal(with_cfg(1, MV=1, BM_MV=bm, NS=ns_, FUSE=fuse)[0], mma1[0]), (bm, ns_, fuse)
            assert np.array_equal(with_cfg(5, MV=1, BM_MV=bm, NS=ns_, FUSE=fuse, SPLIT=0), mma5), (bm, ns_, fuse)
            assert taken == [True] * 4, taken           # gate_up and down, both runs
        taken.clear()
        # 8+ blocks a step > KCB: the MMA runs (at BN 64, as mma1: mv_ok does not look at BN)
        assert np.array_equal(with_cfg(1, MV=1, NS=4, BN=64)[0], mma1[0])
        assert taken == [False, False], taken


def test_decode_schedule_compiles_to_word_loads_without_spills_for_sm90():
    """The decode schedule (MV = 1, 32 outputs a program, 4 warps; the bench geometry, 1-row bucket) compiled for
    sm_90 without a GPU: the weights read as 32-bit words (no byte or half-word loads: the MMA schedule's 34- and
    17-byte blocks are read byte by byte), no tensor-core MMA, no spills and at most 128 registers (4 programs of 4
    warps an SM at least); DP4A 1 puts dp4a in the PTX (and MXFP4's byte-permute code table). In a child without
    TRITON_INTERPRET."""
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4, 5):\n for w in ('gate_up', 'down'):\n  for d in (0, 1):\n"
            "   print(json.dumps(mq.compile_report(w, qt, bucket=1, over={'MV': 1, 'BN': 32, 'num_warps': 4, "
            "'num_stages': 1, 'DP4A': d})))\n")
    reports = _compile_reports(["-c", code], timeout=300)
    assert len(reports) == 12, reports
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0 and r["regs"] <= 128, r
        assert not r["mma"] and not r["imma"], r
        assert not any(".b8" in k or ".b16" in k or ".u8" in k or ".s8" in k for k in r["loads"]), r
        assert (r["dp4a"] > 0) == (r["config"]["DP4A"] == 1), r
        assert ("prmt" in r["asm"]) == (r["config"]["DP4A"] == 1 and r["qt"] == 4), r      # MXFP4's code table


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_word_loads_give_the_byte_load_bits(qt):
    """WL = 1 (the MMA's weight and activation tiles from int32 word loads, unpacked in registers; PF = 1: the next
    K step's words fetched before this step's MMA, PF = 2 its scale words only) gives the bits of the byte-load MMA:
    H = F = 512 (16 blocks: Q8_0's even and odd blocks, MXFP4's blocks at every byte offset mod 4, Q4_K's two
    super-blocks) in chunks of KCB = 8, 1 / 5 / 16 rows of one expert (the 1-row bucket split over programs, the
    16-row bucket walked), K steps of KB = 1 / 2 / 4 / 8 blocks, gate and up fused or not, and one chunk (KCB 0);
    the byte-load bits are the numpy reference's (within its float noise). The launches really take the word loads
    (wl_ok), and a launch whose rows are not word aligned reads bytes (the same bits)."""
    K, kcb = 512, 8
    with pytest.MonkeyPatch.context() as mp:
        raw, h, ids, w, code = _one_expert(mp, qt, K, rows=16, seed_experts=12, seed=11)

        def with_cfg(n, **cfg):     # the MMA in both buckets, 64 outputs a program in both (as Q8_0's one-row
            # bucket: MXFP4's and Q4_K's 16 there are their MV schedule's; the MMA's bits do not depend on BN,
            # test_a_rows_bits_do_not_depend_on_its_block) - a quarter of the one-row launches' interpreted programs
            mp.setitem(mq.TYPE_CONFIG, code, {"KCB": kcb, "MV": 0, "BN": 64, **cfg})
            return run(qt, raw, h[:n], ids[:n], w[:n])
        taken = []                                      # the launches' choice: word loads or bytes
        ok = mq.wl_ok
        mp.setattr(mq, "wl_ok", lambda *a: taken.append(ok(*a)) or taken[-1])
        ref = {n: with_cfg(n, KB=1, WL=0, PF=0) for n in (1, 5, 16)}
        assert taken == [], taken                       # WL 0: byte loads (wl_ok not asked)
        assert all(np.array_equal(ref[n][0], ref[16][0]) for n in (1, 5))
        want = moe_ref(qt, raw, h, ids, w, kcb=kcb)
        assert np.abs(ref[16] - want).max() / np.abs(want).max() <= 1e-6
        # (KB, PF, FUSE) per row count: every PF and FUSE value and KB 2-8 at 16 rows (KB 1: the one-row bucket, split,
        # and an odd row count), fewer than every combination: the interpreter takes ~6 s a launch pair here
        for n, cases in [(1, [(1, 2, 1), (4, 0, 0)]), (5, [(1, 0, 0)]),
                         (16, [(2, 1, 1), (4, 0, 0), (8, 2, 0)])]:
            for kb, pf, fuse in cases:
                taken.clear()
                got = with_cfg(n, KB=kb, WL=1, PF=pf, FUSE=fuse, SPLIT=int(n == 1))
                assert np.array_equal(got, ref[n]), (n, kb, pf, fuse)
                assert taken == [True, True], taken
        one = with_cfg(16, KB=1, KCB=0, WL=0, PF=0)    # one chunk
        assert not np.array_equal(one, ref[16])
        assert np.array_equal(with_cfg(16, KB=2, KCB=0, WL=1, PF=1), one)
        taken.clear()                                   # rows not word aligned: bytes, the same bits
        assert not ok(code, 34 * 3, True) and ok(code, 144, True) and not ok(code, 144, False)
        mp.setattr(mq, "wl_ok", lambda *a: taken.append(False) or False)
        assert np.array_equal(with_cfg(16, KB=2, WL=1, PF=1), ref[16]) and taken == [False, False]


def test_word_loads_compile_for_sm90_to_word_loads_without_spills():
    """WL = 1 at KB 1, BN 64, 4 warps (PF 0, 1 and 2), the shipped 16-row bucket (WL 2, PF 1, KB 2) and WL = 2 at
    KB 1, PF 2 (MXFP4's codes through the byte-permute table; the other types: WL 1), beside the byte-load MMA
    (WL 0), compiled for sm_90 without a GPU, with and without the alignment facts of a device launch (hints): the
    int8 tensor-core MMA is there, every
    global load of the kernel is 32 bits or wider (no ld.global.b8 / .b16, cp.async copies of 4 or 16 bytes: the byte
    MMA reads Q8_0 in half-words, MXFP4 and Q4_K's scales in bytes), and nothing spills. In a child without
    TRITON_INTERPRET."""
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4, 5):\n for w in ('gate_up', 'down'):\n"
            "  for o, h in (({'WL': 0, 'PF': 0, 'KB': 1}, 1), ({'WL': 1, 'PF': 0, 'KB': 1}, 0),\n"
            "               ({'WL': 1, 'PF': 0, 'KB': 1}, 1), ({'WL': 1, 'PF': 1, 'KB': 1}, 1),\n"
            "               ({'WL': 1, 'PF': 2, 'KB': 1}, 1), ({}, 1), ({'WL': 2, 'PF': 2, 'KB': 1}, 1)):\n"
            "   print(json.dumps(mq.compile_report(w, qt, bucket=16, over=o, hints=bool(h))))\n")
    reports = _compile_reports(["-c", code], timeout=600)
    assert len(reports) == 42, reports
    narrow = lambda r: [k for k in r["loads"] if any(w in k for w in (".b8", ".b16", ".u8", ".s8", ".u16", ".s16"))
                        or k.startswith("cp.async") and int(k.rsplit(".", 1)[1]) < 4]      # noqa: E731
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0 and r["regs"] <= 255, r
        assert any(m.startswith("IGMMA") for m in r["imma"]), r
        if r["config"]["WL"]:
            assert not narrow(r), r
        else:                                           # the byte-load MMA (what WL replaces) does read narrow words
            assert narrow(r), r
    prm = [r for r in reports if r["qt"] == 4 and r["config"]["WL"] == 2]   # MXFP4's codes by PTX prmt
    assert len(prm) == 4 and all("prmt" in r["asm"] for r in prm), prm
    assert not any(r["config"]["WL"] == 2 for r in reports if r["qt"] != 4)          # the others: WL 1's decode
    q4k = [r for r in reports if r["qt"] == 5 and r["hints"] and r["config"]["WL"] and not r["config"]["PF"]]
    assert all(r["loads"].get("cp.async.cg.shared.global.16") for r in q4k), q4k       # Q4_K's quants: 16-byte copies
