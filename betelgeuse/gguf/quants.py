"""Dequantization of GGML block formats in torch, on whatever device the bytes live.

Slots and transfers carry quantized bytes as stored in the GGUF file; the worker dequantizes them
on the compute device (CUDA on the GPU machine, CPU in CI). Every kernel here is a handful of
vectorized torch ops over all blocks at once, and follows gguf-py's numpy reference
(`gguf/quants.py`) op for op in float32, so that the results are bit-identical to it: the same
float32 multiplications and subtractions in the same order, with no fused multiply-add (eager torch
never fuses `a * b - c`).

Block layouts (bytes, little-endian), one block = `block_size` consecutive elements of one row:
  Q8_0  (32 elements, 34 B): f16 d | int8 qs[32]                        x = d * q
  Q4_K (256 elements, 144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
        8 sub-blocks of 32, 6-bit scale/min each:                    x = d*sc * q - dmin*m
  Q6_K (256 elements, 210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
        16 sub-blocks of 16, 6-bit quants centred on 32:             x = d*sc * (q - 32)
  Q5_K (256 elements, 176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
        as Q4_K, plus bit s of qh[i] as the 5th bit of element 32s + i:  x = d*sc * q - dmin*m
  Q3_K (256 elements, 110 B): u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
        16 sub-blocks of 16, 6-bit signed scales; q = 2 low bits - 4 * (hmask bit clear)  x = d*sc * q
  Q2_K (256 elements, 84 B): u8 scales[16] (4-bit scale | 4-bit min) | u8 qs[64] | f16 d | f16 dmin
        16 sub-blocks of 16, 2-bit quants:                              x = d*sc * q - dmin*m
  IQ4_NL (32 elements, 18 B): f16 d | u8 qs[16]; element j the low nibble of qs[j], j+16 the high one,
        a non-linear code book:                                        x = d * kvalues[nibble]
  IQ4_XS (256 elements, 136 B): f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]; 8 sub-blocks of 32
        with 6-bit signed scales, IQ4_NL's code book:                   x = d*sc * kvalues[nibble]
  IQ2_XXS (256 elements, 66 B): f16 d | 8 x (u8 grid[4] | u32 4 x 7-bit sign index, 4-bit scale): each
        group of 8 elements is an 8-entry row of a 256-row grid of {8, 25, 43}, signs from a parity table
        (ksigns):                                                      x = d*(0.5+s)/4 * grid * sign
  IQ2_XS (256 elements, 74 B): f16 d | u16 qs[32] (9-bit grid index | 7-bit sign index) | u8 scales[8]
        (4-bit scale per 16 elements), a 512-row grid                  x = d*(0.5+s)/4 * grid * sign
  IQ3_XXS (256 elements, 98 B): f16 d | u8 grid[64] | 8 x u32 (4 x 7-bit sign index, 4-bit scale); each
        group of 8 elements is two 4-entry rows of a 256-row grid of {4, 12, ..., 62}
                                                                       x = d*(0.5+s)/2 * grid * sign
  MXFP4 (32 elements, 17 B): u8 e (E8M0 exponent) | u8 qs[16]; element j is the low nibble of qs[j],
        element j+16 the high one; x = 2^(e-128) * kvalues[nibble] (e2m1 values doubled, scale halved,
        as ggml): every product is exact in float32, so any evaluation order gives gguf's bits
  I32: int32 values (DeepSeek-V4's tid2eid hash-routing table), returned as int32 unless asked otherwise

The i-quants' grids are gguf-py's tables (`gguf.quants.IQ2_XXS.grid` ..., llama.cpp's `iq2xxs_grid` ...):
data, not code; the sign table is computed here (an 8th bit that makes the parity even).
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as QT

from betelgeuse.errors import UnsupportedError

from betelgeuse.gguf.qtypes import SUPPORTED_QTYPES, block_size, qtype_name, row_nbytes, tensor_nbytes  # noqa: F401


def _as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a 1-D uint8 tensor as `dtype`; copies first if the start is not aligned to it
    (a slice of a slot arena may start anywhere; torch's view() and CUDA loads need alignment)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size or raw.data_ptr() % size or not raw.is_contiguous():
        raw = raw.clone()
    return raw.view(dtype)


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 (a column slice of the blocks) -> [n, 1] float32 from little-endian f16."""
    return cols.contiguous().view(torch.float16).to(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 34] -> [n, 32]
    d = _f16(blocks[:, :2])                               # [n, 1]
    q = blocks[:, 2:].view(torch.int8).to(torch.float32)  # [n, 32]
    return q * d


def _k_scale_min(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the (d*sc [n,8,1], dmin*m [n,8,1]) float32 of 8 sub-blocks from f16 d, f16 dmin and 12 bytes
    of packed 6-bit scales/mins at bytes 0-15 of each block."""
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                              # [n, 1]
    dmin = _f16(blocks[:, 2:4])                           # [n, 1]
    s = blocks[:, 4:16].reshape(n, 3, 4)                  # 12 bytes of packed 6-bit scales/mins
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]                # [n, 4] each
    # sub-blocks 0-3 keep 6 bits in bytes 0-7; sub-blocks 4-7 take 4 bits from bytes 8-11 and
    # their top 2 bits from the top of bytes 0-7 (see gguf Q4_K.get_scale_min).
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], dim=-1)    # [n, 8]
    return (d * sc.to(torch.float32)).reshape(n, 8, 1), (dmin * mn.to(torch.float32)).reshape(n, 8, 1)


def _bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int) -> torch.Tensor:
    """(x >> s) & mask for each s, stacked at `dim` (a new axis)."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=dim)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 144] -> [n, 256]
    n = blocks.shape[0]
    dl, ml = _k_scale_min(blocks)
    # 128 bytes = 4 groups of 32; each group gives sub-block 2g (low nibbles) and 2g+1 (high).
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 176] -> [n, 256]: Q4_K's scales, then qh[32] (bit s of qh[i] -> element 32s+i), qs[128]
    n = blocks.shape[0]
    dl, ml = _k_scale_min(blocks)
    qh = _bits(blocks[:, 16:48], tuple(range(8)), 1, 1)                     # [n, 8, 32]
    ql = _bits(blocks[:, 48:176].reshape(n, 4, 32), (0, 4), 0x0F, 2)         # [n, 4, 2, 32]
    q = (ql.reshape(n, 8, 32) | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 110] -> [n, 256]: hmask[32] | qs[64] | scales[12] | f16 d
    n = blocks.shape[0]
    d = _f16(blocks[:, 108:110])                                            # [n, 1]
    sc = blocks[:, 96:108]
    # scale s: low 4 bits from byte s % 8 (nibble s // 8), high 2 bits from byte 8 + s % 4 (bits 2 * (s // 4))
    low = _bits(sc[:, :8], (0, 4), 0x0F, 1).reshape(n, 16)
    high = _bits(sc[:, 8:12], (0, 2, 4, 6), 3, 1).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(blocks[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 3, 2)      # [n, 2, 4, 32]: element 128h + 32t + i
    qh = _bits(blocks[:, 0:32], tuple(range(8)), 1, 1) ^ 1                  # [n, 8, 32]: bit u -> element 32u + i
    q = (ql.reshape(n, 16, 16).to(torch.int8) - (qh.reshape(n, 16, 16) << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, 256)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 84] -> [n, 256]: scales[16] | qs[64] | f16 d | f16 dmin
    n = blocks.shape[0]
    d = _f16(blocks[:, 80:82])
    dmin = _f16(blocks[:, 82:84])
    sc = blocks[:, 0:16]
    dl = (d * (sc & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _bits(blocks[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 3, 2)       # [n, 2, 4, 32]: element 128h + 32t + i
    return (dl * q.reshape(n, 16, 16).to(torch.float32) - ml).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 210] -> [n, 256]
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [n, 16]
    d = _f16(blocks[:, 208:210])                                    # [n, 1]
    dl = (d * scales).reshape(n, 16, 1)
    # low 4 bits: 2 halves of 64 bytes, low nibbles then high nibbles -> 8 runs of 32
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    # high 2 bits: 2 halves of 32 bytes, 4 bit-pairs each -> 8 runs of 32
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int16) - 32                       # [n, 8, 32] in [-32, 31]
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, 256)


# e2m1 code -> value x2 (gguf.quants.MXFP4.kvalues)
_MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_LUTS: dict[tuple[str, str], torch.Tensor] = {}


def _mxfp4_luts(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [256] float32 = 2^(e-128) exactly as ggml_e8m0_to_fp32_half, kvalues [16] float32)."""
    key = ("mxfp4", str(device))
    if key not in _LUTS:
        import numpy as np
        e = np.arange(256, dtype=np.uint32)
        bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
        scale = torch.from_numpy(bits.view(np.float32).copy())
        _LUTS[key] = torch.cat([scale, torch.tensor(_MXFP4_KVALUES, dtype=torch.float32)]).to(device)
    lut = _LUTS[key]
    return lut[:256], lut[256:]


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 17] -> [n, 32]
    scale, kv = _mxfp4_luts(blocks.device)
    d = scale[blocks[:, 0].long()][:, None]                          # [n, 1]
    qs = blocks[:, 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()           # [n, 32]: low nibbles, then high
    return d * kv[codes]


# ---- non-linear and grid (i-)quants -------------------------------------------------------------------

# IQ4_NL / IQ4_XS code book (gguf.quants.IQ4_NL.kvalues, llama.cpp kvalues_iq4nl)
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def ksigns() -> list[int]:
    """The i-quants' sign table: entry i = i | 0x80 if i has an odd number of set bits (8 signs, even parity)."""
    return [i | ((bin(i).count("1") & 1) << 7) for i in range(128)]


def iq_grid(qtype: int):
    """uint8 [rows, 8 or 4]: the grid of an IQ2_XXS (256 x 8), IQ2_XS (512 x 8) or IQ3_XXS (256 x 4) type."""
    import numpy as np
    from gguf import quants as gq
    cls = {int(QT.IQ2_XXS): gq.IQ2_XXS, int(QT.IQ2_XS): gq.IQ2_XS, int(QT.IQ3_XXS): gq.IQ3_XXS}[int(qtype)]
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)).astype(np.uint8)


def _tables(device) -> dict[str, torch.Tensor]:
    """float32 lookup tables on `device`: kvalues [16], ksigns as +-1 [128, 8], the three grids."""
    key = ("iq", str(device))
    if key not in _LUTS:
        signs = torch.tensor(ksigns(), dtype=torch.int64)[:, None] >> torch.arange(8)
        _LUTS[key] = {"kv": torch.tensor(IQ4_KVALUES, dtype=torch.float32),
                      "signs": torch.where((signs & 1) == 0, 1.0, -1.0).to(torch.float32),
                      **{q: torch.from_numpy(iq_grid(q)).to(torch.float32)
                         for q in (int(QT.IQ2_XXS), int(QT.IQ2_XS), int(QT.IQ3_XXS))}}
        _LUTS[key] = {k: v.to(device) for k, v in _LUTS[key].items()}
    return _LUTS[key]


def _u32(cols: torch.Tensor) -> torch.Tensor:
    """[n, 4m] uint8 (a column slice of the blocks) -> [n, m] int64 of the little-endian u32 words."""
    fresh = torch.empty(cols.shape, dtype=torch.uint8, device=cols.device).copy_(cols)   # 4-byte aligned
    return fresh.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 18] -> [n, 32]: f16 d | qs[16], element j < 16 the low nibble of qs[j], j + 16 the high one
    t = _tables(blocks.device)
    d = _f16(blocks[:, :2])
    codes = torch.cat([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], dim=-1).long()
    return d * t["kv"][codes]


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 136] -> [n, 256]: f16 d | u16 scales_h | scales_l[4] | qs[128]
    n = blocks.shape[0]
    t = _tables(blocks.device)
    d = _f16(blocks[:, :2])
    sh = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int64)      # [n, 1]
    low = _bits(blocks[:, 4:8], (0, 4), 0x0F, 2).reshape(n, 8)              # sub-block s: nibble s % 2 of byte s // 2
    high = _bits(sh, tuple(range(0, 16, 2)), 3, 1).reshape(n, 8)            # bits 2s, 2s+1 of scales_h
    scales = ((low.to(torch.int64) | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 8, 1)
    codes = _bits(blocks[:, 8:136].reshape(n, 8, 16), (0, 4), 0x0F, 2).reshape(n, 8, 32).long()
    return (dl * t["kv"][codes]).reshape(n, 256)


def _iq_signs(t: dict, aux: torch.Tensor) -> torch.Tensor:
    """[n, m] u32 words with 4 x 7-bit sign indices -> [n, m, 4, 8] +-1."""
    return t["signs"][_bits(aux, (0, 7, 14, 21), 0x7F, 2)]


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 66] -> [n, 256]: f16 d | 8 x (grid indices u8[4], u32 signs/scale)
    n = blocks.shape[0]
    t = _tables(blocks.device)
    d = _f16(blocks[:, :2])
    aux = _u32(blocks[:, 2:66]).reshape(n, 8, 2)
    db = (d * (0.5 + (aux[..., 1] >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    idx = blocks[:, 2:66].reshape(n, 8, 2, 4)[:, :, 0].long()              # [n, 8, 4]
    grid = t[int(QT.IQ2_XXS)][idx]                                           # [n, 8, 4, 8]
    return (db * grid * _iq_signs(t, aux[..., 1])).reshape(n, 256)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 74] -> [n, 256]: f16 d | u16 qs[32] (grid index 9 bits | sign index 7 bits) | scales[8]
    n = blocks.shape[0]
    t = _tables(blocks.device)
    d = _f16(blocks[:, :2])
    qs = blocks[:, 2:66].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF   # [n, 32]
    sc = _bits(blocks[:, 66:74], (0, 4), 0x0F, 2).reshape(n, 16)            # one per 16 elements
    db = (d * (0.5 + sc.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    grid = t[int(QT.IQ2_XS)][qs & 511].reshape(n, 16, 2, 8)
    signs = t["signs"][qs >> 9].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 98] -> [n, 256]: f16 d | grid indices u8[64] | 8 x u32 signs/scale
    n = blocks.shape[0]
    t = _tables(blocks.device)
    d = _f16(blocks[:, :2])
    aux = _u32(blocks[:, 66:98])                                             # [n, 8]
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    grid = t[int(QT.IQ3_XXS)][blocks[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * _iq_signs(t, aux)).reshape(n, 256)


_BLOCK_KERNELS = {int(QT.MXFP4): _mxfp4, int(QT.Q8_0): _q8_0, int(QT.Q4_K): _q4_k, int(QT.Q6_K): _q6_k,
                  int(QT.Q5_K): _q5_k, int(QT.Q3_K): _q3_k, int(QT.Q2_K): _q2_k, int(QT.IQ4_NL): _iq4_nl,
                  int(QT.IQ4_XS): _iq4_xs, int(QT.IQ2_XXS): _iq2_xxs, int(QT.IQ2_XS): _iq2_xs,
                  int(QT.IQ3_XXS): _iq3_xxs}


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized bytes -> a new tensor of `shape` and `dtype` on raw.device.

    raw: uint8 tensor (any shape, contiguous) holding exactly the bytes of `shape` elements of
    `qtype`, rows along the last dim of `shape`. The result never aliases `raw`, so the caller may
    reuse the slot or ring buffer that held the bytes as soon as the result exists.
    """
    qtype = int(qtype)
    if qtype not in SUPPORTED_QTYPES:
        raise UnsupportedError(f"tensor type {qtype_name(qtype)} is not supported "
                               f"(supported: {', '.join(sorted(qtype_name(q) for q in SUPPORTED_QTYPES))})")
    assert raw.dtype == torch.uint8, f"raw must be uint8, got {raw.dtype}"
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(qtype, shape)
    assert raw.numel() == nbytes, f"{raw.numel()} bytes given, {qtype_name(qtype)}{list(shape)} needs {nbytes}"
    raw = raw.reshape(-1)

    if qtype == QT.F32:
        out = _as_dtype(raw, torch.float32)
    elif qtype == QT.F16:
        out = _as_dtype(raw, torch.float16)
    elif qtype == QT.BF16:
        out = _as_dtype(raw, torch.bfloat16)
    elif qtype == QT.I32:
        out = _as_dtype(raw, torch.int32)
    else:
        _, type_size = block_size(qtype)
        out = _BLOCK_KERNELS[qtype](raw.reshape(-1, type_size))  # [n_blocks, block] float32
    out = out.reshape(shape)
    if out.dtype == dtype and out.data_ptr() == raw.data_ptr():
        out = out.clone()  # F32 -> F32 was a view of raw
    return out.to(dtype)


_OFFSETS: dict[tuple[int, int, str], torch.Tensor] = {}


def dequantize_q8_0_parts(buf: torch.Tensor, starts: torch.Tensor, n_blocks: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Several Q8_0 tensors of `n_blocks` blocks each, lying anywhere in one byte buffer, dequantized
    together: buf uint8 [N], starts int64 [P] (byte offset of each, on buf's device) -> [P, n_blocks * 32].

    One gather and one conversion for all P tensors (an expert's gate, up and down have the same element
    count): ~7 kernel launches per expert instead of ~18, the same arithmetic as `dequantize`, bit for bit."""
    key = (n_blocks, 34, str(buf.device))
    offs = _OFFSETS.get(key)
    if offs is None:
        offs = _OFFSETS[key] = torch.arange(n_blocks, device=buf.device, dtype=torch.int64) * 34
    idx = starts[:, None] + offs[None, :]                   # [P, n_blocks] byte offsets of the blocks
    blocks = buf.unfold(0, 34, 1)[idx]                      # [P, n_blocks, 34], gathered (a new tensor)
    return _q8_0(blocks.reshape(-1, 34)).reshape(starts.numel(), n_blocks * 32).to(dtype)