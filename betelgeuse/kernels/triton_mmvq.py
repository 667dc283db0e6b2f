"""The decode (few-row) schedule of the expert kernels: llama.cpp's mmvq layout with float activations.

llama.cpp's ggml-cuda mmvq.cu / vecdotq.cuh: each program owns a few output rows (BN) and walks K in whole quant
blocks; a block's bytes are loaded as 32-bit words (a warp's threads read consecutive words) and unpacked with
shifts and masks in the registers of the thread holding the word (tl.join), never byte by byte; the scales are
decoded once per block. No tensor cores, and for one row a program no shared memory in the K loop (the MMA path pads
one row to 16 and moves every dequantized tile through shared memory into the dot's operand layout). Unlike
llama.cpp the activations stay float (bf16 / fp32 as the engine holds them, multiplied in fp32): pre-quantizing them
to Q8_1 changes the numerics, which the engine's exactness contract (within float noise of the torch path) does not
allow by default.

The arithmetic of an output (n, m), fixed by the weight type only (never by BN, rows per program, warps, stages),
so that a row's bits do not depend on the launch (DESIGN.md invariant 6):
  - K is walked in steps of S elements (S = STEP[type]: one word group of whole blocks, table below); tile
    position p of a step holds element elem(p) of it (the words' unpacking order);
  - acc[n, m, p] = fma(w[n, elem(p)], x[m, elem(p)], acc[n, m, p]) step after step, from zero (elementwise: the
    same float ops whatever the layout);
  - out[n, m] = the pairwise tree over p: level by level, positions (2i, 2i+1) added (tl.split), a fixed order
    where tl.sum's would follow the register layout;
  - K chunks (the reduction key KC, elements, a multiple of S; 0 = one chunk, the arithmetic above): each chunk's
    acc from zero and its tree total t_c as above, out = 0 + t_0 + t_1 + ... in chunk order, whether one program
    walks the chunks or one program a chunk stores its t_c and the tile's last sums them (SPLIT, triton_moe).
So both rows buckets can take this schedule at different BN / rows per program / warps with the same bits; a
type's launch table switches it on with the reduction key MV = 1 (triton_moe), for both buckets. A program of BM
rows (triton_moe's _mv_step; llama.cpp's ncols_y) decodes a step's weight tile [BN, D1, D2, D3] once and applies it
to its rows in turn, each row's accumulator its own [BN, D1, D2, D3] tensor in the tile's layout: the ops of row m
are those of a program of row m alone, and no reduction runs over a [rows, ...] tile (whose order could follow BM).
Per thread that is BM x BN x S / threads accumulator registers per weight part (gate_up has two): the sweep's
candidates keep it under sm_90's 255.

  type   step S  words per row and step                  tile [D1, D2, D3]     element of position (a, b, c)
  Q8_0   64      2 blocks (68 B, 17 words; quants of the  block, word, byte     32 a + 4 b + c
                 first at byte 2: two overlapping loads)
  MXFP4  128     4 blocks (68 B, 17 words; quants at      block, word, nibble   32 a + 16 (c % 2) + 4 b + c // 2
                 byte 17 a + 1: funnel shifts of words)
  Q4_K   256     1 super-block (144 B: 4 header words,    2 group + nibble      32 a + 16 b + c: element
                 32 qs words; 4 consecutive of a group    half, word quad,      order (a group's low / high
                 per thread: one 16-byte load)            byte                  nibbles are 32-element runs)
  Q5_K   256     1 super-block (176 B: + 8 qh words)      as Q4_K               as Q4_K
  Q6_K   256     1 super-block (210 B: 32 ql, 16 qh, 4    half, 16-byte run,    128 a + 32 (c // 16) + 16 b
                 scale words, d; a thread's ql / qh runs: 4 x 16 (32-element   + c % 16
                 12 word loads, 4 scales decoded once; at run, word, byte)
                 2 mod 4 every other block: aligned word
                 pairs, funnel shifts)
  Q2_K   256     1 super-block (84 B: 4 scale words, 16   as Q6_K               as Q6_K
                 qs words, d | dmin; a thread's run: 4
                 word loads, 4 scale pairs decoded once)
  Q3_K   256     1 super-block (110 B: 8 hmask, 16 qs, 3  as Q6_K               as Q6_K
                 scale words, d; at 2 mod 4 as Q6_K)
(Positions in row-major tile order. Q4_K / Q5_K until issue 23's kq54: tile [4, 8, 8] = group, word, nibble,
element 64 a + 32 (c % 2) + 4 b + c // 2: the same weight floats, another tree order, so other bits.) Requires rows
at 4-byte multiples (aligned parts, row bytes % 4 == 0; ROW_ALIGN: Q6_K's and Q3_K's at 2) and K a multiple of S;
triton_moe.mv_ok checks, and the launch takes the MMA path otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from betelgeuse.kernels.triton_quants import _unit, k_scale_min_of

# the tile of one K step per kernel type code (triton_quants.QT_CODES): [D1, D2, D3] positions, S = their product
DIMS = {0: (2, 8, 4), 4: (4, 4, 8), 5: (8, 2, 16), 6: (8, 2, 16)}          # Q8_0, MXFP4, Q4_K, Q5_K
DIMS[7] = (2, 2, 64)                                                        # Q6_K
DIMS[9] = (2, 2, 64)                                                        # Q2_K
DIMS[8] = (2, 2, 64)                                                        # Q3_K
STEP = {qt: d[0] * d[1] * d[2] for qt, d in DIMS.items()}
# the byte multiple a type's rows may start at (default 4): Q6_K's 210-byte super-blocks sit at 2 mod 4 every other
# block (and rows of an odd count of them), so its words are read from the aligned pair around them (_wat)
ROW_ALIGN = {7: 2, 8: 2}                            # Q6_K (210 B), Q3_K (110 B)


@triton.jit
def _ix(D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """The tile's index tensors [1, D1, 1, 1], [1, 1, D2, 1], [1, 1, 1, D3]."""
    return (tl.arange(0, D1)[None, :, None, None], tl.arange(0, D2)[None, None, :, None],
            tl.arange(0, D3)[None, None, None, :])


@triton.jit
def _word(pool, addr, mask):
    """int32 words at 4-byte aligned byte addresses `addr` (any shape broadcastable with mask)."""
    return tl.load((pool + addr).to(tl.pointer_type(tl.int32)), mask=mask, other=0)


@triton.jit
def k_head(pool, b, m, g):
    """A Q4_K / Q5_K super-block's header at byte b (f16 d | f16 dmin | scales[12]) for its sub-block pair (2g, 2g + 1)
    (get_scale_min_k4's bytes): the scale words b1 (scales[j % 4]), b2 (scales[4 + j % 4]), b3 (scales[8 + j % 4]),
    each shifted so sub-block 2g's byte sits at bits 0-7 and 2g + 1's at 8-15, and d, dmin as float32."""
    w0 = _word(pool, b, m)
    sh = (g % 2) * 16
    return (_word(pool, b + 4, m) >> sh, _word(pool, b + 8, m) >> sh, _word(pool, b + 12, m) >> sh,
            _half(w0), _half(w0 >> 16))


@triton.jit
def _half(bits):
    """float32 of the f16 in the low 16 bits of int32 `bits`."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mv_cols(QT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """[1, D1, D2, D3] element index within a step of each tile position (the table in the module doc)."""
    a, b, c = _ix(D1, D2, D3)
    if QT == 0:                                     # block a, word b, byte c
        return a * 32 + b * 4 + c
    elif QT == 4:                                   # block a, word b, nibble c (byte c // 2, high c % 2)
        return a * 32 + (c % 2) * 16 + b * 4 + c // 2
    elif QT == 7 or QT == 8 or QT == 9:             # Q6_K / Q3_K / Q2_K: half a, run b of D3 / 16 words, (32-element
                                                    # run, word, byte) c
        return a * 128 + (c // (D3 // 4)) * 32 + b * (D3 // 4) + c % (D3 // 4)
    else:                                           # Q4_K / Q5_K: (2 group + high nibble) a, bytes b, c
        return a * (D2 * D3) + b * D3 + c


@triton.jit
def _join4(v0, v1, v2, v3):
    """[..., 4] with v_i at i: the new dimension in each thread's registers (tl.join), no data movement. join(a, b)
    adds a last dimension [a, b], so the nested joins take their operands in bit-reversed order."""
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), v0.shape + [4])


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    return tl.reshape(tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))),
                      v0.shape + [8])


@triton.jit
def _kq(v, qh, n: tl.constexpr, al, be, QT: tl.constexpr):
    """al f + be of nibble n of words v: Q4_K f = 1 + q/16 (q at mantissa bits 19-22); Q5_K f = 1 + q/32, the 5th
    bit at bit 8 (n // 2) + n % 2 of qh, placed at mantissa bit 22."""
    if QT == 5:
        f = ((v >> (4 * n)) & 15) << 19
    else:
        f = (((v >> (4 * n)) & 15) << 18) | (((qh >> (8 * (n // 2) + n % 2)) & 1) << 22)
    return al * _unit(f) + be


@triton.jit
def _e2m1(v, n: tl.constexpr, d):
    """d x the doubled e2m1 value of the 4-bit code n of words v: 2^127 x the float32 with bits s<<31 | eem<<22.
    Each field shifted from v straight to its place (one shift each, not a shift to bit 0 first: 4 ops a weight)."""
    if 4 * n <= 22:
        eem = v << (22 - 4 * n)
    else:
        eem = v >> (4 * n - 22)                     # (arithmetic: bits 22-24 are v's 4n .. 4n + 2 all the same)
    e = (eem & 0x01C00000) | ((v << (28 - 4 * n)) & -2147483648)
    return (e.to(tl.float32, bitcast=True) * 1.7014118346046923e38) * d


@triton.jit
def _i8(v, u: tl.constexpr, a, d):
    """d q of the int8 byte u of words v: f = 1 + (q + 128) / 256 at mantissa bits 15-22, w = 256 d f - 384 d."""
    return a * _unit((((v >> (8 * u)) & 255) ^ 0x80) << 15) - 384.0 * d


@triton.jit
def mv_weights(pool, ra, kk, mn, QT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """float32 [BN, D1, D2, D3]: the weights of rows at byte addresses ra [BN] (mask mn), step kk, in tile order.
    Words are loaded as [BN, D1, D2] (consecutive words along D2: a warp's loads coalesce), each word's D3 values
    unpacked in the registers of the thread that holds it."""
    a = tl.arange(0, D1)[None, :, None]
    bb = tl.arange(0, D2)[None, None, :]
    m = mn[:, None, None]
    r = ra[:, None, None]
    if QT == 0:                                     # Q8_0: two 34-byte blocks = 17 words (68 B)
        b = r + (kk // 64) * 68
        wi = a * 8 + bb                             # quant word: block 0's at bytes 2 + 4 wi (halves of words
        lo = _word(pool, b + wi * 4, m)             # wi, wi + 1), block 1's at 36 + 4 (wi - 8) = word wi + 1
        hi = _word(pool, b + wi * 4 + 4, m)
        v = tl.where(wi < 8, ((lo >> 16) & 0xFFFF) | (hi << 16), hi)
        d = tl.where(a == 0, _half(_word(pool, b, m)), _half(_word(pool, b + 32, m) >> 16))      # [BN, 2, 1]
        s = 256.0 * d
        return _join4(_i8(v, 0, s, d), _i8(v, 1, s, d), _i8(v, 2, s, d), _i8(v, 3, s, d))
    elif QT == 4:                                   # MXFP4: four 17-byte blocks = 17 words (68 B)
        b = r + (kk // 128) * 68
        o = a * 17 + 1 + bb * 4                     # quant word bb of block a: bytes o .. o + 3
        lo = _word(pool, b + (o // 4) * 4, m)
        hi = _word(pool, b + (o // 4) * 4 + 4, m)
        s = (o % 4) * 8                             # 8, 16, 24, or 0 (block 3: word-aligned)
        # bytes o .. o + 3 = the 64-bit hi:lo shifted right by s (a funnel shift: one SHF.R.U64-style op)
        v = ((((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)) >> s.to(tl.int64)) & 0xFFFFFFFF).to(tl.int32)
        e8 = (_word(pool, b + a * 16, m) >> (a * 8)) & 255          # block a's byte 17 a: word 4 a, byte a
        # E8M0 -> 2^(e-128) as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
        d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)    # [BN, 4, 1]
        return _join8(_e2m1(v, 0, d), _e2m1(v, 1, d), _e2m1(v, 2, d), _e2m1(v, 3, d),
                      _e2m1(v, 4, d), _e2m1(v, 5, d), _e2m1(v, 6, d), _e2m1(v, 7, d))
    elif QT == 7:                                   # Q6_K
        return _q6_tile(pool, ra, kk, mn, D1, D2, D3)
    elif QT == 9:                                   # Q2_K
        return _q2_tile(pool, ra, kk, mn, D1, D2, D3)
    elif QT == 8:                                   # Q3_K
        return _q3_tile(pool, ra, kk, mn, D1, D2, D3)
    else:                                           # Q4_K / Q5_K
        return _k_tile(pool, ra, kk, mn, QT, D1, D2, D3)


@triton.jit
def _int_f32(i):
    """float32 of int32 0 <= i < 2^23 exactly, without I2F (a quarter-rate conversion on sm_90): the float with
    exponent 2^23 and i in its mantissa is 2^23 + i, minus 2^23 (one LOP3 + one FADD, both full rate)."""
    return (i | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _kq5(v, u: tl.constexpr, at: tl.constexpr, mask: tl.constexpr, al, be):
    """al f + be of the quant (v >> 8 u) & mask placed at mantissa bit `at` (f = 1 + q / 2^(23 - at)): _kq's floats,
    with Q5_K's fifth bit merged into the byte beforehand (one shift and mask a weight)."""
    return al * _unit(((v >> (8 * u)) & mask) << at) + be


@triton.jit
def _k_tile(pool, ra, kk, mn, QT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Q4_K / Q5_K step (one super-block a row): float32 [BN, 8, D2, D3], position (g, p, j) = element 32 g + D3 p + j
    (g = 2 a + h: the low (h 0) / high (h 1) nibbles of 32-byte group a; byte D3 p + j of the group). Each thread
    loads W = D3 / 4 consecutive qs words of one group (one 8- or 16-byte load) and unpacks both nibble halves, so
    its weights are two runs of D3 consecutive elements (the activations' loads vectorize too) and a group's scales
    are decoded once per thread for 4 W x 8 weights."""
    W: tl.constexpr = D3 // 4
    a = tl.arange(0, 4)[None, :, None, None]
    pw = tl.arange(0, D2)[None, None, :, None] * W + tl.arange(0, W)[None, None, None, :]       # word in group
    m = mn[:, None, None, None]
    if QT == 5:                                     # Q4_K: f16 d | f16 dmin | scales[12] | qs[128] (144 B)
        b = ra[:, None, None, None] + (kk // 256) * 144
        q = tl.load((pool + b + 16).to(tl.pointer_type(tl.int32)) + a * 8 + pw, mask=m, other=0)   # [BN, 4, D2, W]
        qh = q                                      # (unused)
        S: tl.constexpr = 16.0                      # f = 1 + q/16
    else:                                           # Q5_K: f16 d | f16 dmin | scales[12] | qh[32] | qs[128] (176 B)
        b = ra[:, None, None, None] + (kk // 256) * 176
        q = tl.load((pool + b + 48).to(tl.pointer_type(tl.int32)) + a * 8 + pw, mask=m, other=0)
        # the 5th bit of the quant of qs byte c's nibble h: qh[c] bit 2 a + h, i.e. of qh word c // 4 (the qs word's
        # index in its group) bit 8 (c % 4) + 2 a + h
        qh = tl.load((pool + b + 16).to(tl.pointer_type(tl.int32)) + pw, mask=m, other=0)
        S: tl.constexpr = 32.0                      # f = 1 + q/32
    b1, b2, b3, d, dm = k_head(pool, b, m, a)       # [BN, 4, 1, 1]
    lo = a < 2                                      # sub-blocks 2a, 2a + 1 < 4
    ws = ()
    for h in tl.static_range(2):                    # w = d sc q - dmin m = al f - (al + dmin m), f = 1 + q/S
        c1 = (b1 >> (8 * h)) & 255
        c2 = (b2 >> (8 * h)) & 255
        c3 = (b3 >> (8 * h)) & 255
        sc, mi = k_scale_min_of(c1, c2, c3, lo)
        al = S * (d * _int_f32(sc))
        be = -(al + dm * _int_f32(mi))
        if QT == 5:                                 # byte u's nibble h: (q >> 8 u + 4 h) & 15 at mantissa bits 19-22
            v = q >> (4 * h)
            t = _join4(_kq5(v, 0, 19, 15, al, be), _kq5(v, 1, 19, 15, al, be), _kq5(v, 2, 19, 15, al, be),
                       _kq5(v, 3, 19, 15, al, be))
        else:                                       # the 4 bytes' 5-bit quants q + 16 qh bit, bits 18-22
            v = ((q >> (4 * h)) & 0x0F0F0F0F) | (((qh >> (2 * a + h)) << 4) & 0x10101010)
            t = _join4(_kq5(v, 0, 18, 31, al, be), _kq5(v, 1, 18, 31, al, be), _kq5(v, 2, 18, 31, al, be),
                       _kq5(v, 3, 18, 31, al, be))
        t = tl.reshape(t, (q.shape[0], 4, D2, D3))
        ws = ws + (t,)
    # [BN, 4, D2, D3, 2] -> (a, h, p, j)
    w = tl.permute(tl.join(ws[0], ws[1]), (0, 1, 4, 2, 3))
    return tl.reshape(w, (q.shape[0], 8, D2, D3))


@triton.jit
def _wat(pool, b0, sh, o, m):
    """int32 words of the bytes at b0 + sh / 8 + o (o a multiple of 4, b0 4-byte aligned, sh 0 or 16 bits): the
    64-bit hi:lo of the aligned words at b0 + o, b0 + o + 4 shifted right by sh (a funnel shift; sh 0: lo)."""
    lo = _word(pool, b0 + o, m)
    hi = _word(pool, b0 + o + 4, m)
    return ((((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)) >> sh) & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _qb(v, u: tl.constexpr, al, be, B: tl.constexpr):
    """al f + be (one rounding) of the B-bit quant q at bits 8 u .. 8 u + B - 1 of words v: f = 1 + q / 2^B (q at
    mantissa bits 23 - B .. 22). Q6_K: al = 64 d sc, be = -96 d sc, so the exact value is d sc (q - 32), gguf-py's
    float32 (d sc is exact); Q3_K: 8 d sc, -12 d sc -> d sc (q - 4); Q2_K: A = 4 d sc, B = -(A + dmin m)."""
    return tl.fma(al, _unit(((v >> (8 * u)) & ((1 << B) - 1)) << (23 - B)), be)


@triton.jit
def _qb4(v, al, be, B: tl.constexpr):
    """[..., 4 (u)]: _qb of the 4 bytes of words v."""
    return _join4(_qb(v, 0, al, be, B), _qb(v, 1, al, be, B), _qb(v, 2, al, be, B), _qb(v, 3, al, be, B))


@triton.jit
def _steps(ws, BN, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """A low-K tile's 4 sub-steps ws [BN, a, b, c] (c = (w, u)) -> [BN, D1, D2, D3]: (.., c, step) -> (.., step, c)."""
    w = tl.permute(_join4(ws[0], ws[1], ws[2], ws[3]), (0, 1, 2, 4, 3))
    return tl.reshape(w, (BN, D1, D2, D3))


@triton.jit
def _wat4(pool, b0, sh, o, m):
    """[..., 4]: the 4 words at b0 + sh / 8 + o + 4 w (_wat), each a load of o's shape joined in registers."""
    return _join4(_wat(pool, b0, sh, o, m), _wat(pool, b0, sh, o + 4, m), _wat(pool, b0, sh, o + 8, m),
                  _wat(pool, b0, sh, o + 12, m))


@triton.jit
def _q6_tile(pool, ra, kk, mn, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Q6_K step (one super-block a row: ql[128] | qh[64] | int8 scales[16] | f16 d, 210 B): float32 [BN, 2, 2, 64],
    position (n, r, c) = element 128 n + 32 i + 16 r + 4 w + u, c = 16 i + 4 w + u, i = 2 nib + j (llama.cpp's
    order: half n, l = 16 r + 4 w + u < 32; the quant is ql[64 n + 32 j + l]'s nibble nib | qh[32 n + l] bits 2 i
    .. + 1 << 4, scale scales[8 n + 2 i + r]). A thread owns the 16-byte runs (n, r) of ql (j 0, 1) and qh: 12 words
    (loads of [BN, 2, 2] joined in registers, as _q2_tile) for 64 weights, the 6-bit quants of 4 bytes assembled in
    one word with masks, its 4 scales decoded once. A block at 2 mod 4 (every other one; rows of odd block counts)
    is read through the aligned word pairs around it (_wat)."""
    n = tl.arange(0, 2)[None, :, None]
    r = tl.arange(0, 2)[None, None, :]
    m = mn[:, None, None]
    b = ra[:, None, None] + (kk // 256) * 210       # [BN, 1, 1] super-block byte addresses
    r4 = b % 4                                      # 0 or 2 (rows and blocks start at even bytes)
    b0 = b - r4
    sh = r4 * 8
    ql0 = _wat4(pool, b0, sh, n * 64 + r * 16, m)   # [BN, 2, 2, 4]: j 0
    ql1 = _wat4(pool, b0, sh, n * 64 + 32 + r * 16, m)        # j 1
    qh = _wat4(pool, b0, sh, 128 + n * 32 + r * 16, m)
    # scales 8 n + 2 i + r: i 0, 1 in the word at 192 + 8 n, i 2, 3 in the next, byte 2 (i % 2) + r
    s01 = _wat(pool, b0, sh, 192 + n * 8, m) >> (r * 8)       # [BN, 2, 2]
    s23 = _wat(pool, b0, sh, 196 + n * 8, m) >> (r * 8)
    d = _half(_word(pool, b0 + 208, m) >> sh.to(tl.int32))    # the f16 at b + 208 (never straddles a word)
    ws = ()
    for i in tl.static_range(4):                    # i = 2 nib + j
        if i < 2:
            sw = s01
        else:
            sw = s23
        # int8 scale to float exactly: 2^23 + (byte ^ 0x80) - (2^23 + 128), no I2F
        sc = ((((sw >> (16 * (i % 2))) & 255) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        dsc = d * sc                                # exact: an f16 times an int8 (<= 19 significant bits)
        al = (64.0 * dsc)[:, :, :, None]
        be = (-96.0 * dsc)[:, :, :, None]           # exact too (3 x 32 dsc)
        if i % 2 == 0:
            qv = ql0
        else:
            qv = ql1
        # the 4 bytes' 6-bit quants: the nibble nib of ql | qh's bit pair 2 i at bits 4-5
        v = ((qv >> (4 * (i // 2))) & 0x0F0F0F0F) | (((qh >> (2 * i)) << 4) & 0x30303030)
        t = _qb4(v, al, be, 6)   # [.., 4 w, 4 u]
        ws = ws + (tl.reshape(t, (ql0.shape[0], 2, 2, 16)),)
    return _steps(ws, ql0.shape[0], D1, D2, D3)     # [BN, 2, 2, 16 (w, u), 4 (i)] -> (n, r, i, w, u)


@triton.jit
def _q2_tile(pool, ra, kk, mn, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Q2_K step (one super-block a row: scales[16] (low nibble scale, high min) | qs[64] | f16 d | f16 dmin, 84 B,
    21 words): float32 [BN, 2, D2, D3], W = D3 / 16 words a run, position (n, p, c) = element 128 n + 32 j + 4 W p +
    4 w + u, c = 4 W j + 4 w + u (llama.cpp's order: l = 4 W p + 4 w + u < 32, the quant qs[32 n + l] bits 2 j .. + 1,
    scale / min scales[8 n + 2 j + l // 16]). Each thread loads the W consecutive qs words of one run (n, p) (4 W x 4
    weights), whose 4 (scale, min) pairs it decodes once; the weight is w = A f + B with A = 4 d sc, B = -(A + dmin m)
    (triton_quants' formula: gguf-py's d sc q - dmin m to the last bit or two, one rounding in B)."""
    W: tl.constexpr = D3 // 16
    n = tl.arange(0, 2)[None, :, None]
    p = tl.arange(0, D2)[None, None, :]
    m = mn[:, None, None]
    b = ra[:, None, None] + (kk // 256) * 84        # [BN, 1, 1] super-block byte addresses
    # the run's W words as W loads of [BN, 2, D2] joined in registers: a thread owns one run (84-byte blocks allow no
    # 16-byte load, and one [BN, 2, D2, W] load spreads a run over W threads, each then decoding W runs' scales:
    # sass_profile 0.91 warp instructions per weight byte at W 4, 0.60 so)
    qa = b + 16 + n * 32 + p * (4 * W)
    if W == 4:
        q = _join4(_word(pool, qa, m), _word(pool, qa + 4, m), _word(pool, qa + 8, m), _word(pool, qa + 12, m))
    else:
        q = tl.join(_word(pool, qa, m), _word(pool, qa + 4, m))
    # scale bytes 8 n + 2 j + r (r = l // 16 = W p // 4): j 0, 1 in the word at 8 n, j 2, 3 in the next, byte
    # 2 (j % 2) + r; decoded as [BN, 2, D2] (the run's thread), broadcast over its weights
    r = (p * W) // 4
    s01 = _word(pool, b + n * 8, m) >> (r * 8)      # [BN, 2, D2]
    s23 = _word(pool, b + n * 8 + 4, m) >> (r * 8)
    dd = _word(pool, b + 80, m)
    d = _half(dd)
    dm = _half(dd >> 16)
    ws = ()
    for j in tl.static_range(4):
        if j < 2:
            sw = s01 >> (16 * j)
        else:
            sw = s23 >> (16 * (j - 2))
        al3 = 4.0 * (d * _int_f32(sw & 15))         # d sc: exact (an f16 times 4 bits)
        al = al3[:, :, :, None]
        be = (-(al3 + dm * _int_f32((sw >> 4) & 15)))[:, :, :, None]
        v = q >> (2 * j)
        t = _qb4(v, al, be, 2)   # [.., W w, 4 u]
        ws = ws + (tl.reshape(t, (q.shape[0], 2, D2, 4 * W)),)
    return _steps(ws, q.shape[0], D1, D2, D3)       # [BN, 2, D2, 4 W (w, u), 4 (j)] -> (n, p, j, w, u)


@triton.jit
def _q3_tile(pool, ra, kk, mn, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """Q3_K step (one super-block a row: hmask[32] | qs[64] | scales[12] | f16 d, 110 B): float32 [BN, 2, 2, 64],
    position (n, r, c) = element 128 n + 32 j + 16 r + 4 w + u, c = 16 j + 4 w + u (as _q2_tile; llama.cpp's order:
    l = 16 r + 4 w + u, the quant (qs[32 n + l] bits 2 j .. + 1) + 4 hmask[l] bit 4 n + j, minus 4; the 6-bit scale
    s = 8 n + 2 j + r: low nibble n of scales[s % 8], high bits 2 (s // 4) .. + 1 of scales[8 + s % 4], minus 32).
    A thread owns a 16-byte run (n, r): its 4 qs and 4 hmask words (W loads of [BN, 2, 2] each, joined in registers),
    and decodes its 4 scales once. w = fma(8 d sc, 1 + q / 8, -12 d sc) = d sc (q - 4) exactly (gguf-py's value:
    d sc <= 17 significant bits). A block at 2 mod 4 (every other one) is read through aligned word pairs (_wat)."""
    n = tl.arange(0, 2)[None, :, None]
    r = tl.arange(0, 2)[None, None, :]
    m = mn[:, None, None]
    b = ra[:, None, None] + (kk // 256) * 110       # [BN, 1, 1] super-block byte addresses
    r4 = b % 4                                      # 0 or 2
    b0 = b - r4
    sh = r4 * 8
    qa = 32 + n * 32 + r * 16                       # qs run (n, r): bytes 32 + 32 n + l
    q = _wat4(pool, b0, sh, qa, m)
    ha = r * 16                                     # hmask bytes l
    hm = _wat4(pool, b0, sh, ha, m) >> (n * 4)[:, :, :, None]       # bit j: hmask bit 4 n + j
    # scale s = 8 n + 2 j + r: low nibble n of byte 2 j + r of the words at 96 (j 0, 1) and 100 (j 2, 3); high
    # bits 2 (2 n + j // 2) of byte 2 (j % 2) + r of the word at 104; decoded as [BN, 2, 2], broadcast
    lo01 = _wat(pool, b0, sh, 96, m) >> (r * 8 + n * 4)      # [BN, 2, 2]
    lo23 = _wat(pool, b0, sh, 100, m) >> (r * 8 + n * 4)
    hi = _wat(pool, b0, sh, 104, m) >> (r * 8 + n * 4)
    d = _half(_word(pool, b0 + 108, m) >> sh.to(tl.int32))    # the f16 at b + 108 (never straddles a word)
    ws = ()
    for j in tl.static_range(4):
        if j < 2:
            lw = lo01 >> (16 * j)
        else:
            lw = lo23 >> (16 * (j - 2))
        sc = (lw & 15) | (((hi >> (16 * (j % 2) + 2 * (j // 2))) & 3) << 4)
        # d (sc - 32) exactly: 2^23 + sc - (2^23 + 32), times an f16
        dsc = d * ((sc | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0)
        al = (8.0 * dsc)[:, :, :, None]
        be = (-12.0 * dsc)[:, :, :, None]
        v = ((q >> (2 * j)) & 0x03030303) | (((hm >> j) << 2) & 0x04040404)
        t = _qb4(v, al, be, 3)   # [.., 4 w, 4 u]
        ws = ws + (tl.reshape(t, (q.shape[0], 2, 2, 16)),)
    return _steps(ws, q.shape[0], D1, D2, D3)       # [BN, 2, 2, 16 (w, u), 4 (j)] -> (n, r, j, w, u)


@triton.jit
def mv_xptr(x_ptr, xrow, QT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """[1, D1, D2, D3] pointers to the activations of step 0, in tile order, of the row at element offset xrow [1]
    (step kk: + kk)."""
    return x_ptr + xrow[:, None, None, None] + mv_cols(QT, D1, D2, D3)


@triton.jit
def mv_zeros(BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """One row's accumulator [BN, D1, D2, D3]: the weights' own layout (no row dimension), so the loop moves no
    registers through shared memory."""
    return tl.zeros((BN, D1, D2, D3), dtype=tl.float32)


@triton.jit
def mv_acc(acc, w, x):
    """acc + w [BN, D...] x x [1, D...] elementwise (one fused multiply-add per element)."""
    return tl.fma(w, tl.broadcast_to(x, w.shape), acc)


@triton.jit
def mv_total(acc, BN: tl.constexpr, S: tl.constexpr, LOG2S: tl.constexpr):
    """[BN, 1] = acc [BN, D1, D2, D3] (S positions) summed by the pairwise tree over the positions in tile order
    (2i + 2i+1, level by level)."""
    a = tl.reshape(acc, (BN, S))
    for lvl in tl.static_range(LOG2S):
        lo, hi = tl.split(tl.reshape(a, (BN, S >> (lvl + 1), 2)))
        a = lo + hi
    return tl.reshape(a, (BN, 1))


def log2(n: int) -> int:
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1
