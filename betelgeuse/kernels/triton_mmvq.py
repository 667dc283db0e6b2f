"""The decode (few-row) schedule of the expert kernels: llama.cpp's mmvq layout with float activations.

llama.cpp's ggml-cuda mmvq.cu / vecdotq.cuh: each program owns a few output rows (BN) and walks K in whole quant
blocks; a block's bytes are loaded as 32-bit words (16-byte vectors where the row alignment allows) and unpacked
with shifts and masks, never byte by byte; the scales are decoded once per block. No tensor cores and no shared
memory: a 1-row launch needs neither (the MMA path pads one row to 16 and stages every dequantized tile through
shared memory for the dot's operand layout). Unlike llama.cpp the activations stay float (bf16 / fp32 as the
engine holds them, multiplied in fp32): pre-quantizing them to Q8_1 changes the numerics, which the engine's
exactness contract (within float noise of the torch path) does not allow by default.

The arithmetic of an output (n, m), fixed by the weight type only (never by BN, rows per program, warps, stages),
so that a row's bits do not depend on the launch (DESIGN.md invariant 6):
  - K is walked in steps of S elements (S = STEP[type]: one word group of whole blocks, table below); tile
    position p of a step holds element elem(p) of it (the words' unpacking order);
  - acc[n, m, p] = fma(w[n, elem(p)], x[m, elem(p)], acc[n, m, p]) step after step, from zero (elementwise: the
    same float ops whatever the layout);
  - out[n, m] = the pairwise tree over p: level by level, positions (2i, 2i+1) added (tl.split), a fixed order
    where tl.sum's would follow the register layout.
So both rows buckets can take this schedule at different BN / rows per program / warps with the same bits; a
type's launch table switches it on with the reduction key MV = 1 (triton_moe), for both buckets.

  type   step S  words per row and step                         element of position p
  Q8_0   64      2 blocks (68 B, 17 words; quants of the        p
                 first at byte 2: two overlapping word loads)
  MXFP4  128     4 blocks (68 B, 17 words; quants at byte       32 b + 16 hi + 4 t + u, p = 8 (4 b + t) + 2 u + hi
                 17 b + 1: funnel shifts of two words)
  Q4_K   256     1 super-block (144 B: 4 header words, 32       64 g + 32 hi + 4 i + u, p = 64 g + 8 i + 2 u + hi
                 qs words)
(u: byte in a word, hi: the high nibble.) Requires rows at 4-byte multiples (aligned parts, row bytes % 4 == 0) and
K a multiple of S; triton_moe.mv_ok checks and takes the MMA path otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from betelgeuse.kernels.triton_quants import _spread, _unit

# elements per K step of each kernel type code that has this schedule (triton_quants.QT_CODES)
STEP = {0: 64, 4: 128, 5: 256}        # Q8_0, MXFP4, Q4_K


@triton.jit
def _words(pool, addr, i, mask):
    """int32 words at byte address `addr` (4-byte aligned, [BN, 1]) + 4 i (i [W] word indices)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.int32)) + i[None, :], mask=mask, other=0)


@triton.jit
def _word(pool, addr, mask):
    """int32 word [BN, 1] at 4-byte aligned byte addresses addr [BN, 1]."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.int32)), mask=mask, other=0)


@triton.jit
def _half(bits):
    """float32 of the f16 in the low 16 bits of int32 `bits`."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mv_cols(QT: tl.constexpr, S: tl.constexpr):
    """[S] element index within a step of each tile position (the table in the module doc)."""
    p = tl.arange(0, S)
    if QT == 0:
        return p
    elif QT == 4:
        return (p // 32) * 32 + (p % 2) * 16 + ((p // 8) % 4) * 4 + (p // 2) % 4
    else:
        return (p // 64) * 64 + (p % 2) * 32 + ((p // 8) % 8) * 4 + (p // 2) % 4


@triton.jit
def mv_weights(pool, ra2, kk, m2, QT: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """float32 [BN, S]: the weights of rows at byte addresses ra2 [BN, 1] (mask m2), step kk .. kk+S, in tile order."""
    p = tl.arange(0, S)
    if QT == 0:                                     # Q8_0: two 34-byte blocks = 17 words
        b = ra2 + (kk // 64) * 68
        i = tl.arange(0, 16)
        a = _words(pool, b, i, m2)                  # words 0..15
        c = _words(pool, b + 4, i, m2)              # words 1..16 (L1)
        # quant word i: block 0's at bytes 2 + 4i (halves of words i, i+1), block 1's = word 9 + (i - 8) = c[i]
        v = tl.where((i < 8)[None, :], ((a >> 16) & 0xFFFF) | (c << 16), c)
        d0 = _half(_word(pool, b, m2))
        d1 = _half(_word(pool, b + 32, m2) >> 16)
        d = tl.where((p < 32)[None, :], d0, d1)     # [BN, S]
        q = _spread(v, BN, 16, 4)                   # word of position p: p // 4, byte p % 4
        # q ^ 0x80 = q + 128 at mantissa bits 15-22: f = 1 + (q + 128) / 256, w = d q = 256 d f - 384 d
        f = (((q >> ((p % 4) * 8)[None, :]) & 255) ^ 0x80) << 15
        return (256.0 * d) * _unit(f) - 384.0 * d
    elif QT == 4:                                   # MXFP4: four 17-byte blocks = 17 words
        b = ra2 + (kk // 128) * 68
        t = tl.arange(0, 16)                        # quant word t: block t // 4, bytes 17 (t // 4) + 1 + 4 (t % 4)
        o = (t // 4) * 17 + 1 + (t % 4) * 4
        lo = _words(pool, b, o // 4, m2)
        hi = _words(pool, b, o // 4 + 1, m2)
        s = ((o % 4) * 8)[None, :]                  # 8, 16, 24 or 0 (block 3: word-aligned)
        r = tl.where(s == 0, 8, s)                  # (no shift by 32 below)
        v = tl.where(s == 0, lo, ((lo >> r) & ((1 << (32 - r)) - 1)) | (hi << (32 - r)))
        e8 = (_words(pool, b, tl.arange(0, 4) * 4, m2) >> (tl.arange(0, 4) * 8)[None, :]) & 255   # block j's byte 17 j
        # E8M0 -> 2^(e-128) as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
        d = _spread(tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True), BN, 4, 32)
        qs = (_spread(v, BN, 16, 8) >> ((p % 8) * 4)[None, :]) & 15
        # the doubled e2m1 value of a code s|e e|m is 2^127 x the float32 with bits s<<31 | eem<<22
        e = ((qs << 22) & 0x01C00000) | ((qs << 28) & -2147483648)
        return (e.to(tl.float32, bitcast=True) * 1.7014118346046923e38) * d
    else:                                           # Q4_K: f16 d | f16 dmin | scales[12] | qs[128]
        b = ra2 + (kk // 256) * 144
        w0 = _word(pool, b, m2)
        j = tl.arange(0, 8)
        sh = ((j % 4) * 8)[None, :]
        b1 = (_word(pool, b + 4, m2) >> sh) & 255   # scales[j % 4]
        b2 = (_word(pool, b + 8, m2) >> sh) & 255   # scales[4 + j % 4]
        b3 = (_word(pool, b + 12, m2) >> sh) & 255  # scales[8 + j % 4]
        lo = (j < 4)[None, :]
        sc = tl.where(lo, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4)).to(tl.float32)       # [BN, 8] sub-block scales
        mi = tl.where(lo, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4)).to(tl.float32)
        a = 16.0 * (_half(w0) * sc)                 # f = 1 + q/16: w = d sc q - dmin m = a f - (a + dmin m)
        c = -(a + _half(w0 >> 16) * mi)
        # sub-block of position p: 2 (p // 64) + p % 2
        a = tl.reshape(tl.broadcast_to(tl.reshape(a, (BN, 4, 1, 2)), (BN, 4, 32, 2)), (BN, S))
        c = tl.reshape(tl.broadcast_to(tl.reshape(c, (BN, 4, 1, 2)), (BN, 4, 32, 2)), (BN, S))
        q = _spread(_words(pool, b + 16, tl.arange(0, 32), m2), BN, 32, 8)
        f = ((q >> ((p % 8) * 4)[None, :]) & 15) << 19
        return a * _unit(f) + c


@triton.jit
def mv_x(x_ptr, xrow, mr, kk, QT: tl.constexpr, S: tl.constexpr):
    """float32 [BM, S]: the activations of rows at element offsets xrow [BM] (mask mr), step kk, in tile order."""
    return tl.load(x_ptr + xrow[:, None] + (kk + mv_cols(QT, S))[None, :], mask=mr[:, None], other=0).to(tl.float32)


@triton.jit
def mv_acc(acc, w, x):
    """acc [BN, BM, S] + w [BN, S] x [BM, S] elementwise (one fused multiply-add per element)."""
    return tl.fma(tl.broadcast_to(w[:, None, :], acc.shape), tl.broadcast_to(x[None, :, :], acc.shape), acc)


@triton.jit
def mv_total(acc, BN: tl.constexpr, BM: tl.constexpr, S: tl.constexpr, LOG2S: tl.constexpr):
    """[BN, BM] = acc [BN, BM, S] summed over positions by the pairwise tree (2i + 2i+1, level by level)."""
    a = acc
    for lvl in tl.static_range(LOG2S):
        lo, hi = tl.split(tl.reshape(a, (BN, BM, S >> (lvl + 1), 2)))
        a = lo + hi
    return tl.reshape(a, (BN, BM))


def log2(n: int) -> int:
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1
