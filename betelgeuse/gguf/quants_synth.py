"""Valid quantized blocks for the types gguf-py cannot quantize (K-quants, i-quants): seeded random bits with
the f16 super-block scales set, so a synthetic model (`betelgeuse synth --qtype`) or a test gets blocks of every
type that dequantize to finite values of a chosen spread. Where gguf-py has a quantizer (Q8_0, MXFP4, BF16, ...)
`quantize` uses it on the real values instead."""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as QT

from betelgeuse.gguf.qtypes import block_size

# byte offsets of the f16 fields of one block: (super-block scale d, the scale of the mins dmin if any)
F16_FIELDS: dict[int, tuple[int, ...]] = {
    int(QT.Q4_K): (0, 2), int(QT.Q5_K): (0, 2), int(QT.Q6_K): (208,), int(QT.Q3_K): (108,), int(QT.Q2_K): (80, 82),
    int(QT.IQ4_XS): (0,), int(QT.IQ4_NL): (0,), int(QT.IQ2_XXS): (0,), int(QT.IQ2_XS): (0,), int(QT.IQ3_XXS): (0,),
}
GGUF_QUANTIZES = frozenset(int(q) for q in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.MXFP4))


def random_blocks(qtype: int, n_blocks: int, rng: np.random.Generator, d: float | None = None,
                  dmin: float = 0.0) -> np.ndarray:
    """uint8 [n_blocks, type_size]: random bits; d = None draws each block's f16 scales in [-0.05, 0.05] (tests:
    both signs, many exponents), else d (and dmin, for the types with mins) in every block. Also Q8_0 (random
    int8) and MXFP4 (E8M0 exponents 2^-7 .. 2^-3 around d = None, else the power of two nearest d)."""
    qtype = int(qtype)
    _, size = block_size(qtype)
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype == QT.MXFP4:
        e = 128 + (rng.integers(-7, -2, n_blocks) if d is None else np.full(n_blocks, int(np.round(np.log2(d)))))
        b[:, 0] = np.clip(e, 1, 254)
        return b
    for k, at in enumerate(({int(QT.Q8_0): (0,)} | F16_FIELDS)[qtype]):
        v = rng.uniform(-0.05, 0.05, (n_blocks, 1)) if d is None else np.full((n_blocks, 1), dmin if k else d)
        b[:, at:at + 2] = v.astype(np.float16).view(np.uint8)
    return b


_CALIBRATION: dict[int, tuple[float, float]] = {}


def _calibrate(qtype: int) -> tuple[float, float]:
    """(dmin / d that centres the values, the values' std at d = 1) of random blocks, measured with gguf-py."""
    if qtype not in _CALIBRATION:
        rng = np.random.default_rng(0)
        ratio = 0.0
        if len(F16_FIELDS[qtype]) == 2:          # x = d * a - dmin * b: centre with dmin = d * mean(a) / mean(b)
            a = gq.dequantize(random_blocks(qtype, 64, rng, 1.0, 0.0), QT(qtype))
            b = -gq.dequantize(random_blocks(qtype, 64, rng, 0.0, 1.0), QT(qtype))
            ratio = float(a.mean() / b.mean())
        x = gq.dequantize(random_blocks(qtype, 256, rng, 1.0, ratio), QT(qtype))
        _CALIBRATION[qtype] = (ratio, float(x.std()))
    return _CALIBRATION[qtype]


def quantize(x: np.ndarray | None, qtype: int, shape: tuple[int, ...], rng: np.random.Generator,
             std: float) -> np.ndarray:
    """uint8 bytes of a `shape` tensor of `qtype` (rows along the last dim): gguf-py's quantizer of x where it has
    one, else random valid blocks whose values have mean ~0 and spread ~std (x is not needed then: None)."""
    qtype = int(qtype)
    if qtype in GGUF_QUANTIZES:
        assert x is not None and x.shape == tuple(shape)
        if qtype == QT.F32:
            return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)
        if qtype == QT.F16:
            return np.ascontiguousarray(x, dtype=np.float16).view(np.uint8)
        return np.ascontiguousarray(gq.quantize(x.astype(np.float32), QT(qtype))).view(np.uint8)
    blk, size = block_size(qtype)
    assert shape[-1] % blk == 0, (shape, blk)
    ratio, unit = _calibrate(qtype)
    n = int(np.prod(shape)) // blk
    return random_blocks(qtype, n, rng, std / unit, std / unit * ratio).reshape(*shape[:-1], shape[-1] // blk * size)


# ---- synthetic models (`betelgeuse synth --qtype`): expert matrices of the types gguf-py cannot quantize ----

# the expert types a synthetic model can have beyond F32/F16/BF16/Q8_0/MXFP4, and their llama.cpp file types
BLOCK_TYPES = {"Q6_K": 18, "Q5_K": 17, "Q4_K": 15, "Q3_K": 12, "Q2_K": 10, "IQ4_XS": 30, "IQ4_NL": 25, "IQ3_XXS": 23,
               "IQ2_XS": 20, "IQ2_XXS": 19}            # name -> LlamaFileType (MOSTLY_Q6_K, ..., the _M mixes)
_TILE_BLOCKS = 1 << 17


@functools.lru_cache(maxsize=8)
def block_tile(qtype: int, seed: int, std: float) -> np.ndarray:
    """2 x _TILE_BLOCKS random valid blocks uint8 [n, type_size] of values ~std (made once per type, seed and
    std; 18-37 MB). Read-only: a writer gets views of it (synth_common.matrix_chunks)."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, int(qtype), 71])))
    ratio, unit = _calibrate(int(qtype))
    t = random_blocks(int(qtype), 2 * _TILE_BLOCKS, rng, std / unit, std / unit * ratio)
    t.flags.writeable = False
    return t
