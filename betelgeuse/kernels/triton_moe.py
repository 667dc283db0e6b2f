"""Triton kernels for one layer's routed experts, reading quantized bytes straight from slots.

vLLM's fused MoE idea (rows sorted by expert, one program per block of one expert's rows) with the
dequantization fused into the matmul and the expert addressed by a byte offset into one device pool
(VRAM hot slots + execution ring), so a whole tier group of experts is one launch:

  gate_up   grid (E, cdiv(T, BM), cdiv(F, BN)): program (e, m, n) takes rows m*BM.. of expert e
            (rows = (token, rank) pairs sorted by expert), computes g = x W_gate^T and u = x W_up^T
            over H in BK steps, writes act = silu(g) * u  -> inter [R, F] (sorted-row order)
  down      grid (E, cdiv(T, BM), cdiv(H, BN)): y[token*k + rank] = act W_down^T over F
  combine   grid (T, cdiv(H, BN)): out[t] = sum_r w[t, r] * y[t*k + r], r = 0..k-1 in order (fp32)

Programs of experts whose base offset is -1 (not in this group) or past their rows return at once.

Row invariance (DESIGN.md invariant 6): block sizes are constants (never tuned by the row count),
the K loop runs in the same BK steps, and tensor-core MMA computes each output element from its own
row and column only, so a row's bits depend neither on the other rows of its block nor on how many
rows an expert has, nor on which group (tier) the expert is in.

Weight formats (constexpr QT): 0 = Q8_0 (34-byte blocks: f16 scale, 32 x int8), 1 = F16, 2 = BF16,
3 = F32, 4 = MXFP4 (17-byte blocks: E8M0 exponent e, 16 bytes of E2M1 codes; element j is the low nibble
of byte j, element j+16 the high one; x = 2^(e-128) * doubled-e2m1 value, ggml's half-scale convention,
every product exact in float32 and bf16, so the tile holds gguf-py's dequantized values bit for bit).
Other types (K-quants) take the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rows per block, output columns per program, K step (whole Q8_0 blocks), warps: constants for every launch
# whatever the row count (row invariance); CONFIG can be replaced once per process (deploy/device/kernel_sweep.py)
CONFIG = {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3}   # best of deploy/device/kernel_sweep.py on the H200
# gate_up reads two matrices per program over K = H: narrower output blocks give a decode step (8 experts x 1 row)
# 2x the programs (the profile showed gate_up at 230 GB/s against down's 580 GB/s with BN 64)
BN_GATE_UP = 32

QT_CODES = {8: 0, 1: 1, 30: 2, 0: 3, 39: 4}   # GGMLQuantizationType -> QT: Q8_0, F16, BF16, F32, MXFP4


@triton.jit
def _block_starts(base, n64, kk, K, BS: tl.constexpr, BK: tl.constexpr):
    """Byte offsets [BN, BK/32, 1] of the 32-element blocks (BS bytes each) covering columns kk .. kk+BK of rows
    n64 [BN] of a row-major block-quantized [N, K] matrix starting at byte `base` (one tensor: safe to inline)."""
    NB: tl.constexpr = BK // 32
    blk = (kk // 32 + tl.arange(0, NB)).to(tl.int64) * BS
    return base + n64[:, None, None] * ((K // 32) * BS) + blk[None, :, None]


@triton.jit
def _load_w(pool, base, n, kk, K, mn, QT: tl.constexpr, BK: tl.constexpr):
    """Weight tile [BN, BK] float32 of a row-major [N, K] matrix whose bytes start at pool + base:
    rows n [BN], columns kk .. kk+BK (BK a multiple of 32: whole Q8_0 / MXFP4 blocks)."""
    n64 = n.to(tl.int64)
    if QT == 0:
        addr = _block_starts(base, n64, kk, K, 34, BK)                          # [BN, NB, 1]
        m3 = mn[:, None, None]
        q = tl.load(pool + addr + 2 + tl.arange(0, 32)[None, None, :], mask=m3, other=0)   # [BN, NB, 32]
        lo = tl.load(pool + addr, mask=m3, other=0).to(tl.uint16)              # one f16 scale per block
        hi = tl.load(pool + addr + 1, mask=m3, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        w = tl.reshape(q.to(tl.int8, bitcast=True).to(tl.float32) * d, (n.shape[0], BK))
    elif QT == 4:
        addr = _block_starts(base, n64, kk, K, 17, BK)                          # [BN, NB, 1]
        m3 = mn[:, None, None]
        j = tl.arange(0, 32)[None, None, :]
        # element j of a block: byte 1 + j % 16, low nibble for j < 16, high nibble after (each byte read twice)
        q = tl.load(pool + addr + 1 + (j % 16), mask=m3, other=0).to(tl.int32)   # [BN, NB, 32]
        code = (q >> ((j // 16) * 4)) & 15
        # doubled e2m1 magnitude of the 3 low bits m: 0 1 2 3 | 4 6 | 8 12 = m, 2(m-2), 4(m-4); bit 3 = sign
        m = code & 7
        mag = tl.where(m < 4, m, tl.where(m < 6, (m - 2) * 2, (m - 4) * 4))
        v = tl.where(code >= 8, -mag, mag).to(tl.float32)                      # integer negation: code 8 is +0
        # E8M0 -> 2^(e-128) as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
        e8 = tl.load(pool + addr, mask=m3, other=0).to(tl.int32)               # [BN, NB, 1]
        d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(v * d, (n.shape[0], BK))
    else:
        c = kk + tl.arange(0, BK)
        if QT == 1:
            p = (pool + base + (n64[:, None] * K + c[None, :]) * 2).to(tl.pointer_type(tl.float16))
            w = tl.load(p, mask=mn[:, None], other=0).to(tl.float32)
        elif QT == 2:
            p = (pool + base + (n64[:, None] * K + c[None, :]) * 2).to(tl.pointer_type(tl.bfloat16))
            w = tl.load(p, mask=mn[:, None], other=0).to(tl.float32)
        else:
            p = (pool + base + (n64[:, None] * K + c[None, :]) * 4).to(tl.pointer_type(tl.float32))
            w = tl.load(p, mask=mn[:, None], other=0)
    return w


@triton.jit
def _gate_up_kernel(h_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr,
                    H, F, k_top, limit,
                    QT: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    base = tl.load(base_ptr + e)
    lo = tl.load(off_ptr + e)
    hi = tl.load(off_ptr + e + 1)
    r0 = lo + pm * BM
    if base >= 0 and r0 < hi:
        rows = r0 + tl.arange(0, BM)
        mr = rows < hi
        flat = tl.load(rows_ptr + rows, mask=mr, other=0)
        tok = (flat // k_top).to(tl.int64)
        n = pn * BN + tl.arange(0, BN)
        mn = n < F
        gbase = base + tl.load(starts_ptr + e * 3)
        ubase = base + tl.load(starts_ptr + e * 3 + 1)
        accg = tl.zeros((BM, BN), dtype=tl.float32)
        accu = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, H, BK):
            c = kk + tl.arange(0, BK)
            x = tl.load(h_ptr + tok[:, None] * H + c[None, :], mask=mr[:, None], other=0)
            wg = _load_w(pool, gbase, n, kk, H, mn, QT, BK).to(x.dtype)
            wu = _load_w(pool, ubase, n, kk, H, mn, QT, BK).to(x.dtype)
            if IEEE:
                accg = tl.dot(x, tl.trans(wg), accg, input_precision="ieee")
                accu = tl.dot(x, tl.trans(wu), accu, input_precision="ieee")
            else:
                accg = tl.dot(x, tl.trans(wg), accg)
                accu = tl.dot(x, tl.trans(wu), accu)
        if HAS_LIMIT:                       # DeepSeek-V4's clamped SwiGLU
            accg = tl.minimum(accg, limit)
            accu = tl.minimum(tl.maximum(accu, -limit), limit)
        act = accg / (1.0 + tl.exp(-accg)) * accu
        ptr = inter_ptr + rows.to(tl.int64)[:, None] * F + n[None, :]
        tl.store(ptr, act.to(inter_ptr.dtype.element_ty), mask=mr[:, None] & mn[None, :])


@triton.jit
def _down_kernel(inter_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr,
                 H, F,
                 QT: tl.constexpr, IEEE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    base = tl.load(base_ptr + e)
    lo = tl.load(off_ptr + e)
    hi = tl.load(off_ptr + e + 1)
    r0 = lo + pm * BM
    if base >= 0 and r0 < hi:
        rows = r0 + tl.arange(0, BM)
        mr = rows < hi
        flat = tl.load(rows_ptr + rows, mask=mr, other=0).to(tl.int64)
        n = pn * BN + tl.arange(0, BN)
        mn = n < H
        dbase = base + tl.load(starts_ptr + e * 3 + 2)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, F, BK):
            c = kk + tl.arange(0, BK)
            a = tl.load(inter_ptr + rows.to(tl.int64)[:, None] * F + c[None, :], mask=mr[:, None], other=0)
            w = _load_w(pool, dbase, n, kk, F, mn, QT, BK).to(a.dtype)
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        ptr = y_ptr + flat[:, None] * H + n[None, :]
        tl.store(ptr, acc.to(y_ptr.dtype.element_ty), mask=mr[:, None] & mn[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, k_top, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = n < H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r in range(0, k_top):
        w = tl.load(w_ptr + t * k_top + r).to(tl.float32)
        yr = tl.load(y_ptr + (t * k_top + r) * H + n, mask=mn, other=0).to(tl.float32)
        acc = acc + w * yr
    tl.store(out_ptr + t * H + n, acc.to(out_ptr.dtype.element_ty), mask=mn)


def gate_up(h, pool, base, starts, rows, off, inter, n_ff: int, k_top: int, qt: int, limit: float | None):
    """h [T,H]; base [E] int64 (-1 = skip); starts [E,3] int64; rows [R] int32 sorted (token*k+rank);
    off [E+1] int32 row offsets per expert; inter [R, F] (written for the rows of experts in the group)."""
    T, H = h.shape
    E = base.numel()
    c = CONFIG
    bk = block_k(H, n_ff)
    grid = (E, triton.cdiv(T, c["BM"]), triton.cdiv(n_ff, BN_GATE_UP))
    _gate_up_kernel[grid](h, pool, base, starts, rows, off, inter, H, n_ff, k_top,
                          float(limit) if limit is not None else 0.0,
                          QT=qt, HAS_LIMIT=limit is not None, IEEE=h.dtype == torch.float32,
                          BM=c["BM"], BN=BN_GATE_UP, BK=bk, num_warps=c["num_warps"], num_stages=c["num_stages"])


def down(inter, pool, base, starts, rows, off, y, n_tokens: int, qt: int):
    """inter [R, F]; y [T*k, H] (rows of experts in the group written)."""
    F = inter.shape[1]
    H = y.shape[1]
    E = base.numel()
    c = CONFIG
    grid = (E, triton.cdiv(n_tokens, c["BM"]), triton.cdiv(H, c["BN"]))
    _down_kernel[grid](inter, pool, base, starts, rows, off, y, H, F,
                       QT=qt, IEEE=inter.dtype == torch.float32, BM=c["BM"], BN=c["BN"], BK=block_k(H, F),
                       num_warps=c["num_warps"], num_stages=c["num_stages"])


def combine(y, w, out):
    """y [T*k, H], w [T, k] -> out [T, H] = sum over ranks in order (float32 accumulation)."""
    T, k = w.shape
    H = y.shape[1]
    _combine_kernel[(T, triton.cdiv(H, 256))](y, w.contiguous(), out, H, k, BN=256)
    return out


def block_k(H: int, F: int) -> int:
    """The K step: CONFIG's, or the largest multiple of 32 dividing both H and F (tiny test models)."""
    bk = CONFIG["BK"]
    while bk > 32 and (H % bk or F % bk):
        bk //= 2
    assert H % bk == 0 and F % bk == 0, (H, F, bk)
    return bk
