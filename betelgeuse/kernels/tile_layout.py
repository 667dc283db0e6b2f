"""The tile layout of a quantized [rows, K] weight matrix (issue 23, docs/benchmarks/cpu-tile62): block-interleaved
64-row tiles, so the Triton expert kernels' weight loads walk DRAM in runs instead of one short run a row.

GGUF order is row-major: row n's blocks j = 0 .. nb-1 (nb = K / block elements, bb bytes each) at n * row_bytes +
j * bb. A kernel's K step reads, for each of its 64 rows, a few blocks: short runs (68 bytes for Q8_0's two blocks)
a row_bytes stride apart, which H100's DRAM serves at ~1,060 GB/s where the same loads over tile-major bytes read
~2,280 (docs/benchmarks/gpu-run64, pattern_pk.log). The tile layout keeps every block whole and only moves blocks:

  [tile t = n // TR][block j][row i = n % TR][bb bytes]   -- block j of row n at
  t * TR * row_bytes + j * (TR * bb) + i * bb

so a tile holds the same bytes GGUF put there (its TR rows x row_bytes), a K step's blocks of the tile's 64 rows are
one contiguous run, and a kernel reads either layout with two strides: a row's address tile_base + i * rs, its block
j at + j * ks, with (rs, ks) = (row_bytes, bb) for GGUF (tile_base + i * row_bytes = n * row_bytes) and (bb, TR * bb)
tiled (`strides`). The same size: a slot holds either. A block is the type's unit (`unit`: 34 bytes of Q8_0, 17 of
MXFP4, the 144-byte super-block of Q4_K, ...; the float types F32 / F16 / BF16 in units of 32 elements).

tile / untile: a view + permute + copy ([tiles, TR, nb, bb] <-> [tiles, nb, TR, bb]) of a numpy array or a torch
tensor (on any device: the GPU tiles a bank in place of a host copy)."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

TR = 64                                  # rows a tile (the expert kernels' BN: a program's output block)
FLOAT_UNIT = 32                          # elements of a float type's unit (its "block" here)
_FLOATS = {int(QT.F32): 4, int(QT.F16): 2, int(QT.BF16): 2}


def unit(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of a block of `qtype` in the tile layout: GGUF's block, or FLOAT_UNIT elements of a float."""
    qtype = int(qtype)
    if qtype in _FLOATS:
        return FLOAT_UNIT, FLOAT_UNIT * _FLOATS[qtype]
    return GGML_QUANT_SIZES[QT(qtype)]


def usable(rows: int, K: int, qtype: int) -> bool:
    """Whether a [rows, K] matrix of `qtype` tiles: whole tiles (rows a multiple of TR) of whole blocks."""
    return rows > 0 and rows % TR == 0 and K > 0 and K % unit(qtype)[0] == 0


def strides(qtype: int, K: int, tiled: bool) -> tuple[int, int]:
    """(rs, ks) bytes: a row's offset in its tile (row i at tile_base + i * rs) and a block's after its row's (block j
    at + j * ks), for a row of K elements in GGUF order (tiled False) or the tile layout."""
    el, bb = unit(qtype)
    return (bb, TR * bb) if tiled else (K // el * bb, bb)


def block_offsets(rows: int, K: int, qtype: int, tiled: bool) -> np.ndarray:
    """int64 [rows, nb]: the byte offset of block j of row n in the matrix (the kernels' address formula)."""
    el, bb = unit(qtype)
    rs, ks = strides(qtype, K, tiled)
    n = np.arange(rows, dtype=np.int64)[:, None]
    return n // TR * (TR * (K // el * bb)) + n % TR * rs + np.arange(K // el, dtype=np.int64)[None, :] * ks


def _check(a, rows: int, K: int, qtype: int):
    assert usable(rows, K, qtype), (rows, K, qtype)
    el, bb = unit(qtype)
    flat = a.reshape(-1)
    assert str(flat.dtype) in ("uint8", "torch.uint8") and flat.shape[0] == rows * (K // el) * bb, (
        rows, K, qtype, a.shape, a.dtype)
    return flat, rows // TR, K // el, bb


def _move(a, shape: tuple, out=None):
    """a viewed as `shape` [tiles, x, y, bb] -> [tiles, y, x, bb], flat (the one permutation both ways); out (a torch
    tensor of a's size, contiguous, not overlapping a): written in place of a new tensor, and returned."""
    v = a.reshape(shape)
    if hasattr(v, "permute"):                               # torch (any device)
        if out is not None:                                 # one strided copy, on the current stream: no temporary
            out.view(shape[0], shape[2], shape[1], shape[3]).copy_(v.permute(0, 2, 1, 3))
            return out
        return v.permute(0, 2, 1, 3).contiguous().reshape(-1)
    assert out is None, "out: torch tensors only"
    return np.ascontiguousarray(v.transpose(0, 2, 1, 3)).reshape(-1)


def tile(data, rows: int, K: int, qtype: int, out=None):
    """GGUF-ordered bytes of a [rows, K] matrix of `qtype` (a uint8 numpy array or torch tensor, any shape) -> its
    tile-layout bytes: a flat array of the same kind (and device), the same size. out (torch: a contiguous uint8
    tensor of that size, not data's memory, e.g. the VRAM slot data was copied out of: ExpertCache._relayout): the
    bytes written there instead, out returned."""
    a, nt, nb, bb = _check(data, rows, K, qtype)
    return _move(a, (nt, TR, nb, bb), out)


def untile(data, rows: int, K: int, qtype: int):
    """tile's inverse: tile-layout bytes -> GGUF order."""
    a, nt, nb, bb = _check(data, rows, K, qtype)
    return _move(a, (nt, nb, TR, bb))
