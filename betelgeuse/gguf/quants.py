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
  MXFP4 (32 elements, 17 B): u8 e (E8M0 exponent) | u8 qs[16]; element j is the low nibble of qs[j],
        element j+16 the high one; x = 2^(e-128) * kvalues[nibble] (e2m1 values doubled, scale halved,
        as ggml): every product is exact in float32, so any evaluation order gives gguf's bits
  I32: int32 values (DeepSeek-V4's tid2eid hash-routing table), returned as int32 unless asked otherwise
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


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks [n, 144] -> [n, 256]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                              # [n, 1]
    dmin = _f16(blocks[:, 2:4])                           # [n, 1]
    s = blocks[:, 4:16].reshape(n, 3, 4)                  # 12 bytes of packed 6-bit scales/mins
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]                # [n, 4] each
    # sub-blocks 0-3 keep 6 bits in bytes 0-7; sub-blocks 4-7 take 4 bits from bytes 8-11 and
    # their top 2 bits from the top of bytes 0-7 (see gguf Q4_K.get_scale_min).
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], dim=-1)    # [n, 8]
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    # 128 bytes = 4 groups of 32; each group gives sub-block 2g (low nibbles) and 2g+1 (high).
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


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


_BLOCK_KERNELS = {int(QT.MXFP4): _mxfp4, int(QT.Q8_0): _q8_0, int(QT.Q4_K): _q4_k, int(QT.Q6_K): _q6_k}


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