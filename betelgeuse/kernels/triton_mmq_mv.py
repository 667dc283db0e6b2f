"""The q8_1 decode schedule without tensor cores (llama.cpp's mmvq with q8_1 activations), the bits of triton_mmq's.

triton_mmq's int8 MMA pads a decode row to BM = 16 and stages every weight tile through shared memory for the
wgmma; at 1 row per expert most of the MMA is padding and the loads are byte loads of 34- / 17-byte blocks. This
schedule (a schedule key of triton_mmq: MV = 1) reads the weights as 32-bit words in triton_mmvq's layout, one K
step of NS word groups per loop iteration, and takes each block's dot product on the FP32 units:

  w, x   the quants as integer-valued float32 (Q8_0 -128..127, MXFP4 the doubled e2m1 values -12..12, Q4_K
         0..15; q8_1 activations -127..127), decoded with triton_mmvq's bit tricks (exact: 256 f - 384 etc.)
  dot    sum over the block's 32 elements of w x: every product and partial sum is an integer below 2^24
         (32 x 128 x 127 = 520,192), so the float32 sum is exact in any order and equals triton_mmq's int32 dot
  acc    then, per block in ascending K order, the float ops of triton_mmq's block step (its module doc):
         acc = fma(dot, dw dx, acc) (Q8_0, MXFP4); acc = acc + fma(dot, dw dx, -(mw sx)) (Q4_K)
         with dw, mw, dx, sx the same float32 values (the same f16 / E8M0 / 6-bit scale decoding, one fmul each).
DP4A = 1 (a schedule key; the GPU only, inline PTX; the interpreter takes the float dots): each block's dot as
llama.cpp's vec_dot_*_q8_1 takes it, dp4a of the weights' int32 words (Q8_0 bytes, Q4_K nibbles masked to bytes,
MXFP4 codes through a byte-permute table of the doubled e2m1 values) and the activations' words, summed in int32:
the same integers, no float decoding (the ALU cost of the float dots is ~10 ops an element).
So an output is bit for bit the MMA schedule's at the same reduction key KCB (chunks of KCB blocks, each from
zero, summed 0 + p_0 + p_1 + ... by the same split-K / walk code in triton_mmq): the 1-row bucket may take this
schedule while the 16-row bucket keeps the MMA, and a row's bits still do not depend on its bucket (DESIGN.md
invariant 6). BM_MV rows a program (each row's products its own; a step's weights decoded once for them), BN
output rows, NS word groups a step, warps: schedule keys.

  type   blocks per word group   word group (triton_mmvq STEP)     tile [D1, D2, D3] of NS groups
  Q8_0   2                       68 B: 17 words                     [2 NS, 8, 4]   (block a, word, byte)
  MXFP4  4                       68 B: 17 words                     [4 NS, 4, 8]   (block a, word, nibble)
  Q4_K   8                       144 B: one super-block             [4 NS, 8, 8]   (32-byte group a, word, nibble:
                                                                                    block 2 a + nibble % 2)
Requires (mv_ok) rows at 4-byte multiples in 16-byte aligned parts, K a multiple of 32 x (blocks a step) and KCB a
multiple of the blocks a step; a launch that fails it runs the MMA (the same bits).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from betelgeuse.kernels.triton_mmvq import _e2m1, _half, _i8, _join4, _join8, _kq, _word, k_head
from betelgeuse.kernels.triton_quants import k_scale_min_of

GROUP_BLOCKS = {0: 2, 4: 4, 5: 8}           # kernel type code -> q8_1 blocks (32 elements) of one word group
DP4A_TYPES = frozenset({0, 4, 5})           # the types whose block dots may run as PTX dp4a (Q8_0, MXFP4, Q4_K)


def dp4a_ok(qt: int, want) -> bool:
    """Whether a launch takes the dp4a block dots: asked (the DP4A schedule key), a type that has them, and compiled
    for the GPU (the Triton interpreter cannot run inline PTX: the float block dots there, the same integers)."""
    return bool(want) and qt in DP4A_TYPES and os.environ.get("TRITON_INTERPRET", "0") != "1"


def dims(qt: int, ns: int) -> dict:
    """The constexprs of type code qt at NS word groups a step: D1, D2, D3 (the tile) and NB (blocks a step)."""
    d = {0: (2 * ns, 8, 4), 4: (4 * ns, 4, 8), 5: (4 * ns, 8, 8)}[qt]
    nb = GROUP_BLOCKS[qt] * ns
    return dict(D1=d[0], D2=d[1], D3=d[2], NB=nb, LOG2NB=nb.bit_length() - 1)


def mv_ok(qt: int, K: int, kcb: int, ns: int, row_bytes: int, aligned: bool) -> bool:
    """Whether a launch over K columns (chunks of kcb blocks) can take this schedule at NS word groups a step."""
    nb = GROUP_BLOCKS.get(qt, 0) * ns
    return (nb > 0 and aligned and row_bytes % 4 == 0 and (K // 32) % nb == 0 and K % 32 == 0
            and kcb % nb == 0)


@triton.jit
def _pick(P, j: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, LOG2NB: tl.constexpr):
    """P [BN, NB] -> P[:, j] [BN]: register moves (tl.split on the index bits, lowest first), no arithmetic."""
    X = P
    for lvl in tl.static_range(LOG2NB):
        a, b = tl.split(tl.reshape(X, (BN, NB >> (lvl + 1), 2)))
        if (j >> lvl) & 1:
            X = b
        else:
            X = a
    return tl.reshape(X, (BN,))


@triton.jit
def _dp4a(a, b):
    """The dot of the 4 signed bytes of int32 words a and b (PTX dp4a, llama.cpp's ggml_cuda_dp4a): exact int32."""
    return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, tl.broadcast_to(b, a.shape)],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _mxfp4_int8(v):
    """The 8 e2m1 codes of int32 words v (byte k: element k in the low nibble, 16 + k in the high) as two words of 4
    int8 each, the doubled e2m1 values (kvalues_mxfp4): (elements 0..3, elements 16..19) of the word's bytes, by
    byte permutes of the 16-entry table (llama.cpp's get_int_from_table_16): prmt picks each nibble's value from the
    positive half (codes 0-7) and the negative half (8-15), then by the nibble's bit 3, then splits even / odd."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 s, s1, m, sel, sel1, l0, h0, l1, h1, t0, t1, p0, p1, n0, n1;
        mov.b32 p0, 0x03020100;
        mov.b32 p1, 0x0C080604;
        mov.b32 n0, 0xFDFEFF00;
        mov.b32 n1, 0xF4F8FAFC;
        and.b32 s, $2, 0x77777777;
        shr.b32 s1, s, 16;
        prmt.b32 l0, p0, p1, s;
        prmt.b32 h0, n0, n1, s;
        prmt.b32 l1, p0, p1, s1;
        prmt.b32 h1, n0, n1, s1;
        and.b32 m, $2, 0x88888888;
        shr.b32 m, m, 1;
        or.b32 sel, m, 0x32103210;
        shr.b32 sel1, sel, 16;
        prmt.b32 t0, l0, h0, sel;
        prmt.b32 t1, l1, h1, sel1;
        prmt.b32 $0, t0, t1, 0x6420;
        prmt.b32 $1, t0, t1, 0x7531;
        }""", "=r,=r,r", [v], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _bytes4(v):
    """The 4 signed bytes of int32 words v as integer-valued float32 [..., 4] (byte c at position c)."""
    return _join4(_i8(v, 0, 256.0, 1.0), _i8(v, 1, 256.0, 1.0), _i8(v, 2, 256.0, 1.0), _i8(v, 3, 256.0, 1.0))


@triton.jit
def _bytes8(v0, v1):
    """[..., 8]: position c = byte c // 2 of v0 (c even) or v1 (c odd), signed, as integer-valued float32."""
    return _join8(_i8(v0, 0, 256.0, 1.0), _i8(v1, 0, 256.0, 1.0), _i8(v0, 1, 256.0, 1.0), _i8(v1, 1, 256.0, 1.0),
                  _i8(v0, 2, 256.0, 1.0), _i8(v1, 2, 256.0, 1.0), _i8(v0, 3, 256.0, 1.0), _i8(v1, 3, 256.0, 1.0))


@triton.jit
def _weights(pool, ra, s0, mn, QT: tl.constexpr, BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
             D3: tl.constexpr, WORDS: tl.constexpr = False):
    """Blocks s0 .. s0 + NB of weight rows at byte addresses ra [BN] (mask mn): (quants [BN, D1, D2, D3] as integer
    floats in tile order, the block scales dw [BN, NB], the block mins mw [BN, NB] (Q4_K; else dw)), the float32
    values triton_mmq's block functions give. WORDS: the quants as their int32 words [BN, D1, D2] instead (Q8_0: 4
    int8 of block a; MXFP4: 8 codes of block a; Q4_K: 8 nibbles, the low ones of sub-block 2 a, the high 2 a + 1)."""
    a = tl.arange(0, D1)[None, :, None]
    bb = tl.arange(0, D2)[None, None, :]
    m = mn[:, None, None]
    r = ra[:, None, None]
    if QT == 0:                                     # Q8_0: pairs of 34-byte blocks (68 B, 17 words)
        b = r + (s0 // 2) * 68 + (a // 2) * 68
        wi = (a % 2) * 8 + bb                       # triton_mmvq.mv_weights: block 0's quant word wi straddles
        lo = _word(pool, b + wi * 4, m)             # words wi, wi + 1; block 1's is word wi + 1
        hi = _word(pool, b + wi * 4 + 4, m)
        v = tl.where(wi < 8, ((lo >> 16) & 0xFFFF) | (hi << 16), hi)
        dwd = tl.where(a % 2 == 0, _word(pool, b, m), _word(pool, b + 32, m) >> 16)        # [BN, D1, 1]
        dw = tl.reshape(_half(dwd), (BN, D1))
        if WORDS:
            w = v
        else:
            w = _bytes4(v)
        return w, dw, dw
    elif QT == 4:                                   # MXFP4: groups of four 17-byte blocks (68 B, 17 words)
        b = r + (s0 // 4) * 68 + (a // 4) * 68
        al = a % 4
        o = al * 17 + 1 + bb * 4                    # quant word bb of block a: bytes o .. o + 3 (funnel shift)
        lo = _word(pool, b + (o // 4) * 4, m)
        hi = _word(pool, b + (o // 4) * 4 + 4, m)
        s = (o % 4) * 8
        t = tl.where(s == 0, 8, s)
        v = tl.where(s == 0, lo, ((lo >> t) & ((1 << (32 - t)) - 1)) | (hi << (32 - t)))
        e8 = (_word(pool, b + al * 16, m) >> (al * 8)) & 255                                # [BN, D1, 1]
        d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
        dw = tl.reshape(d, (BN, D1))
        one = 1.0
        if WORDS:
            w = v
        else:
            w = _join8(_e2m1(v, 0, one), _e2m1(v, 1, one), _e2m1(v, 2, one), _e2m1(v, 3, one),
                       _e2m1(v, 4, one), _e2m1(v, 5, one), _e2m1(v, 6, one), _e2m1(v, 7, one))
        return w, dw, dw
    else:                                           # Q4_K: 144-byte super-blocks, 4 groups of 32 bytes each
        b = r + (s0 // 8) * 144 + (a // 4) * 144
        ga = a % 4
        q = _word(pool, b + 16 + (ga * 8 + bb) * 4, m)                                     # [BN, D1, D2]
        w = q if WORDS else _join8(_kq(q, q, 0, 16.0, -16.0, 5), _kq(q, q, 1, 16.0, -16.0, 5),
                   _kq(q, q, 2, 16.0, -16.0, 5), _kq(q, q, 3, 16.0, -16.0, 5),
                   _kq(q, q, 4, 16.0, -16.0, 5), _kq(q, q, 5, 16.0, -16.0, 5),
                   _kq(q, q, 6, 16.0, -16.0, 5), _kq(q, q, 7, 16.0, -16.0, 5))             # q = 16 f - 16
        # scales of sub-blocks j = 2 ga + h (get_scale_min_k4, as triton_mmq._q4_k_scale): bytes of words 1-3
        b1, b2, b3, d, dmin = k_head(pool, b, m, ga)                                       # [BN, D1, 1] each
        lo = ga < 2                                 # j < 4
        dws, mws = (), ()
        for h in tl.static_range(2):
            c1 = (b1 >> (8 * h)) & 255
            c2 = (b2 >> (8 * h)) & 255
            c3 = (b3 >> (8 * h)) & 255
            sc, mi = k_scale_min_of(c1, c2, c3, lo)
            dws = dws + (tl.reshape(d * sc.to(tl.float32), (BN, D1)),)
            mws = mws + (tl.reshape(dmin * mi.to(tl.float32), (BN, D1)),)
        # [BN, D1, 2] -> [BN, 2 D1]: block 2 a + h
        dw = tl.reshape(tl.join(dws[0], dws[1]), (BN, 2 * D1))
        mw = tl.reshape(tl.join(mws[0], mws[1]), (BN, 2 * D1))
        return w, dw, mw


@triton.jit
def _acts(xq_ptr, xo, s0, mr, QT: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """The q8_1 quants of one row (element offset xo, in range mr: [1] tensors) for blocks s0 .., in the weights'
    tile order, as integer floats [1, D1, D2, D3] (int32 word loads; the row starts at a multiple of 32 bytes)."""
    a = tl.arange(0, D1)[None, :, None]
    bb = tl.arange(0, D2)[None, None, :]
    p = (xq_ptr + xo[:, None, None] + s0 * 32).to(tl.pointer_type(tl.int32))     # word pointer of block s0
    m = mr[:, None, None]
    if QT == 0:                                     # element 32 a + 4 b + c: word 8 a + b, byte c
        x = _bytes4(tl.load(p + a * 8 + bb, mask=m, other=0))
    elif QT == 4:                                   # element 32 a + 16 h + 4 b + c', c = 2 c' + h: word 8 a + 4 h + b
        x = _bytes8(tl.load(p + a * 8 + bb, mask=m, other=0), tl.load(p + a * 8 + 4 + bb, mask=m, other=0))
    else:                                           # element 64 a + 32 h + 4 b + c': word 16 a + 8 h + b
        x = _bytes8(tl.load(p + a * 16 + bb, mask=m, other=0), tl.load(p + a * 16 + 8 + bb, mask=m, other=0))
    return x


@triton.jit
def _block_dots(p, QT: tl.constexpr, BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                NB: tl.constexpr):
    """[BN, D1, D2, D3] products -> [BN, NB] block sums (exact: integers below 2^24)."""
    if QT == 5:                                     # block 2 a + (c % 2)
        s = tl.sum(tl.sum(tl.reshape(p, (BN, D1, D2, D3 // 2, 2)), axis=3), axis=2)      # [BN, D1, 2]
        r = tl.reshape(s, (BN, NB))
    else:                                           # block a
        r = tl.sum(tl.reshape(p, (BN, D1, D2 * D3)), axis=2)
    return r


@triton.jit
def _block_dots_dp4a(w, xq_ptr, xo, s0, mr, QT: tl.constexpr, BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                     NB: tl.constexpr):
    """[BN, NB] block dots from the weight words w [BN, D1, D2] and one row's q8_1 words (dp4a: exact int32 sums,
    as float32: the values of _block_dots)."""
    a = tl.arange(0, D1)[None, :, None]
    bb = tl.arange(0, D2)[None, None, :]
    p = (xq_ptr + xo[:, None, None] + s0 * 32).to(tl.pointer_type(tl.int32))
    m = mr[:, None, None]
    if QT == 0:                                     # word b of block a: elements 32 a + 4 b ..: q8_1 word 8 a + b
        r = tl.sum(_dp4a(w, tl.load(p + a * 8 + bb, mask=m, other=0)), axis=2)
    elif QT == 4:                                   # MXFP4 word b of block a: elements 32 a + 4 b .. and + 16 ..
        lo, hi = _mxfp4_int8(w)
        r = (tl.sum(_dp4a(lo, tl.load(p + a * 8 + bb, mask=m, other=0)), axis=2)
             + tl.sum(_dp4a(hi, tl.load(p + a * 8 + 4 + bb, mask=m, other=0)), axis=2))
    else:                                           # Q4_K: nibbles of group a: sub-blocks 2 a (low), 2 a + 1 (high)
        lo = tl.sum(_dp4a(w & 0x0F0F0F0F, tl.load(p + a * 16 + bb, mask=m, other=0)), axis=2)
        hi = tl.sum(_dp4a((w >> 4) & 0x0F0F0F0F, tl.load(p + a * 16 + 8 + bb, mask=m, other=0)), axis=2)
        r = tl.reshape(tl.join(lo, hi), (BN, NB))
    return r.to(tl.float32)


@triton.jit
def mv_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, NB: tl.constexpr,
           LOG2NB: tl.constexpr, DP4A: tl.constexpr = False):
    """acc [BN, BM] + the rows' products over quant blocks b0 .. b1 (NB | b1 - b0), the float ops of
    triton_mmq.mmq_acc (module doc): xq rows at element offsets xoff [BM], block scales (and sums) at dxoff [BM].
    DP4A (the GPU only: inline PTX): the block dots as dp4a of the weights' and activations' int32 words, no decoding
    to float (llama.cpp's vec_dot_*_q8_1; MXFP4's codes through a byte-permute table first): the same integers."""
    cols = tl.arange(0, BM)
    xos, mrs = (), ()
    for i in tl.static_range(BM):                   # row i's offset and mask as [1] tensors
        xos = xos + (tl.sum(tl.where(cols == i, xoff, 0), 0) + tl.zeros((1,), dtype=tl.int64),)
        mrs = mrs + (tl.sum(tl.where((cols == i) & mr, 1, 0), 0) + tl.zeros((1,), dtype=tl.int32) > 0,)
    for s0 in range(b0, b1, NB):
        w, dw, mw = _weights(pool, ra, s0, mn, QT, BN, D1, D2, D3, DP4A)
        dots = ()
        for i in tl.static_range(BM):
            if DP4A:
                dots = dots + (_block_dots_dp4a(w, xq_ptr, xos[i], s0, mrs[i], QT, BN, D1, D2, NB),)
            else:
                x = _acts(xq_ptr, xos[i], s0, mrs[i], QT, D1, D2)
                dots = dots + (_block_dots(w * x, QT, BN, D1, D2, D3, NB),)
        for j in tl.static_range(NB):               # ascending blocks: triton_mmq's per-block float ops
            di = tl.zeros((BN, BM), dtype=tl.float32)
            for i in tl.static_range(BM):
                di = tl.where(cols[None, :] == i, _pick(dots[i], j, BN, NB, LOG2NB)[:, None], di)
            dx = tl.load(xd_ptr + dxoff + s0 + j, mask=mr, other=0.0)
            dwj = _pick(dw, j, BN, NB, LOG2NB)
            if QT == 5:
                mwj = _pick(mw, j, BN, NB, LOG2NB)
                sx = tl.load(xs_ptr + dxoff + s0 + j, mask=mr, other=0.0)
                acc = acc + tl.fma(di, dwj[:, None] * dx[None, :], -(mwj[:, None] * sx[None, :]))
            else:
                acc = tl.fma(di, dwj[:, None] * dx[None, :], acc)
    return acc
