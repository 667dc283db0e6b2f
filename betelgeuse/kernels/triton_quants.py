"""In-kernel dequantization and the K-step product for each GGML type the expert kernels read.

`wdot(acc, ...)` adds W[n, kk:kk+BK] @ X[m, kk:kk+BK]^T to acc [BN, BM] for BN weight rows n (byte addresses
`ra` [BN] int64 = tensor start + n * row bytes; TL 1: kernels/tile_layout's address of the row in its tile, its
blocks 64 blocks apart) of a row-major quantized [N, K] matrix in the device pool and BM
activation rows m (element offsets `xrow` [BM] into x). Each type is read as a few 2-D "pieces" [BN, P] in its
byte order (a piece's column c is byte or group c of the blocks, so loads are contiguous runs and no element
tensor is ever reshaped); each piece is turned into weights and multiplied, on the tensor cores, with the
activation columns its elements belong to (x is gathered in piece order: a handful of contiguous runs):

  type     block (elements, bytes)  pieces per 256 elements (BK = 256)         element of piece column c
  Q4_K     256, 144                 low, high nibbles of qs[128]               64 (c//32) + 32 nibble + c%32
  Q5_K     256, 176                 as Q4_K, the 5th bit from qh[32]
  Q6_K     256, 210                 low, high nibbles of ql[128], 2 bits of qh 128 (c//64) + 64 nibble + c%64
  Q3_K     256, 110                 4 bit pairs t of qs[64], 1 bit of hmask     128 (c//32) + 32 t + c%32
  Q2_K     256, 84                  4 bit pairs t of qs[64]                    128 (c//32) + 32 t + c%32
  IQ4_XS   256, 136                 low, high nibbles of qs[128]               32 (c//16) + 16 nibble + c%16
  IQ2_XXS  256, 66                  32 groups of 8 (grid row, sign row)        c (element order)
  IQ2_XS   256, 74                  32 groups of 8
  IQ3_XXS  256, 98                  64 half-groups of 4, 32 sign rows of 8
  Q8_0     32, 34                   BK/32 blocks of 32                         c
  MXFP4    32, 17                   low, high nibbles of qs[16] per block      32 (c//16) + 16 nibble + c%16
  IQ4_NL   32, 18                   low, high nibbles of qs[16] per block      32 (c//16) + 16 nibble + c%16
  F16 / BF16 / F32                  [BN, BK]                                   c

The 256-element types also take BK = 128 (half a super-block). Integer quants become weights without an
int-to-float conversion (a quarter of the FMA rate) nor a subtraction: the q bits are placed at the top of a float
32 mantissa, f = 1 + q / 2^b exactly, and w = A f + B is one fused multiply-add with per-sub-block A = 2^b d sc,
B = -(2^b d sc + offset) (so the exponent's 1 and the quants' zero point fold into B, rounded once at the sub-block's
scale). The IQ4 code book (float16) and the i-quant grids (bytes, rows of 4 or 8) come from one small byte table
(`tables`, L1-resident); the i-quant signs are computed (7 sign bits and their parity), not gathered. Table gathers
stay narrow on purpose: Triton's software pipeliner stages every load of >= 32 bits per thread through shared
memory, num_stages - 1 buffers deep, and [BN, BK] float32 gathers per K step need 256-550 KiB there, more than a
block has (227 KiB on sm_90); tests/kernels/test_kernels_smem.py compiles every type for sm_90 and checks the bound.
The weights agree with `gguf/quants.py` (= gguf-py's values) to the last bit or two of float32
(one fused rounding instead of two), exactly for F16/BF16/F32/MXFP4/IQ4_NL/IQ4_XS and the grid types.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from betelgeuse.gguf.quants import IQ4_KVALUES, iq_grid
from betelgeuse.kernels.tile_layout import FLOAT_UNIT, TR

# kernel codes (constexpr QT) of the GGML types
QT_CODES = {8: 0, 1: 1, 30: 2, 0: 3, 39: 4, 12: 5, 13: 6, 14: 7, 11: 8, 10: 9, 23: 10, 20: 11, 16: 12, 17: 13, 18: 14}
# Q8_0 F16 BF16 F32 MXFP4 Q4_K Q5_K Q6_K Q3_K Q2_K IQ4_XS IQ4_NL IQ2_XXS IQ2_XS IQ3_XXS
SUPER = frozenset({5, 6, 7, 8, 9, 10, 12, 13, 14})      # 256-element super-blocks (K a multiple of 256)

# byte offsets of the tables in `tables()` (the kernels use them as literals)
KV_IQ4, GRID_IQ2XXS, GRID_IQ2XS, GRID_IQ3XXS, TABLES_LEN = 0, 32, 2080, 6176, 7200
_TABLES: dict[str, torch.Tensor] = {}
TILE_ROWS = tl.constexpr(TR)            # rows of a tile of the tile layout (tile_layout: TL = 1)
FLOAT_UNIT_K = tl.constexpr(FLOAT_UNIT)  # elements of a float type's block in it


def tables(device) -> torch.Tensor:
    """uint8 [TABLES_LEN] on `device`: the IQ4 code book as float16 [16] (exact: integers < 128), then the IQ2_XXS
    [256, 8], IQ2_XS [512, 8] and IQ3_XXS [256, 4] grids as bytes (gguf-py's, as gguf/quants.py; values < 64)."""
    key = str(device)
    if key not in _TABLES:
        grids = [iq_grid(q).reshape(-1) for q in (16, 17, 18)]
        assert all(int(g.max()) < 64 for g in grids)            # 6 bits: the kernels' 1 + q/64 mantissa trick
        parts = [np.array(IQ4_KVALUES, np.float16).view(np.uint8), *grids]
        assert np.cumsum([0] + [p.size for p in parts]).tolist() == [KV_IQ4, GRID_IQ2XXS, GRID_IQ2XS, GRID_IQ3XXS,
                                                                     TABLES_LEN]
        _TABLES[key] = torch.from_numpy(np.concatenate(parts)).to(device)
    return _TABLES[key]


# ---- small helpers ------------------------------------------------------------------------------------

@triton.jit
def _f16(pool, addr, mask):
    """float32 of the little-endian f16 at byte `addr` (2-byte aligned: every block with an f16 is even-sized)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.float16)), mask=mask, other=0).to(tl.float32)


@triton.jit
def _u8(pool, addr, mask):
    return tl.load(pool + addr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u16(pool, addr, mask):
    """int32 of the little-endian u16 at byte `addr` (2-byte aligned)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def _u32(pool, addr, mask):
    """int32 bits of the little-endian u32 at byte `addr` (2-byte aligned: two u16 loads)."""
    return _u16(pool, addr, mask) | (_u16(pool, addr + 2, mask) << 16)


@triton.jit
def _unit(bits):
    """float32 from mantissa bits (the quant already shifted to the top of the mantissa): 1 + q / 2^b."""
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _spread(v, BN: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    """[BN, G] -> [BN, G * R]: each value repeated for the R columns of its group."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, G, R)), (BN, G * R))


@triton.jit
def _mma(acc, w, x_ptr, xrow, mr, cols, IEEE: tl.constexpr):
    """acc += w [BN, P] @ x[xrow, cols]^T, x gathered as [P, BM] (cols [P] element offsets within a row)."""
    xt = tl.load(x_ptr + xrow[None, :] + cols[:, None], mask=mr[None, :], other=0)
    if IEEE:
        return tl.dot(w.to(xt.dtype), xt, acc, input_precision="ieee")
    return tl.dot(w.to(xt.dtype), xt, acc)


@triton.jit
def k_scale_min_of(c1, c2, c3, lo):
    """get_scale_min_k4 of a Q4_K/Q5_K sub-block j from its three scale bytes (int32 0-255): c1 = scales[j % 4],
    c2 = scales[4 + j % 4], c3 = scales[8 + j % 4]; lo = j < 4 -> (scale, min), int32 6-bit. Every kernel's K-quant
    scales (byte or word loads) go through this one formula."""
    sc = tl.where(lo, c1 & 63, (c3 & 15) | ((c1 >> 6) << 4))
    mi = tl.where(lo, c2 & 63, (c3 >> 4) | ((c2 >> 6) << 4))
    return sc, mi


@triton.jit
def _k_scale_min(pool, b, s, m):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-blocks s (int32, broadcastable) of blocks b; bytes 4-15 of a block."""
    j4 = s % 4
    sc, mi = k_scale_min_of(_u8(pool, b + 4 + j4, m), _u8(pool, b + 8 + j4, m), _u8(pool, b + 12 + j4, m), s < 4)
    return sc.to(tl.float32), mi.to(tl.float32)


@triton.jit
def _iq4_values(tab, q):
    """float32 IQ4 code book values of 4-bit codes q (tables' float16 [16] at byte 0: 2-byte gathers, unstaged)."""
    return tl.load(tab.to(tl.pointer_type(tl.float16)) + q).to(tl.float32)


@triton.jit
def _grid_weights(tab, off: tl.constexpr, gi, W: tl.constexpr, si, db, BN: tl.constexpr, G: tl.constexpr):
    """The i-quant weights [BN, G * 8] of G groups of 8 = grid rows x scale x signs: gi [BN, G * 8 // W] row
    indices into tables' W-byte rows at byte `off` (values q < 64), db [BN, G] the groups' scales, si [BN, G] their
    7 sign bits (the 8th: the parity of the 7). w = (64 db) (1 + q/64 - 1) = db q rounded once, as db * grid."""
    GR: tl.constexpr = G * 8 // W
    q = tl.load(tab + off + gi[:, :, None] * W + tl.arange(0, W)[None, None, :]).to(tl.int32)   # [BN, GR, W]
    u = _unit(tl.reshape(q, (BN, G * 8)) << 17) - 1.0                      # q / 64, exactly
    w = _spread(64.0 * db, BN, G, 8) * u
    p = si ^ (si >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    neg = (_spread(si | ((p & 1) << 7), BN, G, 8) >> (tl.arange(0, G * 8) % 8)[None, :]) & 1
    return (w.to(tl.int32, bitcast=True) ^ (neg << 31)).to(tl.float32, bitcast=True)


# ---- the K step per type --------------------------------------------------------------------------------

@triton.jit
def _fcols(c, ES: tl.constexpr, TL: tl.constexpr):
    """Byte offsets [1, BK] in a row of float columns c (ES bytes an element): GGUF's c * ES, or the tile layout's
    (TL = 1: block c // FLOAT_UNIT_K at TILE_ROWS blocks a stride, element c % FLOAT_UNIT_K in it)."""
    if TL:
        o = (c // FLOAT_UNIT_K) * (FLOAT_UNIT_K * ES * TILE_ROWS) + (c % FLOAT_UNIT_K) * ES
    else:
        o = c * ES
    return o[None, :]


@triton.jit
def wdot(acc, x_ptr, xrow, mr, pool, tab, ra, kk, mn,
         QT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, TL: tl.constexpr = 0):
    """acc [BN, BM] += W[rows at ra (mask mn), kk .. kk+BK] @ x[xrow (mask mr), kk .. kk+BK]^T. TL: the weights'
    layout, 0 GGUF (block j of a row at ra + j * block bytes), 1 the tile layout (tile_layout: at ra + j * TILE_ROWS
    x block bytes; ra the row's address in its tile): the same loads of the same bytes, so the same bits."""
    m2 = mn[:, None]
    ra2 = ra[:, None]
    if QT >= 1 and QT <= 3:                             # F16 / BF16 / F32
        c = kk + tl.arange(0, BK)
        if QT == 1:
            p = (pool + ra2 + _fcols(c, 2, TL)).to(tl.pointer_type(tl.float16))
        elif QT == 2:
            p = (pool + ra2 + _fcols(c, 2, TL)).to(tl.pointer_type(tl.bfloat16))
        else:
            p = (pool + ra2 + _fcols(c, 4, TL)).to(tl.pointer_type(tl.float32))
        acc = _mma(acc, tl.load(p, mask=m2, other=0), x_ptr, xrow, mr, c, IEEE)
    elif QT == 0:                                       # Q8_0: 34-byte blocks, f16 d | int8 q[32]
        # the quants as u16 words (blocks are 2-byte aligned): piece 0 = the low bytes (even elements), piece 1 =
        # the high bytes (odd elements); f = 1 + (q + 128) / 256 (q ^ 0x80 = q + 128 at mantissa bits 15-22)
        NB: tl.constexpr = BK // 32
        KS: tl.constexpr = 34 * (1 + (TILE_ROWS - 1) * TL)                  # bytes from a block to the row's next
        c = tl.arange(0, BK // 2)                                             # word c: block c // 16
        v = _u16(pool, ra2 + ((kk // 32 + c // 16) * KS + 2 + (c % 16) * 2)[None, :], m2)
        d = _spread(_f16(pool, ra2 + ((kk // 32 + tl.arange(0, NB)) * KS)[None, :], m2), BN, NB, 16)
        a = 256.0 * d                                                         # w = d q = 256 d f - 384 d
        for byte in tl.static_range(2):
            f = ((v << (15 - 8 * byte)) ^ 0x00400000) & 0x007F8000
            acc = _mma(acc, a * _unit(f) - 384.0 * d, x_ptr, xrow, mr, kk + (c // 16) * 32 + (c % 16) * 2 + byte, IEEE)
    elif QT == 4 or QT == 11:                           # MXFP4 (17 B: E8M0 | qs[16]) / IQ4_NL (18 B: f16 d | qs[16])
        NB: tl.constexpr = BK // 32
        if QT == 4:
            BS: tl.constexpr = 17
            QO: tl.constexpr = 1
        else:
            BS: tl.constexpr = 18
            QO: tl.constexpr = 2
        KS: tl.constexpr = BS * (1 + (TILE_ROWS - 1) * TL)
        c = tl.arange(0, BK // 2)
        qs = _u8(pool, ra2 + ((kk // 32 + c // 16) * KS + QO + c % 16)[None, :], m2)   # [BN, BK/2]
        blk0 = ra2 + ((kk // 32 + tl.arange(0, NB)) * KS)[None, :]                      # [BN, NB]
        if QT == 4:
            # E8M0 -> 2^(e-128) as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
            e8 = _u8(pool, blk0, m2)
            d = _spread(tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True),
                        BN, NB, 16)
        else:
            d = _spread(_f16(pool, blk0, m2), BN, NB, 16)
        for nib in tl.static_range(2):
            if QT == 4:
                # the doubled e2m1 value of a code s|e e|m is 2^127 x the float32 with bits s<<31 | eem<<22
                # (normal for e > 0, subnormal for e = 0): two exact products, no table
                v = ((qs << (22 - 4 * nib)) & 0x01C00000) | ((qs << (28 - 4 * nib)) & -2147483648)
                w = (v.to(tl.float32, bitcast=True) * 1.7014118346046923e38) * d       # 2^127
            else:
                w = d * _iq4_values(tab, (qs >> (4 * nib)) & 15)
            acc = _mma(acc, w, x_ptr, xrow, mr, kk + (c // 16) * 32 + nib * 16 + c % 16, IEEE)
    else:                                               # 256-element super-blocks, BK = 256 or 128
        half = (kk // BK) % (256 // BK)                  # which half of the super-block (BK = 128)
        # bytes of a block of QT 5..14: Q4_K Q5_K Q6_K Q3_K Q2_K IQ4_XS (IQ4_NL) IQ2_XXS IQ2_XS IQ3_XXS
        BS: tl.constexpr = (144, 176, 210, 110, 84, 136, 18, 66, 74, 98)[QT - 5]
        KS: tl.constexpr = BS * (1 + (TILE_ROWS - 1) * TL)
        b = ra2 + (kk // 256) * KS                       # [BN, 1] block addresses
        if QT == 5 or QT == 6:                           # Q4_K / Q5_K: scales of 32, mins
            NQ: tl.constexpr = BK // 2                   # qs bytes in this tile
            NG: tl.constexpr = BK // 64                  # 32-byte groups g: sub-blocks 2g (low), 2g+1 (high)
            c = tl.arange(0, NQ)
            g = half * NG + tl.arange(0, NG)
            if QT == 5:
                qs = _u8(pool, b + 16 + half * NQ + c[None, :], m2)
            else:
                qs = _u8(pool, b + 48 + half * NQ + c[None, :], m2)
                qh = tl.reshape(tl.broadcast_to(_u8(pool, b + 16 + tl.arange(0, 32)[None, :], m2)[:, None, :],
                                                (BN, NG, 32)), (BN, NQ))                   # qh[c % 32]
            d = _f16(pool, b, m2)
            dm = _f16(pool, b + 2, m2)
            if QT == 5:
                S: tl.constexpr = 16.0                   # f = 1 + q/16 (q at mantissa bits 19-22)
            else:
                S: tl.constexpr = 32.0                   # f = 1 + q/32, the 5th bit (qh bit 2g+nib) at 22
            for nib in tl.static_range(2):
                sc, mi = _k_scale_min(pool, b, (g * 2 + nib)[None, :], m2)          # [BN, NG]
                if QT == 5:
                    if nib == 0:
                        f = (qs << 19) & 0x00780000
                    else:
                        f = (qs << 15) & 0x00780000
                else:
                    hb = (qh >> (c // 32 * 2 + half * NG * 2 + nib)[None, :]) & 1
                    if nib == 0:
                        f = ((qs << 18) & 0x003C0000) | (hb << 22)
                    else:
                        f = ((qs << 14) & 0x003C0000) | (hb << 22)
                a = S * (d * sc)
                w = _spread(a, BN, NG, 32) * _unit(f) + _spread(-(a + dm * mi), BN, NG, 32)
                acc = _mma(acc, w, x_ptr, xrow, mr, kk + (c // 32) * 64 + nib * 32 + c % 32, IEEE)
        elif QT == 7:                                    # Q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d
            NQ: tl.constexpr = BK // 2                   # ql bytes: element 128 h + 64 nibble + c % 64
            NH: tl.constexpr = BK // 128
            c = tl.arange(0, NQ)
            ql = _u8(pool, b + half * NQ + c[None, :], m2)
            qh = _u8(pool, b + 128 + half * 32 + ((c // 64) * 32 + c % 32)[None, :], m2)
            d = _f16(pool, b + 208, m2)
            for nib in tl.static_range(2):
                # scales of 16: 8 h + 4 nibble + (c % 64) // 16; q = ql nibble | qh bits 4 nib + 2 ((c // 32) % 2)
                si = (half * NH + tl.arange(0, NQ // 16) // 4) * 8 + nib * 4 + tl.arange(0, NQ // 16) % 4
                sc = (_u8(pool, b + 192 + si[None, :], m2) ^ 0x80) - 128                    # int8
                a = (64.0 * d) * sc.to(tl.float32)                                   # f = 1 + q/64
                # q's 4 low bits from ql's nibble, 2 high bits from qh at bits 4 nib + 2 ((c // 32) % 2)
                f = ((ql << (17 - 4 * nib)) & 0x001E0000) | ((qh << (21 - nib * 4 - ((c // 32) % 2) * 2)[None, :]) & 0x00600000)
                w = _spread(a, BN, NQ // 16, 16) * (_unit(f) - 1.5)                 # d sc (q - 32), exactly
                acc = _mma(acc, w, x_ptr, xrow, mr, kk + (c // 64) * 128 + nib * 64 + c % 64, IEEE)
        elif QT == 8 or QT == 9:                         # Q3_K / Q2_K: 4 bit pairs t of qs; scales of 16
            NQ: tl.constexpr = BK // 4                   # qs bytes: element 128 h + 32 t + c % 32
            NH: tl.constexpr = BK // 128
            c = tl.arange(0, NQ)
            h = half * NH + c // 32                      # 128-element half of the super-block
            if QT == 8:
                qs = _u8(pool, b + 32 + half * NQ + c[None, :], m2)
                hm = _u8(pool, b + (c % 32)[None, :], m2)
                d = _f16(pool, b + 108, m2)
            else:
                qs = _u8(pool, b + 16 + half * NQ + c[None, :], m2)
                d = _f16(pool, b + 80, m2)
                dm = _f16(pool, b + 82, m2)
            j = tl.arange(0, NQ // 16)
            for t in tl.static_range(4):
                s = ((half * NH + j // 2) * 8 + t * 2 + j % 2)[None, :]          # sub-block of 16, [1, NQ/16]
                if QT == 8:
                    lo = _u8(pool, b + 96 + s % 8, m2)
                    hi = _u8(pool, b + 104 + s % 4, m2)
                    sc = (((lo >> ((s // 8) * 4)) & 15) | (((hi >> ((s // 4) * 2)) & 3) << 4)) - 32
                    a = 8.0 * (d * sc.to(tl.float32))                           # f = 1 + (q + 4)/8
                    f = (((qs >> (2 * t)) & 3) << 20) | (((hm >> (h * 4 + t)[None, :]) & 1) << 22)
                    w = _spread(a, BN, NQ // 16, 16) * _unit(f) + _spread(-1.5 * a, BN, NQ // 16, 16)
                else:
                    sb = _u8(pool, b + s, m2)
                    a = 4.0 * (d * (sb & 15).to(tl.float32))                     # f = 1 + q/4
                    w = _spread(a, BN, NQ // 16, 16) * _unit(((qs >> (2 * t)) & 3) << 21) + \
                        _spread(-(a + dm * (sb >> 4).to(tl.float32)), BN, NQ // 16, 16)
                acc = _mma(acc, w, x_ptr, xrow, mr, kk + (c // 32) * 128 + t * 32 + c % 32, IEEE)
        elif QT == 10:                                   # IQ4_XS: f16 d | u16 scales_h | scales_l[4] | qs[128]
            NQ: tl.constexpr = BK // 2                   # qs bytes: element 32 (c//16) + 16 nibble + c % 16
            NS: tl.constexpr = BK // 32
            c = tl.arange(0, NQ)
            s = (half * NS + tl.arange(0, NS))[None, :]
            qs = _u8(pool, b + 8 + half * NQ + c[None, :], m2)
            lo = _u8(pool, b + 4 + s // 2, m2)
            sc = (((lo >> ((s % 2) * 4)) & 15) | (((_u16(pool, b + 2, m2) >> (s * 2)) & 3) << 4)) - 32
            dl = _spread(_f16(pool, b, m2) * sc.to(tl.float32), BN, NS, 16)
            for nib in tl.static_range(2):
                w = dl * _iq4_values(tab, (qs >> (4 * nib)) & 15)
                acc = _mma(acc, w, x_ptr, xrow, mr, kk + (c // 16) * 32 + nib * 16 + c % 16, IEEE)
        elif QT == 12 or QT == 13:                       # IQ2_XXS / IQ2_XS: groups of 8 = a grid row x signs
            NGR: tl.constexpr = BK // 8                  # groups in this tile
            l = half * NGR + tl.arange(0, NGR)           # group index in the super-block
            d = _f16(pool, b, m2)
            if QT == 12:
                # sub-block s = l // 4: grid index byte 2 + 8 s + l % 4; u32 at 6 + 8 s: 4 x 7-bit signs, scale
                gi = _u8(pool, b + (2 + (l // 4) * 8 + l % 4)[None, :], m2)
                aux = _u32(pool, b + (6 + (l // 4) * 8)[None, :], m2)
                si = (aux >> ((l % 4) * 7)[None, :]) & 127
                db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
                GO: tl.constexpr = 32                   # GRID_IQ2XXS
            else:
                # u16 at 2 + 2 l: 9-bit grid index, 7-bit signs; 4-bit scale per 16 elements: byte 66 + l // 4
                q = _u16(pool, b + (2 + l * 2)[None, :], m2)
                gi = q & 511
                si = q >> 9
                sb = _u8(pool, b + (66 + l // 4)[None, :], m2)
                db = d * (0.5 + ((sb >> (((l // 2) % 2) * 4)[None, :]) & 15).to(tl.float32)) * 0.25
                GO: tl.constexpr = 2080                 # GRID_IQ2XS
            w = _grid_weights(tab, GO, gi, 8, si, db, BN, NGR)
            acc = _mma(acc, w, x_ptr, xrow, mr, kk + tl.arange(0, BK), IEEE)
        else:                                            # IQ3_XXS: grid[64] of 4-rows, u32 x 8 signs/scale at 66
            NGR: tl.constexpr = BK // 8
            l = half * NGR + tl.arange(0, NGR)           # group of 8 = two grid rows, sub-block l // 4
            aux = _u32(pool, b + (66 + (l // 4) * 4)[None, :], m2)
            si = (aux >> ((l % 4) * 7)[None, :]) & 127
            db = _f16(pool, b, m2) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
            gi = _u8(pool, b + 2 + (half * 2 * NGR + tl.arange(0, 2 * NGR))[None, :], m2)
            w = _grid_weights(tab, 6176, gi, 4, si, db, BN, NGR)     # GRID_IQ3XXS
            acc = _mma(acc, w, x_ptr, xrow, mr, kk + tl.arange(0, BK), IEEE)
    return acc


# ---- a check: the tile itself ---------------------------------------------------------------------------

@triton.jit
def _dequant_kernel(pool, tab, eye_ptr, out_ptr, N, K, row_bytes,
                    QT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, IEEE: tl.constexpr):
    """W[n-block, kk .. kk+BK] @ I[kk+m0 .. kk+m0+BM]^T = the weights of BM columns, exactly (one product each)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    mn = n < N
    acc = wdot(tl.zeros((BN, BM), dtype=tl.float32), eye_ptr, (kk + m).to(tl.int64) * K, m < BK,
               pool, tab, n.to(tl.int64) * row_bytes, kk, mn, QT, BK, BN, IEEE)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + (kk + m)[None, :], acc, mask=mn[:, None])


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, int], bk: int = 256, bn: int = 64,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 [N, K] of a quantized [N, K] matrix (raw uint8 on the device) as the kernels see it: wdot against
    rows of the identity in `dtype` (float32: the tile's values; bfloat16: rounded to bf16, as the GPU's dots
    read them). K a multiple of bk (of 32 for the 32-element types). For checks (tests/scripts, check_cuda)."""
    from betelgeuse.gguf.qtypes import row_nbytes
    N, K = shape
    qt = QT_CODES[int(qtype)]
    assert K % bk == 0 and (qt not in SUPER or bk in (128, 256)), (K, bk)
    out = torch.empty(N, K, dtype=torch.float32, device=raw.device)
    eye = torch.eye(K, dtype=dtype, device=raw.device)
    bm = bk                                              # identity rows per program: the whole K step
    _dequant_kernel[(triton.cdiv(N, bn), K // bk, bk // bm)](raw, tables(raw.device), eye, out, N, K,
                                                            row_nbytes(qtype, K), QT=qt, BK=bk, BN=bn, BM=bm,
                                                            IEEE=dtype == torch.float32)
    return out
