"""Our torch dequantization against gguf-py's numpy reference (an independent implementation).

Equality is bit-exact: both compute the same float32 products/differences in the same order
(see betelgeuse/gguf/quants.py), so there is no ulp tolerance to justify.
"""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from betelgeuse.errors import UnsupportedError
from betelgeuse.gguf.quants import SUPPORTED_QTYPES, dequantize, row_nbytes, tensor_nbytes
from betelgeuse.gguf.quants_synth import random_blocks

SHAPES_32 = [(32,), (3, 64), (2, 5, 96), (8, 16, 32)]    # block-32 / element types
SHAPES_256 = [(256,), (3, 512), (2, 4, 256), (5, 768)]   # K-quants: rows of 256-multiples
# the types gguf-py dequantizes but cannot quantize: random valid blocks
K_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ3_XXS]


def bits(a) -> np.ndarray:
    """float32 array -> its uint32 bit patterns (exact comparison, NaN-safe)."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def random_k_blocks(qtype, shape, rng) -> np.ndarray:
    """Random valid bytes for `shape` of a type gguf cannot quantize: random bits, f16 scales set to small
    finite values (every code, sign and scale bit pattern occurs)."""
    blk = gguf.GGML_QUANT_SIZES[qtype][0]
    return random_blocks(qtype, int(np.prod(shape)) // blk, rng).reshape(*shape[:-1], -1)


def ours(data: np.ndarray, qtype, shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()).to(device)
    return dequantize(raw, qtype, shape, dtype)


def test_supported_set():
    assert SUPPORTED_QTYPES == {int(q) for q in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.MXFP4, QT.I32,
                                                 QT.Q5_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS, QT.IQ4_NL, QT.IQ2_XXS,
                                                 QT.IQ2_XS, QT.IQ3_XXS)}


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0])
@pytest.mark.parametrize("shape", SHAPES_32)
def test_quantizable_types_match_gguf(qtype, shape):
    rng = np.random.default_rng(hash((int(qtype), shape)) % 2**32)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)                  # gguf's own quantizer
    ref = gguf.quants.dequantize(q, qtype).reshape(shape)
    got = ours(q, qtype, shape)
    assert got.shape == shape and got.dtype == torch.float32
    np.testing.assert_array_equal(bits(got.numpy()), bits(ref))
    if qtype == QT.F32:
        np.testing.assert_array_equal(got.numpy(), x)
    # the quantization error is what the format allows (guards against both sides being wrong)
    tol = {QT.F32: 0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 1 / 127}[qtype]
    assert np.abs(got.numpy() - x).max() <= tol * np.abs(x).max() + 1e-12


@pytest.mark.parametrize("qtype", K_TYPES + [QT.IQ4_NL])
@pytest.mark.parametrize("shape", SHAPES_256)
def test_k_and_i_quants_match_gguf(qtype, shape):
    rng = np.random.default_rng(hash((int(qtype), shape)) % 2**32)
    q = random_k_blocks(qtype, shape, rng)
    ref = gguf.quants.dequantize(q, qtype)
    assert ref.shape == shape
    got = ours(q, qtype, shape)
    assert got.shape == shape
    np.testing.assert_array_equal(bits(got.numpy()), bits(ref))
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0


def test_iq_tables_match_llama_cpp():
    """The sign table (computed here) is gguf's; grid rows spot-checked against llama.cpp's ggml-common.h
    (iq2xxs_grid[1], [255], iq2xs_grid[7], iq3xxs_grid[5], little-endian bytes = elements 0..)."""
    from betelgeuse.gguf.quants import IQ4_KVALUES, iq_grid, ksigns
    assert bytes(ksigns()) == gguf.quants.IQ2_XXS.ksigns
    assert IQ4_KVALUES == gguf.quants.IQ4_NL.kvalues

    def row(v: int, n: int) -> list[int]:
        return list(v.to_bytes(n, "little"))
    assert list(iq_grid(QT.IQ2_XXS)[1]) == row(0x080808080808082b, 8)
    assert list(iq_grid(QT.IQ2_XXS)[255]) == row(0x2b2b2b1908081908, 8)
    assert list(iq_grid(QT.IQ2_XS)[7]) == row(0x080808080819192b, 8)
    assert list(iq_grid(QT.IQ3_XXS)[5]) == row(0x04040c3e, 4)
    assert [g.shape for g in map(iq_grid, (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ3_XXS))] == [(256, 8), (512, 8), (256, 4)]


def test_known_values_q2_k_and_iq4_nl():
    """Hand-built blocks, independent of any library. Q2_K: sub-block s has scale s % 16 and min 1, every
    2-bit quant 2 (x = d * s * 2 - dmin); IQ4_NL: nibble j % 16 -> d * kvalues[j % 16]."""
    block = np.zeros(84, np.uint8)
    block[:16] = np.arange(16, dtype=np.uint8) | 0x10
    block[16:80] = 0b10101010
    block[80:84] = np.array([0.5, 0.25], np.float16).view(np.uint8)
    got = ours(block, QT.Q2_K, (256,)).numpy()
    np.testing.assert_array_equal(got, np.repeat(np.arange(16, dtype=np.float32) * 0.5 * 2 - 0.25, 16))
    nl = np.zeros(18, np.uint8)
    nl[:2] = np.array([2.0], np.float16).view(np.uint8)
    nl[2:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    kv = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    np.testing.assert_array_equal(ours(nl, QT.IQ4_NL, (32,)).numpy(), 2.0 * np.concatenate([kv, kv[::-1]]))


def test_known_values_q8_0():
    """A hand-built block, independent of any library: x = d * q."""
    block = np.zeros(34, np.uint8)
    block[:2] = np.array([0.5], np.float16).view(np.uint8)
    block[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    got = ours(block, QT.Q8_0, (32,))
    np.testing.assert_array_equal(got.numpy(), np.arange(-16, 16, dtype=np.float32) * 0.5)


def test_known_values_q6_k():
    """Hand-built Q6_K block: all quants 33 (-> +1), sub-block scale s = index+1, d = 0.25."""
    block = np.zeros(210, np.uint8)
    block[:128] = 0x11                  # low nibbles 1 in both halves
    block[128:192] = 0b10101010         # high bit-pairs 2 -> q = 1 | 2 << 4 = 33
    block[192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)
    block[208:210] = np.array([0.25], np.float16).view(np.uint8)
    got = ours(block, QT.Q6_K, (256,)).numpy()
    np.testing.assert_array_equal(got, np.repeat(np.arange(1, 17, dtype=np.float32) * 0.25, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_dtype_is_rounded_float32(dtype):
    rng = np.random.default_rng(1)
    q = random_k_blocks(QT.Q4_K, (2, 256), rng)
    ref = torch.from_numpy(gguf.quants.dequantize(q, QT.Q4_K)).to(dtype)
    got = ours(q, QT.Q4_K, (2, 256), dtype)
    assert got.dtype == dtype
    assert torch.equal(got, ref)


def test_unaligned_slice_and_no_alias():
    """A tensor that starts at an odd byte of a bigger buffer (a slot arena) still works, and the
    result does not alias the bytes (the buffer may be reused right after)."""
    x = np.arange(12, dtype=np.float32)
    buf = torch.zeros(1 + x.nbytes, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(x.view(np.uint8))
    got = dequantize(buf[1:], QT.F32, (3, 4))
    np.testing.assert_array_equal(got.numpy(), x.reshape(3, 4))
    aligned = torch.from_numpy(x.view(np.uint8).copy())
    got = dequantize(aligned, QT.F32, (12,))
    aligned.zero_()
    np.testing.assert_array_equal(got.numpy(), x)


def test_row_nbytes():
    assert row_nbytes(QT.F32, 10) == 40
    assert row_nbytes(QT.BF16, 10) == 20
    assert row_nbytes(QT.Q8_0, 64) == 68
    assert row_nbytes(QT.Q4_K, 512) == 288
    assert row_nbytes(QT.Q6_K, 256) == 210
    assert tensor_nbytes(QT.Q8_0, (8, 16, 32)) == 8 * 16 * 34
    with pytest.raises(ValueError, match="block"):
        row_nbytes(QT.Q4_K, 128)


def test_unsupported_type_raises():
    with pytest.raises(UnsupportedError, match="Q4_0"):
        dequantize(torch.zeros(18, dtype=torch.uint8), QT.Q4_0, (32,))
    with pytest.raises(UnsupportedError, match="IQ1_S"):
        dequantize(torch.zeros(50, dtype=torch.uint8), QT.IQ1_S, (256,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", K_TYPES)
def test_cuda_matches_gguf(qtype):
    rng = np.random.default_rng(7)
    q = random_k_blocks(qtype, (4, 512), rng)
    ref = gguf.quants.dequantize(q, qtype)
    got = ours(q, qtype, (4, 512), device="cuda")
    assert got.device.type == "cuda"
    np.testing.assert_array_equal(bits(got.cpu().numpy()), bits(ref))


def test_q8_0_parts_fused_equals_per_part():
    """The engine's fused path (one gather for an expert's three parts) gives dequantize's bits exactly."""
    from betelgeuse.gguf.quants import dequantize_q8_0_parts
    rng = np.random.default_rng(7)
    rows, cols = 24, 64                                   # 48 blocks per part
    parts = [gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), QT.Q8_0)
             for _ in range(3)]
    buf = np.zeros(3 * 4096 + 200, dtype=np.uint8)
    starts = [32, 4096 + 96, 2 * 4096 + 160]              # unaligned, as in a slot: place + file offset % 4096
    for s, p in zip(starts, parts):
        buf[s:s + p.nbytes] = p.reshape(-1)
    t = torch.from_numpy(buf)
    for dtype in (torch.float32, torch.bfloat16):
        fused = dequantize_q8_0_parts(t, torch.tensor(starts), rows * cols // 32, dtype)
        for k, p in enumerate(parts):
            want = dequantize(torch.from_numpy(p.reshape(-1).copy()), QT.Q8_0, (rows, cols), dtype)
            assert torch.equal(fused[k].view(rows, cols), want)
        ref = gguf.quants.dequantize(parts[1], QT.Q8_0)
        if dtype == torch.float32:
            assert np.array_equal(fused[1].view(rows, cols).numpy(), ref)
