"""Shared by the MMQ tests (test_mmq*.py, test_mmq_bf16, test_gluon_mmq, test_pattern_bench): numpy references of
kernels/triton_mmq.py's arithmetic on gguf-py's bytes -- the q8_1 quantizer (a port of llama.cpp's
quantize_row_q8_1_ref, ggml/src/ggml-quants.c), the weights' (quants, d, min) checked against gguf-py's
dequantization, the int8 block dots (llama.cpp ggml-cuda/vecdotq.cuh vec_dot_q8_0_q8_1: d8_0 * d8_1 * sumi per
32-element block) and a whole layer -- the experts' bytes, the layer through MoEKernels (run), the compile reports of
a child without the interpreter, and the schedule tests' one-expert launch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

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


def compile_reports(argv: list[str], timeout: int) -> list[dict]:
    """`python argv` in a child without TRITON_INTERPRET (which turns every jit function into an interpreted one that
    cannot compile) -> the compile reports it printed, one JSON object a line (triton_mmq.compile_report)."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


# the head of a Gluon compile child (compile_reports' argv: "CASES = ..." + this + its loop): exits with {"skip": why}
# where sm_90 cannot be compiled here; fops(ptx): the PTX's rounding float ops by kind; kinds(body): SASS instructions
# by opcode and first modifier
GLUON_CHILD_HEAD = """
import json, re, sys
sys.path.insert(0, "tests/scripts")
import kernel_smem
why = kernel_smem.probe()
from betelgeuse.kernels import gluon_mmq as gm
if why or not gm.HAVE_GLUON:
    print(json.dumps({"skip": why or "no Gluon"})); sys.exit(0)
import sass_profile as sp
from betelgeuse.kernels import triton_mmq as mq
FOPS = re.compile(r"^\\s*((?:ex2|div|rcp|fma|add|sub|mul|min|max)\\.[\\w.]*f32[\\w.]*"
                  r"|cvt\\.rn\\.bf16\\w*\\.f32)", re.M)
def fops(ptx):                      # the PTX's float ops that round, by kind (exact ones left out: cvt f16 -> f32, and
    # negation: Q4_K's -(dmin m * sx) is a sign flip of one factor, Triton's an xor of sx's sign bit, Gluon's a neg
    # of dmin m -- the same product bits either way)
    ops = {}
    for m in FOPS.findall(ptx):
        ops[m.replace("bf16x2", "bf16")] = ops.get(m.replace("bf16x2", "bf16"), 0) + (2 if "x2" in m else 1)
    return ops
def kinds(body):                    # instructions by opcode and first modifiers
    ops = {}
    for _, op, rest in body:
        key = op + (rest.split()[0] if rest.startswith(".") else "")
        ops[key] = ops.get(key, 0) + 1
    return ops
"""


def one_expert(mp, qt: int, K: int, rows: int, seed_experts: int, seed: int):
    """The schedule tests' launch: experts of type qt at H = F = K (DIMS patched through mp), `rows` rows of
    activations (a band of columns x4: blocks of different scales) all routed to expert 0 with weight 1 ->
    (raw experts, h [rows, K], ids [rows, 1], w [rows, 1], the kernels' type code)."""
    mp.setitem(DIMS, qt, (K, K))
    raw = experts(qt, seed_experts)
    h = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)
    h[:, 64:96] *= 4
    ids, w = np.zeros((rows, 1), np.int64), np.ones((rows, 1), np.float32)
    return raw, h, ids, w, {8: 0, 39: 4, 12: 5}[qt]
