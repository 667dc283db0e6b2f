"""In-kernel dequantization: one weight tile [BN, BK] float32 of a row-major quantized [N, K] matrix, from its
bytes in the device pool, for each GGML type the expert kernels read (triton_moe._gate_up_kernel / _down_kernel).

A tile is rows n (row byte addresses `ra` [BN] int64 = tensor start + n * row bytes) x columns kk .. kk+BK. It is
built as a 4-D tensor whose dims follow the block layout, so each byte is loaded once and broadcast to the
elements it encodes, then reshaped to [BN, BK] in element order (the x tile is then plain contiguous columns):

  type     block (elements, bytes)  tile dims (BK = 256)          element j of the super-block
  Q4_K     256, 144                 [BN, 4 g, 2 nibble, 32 i]     64 g + 32 nibble + i
  Q5_K     256, 176                 [BN, 4 g, 2 nibble, 32 i]     64 g + 32 nibble + i
  Q6_K     256, 210                 [BN, 8 u, 2 c, 16 i]          32 u + 16 c + i  (u = 4 h + t, 16-element scales)
  Q3_K     256, 110                 [BN, 8 u, 2 c, 16 i]          32 u + 16 c + i
  Q2_K     256, 84                  [BN, 8 u, 2 c, 16 i]          32 u + 16 c + i
  IQ4_XS   256, 136                 [BN, 8 s, 2 nibble, 16 i]     32 s + 16 nibble + i
  IQ2_XXS  256, 66                  [BN, 8 s, 4 l, 8 k]           32 s + 8 l + k
  IQ2_XS   256, 74                  [BN, 16 c, 2 l, 8 k]          16 c + 8 l + k
  IQ3_XXS  256, 98                  [BN, 32 g, 2 p, 4 k]          8 g + 4 p + k
  IQ4_NL   32, 18                   [BN, BK/32 blocks, 2 nibble, 16 i]
  Q8_0     32, 34                   [BN, BK/32 blocks, 32]
  MXFP4    32, 17                   [BN, BK/32 blocks, 2 nibble, 16 i]
  F16 / BF16 / F32                  [BN, BK]

The 256-element types also take BK = 128 (half a super-block: the first dim halves). Code books, grids and the
i-quant signs come from one float32 table tensor (`tables`): gathers from it are rows of 4-8 contiguous floats.
Quant integers become floats by the exponent trick ((q | 0x4B000000) as float32 = 2^23 + q, minus 2^23: exact,
and no int-to-float conversion, which runs at a quarter of the FMA rate). Scales are computed per sub-block in
float32 as gguf-py does (d * sc, dmin * m), so a tile equals `gguf/quants.py`'s values up to the one rounding of
a fused multiply-add (exactly, for F16/BF16/F32/Q8_0/MXFP4/IQ4_NL whose products are single roundings).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from betelgeuse.gguf.quants import IQ4_KVALUES, _MXFP4_KVALUES, iq_grid, ksigns

# kernel codes (constexpr QT) of the GGML types, and the bytes of one block of each
QT_CODES = {8: 0, 1: 1, 30: 2, 0: 3, 39: 4, 12: 5, 13: 6, 14: 7, 11: 8, 10: 9, 23: 10, 20: 11, 16: 12, 17: 13, 18: 14}
# Q8_0 F16 BF16 F32 MXFP4 Q4_K Q5_K Q6_K Q3_K Q2_K IQ4_XS IQ4_NL IQ2_XXS IQ2_XS IQ3_XXS
SUPER = frozenset({5, 6, 7, 8, 9, 10, 12, 13, 14})      # 256-element super-blocks (K a multiple of 256)

# offsets (float32 elements) of the tables in `tables()`
KV_IQ4, KV_MXFP4, SIGNS, GRID_IQ2XXS, GRID_IQ2XS, GRID_IQ3XXS, TABLES_LEN = 0, 16, 32, 1056, 3104, 7200, 8224
_TABLES: dict[str, torch.Tensor] = {}


def tables(device) -> torch.Tensor:
    """float32 [TABLES_LEN] on `device`: IQ4 code book, doubled e2m1 values, the i-quant signs as +-1 [128, 8],
    and the IQ2_XXS [256, 8], IQ2_XS [512, 8], IQ3_XXS [256, 4] grids (gguf-py's, as gguf/quants.py)."""
    key = str(device)
    if key not in _TABLES:
        s = np.array(ksigns(), dtype=np.int64)[:, None] >> np.arange(8)
        parts = [np.array(IQ4_KVALUES, np.float32), np.array(_MXFP4_KVALUES, np.float32),
                 np.where((s & 1) == 0, 1.0, -1.0).astype(np.float32).reshape(-1)]
        parts += [iq_grid(q).astype(np.float32).reshape(-1) for q in (16, 17, 18)]
        t = np.concatenate(parts)
        assert t.size == TABLES_LEN and [p.size for p in parts] == [16, 16, 1024, 2048, 4096, 1024]
        _TABLES[key] = torch.from_numpy(t).to(device)
    return _TABLES[key]


@triton.jit
def _f16(pool, addr, mask):
    """float32 of the little-endian f16 at byte `addr` (2-byte aligned: every block with an f16 is even-sized)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.float16)), mask=mask, other=0).to(tl.float32)


@triton.jit
def _u16(pool, addr, mask):
    """int32 of the little-endian u16 at byte `addr` (2-byte aligned)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def _i2f(q):
    """int32 0 <= q < 2^23 -> float32 q, exactly, without an int-to-float conversion."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _k_scale_min(pool, b4, s, m4):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-blocks s (int32, broadcastable) of blocks b4; bytes 4-15 of a block."""
    j4 = s % 4
    b0 = tl.load(pool + b4 + 4 + j4, mask=m4, other=0).to(tl.int32)
    b1 = tl.load(pool + b4 + 8 + j4, mask=m4, other=0).to(tl.int32)
    b2 = tl.load(pool + b4 + 12 + j4, mask=m4, other=0).to(tl.int32)
    lo = s < 4
    sc = tl.where(lo, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mi = tl.where(lo, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mi.to(tl.float32)


@triton.jit
def _signs(tab, sidx, k):
    """+-1 of element k (0..7) of the groups with 7-bit sign indices sidx (ksigns' parity bit included)."""
    return tl.load(tab + 32 + sidx * 8 + k)


@triton.jit
def tile(pool, tab, ra, kk, mn, QT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """[BN, BK] float32 weights: rows at byte addresses ra [BN] int64 (mask mn [BN]), columns kk .. kk+BK."""
    m4 = mn[:, None, None, None]
    if QT >= 1 and QT <= 3:                             # F16 / BF16 / F32
        c = kk + tl.arange(0, BK)
        if QT == 1:
            p = (pool + ra[:, None] + c[None, :] * 2).to(tl.pointer_type(tl.float16))
        elif QT == 2:
            p = (pool + ra[:, None] + c[None, :] * 2).to(tl.pointer_type(tl.bfloat16))
        else:
            p = (pool + ra[:, None] + c[None, :] * 4).to(tl.pointer_type(tl.float32))
        w = tl.load(p, mask=mn[:, None], other=0).to(tl.float32)
    elif (QT == 0 or QT == 4) or QT == 11:              # 32-element blocks: Q8_0 (34 B), MXFP4 (17 B), IQ4_NL (18 B)
        NB: tl.constexpr = BK // 32
        if QT == 0:
            BS: tl.constexpr = 34
        elif QT == 4:
            BS: tl.constexpr = 17
        else:
            BS: tl.constexpr = 18
        blk = ra[:, None, None, None] + ((kk // 32 + tl.arange(0, NB)) * BS)[None, :, None, None]   # [BN, NB, 1, 1]
        if QT == 0:
            j = tl.arange(0, 32)[None, None, None, :]
            q = tl.load(pool + blk + 2 + j, mask=m4, other=0).to(tl.int32)                      # int8 as u8
            d = _f16(pool, blk, m4)
            w = _i2f(q ^ 0x80) - 128.0                                                            # q ^ 0x80 = q + 128
            w = tl.reshape(w * d, (BN, BK))
        else:
            nib = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, :]
            if QT == 4:
                QO: tl.constexpr = 1                                 # codes after the E8M0 byte
            else:
                QO: tl.constexpr = 2                                 # after the f16 scale
            code = (tl.load(pool + blk + QO + i, mask=m4, other=0).to(tl.int32) >> (nib * 4)) & 15
            if QT == 4:
                # E8M0 -> 2^(e-128) as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
                e8 = tl.load(pool + blk, mask=m4, other=0).to(tl.int32)
                d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
                v = tl.load(tab + 16 + code)                        # doubled e2m1 value: d * v exact
            else:
                d = _f16(pool, blk, m4)
                v = tl.load(tab + code)                             # IQ4 code book
            w = tl.reshape(d * v, (BN, BK))
    else:                                                   # 256-element super-blocks, BK = 256 or 128
        H: tl.constexpr = 256 // BK                          # tiles per super-block
        half = (kk // BK) % H
        if QT == 5:
            BS: tl.constexpr = 144
        elif QT == 6:
            BS: tl.constexpr = 176
        elif QT == 7:
            BS: tl.constexpr = 210
        elif QT == 8:
            BS: tl.constexpr = 110
        elif QT == 9:
            BS: tl.constexpr = 84
        elif QT == 10:
            BS: tl.constexpr = 136
        elif QT == 12:
            BS: tl.constexpr = 66
        elif QT == 13:
            BS: tl.constexpr = 74
        else:
            BS: tl.constexpr = 98
        b4 = (ra + (kk // 256) * BS)[:, None, None, None]     # [BN, 1, 1, 1] block addresses
        if QT == 5 or QT == 6:                                # Q4_K / Q5_K: [BN, g, nibble, i]
            NG: tl.constexpr = BK // 64
            g = (half * NG + tl.arange(0, NG))[None, :, None, None]
            nib = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 32)[None, None, None, :]
            s = g * 2 + nib                                    # sub-block of 32
            if QT == 5:
                qs = tl.load(pool + b4 + 16 + g * 32 + i, mask=m4, other=0).to(tl.int32)
                q = (qs >> (nib * 4)) & 15
            else:
                qs = tl.load(pool + b4 + 48 + g * 32 + i, mask=m4, other=0).to(tl.int32)
                qh = tl.load(pool + b4 + 16 + i, mask=m4, other=0).to(tl.int32)
                q = ((qs >> (nib * 4)) & 15) | (((qh >> s) & 1) << 4)
            sc, mi = _k_scale_min(pool, b4, s, m4)
            dl = _f16(pool, b4, m4) * sc
            ml = _f16(pool, b4 + 2, m4) * mi
            w = dl * _i2f(q) - ml
        elif QT >= 7 and QT <= 9:                             # Q6_K / Q3_K / Q2_K: [BN, u, c, i], scale per 2u + c
            NU: tl.constexpr = BK // 32
            u = (half * NU + tl.arange(0, NU))[None, :, None, None]
            c = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, :]
            h = u // 4                                         # 128-element half
            t = u % 4
            if QT == 7:
                # ql: byte 64h + 32(t%2) + i, nibble t//2; qh: byte 128 + 32h + i, bits 2t; int8 scales at 192
                ql = tl.load(pool + b4 + h * 64 + (t % 2) * 32 + c * 16 + i, mask=m4, other=0).to(tl.int32)
                qh = tl.load(pool + b4 + 128 + h * 32 + c * 16 + i, mask=m4, other=0).to(tl.int32)
                q = ((ql >> ((t // 2) * 4)) & 15) | (((qh >> (t * 2)) & 3) << 4)
                sc = tl.load((pool + b4 + 192 + u * 2 + c).to(tl.pointer_type(tl.int8)), mask=m4, other=0)
                w = (_f16(pool, b4 + 208, m4) * sc.to(tl.float32)) * (_i2f(q) - 32.0)
            elif QT == 8:
                # qs: byte 32 + 32h + i, bits 2t; hmask: byte i, bit u (set: no -4); 6-bit scales at 96
                ql = tl.load(pool + b4 + 32 + h * 32 + c * 16 + i, mask=m4, other=0).to(tl.int32)
                hm = tl.load(pool + b4 + c * 16 + i, mask=m4, other=0).to(tl.int32)
                q = ((ql >> (t * 2)) & 3) + (((hm >> u) & 1) << 2)        # q + 4, in 0..7
                s = u * 2 + c
                lo = tl.load(pool + b4 + 96 + s % 8, mask=m4, other=0).to(tl.int32)
                hi = tl.load(pool + b4 + 104 + s % 4, mask=m4, other=0).to(tl.int32)
                sc = (((lo >> ((s // 8) * 4)) & 15) | (((hi >> ((s // 4) * 2)) & 3) << 4)) - 32
                w = (_f16(pool, b4 + 108, m4) * sc.to(tl.float32)) * (_i2f(q) - 4.0)
            else:
                # qs: byte 16 + 32h + i, bits 2t; scales at 0 (low nibble scale, high nibble min)
                qs = tl.load(pool + b4 + 16 + h * 32 + c * 16 + i, mask=m4, other=0).to(tl.int32)
                q = (qs >> (t * 2)) & 3
                sb = tl.load(pool + b4 + u * 2 + c, mask=m4, other=0).to(tl.int32)
                dl = _f16(pool, b4 + 80, m4) * (sb & 15).to(tl.float32)
                ml = _f16(pool, b4 + 82, m4) * (sb >> 4).to(tl.float32)
                w = dl * _i2f(q) - ml
        elif QT == 10:                                         # IQ4_XS: [BN, s, nibble, i]
            NS: tl.constexpr = BK // 32
            s = (half * NS + tl.arange(0, NS))[None, :, None, None]
            nib = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, :]
            code = (tl.load(pool + b4 + 8 + s * 16 + i, mask=m4, other=0).to(tl.int32) >> (nib * 4)) & 15
            lo = tl.load(pool + b4 + 4 + s // 2, mask=m4, other=0).to(tl.int32)
            hi = _u16(pool, b4 + 2, m4)
            sc = (((lo >> ((s % 2) * 4)) & 15) | (((hi >> (s * 2)) & 3) << 4)) - 32
            w = (_f16(pool, b4, m4) * sc.to(tl.float32)) * tl.load(tab + code)
        elif QT == 12:                                         # IQ2_XXS: [BN, s, l, k]
            NS: tl.constexpr = BK // 32
            s = (half * NS + tl.arange(0, NS))[None, :, None, None]
            l4 = tl.arange(0, 4)[None, None, :, None]
            k = tl.arange(0, 8)[None, None, None, :]
            gi = tl.load(pool + b4 + 2 + s * 8 + l4, mask=m4, other=0).to(tl.int32)       # [BN, NS, 4, 1]
            aux = _u16(pool, b4 + 6 + s * 8, m4) | (_u16(pool, b4 + 8 + s * 8, m4) << 16)
            db = _f16(pool, b4, m4) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
            grid = tl.load(tab + 1056 + gi * 8 + k)
            w = db * grid * _signs(tab, (aux >> (l4 * 7)) & 127, k)
        elif QT == 13:                                         # IQ2_XS: [BN, c, l, k]
            NC: tl.constexpr = BK // 16
            c = (half * NC + tl.arange(0, NC))[None, :, None, None]
            l2 = tl.arange(0, 2)[None, None, :, None]
            k = tl.arange(0, 8)[None, None, None, :]
            q = _u16(pool, b4 + 2 + c * 4 + l2 * 2, m4)                                    # [BN, NC, 2, 1]
            sb = tl.load(pool + b4 + 66 + c // 2, mask=m4, other=0).to(tl.int32)
            db = _f16(pool, b4, m4) * (0.5 + ((sb >> ((c % 2) * 4)) & 15).to(tl.float32)) * 0.25
            grid = tl.load(tab + 3104 + (q & 511) * 8 + k)
            w = db * grid * _signs(tab, q >> 9, k)
        else:                                                  # IQ3_XXS: [BN, g, p, k], g = 4 s + l
            NG: tl.constexpr = BK // 8
            g = (half * NG + tl.arange(0, NG))[None, :, None, None]
            p = tl.arange(0, 2)[None, None, :, None]
            k = tl.arange(0, 4)[None, None, None, :]
            gi = tl.load(pool + b4 + 2 + g * 2 + p, mask=m4, other=0).to(tl.int32)        # [BN, NG, 2, 1]
            s = g // 4
            aux = _u16(pool, b4 + 66 + s * 4, m4) | (_u16(pool, b4 + 68 + s * 4, m4) << 16)
            db = _f16(pool, b4, m4) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
            grid = tl.load(tab + 7200 + gi * 4 + k)
            w = db * grid * _signs(tab, (aux >> ((g % 4) * 7)) & 127, p * 4 + k)
        w = tl.reshape(w, (BN, BK))
    return w


@triton.jit
def _dequant_kernel(pool, tab, out_ptr, base, N, K, row_bytes,
                    QT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK
    mn = n < N
    w = tile(pool, tab, base + n.to(tl.int64) * row_bytes, kk, mn, QT, BK, BN)
    c = kk + tl.arange(0, BK)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + c[None, :], w, mask=mn[:, None])


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, int], bk: int = 256, bn: int = 16) -> torch.Tensor:
    """float32 [N, K] of a quantized [N, K] matrix through the kernels' tile (checks: tests/scripts, check_cuda):
    raw uint8 on the device, K a multiple of bk (of 32 for the 32-element types)."""
    from betelgeuse.gguf.qtypes import row_nbytes
    N, K = shape
    qt = QT_CODES[int(qtype)]
    assert K % bk == 0 and (qt not in SUPER or bk in (128, 256)), (K, bk)
    out = torch.empty(N, K, dtype=torch.float32, device=raw.device)
    _dequant_kernel[(triton.cdiv(N, bn), K // bk)](raw, tables(raw.device), out, 0, N, K, row_nbytes(qtype, K),
                                                 QT=qt, BK=bk, BN=bn)
    return out
