"""GGML tensor types: names, block sizes and byte counts. No torch here, so the store process
(which never dequantizes) does not pay for importing it."""

from __future__ import annotations

import math

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from betelgeuse.errors import UnsupportedError

SUPPORTED_QTYPES: frozenset[int] = frozenset(
    int(q) for q in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.MXFP4, QT.I32,
                     QT.Q5_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS, QT.IQ4_NL, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ3_XXS)
)


def qtype_name(qtype: int) -> str:
    """'Q8_0' for 8; 'type 99' for a value gguf does not know."""
    try:
        return QT(qtype).name
    except ValueError:
        return f"type {qtype}"


def block_size(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type."""
    try:
        return GGML_QUANT_SIZES[QT(qtype)]
    except (ValueError, KeyError):
        raise UnsupportedError(f"unknown GGML tensor type {qtype}") from None


def row_nbytes(qtype: int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements; rows are quantized independently."""
    blk, size = block_size(qtype)
    if n_cols % blk != 0:
        raise ValueError(f"a row of {n_cols} elements is not a multiple of the {qtype_name(qtype)} block ({blk})")
    return n_cols // blk * size


def tensor_nbytes(qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (torch order: the last dim is the row)."""
    assert len(shape) >= 1
    return math.prod(shape[:-1]) * row_nbytes(qtype, shape[-1])
