"""betelgeuse/kernels/mma_pack (docs/benchmarks/cpu-pack62, cpu-packk62, cpu-mxpk63): the packed layout is a
permutation of a Q8_0 / Q4_K / MXFP4 matrix's bytes (round trip, same size), and the packed bytes read the way the PK
kernels read them (Q8_0: a thread's quant words at its rows' 16-byte pieces, a row's scale word after the step's
quants) dequantize to gguf-py's dequantization of the GGUF bytes, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from betelgeuse.kernels import mma_pack


def _q8(rows: int, K: int, seed: int) -> np.ndarray:
    """A [rows, K] Q8_0 matrix's GGUF bytes (gguf-py's quantizer; rows of mixed magnitudes)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, K)).astype(np.float32) * rng.uniform(0.01, 4, (rows, 1)).astype(np.float32)
    return np.ascontiguousarray(gq.quantize(x, GT.Q8_0)).reshape(-1)


def _read_packed(p: np.ndarray, rows: int, K: int) -> np.ndarray:
    """[rows, K] float32 from packed bytes, addressed as the kernel does: tile t, step s at (t * K / 64 + s) * 4352;
    row n of the tile's quant words [16] at 1024 (n % 64 // 16) + 512 (n // 8 % 2) + 64 (n % 8), word c holding the
    pairs 8 (c % 4) + c // 4 (low half) and that + 4 (high); its scale word at 4096 + 4 n (block 2 s's f16 d, then
    2 s + 1's). Value = float32(d) * float32(int8), gguf-py's product."""
    out = np.zeros((rows, K), np.float32)
    for t in range(rows // 64):
        for s in range(K // 64):
            st = p[(t * (K // 64) + s) * 4352:][:4352]
            for n in range(64):
                g = 1024 * (n % 64 // 16) + 512 * (n // 8 % 2) + 64 * (n % 8)
                q = st[g:g + 64].view(np.int8).reshape(16, 2, 2)        # [word c][low / high pair][2 int8]
                d = st[4096 + 4 * n:4100 + 4 * n].view(np.float16).astype(np.float32)
                for c in range(16):
                    for hi in range(2):
                        pr = 8 * (c % 4) + c // 4 + 4 * hi              # the step's pair: elements 2 pr, 2 pr + 1
                        k = 64 * s + 2 * pr
                        out[64 * t + n, k:k + 2] = d[pr // 16] * q[c, hi].astype(np.float32)
    return out


@pytest.mark.parametrize("rows,K", [(64, 64), (128, 768), (64, 2048)])
def test_pack_is_a_permutation_and_reads_as_gguf(rows, K):
    raw = _q8(rows, K, rows + K)
    packed = mma_pack.pack(raw.tobytes(), rows, K)
    assert packed.dtype == np.uint8 and packed.size == raw.size
    assert np.array_equal(mma_pack.unpack(packed, rows, K), raw)
    assert not np.array_equal(packed, raw)
    ref = gq.dequantize(raw.reshape(rows, -1), GT.Q8_0).astype(np.float32)
    got = _read_packed(packed, rows, K)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_usable():
    assert mma_pack.usable(768, 2048) and mma_pack.usable(2048, 768)
    assert not mma_pack.usable(96, 2048) and not mma_pack.usable(64, 96) and not mma_pack.usable(0, 64)
    with pytest.raises(AssertionError):
        mma_pack.pack(np.zeros(96 * 68, np.uint8), 96, 64)


def test_torch_gather_matches_numpy():
    """The GPU path's gather (a torch tensor in, on its device) gives numpy's bytes."""
    torch = pytest.importorskip("torch")
    raw = _q8(128, 768, 5)
    got = mma_pack.pack(torch.from_numpy(raw.copy()), 128, 768)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), mma_pack.pack(raw, 128, 768))
    assert np.array_equal(mma_pack.unpack(got, 128, 768).numpy(), raw)


def test_pk_conversion_order_is_the_steps_k_order():
    """gluon_mmq._conv_raw's PK reordering emulated in numpy (gl.join = a stack on a new last axis; reshape / permute
    as numpy's): the words [64, 16] of a step, loaded at the kernel's addresses, become a [64, 64] tile whose column
    k is element k of the step's two blocks (the int8 at byte 34 (2 s + k // 32) + 2 + k % 32 of the GGUF row) --
    PK 0's A tile, so the MMA sees the same operand. The emulation follows the kernel's source, which is checked."""
    import inspect

    from betelgeuse.kernels import gluon_mmq as gm
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")
    src = inspect.getsource(gm._conv_raw.fn if hasattr(gm._conv_raw, "fn") else gm._conv_raw)
    for line in ("v = gl.join(gl.join(_lo_bf16(lo), _lo_bf16(lo >> 16)), gl.join(_lo_bf16(hi), _lo_bf16(hi >> 16)))",
                 "v = gl.permute(gl.reshape(v, [R, 4, 4, 2, 2]), [0, 2, 4, 1, 3])",
                 "wb = gl.convert_layout(gl.reshape(v, [R, KB * 32]), AL)"):
        assert line in src, line
    rows, K = 64, 768
    raw = _q8(rows, K, 9)
    packed = mma_pack.pack(raw, rows, K)
    q = raw.reshape(rows, K // 32, 34)[:, :, 2:].view(np.int8).reshape(rows, K)
    n = np.arange(64)
    g = 1024 * (n // 16) + 512 * (n // 8 % 2) + 64 * (n % 8)
    for s in range(K // 64):
        st = packed[s * 4352:(s + 1) * 4352]
        w = st[g[:, None, None] + 4 * np.arange(16)[None, :, None] + np.arange(4)].view(np.int8)     # [64, 16, 4]
        lo, hi = w[..., 0:2], w[..., 2:4]                   # the words' low / high pairs, their 2 int8 each (i)
        v = np.stack([np.stack([lo[..., 0], lo[..., 1]], -1), np.stack([hi[..., 0], hi[..., 1]], -1)], -1)
        v = v.reshape(rows, 4, 4, 2, 2).transpose(0, 2, 4, 1, 3).reshape(rows, 64)
        assert np.array_equal(v, q[:, 64 * s:64 * s + 64]), s


# ---- Q4_K (type code 5, cpu-packk62) ----

def _q4_k(rows: int, K: int, seed: int) -> np.ndarray:
    """A [rows, K] Q4_K matrix's GGUF bytes: random valid super-blocks (every 6-bit scale / min pattern)."""
    from betelgeuse.gguf.quants_synth import random_blocks
    return np.ascontiguousarray(random_blocks(int(GT.Q4_K), rows * K // 256, np.random.default_rng(seed))).reshape(-1)


def _q4_k_piece(n: int) -> int:
    """Row n's 16-byte piece of a group in the kernel's addressing (gluon_mmq._pk_rows + _fetch_k): 1024 + 512 (n % 64
    // 16) + 64 (n % 8) from the super-block, + 2048 g for group g, + 8 h (h = n // 8 % 2) + 2 j for pair b + 4 j
    of the lane-quad b's 16 bytes at + 16 b."""
    return 1024 + 512 * (n % 64 // 16) + 64 * (n % 8) + 8 * (n // 8 % 2)


def _read_packed_q4_k(p: np.ndarray, rows: int, K: int) -> np.ndarray:
    """GGUF super-blocks [rows, K / 256, 144] gathered from packed bytes where the kernel reads them: tile t's
    super-block s at (t K / 256 + s) x 9216; row n's header (d, dmin, scales: GGUF bytes 0..15) at 16 n; group g's
    byte pair p = b + 4 j (GGUF bytes 16 + 32 g + 2 p, + 1) at _q4_k_piece(n) + 2048 g + 16 b + 2 j."""
    out = np.zeros((rows, K // 256, 144), np.uint8)
    for t in range(rows // 64):
        for s in range(K // 256):
            sb = p[(t * (K // 256) + s) * 9216:][:9216]
            for n in range(64):
                out[64 * t + n, s, :16] = sb[16 * n:16 * n + 16]
                for g in range(4):
                    for b in range(4):
                        for j in range(4):
                            a = _q4_k_piece(n) + 2048 * g + 16 * b + 2 * j
                            out[64 * t + n, s, 16 + 32 * g + 2 * (b + 4 * j):][:2] = sb[a:a + 2]
    return out


def test_q4_k_pk_pairs_reach_ql_in_the_gguf_pair_order():
    """gluon_mmq._fetch_k's PK loads emulated in numpy: each step's QZ tile [R / 2, 32] of 16-bit pairs (row q = 8
    (n // 16) + n % 8 at _half_rows' piece of row n, column m = 8 b + 4 h + j), reshaped / permuted as the kernel's
    source says (_k_pk_pairs, checked), is the [R, 16] tile whose column p is the GGUF group's byte pair p of row n --
    the shipped form's QL tile (pair p at byte 16 + 32 g + 2 p), so _nibs_bf16 and the MMA see the same operand. GP 1 /
    2 (_load_raw_k / _conv_raw_k, cpu-gpk63): the same bytes loaded as int32 words [R / 2, 16] (word u = columns 2 u,
    2 u + 1) and split by join(w, w >> 16) (an arithmetic shift: the bits above 16 dropped by the uint16 cast) give
    the same QZ tile, so the same QL tile."""
    import inspect

    from betelgeuse.kernels import gluon_mmq as gm
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")

    def src(f):
        return inspect.getsource(f.fn if hasattr(f, "fn") else f)
    for f, line in ((gm._k_pk_pairs, "z = gl.permute(gl.reshape(z, [R // 16, 8, 4, 2, 4]), [0, 3, 1, 4, 2])"),
                    (gm._k_pk_pairs, "q = gl.convert_layout(gl.reshape(z, [R, 16]), LQ)"),
                    (gm._fetch_k, "a = gl.multiple_of(ra + ((kb0 >> 3) * 9216 + ((kb0 >> 1) & 3) * 2048), 16)"),
                    (gm._fetch_k, "p = (pool + a).to(gl.pointer_type(gl.uint16))"),
                    (gm._fetch_k, "q = _k_pk_pairs(z)"),
                    (gm._pk_step, "o = (kb0 >> 3) * 9216 + ((kb0 >> 1) & 3) * 2048"),
                    (gm._pk_ptrs, "pw = (pool + a).to(gl.pointer_type(gl.int32))"),
                    (gm._pk_ptrs, "return pw[:, None] + u[None, :]"),
                    (gm._load_raw_k, "pw, mw = _pk_ptrs(pool, ra, mn, _pk_step(kb0, 5))"),
                    (gm._conv_raw_k, "q = _k_pk_pairs(gl.reshape(gl.join(w, w >> 16), [R // 2, 32]))"),
                    (gm._conv_raw_k, "wb = _k_a(q.to(gl.uint16))")):
        assert line in src(f), line
    for R, rows in ((64, 64), (128, 128)):              # 128: two tiles as FUSE's gate / up rows
        K = 512
        raw = _q4_k(rows, K, R)
        packed = mma_pack.pack(raw, rows, K, 5).view(np.uint16)
        gg = raw.reshape(rows, K // 256, 144)[:, :, 16:].reshape(rows, K // 256, 4, 16, 2).copy().view(np.uint16)
        n = np.array([16 * (q // 8) + q % 8 for q in range(R // 2)])      # the h = 0 row of QZ's row q
        for kb0 in range(0, K // 32, 2):
            s, g = kb0 >> 3, (kb0 >> 1) & 3
            base = (n // 64) * (K // 256) * 9216 + np.array([_q4_k_piece(i) - 8 * (i // 8 % 2) for i in n])
            a = (base + s * 9216 + g * 2048)[:, None] + 2 * np.arange(32)[None, :]
            z = packed[a // 2]                                               # [R / 2, 32] uint16
            q = z.reshape(R // 16, 8, 4, 2, 4).transpose(0, 3, 1, 4, 2).reshape(R, 16)
            assert np.array_equal(q, gg[:rows, s, g, :, 0]), kb0
            w = packed.view(np.int32)[a[:, 0::2] // 4]                      # GP >= 1: [R / 2, 16] int32 words
            z2 = np.stack([w, w >> 16], -1).reshape(R // 2, 32).astype(np.uint16)   # (the uint16 cast truncates)
            assert np.array_equal(z2, z), kb0


# ---- MXFP4 (type code 4, cpu-mxpk63) ----

def _mxfp4(rows: int, K: int, seed: int) -> np.ndarray:
    """A [rows, K] MXFP4 matrix's GGUF bytes (gguf-py's quantizer; rows of mixed magnitudes: many E8M0 scales)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, K)).astype(np.float32) * rng.uniform(0.01, 4, (rows, 1)).astype(np.float32)
    return np.ascontiguousarray(gq.quantize(x, GT.MXFP4)).reshape(-1)


def _mx_piece(n: int) -> int:
    """Row n's 16-byte piece of a step in the kernel's addressing (gluon_mmq._pk_rows + _mx_pk_load): 512 (n % 64 //
    16) + 64 (n % 8), lane-quad b's 16 bytes at + 16 b, row n's 8 of them at + 8 (n // 8 % 2)."""
    return 512 * (n % 64 // 16) + 64 * (n % 8) + 8 * (n // 8 % 2)


def _read_packed_mxfp4(p: np.ndarray, rows: int, K: int) -> np.ndarray:
    """GGUF blocks [rows, K / 32, 17] gathered from packed bytes where the kernel reads them: tile t's step s at
    (t K / 64 + s) x 2176; row n's scale bytes (blocks 2 s, 2 s + 1) at 2048 + 2 n; its nibble byte p = b + 4 j of the
    step (GGUF byte 1 + p % 16 of block 2 s + p // 16) at _mx_piece(n) + 16 b + j."""
    out = np.zeros((rows, K // 32, 17), np.uint8)
    for t in range(rows // 64):
        for s in range(K // 64):
            st = p[(t * (K // 64) + s) * 2176:][:2176]
            for n in range(64):
                out[64 * t + n, 2 * s:2 * s + 2, 0] = st[2048 + 2 * n:2050 + 2 * n]
                for b in range(4):
                    for j in range(8):
                        q = b + 4 * j
                        out[64 * t + n, 2 * s + q // 16, 1 + q % 16] = st[_mx_piece(n) + 16 * b + j]
    return out


def test_mxfp4_pk_words_reach_the_gguf_byte_order():
    """gluon_mmq's MXFP4 PK loads emulated in numpy (gluon_emu: gl.join = a stack on a new last axis; reshape /
    permute as numpy's): each step's MW tile [R / 2, 16] of int32 words (row q = 8 (n // 16) + n % 8 at _half_rows'
    piece of row n, the step at kb0 x 1088), reordered as _mx_pk_words' source says (checked), is word for word what
    _mx_words makes of the GGUF form's bytes (its one byte load a pair: column p the step's nibble byte p of row n, GGUF
    byte 1 + p % 16 of block kb0 + p // 16), so _mx_a's decode, the scales and the MMA see the same operand
    (test_gluon_mmq: that operand is gguf-py's dequantization). The scale word (one 16-bit load at 2048 + 2 n) is the
    two blocks' E8M0 bytes, kb0's low."""
    import inspect

    import gluon_emu

    from betelgeuse.kernels import gluon_mmq as gm
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")
    gluon_emu.mx_source_lines(gm)
    src = "".join(inspect.getsource(f.fn if hasattr(f, "fn") else f) for f in (gm._mx_pk_load, gm._pk_step,
                                                                                 gm._pk_rows, gm._conv_raw))
    for line in ("o = kb0 * 1088", "_pk_ptrs(pool, ra, mn, _pk_step(kb0, 4))", "o = 2048 + 2 * i", "o = 512 * (i // 16) + 64 * (i % 8)",
                 "d0 = _e8m0(r0 & 255)", "d1 = _e8m0(r1 >> 8)", "wb = _mx_a(_mx_pk_words(w))",
                 "wb = _mx_a(_mx_words(w))"):
        assert line in src, line
    for R in (64, 128):                                 # 128: two tiles as FUSE's gate / up rows
        K = 256
        raw = _mxfp4(R, K, R)
        packed = mma_pack.pack(raw, R, K, 4)
        gg = raw.reshape(R, K // 32, 17)
        n = np.array([16 * (q // 8) + q % 8 for q in range(R // 2)])      # the h = 0 row of MW's row q
        tile = (n // 64) * (K // 64) * 2176
        for kb0 in range(0, K // 32, 2):
            a = (tile + 512 * (n % 64 // 16) + 64 * (n % 8) + kb0 * 1088)[:, None] + 4 * np.arange(16)[None, :]
            w = packed[a[..., None] + np.arange(4)].copy().view(np.int32)[..., 0]     # [R / 2, 16] little-endian
            want = np.concatenate([gg[:, kb0, 1:], gg[:, kb0 + 1, 1:]], axis=1).astype(np.int64)
            assert np.array_equal(gluon_emu.mx_pk_words(w.view(np.uint32)), gluon_emu.mx_words(gm, want)), kb0
            m = np.arange(R)
            sc = packed[((m // 64) * (K // 64) * 2176 + 2048 + 2 * (m % 64) + kb0 * 1088)[:, None] + np.arange(2)]
            sw = sc.copy().view(np.uint16)[:, 0].astype(np.int32)
            assert np.array_equal(sw & 255, gg[:, kb0, 0]) and np.array_equal(sw >> 8, gg[:, kb0 + 1, 0]), kb0


# ---- the block types' layouts (Q4_K, MXFP4): round trip, addresses, gather ----

BLOCKS = {5: (_q4_k, _read_packed_q4_k, GT.Q4_K), 4: (_mxfp4, _read_packed_mxfp4, GT.MXFP4)}   # type code -> (GGUF
#                                                      bytes of a matrix, the kernel's gather of packed bytes, GGML type)


@pytest.mark.parametrize("qt,rows,K", [(5, 64, 256), (5, 128, 768), (5, 64, 2048), (4, 64, 64), (4, 128, 768),
                                       (4, 64, 2048)])
def test_block_pack_is_a_permutation_and_reads_as_gguf(qt, rows, K):
    """Q4_K / MXFP4: round trip, the same size, and the bytes at the kernel's addresses (_read_packed_q4_k /
    _read_packed_mxfp4) dequantize (gguf-py) to the GGUF bytes' dequantization, bit for bit."""
    make, gather, gt = BLOCKS[qt]
    raw = make(rows, K, rows + K)
    packed = mma_pack.pack(raw.tobytes(), rows, K, qt)
    assert packed.dtype == np.uint8 and packed.size == raw.size
    assert np.array_equal(mma_pack.unpack(packed, rows, K, qt), raw)
    assert not np.array_equal(packed, raw)
    ref = gq.dequantize(raw.reshape(rows, -1), gt).astype(np.float32)
    got = gq.dequantize(gather(packed, rows, K).reshape(rows, -1), gt).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qt", [5, 4])
def test_block_usable_and_torch_gather(qt):
    """usable: whole 64-row tiles and K steps (Q4_K: super-blocks of 256, MXFP4: 64); a type without a layout (Q5_K)
    never; and the GPU path's gather (a torch tensor in) gives numpy's bytes."""
    torch = pytest.importorskip("torch")
    assert mma_pack.usable(768, 2048, qt) and mma_pack.usable(2048, 768, qt) and not mma_pack.usable(96, 2048, qt)
    assert mma_pack.usable(64, 64, qt) == (qt == 4) and not mma_pack.usable(768, 32, qt)
    assert not mma_pack.usable(256, 256, 6) and mma_pack.GGML == {8: 0, 39: 4, 12: 5}
    raw = BLOCKS[qt][0](128, 768, 7)
    got = mma_pack.pack(torch.from_numpy(raw.copy()), 128, 768, qt)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), mma_pack.pack(raw, 128, 768, qt))
    assert np.array_equal(mma_pack.unpack(got, 128, 768, qt).numpy(), raw)
