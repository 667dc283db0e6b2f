"""The bf16 MMA of Q8_0, MXFP4 and Q4_K experts (act_quant bf16, triton_mmq's BF schedule) in Gluon: the weights
loaded straight into the wgmma's A registers (issue 23, docs/benchmarks/cpu-gluon55, cpu-gluonk57).

Triton lowers triton_mmq's `tl.dot(wq.to(bf16), xt)` with a register-built A as a round trip through shared memory
(STS, barrier, LDSM: docs/benchmarks/cpu-mma55). Here the weight tile [BN, KB*32] is loaded in the wgmma's A operand
layout itself (DotOperandLayout(0, NVMMA v3 m64 n32 k16, k_width 2)) and handed to hopper.warpgroup_mma as a register
tensor; only the block-diagonal B tile [KB*32, KB*BM] goes through shared memory (it must: wgmma reads B there).

The same arithmetic as triton_mmq's BF schedule at BF_TUNING's constants (BN 64, BM 16, KB 2, 4 warps: one warpgroup),
so the same bits on the GPU (deploy/device/check_gluon_mmq.py checks torch.equal):
  * one K step = blocks kb0, kb0 + 1: ONE warpgroup MMA [64, 64] x [64, 32] -> [64, 32] fp32 from zero (4 HGMMA
    64x32x16.F32.BF16, k16 in ascending order, the instruction Triton issues; A row n = weight row n, B column
    i*16 + m = row m's block kb0 + i, zeros elsewhere), its columns split into the 2 block dots [64, 16];
  * acc = fma(dot_0, d_0, acc); acc = fma(dot_1, d_1, acc) (d: the block scale as float32), acc from zero each K
    chunk of KCB blocks; Q4_K: acc = acc + fma(dot_i, d sc_i, -(dmin m_i * sx_i)) (d sc, dmin m: float32 products
    of the super-block's f16 d / dmin and get_scale_min_k4's 6-bit values; sx the x block sums, prepare_bf16's);
  * Q4_K: a K step's two sub-blocks (j, j + 1; j even) are the low and high nibbles of ONE 32-byte group: each
    16-bit pair of it loaded once (thread t's pairs are its A k pairs) and decoded by inline PTX straight into
    the two blocks' bf16 pairs (0x4300 | n is the bf16 128 + n; one add.bf16x2 of -128, exact);
  * MXFP4: the doubled e2m1 values in triton_mmq._perm's element order, for the weights (a thread's k pair is then
    the two nibbles of one byte: one byte load a pair) and the B tile alike, as the Triton kernel's BF tiles; the
    nibbles decoded by inline PTX, 8 codes a 32-bit word (prmt table lookups, then 0x4300 | 64 + value less 192 in
    bf16: exact), straight into the bf16 pairs (cpu-mxlut63; the same values, so the same bits);
  * the chunk sums 0 + p_0 + p_1 + ... in chunk order: walked (16-row bucket) or split over programs (SPLIT, the
    1-row bucket: the tile's last program sums the stored partials, triton_moe's counter protocol);
  * gate_up: SwiGLU (the clamped form under HAS_LIMIT) as triton_moe._gu_store; down: y's bf16 store;
  * FUSE (gate_up; BF_TUNING's for MXFP4 and Q4_K): gate's BN rows then up's as one A of 128 rows, one MMA of 2 x
    m64 HGMMA a k16 on the same B tile (Triton's FUSE); FUSE 0: gate's K walk, then up's. A schedule key either way
    (each output's instruction, operands and float ops are its own).
  * GP (_acc_part): where a K step's loads are converted -- 0 in the step that issues them (one step ahead, but
    waited for before that step ends), 1 / 2 carried as loaded one / two steps and converted in the step that uses
    them (PTX loads and conversions the compiler cannot move back: cpu-gluon16r57). A schedule key. Q4_K (cpu-gpk63):
    GP 0 is _acc_part_k, GP 1 / 2 _acc_part's loop on _load_raw_k's set (the pairs, headers, x sums and B tile as
    loaded), its scale terms computed before the next loads are issued (_k_terms: the min products by PTX).
  * PK (Q8_0 with GP >= 1, Q4_K, MXFP4; off everywhere): the pool's weights in mma_pack's layout (64-row tiles, a K
    step's quants in the order of the threads' A k pairs): a thread's weights of a tile and step are 16 contiguous bytes
    (one 128-bit load; a warp load 512 contiguous bytes, where GGUF order gives 8 rows x 8 bytes in 8 lines) and a row's
    two scales one 32-bit word; register moves put the words' int8 in AL's order, so the MMA gets the same A: the same
    bits as PK 0 on the GGUF bytes (cpu-pack62). A schedule key; the caller packs the pool. PK 2 (engine.pack_experts,
    cpu-vram62): per expert, bit 0 of its base offset (a packed VRAM slot's: ExpertCache._own) picks the packed or the
    GGUF body once a program (_pk_of; both compiled into the kernel), so one launch reads VRAM experts packed beside
    host, flex and ring experts in GGUF order. Q4_K (cpu-packk62; at any GP: cpu-gpk63) reads mma_pack's Q4_K layout
    under PK 1 / 2 alike: a thread's byte pairs of a 64-row tile and step (rows t / 4 and + 8, QL's) are 16 contiguous
    bytes (one 128-bit load where GGUF order takes 8 16-bit loads; a warp load 512 contiguous bytes), moved to QL by
    register moves, and a row's header 16 bytes of one contiguous 1 KiB a super-block; the decode, MMA and float ops are
    the shipped form's. MXFP4 (cpu-mxpk63) reads mma_pack's MXFP4 layout under PK 1 / 2 at any GP: a thread's nibble
    bytes of a 64-row tile and step (its AL k pairs under _perm: rows t / 4 and + 8) are 16 contiguous bytes (one
    128-bit load of 4 words where GGUF order takes 16 byte loads), moved to the words _mx_a decodes by register moves
    (the GGUF form packs its bytes into the same words), and a row's two scale bytes one 16-bit load; _mx_a's decode,
    the MMA and the float ops are the GGUF form's.
  * ST (MXFP4, Q4_K with PK and GP 1; off everywhere; cpu-mxtma65): the weight words of the next ST - 1 K steps in
    flight through a ring of shared memory slots ([slots, R / 2, 16] int32, slots ST's power of two): each thread
    copies its 16 bytes of a tile and step by cp.async (LDGSTS.128, one commit group a step) and reads them back in the
    step that uses them (LDS.128, after wait_group(ST - 2)); the step's other loads (scales / headers, sums, B tile)
    are GP 1's. Registers no longer hold the steps ahead, so the bytes in flight a CTA are (ST - 1) x the step's tile
    bytes; the words are the same, and so are the decode, MMA and float ops: the same bits as GP 1 PK.
The schedule key GL (triton_mmq.CONFIG, 0 by default) asks for it; triton_mmq._launch takes it where `usable` says so
(CUDA sm_90, Gluon importable, Q8_0, MXFP4 or Q4_K at these constants, aligned parts), else the Triton kernel runs
(CPU, the interpreter: Gluon has no interpreter). Compiles on Triton 3.6 (the device's) and 3.9: the API
differences used here are the CTA barrier's name (gl.thread_barrier on 3.6, gl.barrier on 3.9) and cp.async's
(async_copy_global_to_shared on 3.6, async_load on 3.9); 3.6 has no gl.cumsum (an associative_scan here).
"""

from __future__ import annotations

import os

from betelgeuse.kernels.triton_launch import launcher

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    HAVE_GLUON = True
except ImportError:                 # a Triton without Gluon: triton_mmq's kernels only
    HAVE_GLUON = False

TYPES = {0: (32, 34), 4: (32, 17), 5: (256, 144)}  # kernel type code (triton_quants.QT_CODES) -> (elements, bytes)
#                                                   of a block: Q8_0, MXFP4, Q4_K (its super-block)
SHAPE = {"BN": 64, "BM": 16, "KB": 2, "num_warps": 4}   # the one schedule compiled here (BF_TUNING's)


def row_bytes(qt: int, K: int) -> int:
    """Bytes of one weight row of K elements of type code qt (a TYPES type)."""
    n, b = TYPES[qt]
    return K // n * b


def usable(qt: int, c: dict, kb: int, device, aligned: bool = True) -> bool:
    """Whether a bf16 MMA launch of type qt with config c (KB kb as launched) can run here: Gluon imports, a CUDA
    device of capability 9.x (wgmma), not the interpreter, a type of TYPES at SHAPE's constants (FUSE either way:
    gate_up's fused form is here too; a schedule key, the same bits), parts 16-byte aligned (`aligned`, as
    triton_mmq.gate_up's: the weights are read in 2-, 4- and 16-byte words); PK (the weights packed: mma_pack)
    Q8_0 with GP >= 1, Q4_K or MXFP4 (any GP), only; ST (the weight ring, not 0) at least 2, with PK, GP 1, Q4_K
    or MXFP4 only (ST 2 .. 8)."""
    if not HAVE_GLUON or qt not in TYPES or getattr(device, "type", "") != "cuda" or not aligned:
        return False
    if c.get("PK") and not (qt == 0 and c.get("GP") or qt in (4, 5)):
        return False
    if c.get("ST") and not (2 <= c["ST"] <= 8 and c.get("PK") and c.get("GP") == 1 and qt in (4, 5)):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if any(c[k] != v for k, v in SHAPE.items() if k != "KB") or kb != SHAPE["KB"]:
        return False
    import torch
    return torch.cuda.get_device_capability(device)[0] == 9


if HAVE_GLUON:
    _barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier   # 3.6 / 3.9's name
    # cp.async global -> shared (ST's ring): 3.9's async_load, 3.6's async_copy_global_to_shared (removed in 3.9)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # the MMA's accumulator [64, 32]: 4 warps along M (one warpgroup), instruction m64 n32 k16 (as Triton's)
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16]))
    # the weights [64, 64] bf16 as wgmma's register A: thread t holds k pairs (2 (t % 4), +1) and +8 of rows t / 4
    # and t / 4 + 8 of its warp's 16 (k_width 2: two bf16 a 32-bit register)
    AL = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
    # a block dot / the accumulator [64, 16]: the MMA layout's columns 0..15 (the split's result: the column-16 bit
    # of MMA is a register bit, so the split moves no data; convert_layout to it is a no-op)
    ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
    # the B tile [64, 32] bf16 in registers: 8 consecutive k (16 bytes of one activation row) a thread
    BL = gl.constexpr(gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1]))
    # ... and in shared memory for wgmma (K-major, 128-byte swizzle: what Triton picks for this tile)
    SH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=True))
    L1 = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))        # the experts' table [EP]
    # Q4_K's byte pairs [R, 16] uint16 (pair p: bytes 2p, 2p + 1 of a row's 32-byte group): thread t holds pairs
    # p = t % 4 + 0, 4, 8, 12 of rows t / 4 and t / 4 + 8 of its warp's 16 -- the bytes of its AL k pairs (k_width 2:
    # k = 2 (t % 4) + 0, 1, 8, 9, 16, ...), one 16-bit load a pair; R 128 (gate_up's FUSE): rows + 64 in registers
    QL = gl.constexpr(gl.DistributedLinearLayout([[0, 4], [0, 8], [8, 0]], [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                                 [[16, 0], [32, 0]], [], [64, 16]))
    QL2 = gl.constexpr(gl.DistributedLinearLayout([[0, 4], [0, 8], [8, 0], [64, 0]],
                                                  [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                                  [128, 16]))
    # Q4_K's super-block header [R, 4] int32 (f16 d | f16 dmin, scales[0..3], [4..7], [8..11]): a row's 4 words in
    # one thread (16-byte aligned: one 128-bit load), the rows as ACC's (t / 4 and t / 4 + 8 of the warp's 16; the
    # 4 lanes of a quad alike)
    HL = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                                 [[16, 0], [32, 0]], [], [64, 4]))
    HL2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0], [64, 0]],
                                                  [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                                  [128, 4]))
    # PK's Q4_K pairs [R / 2, 32] uint16 as loaded (mma_pack's layout): row q = 8 (n // 16) + n % 8 holds the pieces
    # of rows n and n + 8, column m = 8 b + 4 h + j their pair b + 4 j of row n + 8 h; thread t holds m = 8 (t % 4)
    # .. + 7 (16 contiguous bytes: one 128-bit load) of q = t / 4 of its warp's 8 -- QL's pairs of the same rows;
    # R 128: q + 32 (rows + 64) in registers
    QZ = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4]], [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                 [[8, 0], [16, 0]], [], [32, 32]))
    QZ2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [32, 0]],
                                                  [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], [[8, 0], [16, 0]], [],
                                                  [64, 32]))
    # PK's MXFP4 nibble bytes [R / 2, 16] int32 words as loaded (mma_pack's layout): row q = 8 (n // 16) + n % 8 holds
    # the pieces of rows n and n + 8, word u = 4 b + r its bytes 4 r .. 4 r + 3 of lane-quad b's 16 (byte 8 h + j:
    # the step's byte b + 4 j of row n + 8 h); thread t holds u = 4 (t % 4) .. + 3 (16 contiguous bytes: one 128-bit
    # load) of q = t / 4 of its warp's 8 -- AL's pairs of the same rows (pair p: the two nibbles of byte p); R 128:
    # q + 32 (rows + 64) in registers
    MW = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                 [[8, 0], [16, 0]], [], [32, 16]))
    MW2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [32, 0]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                  [[8, 0], [16, 0]], [], [64, 16]))
    # ST's weight ring [slots, R / 2, 16] int32 in shared memory (MW's words of a K step a slot, row-major,
    # unswizzled): a thread's 16 bytes of a step are copied (cp.async, 16 bytes) and read back (LDS.128) by the same
    # thread; a warp reads 512 contiguous bytes (no bank conflicts)
    RING = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    # MXFP4's B tile [KB*32, KB*BM] bf16 as loaded, in element order (row e: element e % 32 of block e // 32; BL's
    # position 32 a + 8 w + 2 c + h holds element 32 a + 16 h + 4 w + c, _perm): thread t holds the elements of BL's
    # 8 positions of its column (w = t % 4, a = t / 4 % 2, the columns as BL's): 2 runs of 4 contiguous elements (8
    # bytes, one 64-bit load each) where BL's positions take 8 16-bit loads
    XW = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 8], [16, 0]],
                                                 [[0, 2], [0, 4], [0, 16], [1, 0], [2, 0]], [[4, 0], [8, 0]], [],
                                                 [32, 32]))
    XE = gl.constexpr(gl.DistributedLinearLayout([[1, 0], [2, 0], [16, 0], [0, 16]],
                                                 [[4, 0], [8, 0], [32, 0], [0, 1], [0, 2]], [[0, 4], [0, 8]], [],
                                                 [64, 32]))

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _find_block(off_ptr, base_ptr, n_exp, b, BM: gl.constexpr, EP: gl.constexpr):
        """triton_moe._find_block: row block b -> (expert e, its block index, e's pool offset or -1)."""
        ei = gl.arange(0, EP, layout=L1)
        me = ei < n_exp
        lo = gl.load(off_ptr + ei, mask=me, other=0)
        hi = gl.load(off_ptr + ei + 1, mask=me, other=0)
        nb = (hi - lo + BM - 1) // BM
        cum = gl.associative_scan(nb, 0, _add)                      # inclusive (3.6 has no gl.cumsum)
        e = gl.sum((cum <= b).to(gl.int32), 0)
        first = gl.sum(gl.where(ei == e, cum - nb, 0), 0)
        base = gl.load(base_ptr + gl.minimum(e, n_exp - 1))
        return e, b - first, gl.where(e < n_exp, base, -1)

    @gluon.jit
    def _pk_of(base):
        """PK 2 (per expert): a pool offset `base` (not -1) -> (pk, the offset): pk = its bit 0, set by ExpertCache on
        a packed VRAM slot (mma_pack's layout; every real offset is even: slots are 4 KiB-aligned, host offsets
        differences of aligned addresses), cleared from the offset."""
        pk = base & 1
        return pk, base - pk

    @gluon.jit
    def _rows_of(off_ptr, rows_ptr, e, mb, j, BM: gl.constexpr):
        """triton_moe._rows_of for positions j (any layout; row j % BM of block mb of expert e): (sorted-row
        indices, their mask, their token*k+rank values int64)."""
        rows = gl.load(off_ptr + e) + mb * BM + j % BM
        mr = rows < gl.load(off_ptr + e + 1)
        return rows, mr, gl.load(rows_ptr + rows, mask=mr, other=0).to(gl.int64)

    @gluon.jit
    def _part_rows(base, starts_ptr, e, part: gl.constexpr, n, row_bytes, ALIGNED: gl.constexpr,
                   RA: gl.constexpr):
        """triton_moe._part_rows: byte addresses [BN] int64 of rows n of part `part` (gate 0, up 1, down 2)."""
        b = base + gl.load(starts_ptr + e * 3 + part)
        if ALIGNED:
            b = gl.multiple_of(b, 16)
        r = b + n.to(gl.int64) * row_bytes
        if ALIGNED:
            r = gl.multiple_of(r, RA)
        return r

    @gluon.jit
    def _pk_rows(r, n, row_bytes, SC: gl.constexpr, QT: gl.constexpr):
        """PK: _part_rows' GGUF row addresses r [R] of part rows n (same layout) -> mma_pack's, in the K step (Q4_K:
        super-block) 0 of the row's 64-row tile (tile-major: the tile's bytes where GGUF had them). Q8_0: the row's
        quant words (SC False: 16-byte aligned) or its scale word (SC True); Q4_K: its header (SC True) or its
        half-warp's 16-byte pieces of group 0 (SC False: rows n and n + 8 alike, the half h a piece's 8 bytes);
        MXFP4: its two scale bytes (SC True) or its lane-quads' 16-byte pieces (SC False: rows n and n + 8 alike)."""
        i = n % 64
        if QT == 5:
            if SC:
                o = 16 * i
            else:
                o = 1024 + 512 * (i // 16) + 64 * (i % 8)
        elif QT == 4:
            if SC:
                o = 2048 + 2 * i
            else:
                o = 512 * (i // 16) + 64 * (i % 8)
        elif SC:
            o = 4096 + 4 * i
        else:
            o = 1024 * (i // 16) + 512 * ((i // 8) % 2) + 64 * (i % 8)
        return gl.multiple_of(r + (o - i * row_bytes).to(gl.int64), (2 if QT == 4 else 4) if SC and QT != 5 else 16)

    @gluon.jit
    def _perm(p):
        """triton_mmq._perm: MXFP4's element order in the bf16 MMA's tiles, position 32 a + 8 w + 2 c + h holds
        element 32 a + 16 h + 4 w + c (a thread's k pair (2 c', 2 c' + 1): the two nibbles of one byte)."""
        r = p % 32
        return (p // 32) * 32 + (r % 2) * 16 + (r // 8) * 4 + (r % 8) // 2

    @gluon.jit
    def _e8m0(e8):
        """MXFP4's E8M0 scale bytes e8 (int32, 0..255) -> 2^(e - 128) float32 (ggml_e8m0_to_fp32_half, as
        triton_mmq._w_scale): a subnormal below e 2, else the exponent field e - 1."""
        return gl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _e2m1x8(w):
        """MXFP4 nibble words w (int32: byte i = a k pair, its low nibble's code at k 2 p, the high's at 2 p + 1) ->
        4 int32 (o_i: byte i's two values as bf16x2, low half the low nibble's), llama.cpp's kvalues_mxfp4 (the doubled
        e2m1 values 0 1 2 3 4 6 8 12, code bit 3 the sign), exactly, by PTX (17 instructions for 8 codes; the
        compiler's shift table, select and int8 -> bf16 took ~80: cpu-mxpk63):
          * prmt looks 4 codes up at once (selector nibbles: the word's low 16 bits, then its high 16) in the 8-byte
            magnitude table; a selector with bit 3 set gives the sign of its table byte (0x00: every magnitude < 128),
            so the code c itself gives P = mag(c) for c < 8, else 0, and c ^ 8 gives N = mag(c & 7) for c >= 8, else 0;
          * D = P + 0x40404040 - N: the bytes 64 + value (52 .. 76, no borrows), one integer add a 4 codes;
          * prmt spreads 2 bytes of D under 0x43 (bf16 0x43XX is 128 + XX for XX < 128: 192 + value), one sub.bf16x2
            of 192 gives the value (integers below 256, exact; a zero code +0, as the int8 -> bf16 of 0)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, k, c, x, wh, xh, p, n, d0, d1, a;
            mov.b32 t0, 0x03020100;
            mov.b32 t1, 0x0C080604;
            mov.b32 k, 0x43434343;
            mov.b32 c, 0x43404340;
            xor.b32 x, $4, 0x88888888;
            shr.u32 wh, $4, 16;
            shr.u32 xh, x, 16;
            prmt.b32 p, t0, t1, $4;
            prmt.b32 n, t0, t1, x;
            add.u32 d0, p, 0x40404040;
            sub.u32 d0, d0, n;
            prmt.b32 p, t0, t1, wh;
            prmt.b32 n, t0, t1, xh;
            add.u32 d1, p, 0x40404040;
            sub.u32 d1, d1, n;
            prmt.b32 a, d0, k, 0x4140;
            sub.rn.bf16x2 $0, a, c;
            prmt.b32 a, d0, k, 0x4342;
            sub.rn.bf16x2 $1, a, c;
            prmt.b32 a, d1, k, 0x4140;
            sub.rn.bf16x2 $2, a, c;
            prmt.b32 a, d1, k, 0x4342;
            sub.rn.bf16x2 $3, a, c;
            }""", "=r,=r,=r,=r,r", [w], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _mx_a(w):
        """MXFP4's nibble words w [R, KB*4] int32 (column 2 b + jh: byte i is row n's step byte p = b + 4 (4 jh + i),
        AL's k pair (2 p, 2 p + 1) under _perm) -> the weights [R, KB*32] bf16 in AL: the low nibble's doubled e2m1
        value at k 2 p, the high's at 2 p + 1 (_e2m1x8; the rest register moves: each thread's words are its own
        pairs, b = t % 4)."""
        R: gl.constexpr = w.shape[0]
        o0, o1, o2, o3 = _e2m1x8(w)
        v = gl.join(gl.join(o0, o2), gl.join(o1, o3))              # [R, 8, 2, 2]: [.., x, y] = byte 2 x + y
        v = gl.permute(gl.reshape(v, [R, 4, 2, 4]), [0, 2, 3, 1])   # [R, b, jh, i] -> [R, jh, i, b]: pair 4 j + b
        return gl.convert_layout(_bf16x2(gl.reshape(v, [R, 32]), R), AL)

    @gluon.jit
    def _mx_words(v):
        """GGUF order: _fetch's nibble bytes v [R, KB*16] int32 (column p: a row's step byte p) -> _mx_a's words
        [R, KB*4] (column 2 b + jh: bytes p = b + 4 (4 jh + i), i = 0 .. 3), by register moves and 3 prmt a word."""
        R: gl.constexpr = v.shape[0]
        v = gl.reshape(gl.permute(gl.reshape(v, [R, 2, 4, 4]), [0, 3, 1, 2]), [R, 8, 2, 2])   # [R, b, jh, i]
        v02, v13 = gl.split(v)                                      # i = 2 x + y: y = 0 | 1
        b0, b2 = gl.split(v02)
        b1, b3 = gl.split(v13)
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 l, h;
            prmt.b32 l, $1, $2, 0x5140;
            prmt.b32 h, $3, $4, 0x5140;
            prmt.b32 $0, l, h, 0x5410;
            }""", "=r,r,r,r,r", [b0, b1, b2, b3], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _mx_x_load(xq_ptr, jo, jm, kb0, KB: gl.constexpr):
        """MXFP4's B tile of K step kb0 in element order (XE): column j = i*BM + m holds activation row m's block
        kb0 + i (element offsets jo, mask jm) at rows 32 i .. 32 i + 31, zeros elsewhere."""
        e = gl.arange(0, KB * 32, layout=gl.SliceLayout(1, XE))
        jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(0, XE)) // (jo.shape[0] // KB)
        m2 = gl.convert_layout(jm, gl.SliceLayout(0, XE))[None, :] & (jb[None, :] == (e // 32)[:, None])
        return gl.load(xq_ptr + gl.convert_layout(jo, gl.SliceLayout(0, XE))[None, :] + kb0 * 32 + e[:, None], mask=m2,
                       other=0.0)

    @gluon.jit
    def _mx_x_words(xq_ptr, jo, jm, kb0, KB: gl.constexpr):
        """GP >= 1: _mx_x_load's tile as int32 words [KB*BM, KB*32] (XW: row j, word u = elements 2 u, 2 u + 1), the
        bf16 pairs as loaded (64-bit loads), carried untouched to the step that uses them."""
        u = gl.arange(0, KB * 16, layout=gl.SliceLayout(0, XW))
        jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(1, XW)) // (jo.shape[0] // KB)
        m2 = gl.convert_layout(jm, gl.SliceLayout(1, XW))[:, None] & (jb[:, None] == (u // 16)[None, :])
        xw = xq_ptr.to(gl.pointer_type(gl.int32))
        return gl.load(xw + (gl.convert_layout(jo, gl.SliceLayout(1, XW))[:, None] + kb0 * 32) // 2 + u[None, :],
                       mask=m2, other=0)

    @gluon.jit
    def _mx_x_perm(x):
        """_mx_x_load's tile -> the B tile in BL in _perm's positions (position 32 a + 8 w + 2 c + h: element 32 a +
        16 h + 4 w + c; triton_mmq._bd_tile's values), by register moves (the same elements in the same threads)."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        x = gl.permute(gl.reshape(x, [R // 32, 2, 4, 4, C]), [0, 2, 3, 1, 4])     # [a, h, w, c] -> [a, w, c, h]
        return gl.convert_layout(gl.reshape(x, [R, C]), BL)

    @gluon.jit
    def _mx_pk_load(pool, ra, mn, rc, mc, kb0):
        """PK (MXFP4): K step kb0 .. kb0 + 1's loads from mma_pack's layout (the step at byte kb0 / 2 x 2176 of the
        rows' tile): (the nibble words [R / 2, 16] int32 (MW) at _half_rows' pieces ra (mask mn), one 128-bit load a
        thread and 64-row tile; the scale bytes of blocks kb0 (low) and kb0 + 1 (high) of rows rc (mask mc), one 16-bit
        load a row, zero-extended into an int32 by the load (_ld_u16))."""
        pw, mw = _pk_ptrs(pool, ra, mn, _pk_step(kb0, 4))
        return gl.load(pw, mask=mw, other=0), _ld_u16(pool + rc + kb0 * 1088, mc)

    @gluon.jit
    def _pk_step(kb0, QT: gl.constexpr):
        """PK (MXFP4, Q4_K): the byte offset of K step kb0 .. kb0 + 1 (kb0 even) from its 64-row tile's first in
        mma_pack's layout: MXFP4 kb0 / 2 x 2176; Q4_K super-block kb0 // 8 (9216 bytes) and its 32-byte group
        (kb0 // 2) % 4 (2048 bytes of pairs a tile)."""
        if QT == 4:
            o = kb0 * 1088
        else:
            o = (kb0 >> 3) * 9216 + ((kb0 >> 1) & 3) * 2048
        return o

    @gluon.jit
    def _pk_ptrs(pool, ra, mn, off):
        """PK (MXFP4, Q4_K): the int32 word pointers [R / 2, 16] (MW / MW2: a thread's 16 contiguous bytes of a
        64-row tile) at byte off of _half_rows' pieces ra, and their mask (mn's rows): one 128-bit load (or 16-byte
        cp.async) a thread and tile."""
        if ra.shape[0] == 32:
            LW: gl.constexpr = MW
        else:
            LW: gl.constexpr = MW2
        u = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
        # the 16-byte hint on the add (after the convert: Triton 3.6 loses one on it)
        a = gl.multiple_of(gl.convert_layout(ra, gl.SliceLayout(1, LW)) + off, 16)
        pw = (pool + a).to(gl.pointer_type(gl.int32))
        mw = gl.convert_layout(mn, gl.SliceLayout(1, LW))
        return pw[:, None] + u[None, :], gl.broadcast(mw[:, None], u[None, :])[0]

    @gluon.jit
    def _ring_fill(ring, pool, ra, mn, kb, b1, QT: gl.constexpr, KB: gl.constexpr):
        """ST: K step kb's weight words (_pk_ptrs', masked off past b1) copied into ring slot (kb / KB) % slots by
        cp.async (16 bytes a thread), committed as one group (a group a step, empty past b1: the wait counts
        stay uniform). Slots >= ST: the slot is none of the ST - 2 steps still in flight nor the step being read."""
        pw, mw = _pk_ptrs(pool, ra, mn & (kb < b1), _pk_step(kb, QT))
        _cp_async(ring.index((kb // KB) % ring.shape[0]), pw, mw)
        async_copy.commit_group()

    @gluon.jit
    def _ring_read(ring, kb, KB: gl.constexpr, ST: gl.constexpr):
        """ST: K step kb's weight words [R / 2, 16] from its ring slot into registers (MW / MW2, LDS.128), once
        this thread's copy of them has landed (at most ST - 2 younger groups still in flight: the steps after it)."""
        async_copy.wait_group(ST - 2)
        if ring.shape[1] == 32:
            LW: gl.constexpr = MW
        else:
            LW: gl.constexpr = MW2
        return ring.index((kb // KB) % ring.shape[0]).load(LW)

    @gluon.jit
    def _mx_pk_words(w):
        """_mx_pk_load's words [R / 2, 16] -> _mx_a's words [R, 8] (column 2 b + jh: row n's step bytes b + 4 (4 jh +
        i)), by register moves: word u = 4 b + 2 h + jh of row q holds bytes 8 h + 4 jh + i of lane-quad b's piece,
        [n // 16, n % 8, b, h, jh] -> [n // 16, h, n % 8, b, jh] (row 16 (n // 16) + 8 h + n % 8)."""
        R: gl.constexpr = 2 * w.shape[0]
        return gl.reshape(gl.permute(gl.reshape(w, [R // 16, 8, 4, 2, 2]), [0, 3, 1, 2, 4]), [R, 8])

    @gluon.jit
    def _scale(pool, rc, mc, kb, QT: gl.constexpr):
        """Block kb's weight scale d [BN] float32 of rows rc (mask mc): Q8_0's f16 d, MXFP4's 2^(e - 128) of its E8M0
        byte (ggml_e8m0_to_fp32_half, as triton_mmq._w_scale)."""
        if QT == 0:
            d = gl.load((pool + rc + kb * 34).to(gl.pointer_type(gl.float16)), mask=mc, other=0).to(gl.float32)
        else:
            d = _e8m0(gl.load(pool + rc + kb * 17, mask=mc, other=0).to(gl.int32))
        return d

    @gluon.jit
    def _fetch(pool, ra, mn, rc, mc, xq_ptr, jo, jm, kb0, QT: gl.constexpr, KB: gl.constexpr, PK: gl.constexpr):
        """K step kb0 .. kb0 + KB: (the weights [BN, KB*32] bf16 in AL of rows ra (mask mn): column c = block
        kb0 + c // 32's element c % 32 (Q8_0: the int8 at byte 34 kb + 2 + e) or element _perm(c) % 32 (MXFP4: the
        doubled e2m1 value of the nibble (e // 16) of byte 17 kb + 1 + e % 16) -- triton_mmq._w_tile's values; the
        scales d [BN] float32 of blocks kb0 and kb0 + 1 of rows rc (mask mc, ACC's rows); the B tile [KB*32, KB*BM]
        bf16 in BL: column j = i*BM + m holds activation row m's block kb0 + i (element offsets jo, mask jm) at rows
        32 i .. 32 i + 31 (MXFP4: element _perm(k), loaded in element order by _mx_x_load, but for FUSE's 128 rows),
        zeros elsewhere -- triton_mmq._bd_tile's values). PK (MXFP4):
        the same values from mma_pack's layout (_mx_pk_load: ra / mn _half_rows' pieces, rc the rows' scale bytes)."""
        c = gl.arange(0, KB * 32, layout=gl.SliceLayout(0, AL))
        if QT == 0:
            w = gl.load(pool + ra[:, None] + ((kb0 + c // 32) * 34 + 2 + c % 32)[None, :], mask=mn[:, None], other=0)
            wb = w.to(gl.int8, bitcast=True).to(gl.bfloat16)
        elif PK:                    # MXFP4 packed: a thread's bytes of a tile one 128-bit load, a row's scales one
            w, sc = _mx_pk_load(pool, ra, mn, rc, mc, kb0)
            wb = _mx_a(_mx_pk_words(w))
        else:                       # a thread's k pair (c, c + 1), c even: the low and high nibble of one byte
            p = _perm(c)
            o = gl.broadcast(ra[:, None], ((kb0 + p // 32) * 17 + 1 + p % 16)[None, :])
            o = o[0] + o[1]                                            # [BN, KB*32] byte offsets, pairs equal
            m = gl.broadcast(mn[:, None], o)[0]
            o1, o2 = gl.split(gl.reshape(o, [o.shape[0], KB * 16, 2]))    # one byte a pair (register moves)
            m1, m2 = gl.split(gl.reshape(m, [o.shape[0], KB * 16, 2]))
            wb = _mx_a(_mx_words(gl.load(pool + o1, mask=m1, other=0).to(gl.int32)))    # [BN, KB*16] bytes
        if QT == 4 and PK:
            d0 = _e8m0(sc & 255)
            d1 = _e8m0(sc >> 8)
        else:
            d0 = _scale(pool, rc, mc, kb0, QT)
            d1 = _scale(pool, rc, mc, kb0 + 1, QT)
        if QT == 4 and rc.shape[0] == 64:         # MXFP4's B tile as 4 runs of 4 elements (cpu-mxlut63), but
            x = _mx_x_perm(_mx_x_load(xq_ptr, jo, jm, kb0, KB))     # for FUSE's 128 rows: there its registers
        else:                                       # rose from 168 to 176 (the 1-row gate_up: 2 CTAs a SM, not 3)
            k = gl.arange(0, KB * 32, layout=gl.SliceLayout(1, BL))
            jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(0, BL)) // (jo.shape[0] // KB)
            m2 = jm[None, :] & (jb[None, :] == (k // 32)[:, None])
            if QT == 4:
                k = _perm(k)
            x = gl.load(xq_ptr + jo[None, :] + kb0 * 32 + k[:, None], mask=m2, other=0.0)
        return wb, d0, d1, x

    # GP >= 1's loads (_load_raw): each a 32-bit register as loaded (16-bit loads zero-extended by the load itself),
    # carried across steps untouched -- a narrower value carried is packed or sign-extended by the compiler in the step
    # that loads it, which waits for the load there (cpu-gluon16r57: GP 1 with the bytes carried as int8 did so)
    # Q8_0's weight pairs [R, 16 KB] (pair p: the int8s 2 (p % 16), + 1 of block p // 16) as AL's k pairs: thread t
    # holds pairs t % 4 + 4 j of rows t / 4 and t / 4 + 8 of its warp's 16 (AL, k_width 2: k = 2 (t % 4) + 8 j, + 1)
    PL = gl.constexpr(gl.DistributedLinearLayout([[8, 0], [0, 4], [0, 8], [0, 16]],
                                                 [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                                 [64, 32]))
    PL2 = gl.constexpr(gl.DistributedLinearLayout([[8, 0], [0, 4], [0, 8], [0, 16], [64, 0]],
                                                  [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                                  [128, 32]))
    # PK 1's quant words [R, 16] int32 of a K step (mma_pack's layout): word c = 4 b + a of row n holds pairs 8 a + b
    # (low 16 bits) and 8 a + b + 4 (high); thread t holds words 4 (t % 4) .. + 3 (16 contiguous bytes: one 128-bit
    # load) of rows t / 4 and t / 4 + 8 of its warp's 16 -- PL's pairs of the same rows; R 128: rows + 64 too
    PW = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                 [[16, 0], [32, 0]], [], [64, 16]))
    PW2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0], [64, 0]],
                                                  [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [],
                                                  [128, 16]))
    # the B tile as int32 words [KB*16, KB*BM] (word w of a column: its bf16 k = 2 w, 2 w + 1): 4 consecutive words
    # (16 bytes, one 128-bit load) a thread, BL's elements
    BW = gl.constexpr(gl.BlockedLayout([4, 1], [8, 4], [1, 4], [0, 1]))

    @gluon.jit
    def _ld_u16(ptr, mask):
        """The 16 bits at byte pointers ptr (2-byte aligned; 0 where mask is False) zero-extended into an int32, by
        PTX: one 16-bit load straight into a 32-bit register, opaque to the compiler (a gl.load of uint16 is an i16
        value, which the compiler extends, narrows or packs in the step that loads it, waiting for it there:
        cpu-gluon16r57)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.ne.b32 p, $2, 0;
            mov.b32 $0, 0;
            @p ld.global.u16 $0, [$1];
            }""", "=r,l,r", [ptr, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _x_words(xq_ptr, jo, jm, kb0, KB: gl.constexpr):
        """GP >= 1 (Q8_0, Q4_K): _fetch's B tile of K step kb0 as int32 words [KB*16, KB*BM] (BW: word w of column j =
        its bf16 k 2 w, 2 w + 1; 128-bit loads), carried as loaded to the step that uses them (_x_bf16)."""
        kw = gl.arange(0, KB * 16, layout=gl.SliceLayout(1, BW))
        jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(0, BW)) // (jo.shape[0] // KB)
        jw = gl.convert_layout(jo, gl.SliceLayout(0, BW))
        jmw = gl.convert_layout(jm, gl.SliceLayout(0, BW))
        m2 = jmw[None, :] & (jb[None, :] == (kw // 16)[:, None])
        xw = xq_ptr.to(gl.pointer_type(gl.int32))               # the bf16 activations as words
        return gl.load(xw + (jw[None, :] + kb0 * 32) // 2 + kw[:, None], mask=m2, other=0)

    @gluon.jit
    def _x_bf16(x):
        """_x_words' words -> _fetch's B tile [KB*32, KB*BM] bf16 in BL (register moves)."""
        xl = _lo_bf16(x)                                         # word w's k 2 w, then 2 w + 1
        xh = _lo_bf16(x >> 16)
        xb = gl.reshape(gl.permute(gl.join(xl, xh), [0, 2, 1]), [2 * x.shape[0], x.shape[1]])
        return gl.convert_layout(xb, BL)

    @gluon.jit
    def _load_raw(pool, ra, mn, rc, mc, xq_ptr, jo, jm, kb0, QT: gl.constexpr, KB: gl.constexpr, PK: gl.constexpr,
                  WL: gl.constexpr = True):
        """GP >= 1: K step kb0 .. kb0 + KB's loads (_fetch's bytes), each an int32 as loaded: (the weights: Q8_0 the
        pairs [R, KB*16] (PL) of rows ra (mask mn), pair p at byte 34 (kb0 + p // 16) + 2 + 2 (p % 16); MXFP4
        _fetch's bytes [R, KB*16]; the scales' raw values of blocks kb0, kb0 + 1 of rows rc (mask mc): Q8_0 the f16
        bits, MXFP4 the E8M0 byte; the B tile: Q8_0 as words [KB*16, KB*BM] (BW) of _fetch's tile, MXFP4 as words
        [KB*BM, KB*16] in element order (_mx_x_words: 64-bit loads)). PK (Q8_0): the weights as mma_pack's words
        [R, 16] (PW) of the step, at byte kb0 / 2 x 4352 from the rows' _pk_rows addresses ra (128-bit loads); r0 = r1
        their scale words at rc's (block kb0's f16 d in the low 16 bits, kb0 + 1's in the high). PK (MXFP4):
        _mx_pk_load's words [R / 2, 16] and r0 = r1 the rows' two scale bytes (kb0's low); WL False (ST): the scale
        bytes alone (w 0: the ring holds the words)."""
        R: gl.constexpr = ra.shape[0]
        if QT == 0:
            if PK:
                if R == 64:
                    LW: gl.constexpr = PW
                else:
                    LW: gl.constexpr = PW2
                st = kb0 * 2176                     # the step's bytes from the tile's first (kb0 even: kb0 / 2 x 4352)
                c = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
                pw = (pool + gl.convert_layout(ra, gl.SliceLayout(1, LW)) + st).to(gl.pointer_type(gl.int32))
                mp = gl.convert_layout(mn, gl.SliceLayout(1, LW))
                w = gl.load(pw[:, None] + c[None, :], mask=gl.broadcast(mp[:, None], c[None, :])[0], other=0)
                r0 = gl.load((pool + rc + st).to(gl.pointer_type(gl.int32)), mask=mc, other=0)
                r1 = r0
            else:
                if R == 64:
                    LP: gl.constexpr = PL
                else:
                    LP: gl.constexpr = PL2
                pp = gl.arange(0, KB * 16, layout=gl.SliceLayout(0, LP))
                rp = gl.convert_layout(ra, gl.SliceLayout(1, LP))
                o = rp[:, None] + ((kb0 + pp // 16) * 34 + 2 + (pp % 16) * 2)[None, :]
                mp = gl.convert_layout(mn, gl.SliceLayout(1, LP))
                w = _ld_u16(pool + o, gl.broadcast(mp[:, None], o)[0])
                r0 = _ld_u16(pool + rc + kb0 * 34, mc)
                r1 = _ld_u16(pool + rc + kb0 * 34 + 34, mc)
            x = _x_words(xq_ptr, jo, jm, kb0, KB)
        else:
            if PK and WL:
                w, r0 = _mx_pk_load(pool, ra, mn, rc, mc, kb0)
                r1 = r0
            elif PK:
                w = 0
                r0 = _ld_u16(pool + rc + kb0 * 1088, mc)
                r1 = r0
            else:
                c = gl.arange(0, KB * 32, layout=gl.SliceLayout(0, AL))
                p = _perm(c)
                o = gl.broadcast(ra[:, None], ((kb0 + p // 32) * 17 + 1 + p % 16)[None, :])
                o = o[0] + o[1]
                m = gl.broadcast(mn[:, None], o)[0]
                o1, o2 = gl.split(gl.reshape(o, [o.shape[0], KB * 16, 2]))
                m1, m2 = gl.split(gl.reshape(m, [o.shape[0], KB * 16, 2]))
                w = gl.load(pool + o1, mask=m1, other=0).to(gl.int32)
                r0 = gl.load(pool + rc + kb0 * 17, mask=mc, other=0).to(gl.int32)
                r1 = gl.load(pool + rc + kb0 * 17 + 17, mask=mc, other=0).to(gl.int32)
            x = _mx_x_words(xq_ptr, jo, jm, kb0, KB)
        return w, r0, r1, x

    @gluon.jit
    def _q8_bf16x2(w):
        """int32 w holding two int8 in its low 16 bits (b0 | b1 << 8, zero-extended) -> their bf16 values as bf16x2 in
        an int32 (low half b0's), exactly, by PTX (the compiler's own int8 -> bf16 of the same values): prmt makes
        0x43 b1 0x43 b0 (bf16 128 + (b & 127) | the byte's sign bit as the exponent's low bit), then (t & 0xff7fff7f)
        - (t & 0xff80ff80) = (128 + (b & 127)) - (128 or 256) = the int8, exact in bf16. Opaque to the compiler, so it
        is not moved into the step that loads w (a conversion written in Triton ops was: cpu-gluon16r57)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t, a, b;
            prmt.b32 t, $1, 0x43, 0x4140;
            and.b32 a, t, 0xff7fff7f;
            and.b32 b, t, 0xff80ff80;
            sub.rn.bf16x2 $0, a, b;
            }""", "=r,r", [w], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _f16_asm(bits):
        """_f16 (float32 of the f16 in the low 16 bits of int32 bits, exact) by PTX: opaque to the compiler, which
        otherwise narrows and packs the loaded scales in the step that loads them (cpu-gluon16r57)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b16 h;
            cvt.u16.u32 h, $1;
            cvt.f32.f16 $0, h;
            }""", "=f,r", [bits], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _lo_bf16(v):
        """The int32 v's low 16 bits as a bf16 (a bitcast)."""
        return (v & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _conv_raw(w, r0, r1, x, QT: gl.constexpr, KB: gl.constexpr, PK: gl.constexpr):
        """_load_raw's values -> _fetch's: (the weights [R, KB*32] bf16 in AL, d0, d1 [R] float32, the B tile
        [KB*32, KB*BM] bf16) -- the same values (Q8_0: int8 -> bf16 of each byte of a pair, the f16 scale exactly
        to float32; MXFP4: _fetch's decode of the bytes packed into words, or PK's words)."""
        R: gl.constexpr = w.shape[0]
        if QT == 0:
            if PK:                                      # word c = 4 b + a: pairs 8 a + b (low half) and + 4 (high)
                lo = _q8_bf16x2(w)
                hi = _q8_bf16x2(w >> 16)
                v = gl.join(gl.join(_lo_bf16(lo), _lo_bf16(lo >> 16)), gl.join(_lo_bf16(hi), _lo_bf16(hi >> 16)))
                v = gl.permute(gl.reshape(v, [R, 4, 4, 2, 2]), [0, 2, 4, 1, 3])    # [R, a, h, b, i]: the step's
                wb = gl.convert_layout(gl.reshape(v, [R, KB * 32]), AL)          # k = 16 a + 8 h + 2 b + i
                d0 = _f16_asm(r0)
                d1 = _f16_asm(r1 >> 16)
            else:
                v = _q8_bf16x2(w)                       # low half: the pair's low byte (k 2 (p % 16)), high: k + 1
                wb = gl.convert_layout(gl.reshape(gl.join(_lo_bf16(v), _lo_bf16(v >> 16)), [R, KB * 32]), AL)
                d0 = _f16_asm(r0)
                d1 = _f16_asm(r1)
            xb = _x_bf16(x)
        elif PK:                                        # MXFP4 packed: the words, the scale bytes' halves
            wb = _mx_a(_mx_pk_words(w))
            d0 = _e8m0(r0 & 255)
            d1 = _e8m0(r1 >> 8)
            xb = _mx_x_perm(gl.permute(_bf16x2(x, x.shape[0]), [1, 0]))
        else:
            wb = _mx_a(_mx_words(w))
            d0 = _e8m0(r0)
            d1 = _e8m0(r1)
            xb = _mx_x_perm(gl.permute(_bf16x2(x, x.shape[0]), [1, 0]))
        return wb, d0, d1, xb

    @gluon.jit
    def _mma_acc(acc, z, wb, xs, d0, d1, BN: gl.constexpr, BM: gl.constexpr, KB: gl.constexpr):
        """A K step's MMA (wb [BN, KB*32] in wgmma's A registers, xs the B tile in shared memory) and its two blocks'
        scale fmas into acc, ascending (triton_mmq._mmq_step's float ops): every GP form's step ends here."""
        hopper.fence_async_shared()
        dot = hopper.warpgroup_mma(wb, xs, z, use_acc=False, is_async=True)
        dot = hopper.warpgroup_mma_wait(0, deps=[dot])
        p0, p1 = gl.split(gl.permute(gl.reshape(dot, [BN, KB, BM]), [0, 2, 1]))     # column i*BM + m -> pi
        p0 = gl.convert_layout(p0, ACC)
        p1 = gl.convert_layout(p1, ACC)
        acc = gl.fma(p0, gl.broadcast(d0[:, None], acc)[0], acc)                  # ascending blocks
        return gl.fma(p1, gl.broadcast(d1[:, None], acc)[0], acc)

    @gluon.jit
    def _step_raw(acc, z, w, r0, r1, x, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, kb0, b1,
                  QT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KB: gl.constexpr, AHEAD: gl.constexpr,
                  PK: gl.constexpr, ring=None, ST: gl.constexpr = 0):
        """GP >= 1's K step kb0 on a set of loads (w, r0, r1, x: _load_raw's of step kb0; Q4_K: _load_raw_k's pairs,
        headers, x sums, B tile): the set converted and its B tile stored to shared memory first, then step kb0 +
        AHEAD's loads issued into the same set (its registers free again: no copy between the loop's steps, which
        would wait for the loads), then the MMA and fmas (_mma_acc, Q4_K's _k_fma). (acc, the set of step kb0 +
        AHEAD). ST (PK, GP 1): the step's weight words read from the ring first (w: 0, carried unused) and step kb0 +
        (ST - 1) KB's copied into its slot (_ring_fill, beside the next set's loads)."""
        if ST:
            w = _ring_read(ring, kb0, KB, ST)
        if QT == 5:
            wb, dw0, t0, dw1, t1, xb = _conv_raw_k(w, r0, r1, x, kb0, PK)
        else:
            wb, d0, d1, xb = _conv_raw(w, r0, r1, x, QT, KB, PK)
        xs = gl.allocate_shared_memory(gl.bfloat16, [KB * 32, KB * BM], SH, xb)
        more = kb0 + AHEAD < b1                     # masked off past b1
        if ST:
            _ring_fill(ring, pool, ra, mn, kb0 + (ST - 1) * KB, b1, QT, KB)
        if QT == 5:
            w, r0, r1, x = _load_raw_k(pool, ra, mn & more, rc, mc & more, xq_ptr, jo, jm & more, xs_ptr, so,
                                       sm & more, kb0 + AHEAD, KB, PK, ST == 0)
            hopper.fence_async_shared()
            dot = hopper.warpgroup_mma(wb, xs, z, use_acc=False, is_async=True)
            acc = _k_fma(acc, hopper.warpgroup_mma_wait(0, deps=[dot]), dw0, t0, dw1, t1, BN, BM, KB)
        else:
            w, r0, r1, x = _load_raw(pool, ra, mn & more, rc, mc & more, xq_ptr, jo, jm & more, kb0 + AHEAD, QT, KB,
                                     PK, ST == 0)
            acc = _mma_acc(acc, z, wb, xs, d0, d1, BN, BM, KB)
        return acc, w, r0, r1, x

    @gluon.jit
    def _load_any(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, kb0, QT: gl.constexpr, KB: gl.constexpr,
                  PK: gl.constexpr, WL: gl.constexpr = True):
        """GP >= 1's set of loads of K step kb0: _load_raw_k (Q4_K) or _load_raw (WL False: PK's words left out)."""
        if QT == 5:
            w, r0, r1, x = _load_raw_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, kb0, KB, PK, WL)
        else:
            w, r0, r1, x = _load_raw(pool, ra, mn, rc, mc, xq_ptr, jo, jm, kb0, QT, KB, PK, WL)
        return w, r0, r1, x

    @gluon.jit
    def _acc_part(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, b1, QT: gl.constexpr, BN: gl.constexpr,
                  BM: gl.constexpr, KB: gl.constexpr, GP: gl.constexpr, PK: gl.constexpr, ST: gl.constexpr = 0):
        """One part's partial [BN, BM] (ACC) over blocks b0 .. b1 (KB | b1 - b0), from zero: triton_mmq._mmq_step's
        float ops (module doc). BN: the rows of ra (gate_up's FUSE: 2 BN, gate's then up's, one MMA of M 128 = 2 x
        m64 a k16). GP (a schedule key: the same loads, conversions, MMA and float ops, only where they sit):
          0  the next step's loads issued before this step's MMA (triton_mmq's PF 1) and converted right there
             (_fetch; Q4_K's GP 0 is _acc_part_k): in the SASS every load of a step is consumed within the step that
             issues it (cpu-gluon16r57), so each step waits out a full memory latency;
          1  the next step's loads issued before this step's MMA, carried as loaded, converted in the step that uses
             them: a load has a whole step to land (Q4_K too: _load_raw_k, cpu-gpk63; xs_ptr / so / sm its x block
             sums, unused by Q8_0 / MXFP4);
          2  as 1, two steps ahead (two steps' bytes in flight a program: for grids of few programs a SM, the 16-row
             gate_up's 192 programs on 132 SMs).
        PK (a schedule key, Q8_0 with GP >= 1, MXFP4 and Q4_K at any GP): the weights in mma_pack's layout (ra / rc:
        _pk_rows' addresses; MXFP4's and Q4_K's pieces shared by rows n and n + 8: _half_rows, once a part).
        ST (a schedule key, 0 off; MXFP4 and Q4_K with PK and GP 1): the weight words of the next ST - 1 K steps in
        flight through a ring of shared memory slots (ST's power of two; cp.async: _ring_fill, _ring_read), the other
        loads of a step carried one step as GP 1's; the same words into the same decode, MMA and float ops
        (cpu-mxtma65)."""
        gl.static_assert(KB == 2)
        gl.static_assert(ST == 0 or (ST >= 2 and ST <= 8 and PK != 0 and QT != 0 and GP == 1))
        gl.static_assert(PK == 0 or QT != 0 or GP > 0)
        gl.static_assert(QT != 5 or GP > 0)
        acc = gl.zeros([BN, BM], gl.float32, ACC)
        z = gl.zeros([BN, KB * BM], gl.float32, MMA)
        if PK and QT != 0:
            ra = _half_rows(ra, QT)
            mn = _half_rows(mn, QT)
        if GP == 0:
            wb, d0, d1, x = _fetch(pool, ra, mn, rc, mc, xq_ptr, jo, jm, b0, QT, KB, PK)
            for kb0 in range(b0, b1, KB):
                more = kb0 + KB < b1                    # the next step's loads, masked off past b1
                wb2, e0, e1, x2 = _fetch(pool, ra, mn & more, rc, mc & more, xq_ptr, jo, jm & more, kb0 + KB, QT,
                                         KB, PK)
                xs = gl.allocate_shared_memory(gl.bfloat16, [KB * 32, KB * BM], SH, x)
                acc = _mma_acc(acc, z, wb, xs, d0, d1, BN, BM, KB)
                wb, d0, d1, x = wb2, e0, e1, x2
        else:                                           # GP 1: one set of loads in flight, GP 2: two (steps
            w, r0, r1, x = _load_any(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, QT, KB, PK,  # b0, b0 +
                                     ST == 0)
            if GP == 2:                                 # 2 KB, ..: set one; b0 + KB, b0 + 3 KB, ..: set two, masked
                m1 = b0 + KB < b1                       # off past b1)
                v, s0, s1, y = _load_any(pool, ra, mn & m1, rc, mc & m1, xq_ptr, jo, jm & m1, xs_ptr, so, sm & m1,
                                         b0 + KB, QT, KB, PK)
            if GP == 1 and ST:                          # the ring: steps b0 .. b0 + (ST - 2) KB's words first
                if ST <= 2:                             # slots: ST's power of two (a shared buffer's shape;
                    NS: gl.constexpr = 2                # the slot index a mask)
                elif ST <= 4:
                    NS: gl.constexpr = 4
                else:
                    NS: gl.constexpr = 8
                ring = gl.allocate_shared_memory(gl.int32, [NS, BN // 2, 16], RING)
                for i in gl.static_range(ST - 1):
                    _ring_fill(ring, pool, ra, mn, b0 + i * KB, b1, QT, KB)
                for kb0 in range(b0, b1, KB):
                    acc, w, r0, r1, x = _step_raw(acc, z, w, r0, r1, x, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr,
                                                  so, sm, kb0, b1, QT, BN, BM, KB, KB, PK, ring, ST)
                async_copy.wait_group(0)                # the last steps' (empty) groups, before the ring is freed
            elif GP == 1:
                for kb0 in range(b0, b1, KB):
                    acc, w, r0, r1, x = _step_raw(acc, z, w, r0, r1, x, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr,
                                                  so, sm, kb0, b1, QT, BN, BM, KB, KB, PK)
            else:                                       # pairs of steps (no branch in the loop: the sets' registers
                for kb0 in range(b0, b1 - KB, 2 * KB):  # stay put), then an odd count's last step on set one
                    acc, w, r0, r1, x = _step_raw(acc, z, w, r0, r1, x, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr,
                                                  so, sm, kb0, b1, QT, BN, BM, KB, 2 * KB, PK)
                    acc, v, s0, s1, y = _step_raw(acc, z, v, s0, s1, y, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr,
                                                  so, sm, kb0 + KB, b1, QT, BN, BM, KB, 2 * KB, PK)
                if (b1 - b0) // KB % 2 == 1:
                    acc, w, r0, r1, x = _step_raw(acc, z, w, r0, r1, x, pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr,
                                                  so, sm, b1 - KB, b1, QT, BN, BM, KB, 2 * KB, PK)
        return acc

    @gluon.jit
    def _f16(bits):
        """float32 of the f16 in the low 16 bits of int32 `bits` (triton_mmvq._half: exact)."""
        return (bits & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _k_scales(w1, w2, w3, j):
        """Q4_K sub-blocks j and j + 1 (j even)'s 6-bit (sc_j, m_j, sc_j+1, m_j+1) [R] int32 from their super-block's
        header words w1, w2, w3 (scales[0..3], [4..7], [8..11]): triton_quants.k_scale_min_of's values
        (get_scale_min_k4) -- c1, c2, c3 = byte j % 4 of w1, w2, w3; j < 4: c1 & 63, c2 & 63, else
        (c3 & 15) | (c1 >> 6) << 4, (c3 >> 4) | (c2 >> 6) << 4 -- the pair's bytes adjacent, the branch uniform (j is
        the K step's)."""
        sh = (j & 3) * 8                            # 0 or 16 (kb0 >= 0: bit ops, not a signed % and //)
        a = w1 >> sh
        b = w2 >> sh
        if j < 4:
            s0 = a & 63
            s1 = (a >> 8) & 63
            m0 = b & 63
            m1 = (b >> 8) & 63
        else:
            c = w3 >> sh
            s0 = (c & 15) | ((a >> 2) & 48)
            s1 = ((c >> 8) & 15) | ((a >> 10) & 48)
            m0 = ((c >> 4) & 15) | ((b >> 2) & 48)
            m1 = ((c >> 12) & 15) | ((b >> 10) & 48)
        return s0, m0, s1, m1

    @gluon.jit
    def _nibs_bf16(q):
        """uint16 byte pairs q [R, 16] (b0 | b1 << 8) -> (the low nibbles, the high nibbles) as bf16x2 in int32 (low
        half b0's, high half b1's), exactly 0..15, by PTX: prmt spreads the bytes to bits 0 and 16, and / or set the
        4 bits under the bf16 0x4300 (128: the nibble is then the low mantissa bits, 128 + n), one add.bf16x2 of -128
        (exact) a register: 6 instructions for 4 weights (the compiler's uint8 -> bf16 took ~11: cpu-gluonk57)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 x, y, c;
            mov.b32 c, 0xC300C300;
            cvt.u32.u16 x, $2;
            prmt.b32 x, x, 0, 0x4140;
            shr.b32 y, x, 4;
            lop3.b32 x, x, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 y, y, 0x000F000F, 0x43004300, 0xEA;
            add.rn.bf16x2 $0, x, c;
            add.rn.bf16x2 $1, y, c;
            }""", "=r,=r,h", [q], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _bf16x2(v, R: gl.constexpr):
        """int32 [R, C] holding bf16 pairs -> bf16 [R, 2 C] (element 2 p + h: half h of v[:, p]): register moves."""
        lo = (v & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (v >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.reshape(gl.join(lo, hi), [R, 2 * v.shape[1]])

    @gluon.jit
    def _half_rows(v, QT: gl.constexpr):
        """PK (Q4_K, MXFP4): [R] values of rows n (SliceLayout(1, AL)) -> [R / 2] those of rows n // 8 even (QZ's /
        MW's rows q = 8 (n // 16) + n % 8) in QZ's (Q4_K) or MW's (MXFP4) row slice: the packed pieces' addresses and
        masks, rows n and n + 8 alike."""
        R: gl.constexpr = v.shape[0]
        h0, h1 = gl.split(gl.permute(gl.reshape(v, [R // 16, 2, 8]), [0, 2, 1]))
        if QT == 4:
            if R == 64:
                LZ: gl.constexpr = MW
            else:
                LZ: gl.constexpr = MW2
        elif R == 64:
            LZ: gl.constexpr = QZ
        else:
            LZ: gl.constexpr = QZ2
        return gl.convert_layout(gl.reshape(h0, [R // 2]), gl.SliceLayout(1, LZ))

    @gluon.jit
    def _k_pk_pairs(z):
        """PK (Q4_K): a K step's byte pairs [R / 2, 32] as mma_pack's layout holds them (row q = 8 (n // 16) + n % 8,
        column m = 8 b + 4 h + j: pair b + 4 j of row n + 8 h; 16-bit values, any bits above ignored) -> QL's [R, 16]
        (pair p = 4 j + b of row n), by register moves (the same pairs in the same threads)."""
        R: gl.constexpr = 2 * z.shape[0]
        if R == 64:
            LQ: gl.constexpr = QL
        else:
            LQ: gl.constexpr = QL2
        z = gl.permute(gl.reshape(z, [R // 16, 8, 4, 2, 4]), [0, 3, 1, 4, 2])   # [n // 16, h, n % 8, j, b]
        q = gl.convert_layout(gl.reshape(z, [R, 16]), LQ)                       # [R, 16]: pair p = 4 j + b
        return q

    @gluon.jit
    def _k_a(q):
        """Q4_K: QL's byte pairs [R, 16] uint16 of a K step's 32-byte group -> its weights [R, 64] bf16 in AL: column
        c = nibble c // 32 of byte c % 32 (sub-blocks j, j + 1: the low nibbles, then the high), _nibs_bf16's."""
        R: gl.constexpr = q.shape[0]
        lo, hi = _nibs_bf16(q)
        w = gl.reshape(gl.permute(gl.join(_bf16x2(lo, R), _bf16x2(hi, R)), [0, 2, 1]), [R, 64])
        return gl.convert_layout(w, AL)             # column 32 i + e: block i (a register permutation: no data moves)

    @gluon.jit
    def _k_hdr(pool, rc, mc, hb):
        """Q4_K: the super-block headers [R, 4] int32 (f16 d | f16 dmin, scales[0..3], [4..7], [8..11]) at byte hb of
        rows rc (mask mc, ACC's rows), one 128-bit load a row (HL)."""
        R: gl.constexpr = rc.shape[0]
        if R == 64:
            LH: gl.constexpr = HL
        else:
            LH: gl.constexpr = HL2
        hp = (pool + gl.convert_layout(rc + hb, gl.SliceLayout(1, LH))).to(gl.pointer_type(gl.int32))
        hm = gl.convert_layout(mc, gl.SliceLayout(1, LH))
        hw = gl.arange(0, 4, layout=gl.SliceLayout(0, LH))
        return gl.load(hp[:, None] + hw[None, :], mask=gl.broadcast(hm[:, None], hw[None, :])[0], other=0)

    @gluon.jit
    def _k_words(hdr):
        """_k_hdr's [R, 4] -> its words w0, w1, w2, w3 [R] in ACC's rows (register moves: the same bases)."""
        R: gl.constexpr = hdr.shape[0]
        h02, h13 = gl.split(gl.reshape(hdr, [R, 2, 2]))             # words 0, 2 | 1, 3 (register moves)
        w0, w2 = gl.split(h02)
        w1, w3 = gl.split(h13)
        RL: gl.constexpr = gl.SliceLayout(1, ACC)
        return (gl.convert_layout(w0, RL), gl.convert_layout(w1, RL), gl.convert_layout(w2, RL),
                gl.convert_layout(w3, RL))

    @gluon.jit
    def _fetch_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, kb0, KB: gl.constexpr, PK: gl.constexpr):
        """Q4_K's K step kb0, kb0 + 1 (kb0 even: sub-blocks j = kb0 % 8 and j + 1 of super-block kb0 // 8, the low and
        the high nibbles of ONE 32-byte group, (kb0 % 8) // 2): (the weights [R, 64] bf16 in AL of rows ra (mask mn):
        column c = nibble c // 32 of byte 16 + 32 group + c % 32 -- triton_mmq._w_tile's values in its order, each
        byte pair loaded once (QL) for both blocks (_k_a); the header's word 0 (f16 d | f16 dmin) and both
        blocks' 6-bit sc, m [R] int32 (rows rc, mask mc, ACC's rows; the header one 16-byte load a row, _k_hdr); the x
        block sums [BM] of both (at element offsets so, mask sm); the B tile as _fetch's (no _perm)). PK (mma_pack's
        layout): ra / mn are _half_rows' [R / 2] of the rows' _pk_rows pieces, the pairs loaded as QZ's [R / 2, 32]
        (128-bit loads) and moved to QL's [R, 16] (_k_pk_pairs); rc the rows' headers."""
        R: gl.constexpr = rc.shape[0]
        if R == 64:
            LQ: gl.constexpr = QL
            LZ: gl.constexpr = QZ
        else:
            LQ: gl.constexpr = QL2
            LZ: gl.constexpr = QZ2
        if PK:                                      # super-block kb0 // 8 of the tile, its group (kb0 // 2) % 4
            m = gl.arange(0, 32, layout=gl.SliceLayout(0, LZ))
            # the 16-byte hint on the add: Triton 3.6 loses one on _half_rows' convert (it folds), then loads 16 bits
            a = gl.multiple_of(ra + ((kb0 >> 3) * 9216 + ((kb0 >> 1) & 3) * 2048), 16)
            p = (pool + a).to(gl.pointer_type(gl.uint16))
            z = gl.load(p[:, None] + m[None, :], mask=gl.broadcast(mn[:, None], m[None, :])[0], other=0)
            q = _k_pk_pairs(z)
            hb = (kb0 >> 3) * 9216
        else:
            c = gl.arange(0, 16, layout=gl.SliceLayout(0, LQ))
            rq = gl.convert_layout(ra + ((kb0 >> 3) * 144 + 16 + ((kb0 >> 1) & 3) * 32), gl.SliceLayout(1, LQ))
            p = (pool + rq).to(gl.pointer_type(gl.uint16))[:, None] + c[None, :]       # a row's base, then pairs
            mq = gl.convert_layout(mn, gl.SliceLayout(1, LQ))
            q = gl.load(p, mask=gl.broadcast(mq[:, None], p)[0], other=0)             # [R, 16] uint16
            hb = (kb0 >> 3) * 144
        wb = _k_a(q)
        w0, w1, w2, w3 = _k_words(_k_hdr(pool, rc, mc, hb))
        sc0, m0, sc1, m1 = _k_scales(w1, w2, w3, kb0 & 7)
        s0 = gl.load(xs_ptr + so + kb0, mask=sm, other=0.0)
        s1 = gl.load(xs_ptr + so + kb0 + 1, mask=sm, other=0.0)
        k = gl.arange(0, KB * 32, layout=gl.SliceLayout(1, BL))
        jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(0, BL)) // (jo.shape[0] // KB)
        m2 = jm[None, :] & (jb[None, :] == (k // 32)[:, None])
        x = gl.load(xq_ptr + jo[None, :] + kb0 * 32 + k[:, None], mask=m2, other=0.0)
        return wb, w0, sc0, m0, sc1, m1, s0, s1, x

    @gluon.jit
    def _load_raw_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, kb0, KB: gl.constexpr, PK: gl.constexpr,
                    WL: gl.constexpr = True):
        """GP >= 1 (Q4_K): _fetch_k's loads of K step kb0, each an int32 / float32 as loaded: (the pairs: GGUF order
        QL's [R, 16], one 16-bit load a pair zero-extended (_ld_u16); PK mma_pack's words [R / 2, 16] (MW: a
        thread's 16 contiguous bytes of a 64-row tile, one 128-bit load; word u = pairs m = 2 u (low half), 2 u + 1 of
        QZ's columns) at _half_rows' pieces ra; the headers [R, 4] (_k_hdr); the x block sums of both blocks, joined
        [BM, 2]; the B tile as _x_words). WL False (ST): PK's words not loaded (w 0: the ring holds them)."""
        R: gl.constexpr = rc.shape[0]
        if PK:
            if WL:
                pw, mw = _pk_ptrs(pool, ra, mn, _pk_step(kb0, 5))
                w = gl.load(pw, mask=mw, other=0)
            else:                                   # ST: the words come through the ring (_ring_fill)
                w = 0
            hb = (kb0 >> 3) * 9216
        else:
            if R == 64:
                LQ: gl.constexpr = QL
            else:
                LQ: gl.constexpr = QL2
            c = gl.arange(0, 16, layout=gl.SliceLayout(0, LQ))
            rq = gl.convert_layout(ra + ((kb0 >> 3) * 144 + 16 + ((kb0 >> 1) & 3) * 32), gl.SliceLayout(1, LQ))
            o = rq[:, None] + 2 * c[None, :]                            # byte offsets of the pairs
            mq = gl.convert_layout(mn, gl.SliceLayout(1, LQ))
            w = _ld_u16(pool + o, gl.broadcast(mq[:, None], o)[0])
            hb = (kb0 >> 3) * 144
        ps = xs_ptr + so + kb0                      # both blocks' sums as one [BM, 2] load (joined pointers: a
        s = gl.load(gl.join(ps, ps + 1), mask=gl.join(sm, sm), other=0.0)    # join of loaded values is copied by 3.6)
        return w, _k_hdr(pool, rc, mc, hb), s, _x_words(xq_ptr, jo, jm, kb0, KB)

    @gluon.jit
    def _conv_raw_k(w, hdr, s, x, kb0, PK: gl.constexpr):
        """_load_raw_k's values of K step kb0 -> (the weights [R, 64] bf16 in AL, _k_terms' dw0, t0, dw1, t1, the B
        tile bf16 in BL): _fetch_k's values (the pairs' low 16 bits; PK's words split into their halves and moved to
        QL's pairs by register moves) and the float ops GP 0 does beside the MMA (_k_terms), here before the next step's
        loads are issued into the same registers (a value of the set still live then would be copied at the loop's
        end, waiting for those loads)."""
        R: gl.constexpr = hdr.shape[0]
        if PK:                                      # word u's halves: QZ's columns 2 u, 2 u + 1
            q = _k_pk_pairs(gl.reshape(gl.join(w, w >> 16), [R // 2, 32]))
        else:
            q = w
        wb = _k_a(q.to(gl.uint16))
        w0, w1, w2, w3 = _k_words(hdr)
        sc0, m0, sc1, m1 = _k_scales(w1, w2, w3, kb0 & 7)
        s0, s1 = gl.split(s)
        SL: gl.constexpr = gl.SliceLayout(0, ACC)
        dw0, t0, dw1, t1 = _k_terms(_f16_asm(w0), _f16_asm(w0 >> 16), sc0, m0, sc1, m1,   # (PTX: not sunk past
                                    gl.convert_layout(s0, SL), gl.convert_layout(s1, SL), True)   # the loads)
        return wb, dw0, t0, dw1, t1, _x_bf16(x)

    @gluon.jit
    def _k_terms(d, dmin, c0, n0, c1, n1, s0, s1, PIN: gl.constexpr = False):
        """Q4_K's scale terms of a K step's two blocks (triton_mmq's K-quant float ops, as _wl_step's): dw_i = d sc_i
        and the min term t_i = -(dmin m_i * sx_i) [R, BM] (float32 products; d / dmin the header's f16 as float32,
        c / n the 6-bit sc / m [R], s the x block sums [BM]). PIN (GP >= 1): the min terms by _neg_mul, where they
        are written (Triton 3.6 otherwise sinks them past the next step's loads: the sums then copied, waited for)."""
        dw0 = d * c0.to(gl.float32)
        mw0 = dmin * n0.to(gl.float32)
        dw1 = d * c1.to(gl.float32)
        mw1 = dmin * n1.to(gl.float32)
        if PIN:
            t0 = _neg_mul(gl.broadcast(mw0[:, None], s0[None, :]))
            t1 = _neg_mul(gl.broadcast(mw1[:, None], s1[None, :]))
        else:
            t0 = -(mw0[:, None] * s0[None, :])
            t1 = -(mw1[:, None] * s1[None, :])
        return dw0, t0, dw1, t1

    @gluon.jit
    def _neg_mul(ab):
        """-(a * b) of float32 (a, b) (broadcast pairs) by PTX: Triton's own instructions for it (mul.f32, neg.f32),
        in an asm with side effects, which the compiler does not move (the same rounding: one mul)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .f32 t;
            mul.f32 t, $1, $2;
            neg.f32 $0, t;
            }""", "=f,f,f", [ab[0], ab[1]], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _k_fma(acc, dot, dw0, t0, dw1, t1, BN: gl.constexpr, BM: gl.constexpr, KB: gl.constexpr):
        """Q4_K's block sums into acc, ascending: acc + fma(dot_i, dw_i, t_i) (dot [BN, KB*BM] the MMA's, column
        i*BM + m block i's)."""
        p0, p1 = gl.split(gl.permute(gl.reshape(dot, [BN, KB, BM]), [0, 2, 1]))
        p0 = gl.convert_layout(p0, ACC)
        p1 = gl.convert_layout(p1, ACC)
        acc = acc + gl.fma(p0, gl.broadcast(dw0[:, None], acc)[0], t0)
        return acc + gl.fma(p1, gl.broadcast(dw1[:, None], acc)[0], t1)

    @gluon.jit
    def _acc_part_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, b1, BN: gl.constexpr, BM: gl.constexpr,
                    KB: gl.constexpr, PK: gl.constexpr):
        """_acc_part of Q4_K at GP 0 (_acc_part's GP 1 / 2 take Q4_K too): per block, acc + fma(dot, d sc, -(dmin m *
        sx)) in ascending order (_k_terms, _k_fma; sx: the x block sums, so / sm their offsets [BM] and mask in ACC's
        columns). PK (a schedule key): the weights in mma_pack's layout (ra / rc: _pk_rows' addresses; the loads
        alone differ, _fetch_k)."""
        gl.static_assert(KB == 2)
        acc = gl.zeros([BN, BM], gl.float32, ACC)
        z = gl.zeros([BN, KB * BM], gl.float32, MMA)
        if PK:                                      # the pieces' rows, once a part (_half_rows)
            ra = _half_rows(ra, 5)
            mn = _half_rows(mn, 5)
        wb, w0, c0, n0, c1, n1, s0, s1, x = _fetch_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, KB, PK)
        for kb0 in range(b0, b1, KB):
            more = kb0 + KB < b1
            wb2, v0, e0, f0, e1, f1, t0, t1, x2 = _fetch_k(pool, ra, mn & more, rc, mc & more, xq_ptr, jo, jm & more,
                                                           xs_ptr, so, sm & more, kb0 + KB, KB, PK)
            xs = gl.allocate_shared_memory(gl.bfloat16, [KB * 32, KB * BM], SH, x)
            hopper.fence_async_shared()
            dot = hopper.warpgroup_mma(wb, xs, z, use_acc=False, is_async=True)
            dw0, u0, dw1, u1 = _k_terms(_f16(w0), _f16(w0 >> 16), c0, n0, c1, n1, s0, s1)   # (beside the MMA)
            dot = hopper.warpgroup_mma_wait(0, deps=[dot])
            acc = _k_fma(acc, dot, dw0, u0, dw1, u1, BN, BM, KB)
            wb, w0, c0, n0, c1, n1, s0, s1, x = wb2, v0, e0, f0, e1, f1, t0, t1, x2
        return acc

    @gluon.jit
    def _acc_any(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, b1, QT: gl.constexpr, BN: gl.constexpr,
                 BM: gl.constexpr, KB: gl.constexpr, GP: gl.constexpr, PK: gl.constexpr, ST: gl.constexpr):
        """The partial [BN, BM] of type QT: _acc_part_k (Q4_K at GP 0) or _acc_part."""
        if QT == 5 and GP == 0:
            r = _acc_part_k(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, b1, BN, BM, KB, PK)
        else:
            r = _acc_part(pool, ra, mn, rc, mc, xq_ptr, jo, jm, xs_ptr, so, sm, b0, b1, QT, BN, BM, KB, GP, PK, ST)
        return r

    @gluon.jit
    def _partial_ptr(ws_ptr, tile, c, NCH, WS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr):
        """[BN, BM] pointers (ACC) to partial c of `tile` (WS floats a partial, the tile's NCH contiguous)."""
        o = (tile.to(gl.int64) * NCH + c) * WS
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        m = gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
        return ws_ptr + o + r[:, None] * BM + m[None, :]

    @gluon.jit
    def _arrive(cnt_ptr, tile, NCH):
        """triton_moe._arrive: True for the tile's last program to arrive (CTA barrier + acq_rel atomic)."""
        _barrier()
        return gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == NCH - 1

    @gluon.jit
    def _gu_store(accg, accu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT: gl.constexpr):
        """triton_moe._gu_store: SwiGLU (clamped under HAS_LIMIT) of [BN, BM] (ACC) into inter's rows."""
        if HAS_LIMIT:
            accg = gl.minimum(accg, limit)
            accu = gl.minimum(gl.maximum(accu, -limit), limit)
        act = accg / (1.0 + gl.exp(-accg)) * accu
        ptr = inter_ptr + rows.to(gl.int64)[None, :] * F + n[:, None]
        gl.store(ptr, act.to(inter_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])

    @gluon.jit
    def _gu_split(tot, BN: gl.constexpr, BM: gl.constexpr):
        """FUSE's [2 BN, BM] (gate's rows then up's) -> (gate [BN, BM], up [BN, BM]) in ACC (the row-64 bit of the
        MMA layout is a register bit: register moves)."""
        g, u = gl.split(gl.permute(gl.reshape(tot, [2, BN, BM]), [1, 2, 0]))
        return gl.convert_layout(g, ACC), gl.convert_layout(u, ACC)

    @gluon.jit
    def _gate_up_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                      k_top, limit, KCB, e, mb, base, QT: gl.constexpr, HAS_LIMIT: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, ALIGNED: gl.constexpr, RA: gl.constexpr,
                      KB: gl.constexpr, SPLIT: gl.constexpr, FUSE: gl.constexpr, GP: gl.constexpr,
                      PK: gl.constexpr, ST: gl.constexpr):
        """_gate_up_gl_kernel's program for row block mb of expert e, whose slot is at pool offset base (PK 0: GGUF
        order, 1: mma_pack's layout)."""
        rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), BM)
        u1, jm, jflat = _rows_of(off_ptr, rows_ptr, e, mb,
                                 gl.arange(0, KB * BM, layout=gl.SliceLayout(0, BL)), BM)
        jo = (jflat // k_top) * H                               # the B tile's columns: their tokens' rows of h
        so = (flat // k_top) * (H // 32)                        # the x block sums' rows (Q4_K)
        NBLK = H // 32
        NCH = (NBLK + KCB - 1) // KCB
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        nc = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        mnc = nc < F
        if FUSE:                    # rows i < BN: gate's row n0 + i; i >= BN: up's row n0 + i - BN
            ia = gl.arange(0, 2 * BN, layout=gl.SliceLayout(1, AL))
            ic = gl.arange(0, 2 * BN, layout=gl.SliceLayout(1, ACC))
            na = gl.program_id(0) * BN + ia % BN
            n2 = gl.program_id(0) * BN + ic % BN
            ra = gl.where(ia < BN, _part_rows(base, starts_ptr, e, 0, na, row_bytes, ALIGNED, RA),
                          _part_rows(base, starts_ptr, e, 1, na, row_bytes, ALIGNED, RA))
            rc = gl.where(ic < BN, _part_rows(base, starts_ptr, e, 0, n2, row_bytes, ALIGNED, RA),
                          _part_rows(base, starts_ptr, e, 1, n2, row_bytes, ALIGNED, RA))
            if ALIGNED:             # (the select loses _part_rows' alignment facts: wide loads need them)
                ra = gl.multiple_of(ra, RA)
                rc = gl.multiple_of(rc, RA)
            if PK:                  # the weights packed (mma_pack): the rows' addresses in their tiles
                ra = _pk_rows(ra, na, row_bytes, False, QT)
                rc = _pk_rows(rc, n2, row_bytes, True, QT)
            tot = gl.zeros([2 * BN, BM], gl.float32, ACC)
            if SPLIT:
                pc = gl.program_id(2)
                acc = _acc_any(pool, ra, na < F, rc, n2 < F, xq_ptr, jo, jm, xs_ptr, so, mr, pc * KCB,
                               gl.minimum(pc * KCB + KCB, NBLK), QT, 2 * BN, BM, KB, GP, PK, ST)
                gl.store(_partial_ptr(ws_ptr, tile, pc, NCH, 2 * BN * BM, 2 * BN, BM), acc)
                if _arrive(cnt_ptr, tile, NCH):
                    for ch in range(0, NCH):    # 0 + p_0 + p_1 + ... in chunk order
                        tot = tot + gl.load(_partial_ptr(ws_ptr, tile, ch, NCH, 2 * BN * BM, 2 * BN, BM),
                                            cache_modifier=".cg")
                    gl.atomic_xchg(cnt_ptr + tile, 0)
                    accg, accu = _gu_split(tot, BN, BM)
                    _gu_store(accg, accu, inter_ptr, rows, mr, nc, mnc, F, limit, HAS_LIMIT)
            else:
                for ch in range(0, NCH):
                    tot = tot + _acc_any(pool, ra, na < F, rc, n2 < F, xq_ptr, jo, jm, xs_ptr, so, mr, ch * KCB,
                                         gl.minimum(ch * KCB + KCB, NBLK), QT, 2 * BN, BM, KB, GP, PK, ST)
                accg, accu = _gu_split(tot, BN, BM)
                _gu_store(accg, accu, inter_ptr, rows, mr, nc, mnc, F, limit, HAS_LIMIT)
        else:
            na = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
            mna = na < F
            ga = _part_rows(base, starts_ptr, e, 0, na, row_bytes, ALIGNED, RA)
            ua = _part_rows(base, starts_ptr, e, 1, na, row_bytes, ALIGNED, RA)
            gc = _part_rows(base, starts_ptr, e, 0, nc, row_bytes, ALIGNED, RA)
            uc = _part_rows(base, starts_ptr, e, 1, nc, row_bytes, ALIGNED, RA)
            if PK:
                ga = _pk_rows(ga, na, row_bytes, False, QT)
                ua = _pk_rows(ua, na, row_bytes, False, QT)
                gc = _pk_rows(gc, nc, row_bytes, True, QT)
                uc = _pk_rows(uc, nc, row_bytes, True, QT)
            totg = gl.zeros([BN, BM], gl.float32, ACC)
            totu = gl.zeros([BN, BM], gl.float32, ACC)
            if SPLIT:               # this program: chunk program_id(2); the tile's last sums them in order
                pc = gl.program_id(2)
                b1 = gl.minimum(pc * KCB + KCB, NBLK)
                g = _acc_any(pool, ga, mna, gc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, pc * KCB, b1, QT, BN,
                             BM, KB, GP, PK, ST)
                u = _acc_any(pool, ua, mna, uc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, pc * KCB, b1, QT, BN,
                             BM, KB, GP, PK, ST)
                pp = _partial_ptr(ws_ptr, tile, pc, NCH, 2 * BN * BM, BN, BM)
                gl.store(pp, g)
                gl.store(pp + BN * BM, u)
                if _arrive(cnt_ptr, tile, NCH):
                    for ch in range(0, NCH):    # 0 + p_0 + p_1 + ... in chunk order
                        pq = _partial_ptr(ws_ptr, tile, ch, NCH, 2 * BN * BM, BN, BM)
                        totg = totg + gl.load(pq, cache_modifier=".cg")
                        totu = totu + gl.load(pq + BN * BM, cache_modifier=".cg")
                    gl.atomic_xchg(cnt_ptr + tile, 0)
                    _gu_store(totg, totu, inter_ptr, rows, mr, nc, mnc, F, limit, HAS_LIMIT)
            else:                   # the same chunk partials and sums, walked by one program
                for ch in range(0, NCH):
                    b1 = gl.minimum(ch * KCB + KCB, NBLK)
                    totg = totg + _acc_any(pool, ga, mna, gc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, ch * KCB, b1,
                                           QT, BN, BM, KB, GP, PK, ST)
                    totu = totu + _acc_any(pool, ua, mna, uc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, ch * KCB, b1,
                                           QT, BN, BM, KB, GP, PK, ST)
                _gu_store(totg, totu, inter_ptr, rows, mr, nc, mnc, F, limit, HAS_LIMIT)

    @gluon.jit
    def _gate_up_gl_kernel(xq_ptr, xs_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr,
                           H, F, row_bytes, n_exp, k_top, limit, KCB, QT: gl.constexpr, HAS_LIMIT: gl.constexpr,
                           BM: gl.constexpr, BN: gl.constexpr, EP: gl.constexpr, ALIGNED: gl.constexpr,
                           RA: gl.constexpr, KB: gl.constexpr, SPLIT: gl.constexpr, FUSE: gl.constexpr,
                           GP: gl.constexpr = 0, PK: gl.constexpr = 0, ST: gl.constexpr = 0):
        """triton_mmq._gate_up_mmq_kernel (BF, FUSE either way) with the A operand in registers: grid (F / BN, row
        blocks[, chunks]). FUSE: gate's BN rows and up's as one A of 2 BN rows (one K walk, the B tile stored once a
        step for both; each output's float ops its own: the same bits)."""
        e, mb, base = _find_block(off_ptr, base_ptr, n_exp, gl.program_id(1), BM, EP)
        if base != -1:                  # -1 alone: not in this group (a negative offset is an expert)
            if PK == 2:                 # per expert: bit 0 of base flags mma_pack's layout (_pk_of)
                pk, base = _pk_of(base)
                if pk != 0:             # one expert a program: a uniform branch
                    _gate_up_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                                  row_bytes, k_top, limit, KCB, e, mb, base, QT, HAS_LIMIT, BM, BN, ALIGNED, RA, KB,
                                  SPLIT, FUSE, GP, 1, ST)
                else:                   # GGUF order: no ring (ST 0)
                    _gate_up_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                                  row_bytes, k_top, limit, KCB, e, mb, base, QT, HAS_LIMIT, BM, BN, ALIGNED, RA, KB,
                                  SPLIT, FUSE, GP, 0, 0)
            else:
                _gate_up_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                              row_bytes, k_top, limit, KCB, e, mb, base, QT, HAS_LIMIT, BM, BN, ALIGNED, RA, KB, SPLIT,
                              FUSE, GP, PK, ST)

    @gluon.jit
    def _down_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes, KCB,
                   e, mb, base, QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, ALIGNED: gl.constexpr,
                   RA: gl.constexpr, KB: gl.constexpr, SPLIT: gl.constexpr, GP: gl.constexpr, PK: gl.constexpr,
                   ST: gl.constexpr):
        """_down_gl_kernel's program for row block mb of expert e at pool offset base (PK 0: GGUF, 1: packed)."""
        rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), BM)
        jrows, jm, u1 = _rows_of(off_ptr, rows_ptr, e, mb,
                                 gl.arange(0, KB * BM, layout=gl.SliceLayout(0, BL)), BM)
        jo = jrows.to(gl.int64) * F                             # inter's rows are the sorted rows
        so = rows.to(gl.int64) * (F // 32)                      # their block sums (Q4_K)
        na = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
        nc = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        mna = na < H
        mnc = nc < H
        da = _part_rows(base, starts_ptr, e, 2, na, row_bytes, ALIGNED, RA)
        dc = _part_rows(base, starts_ptr, e, 2, nc, row_bytes, ALIGNED, RA)
        if PK:
            da = _pk_rows(da, na, row_bytes, False, QT)
            dc = _pk_rows(dc, nc, row_bytes, True, QT)
        NBLK = F // 32
        NCH = (NBLK + KCB - 1) // KCB
        ptr = y_ptr + flat[None, :] * H + nc[:, None]
        msk = mnc[:, None] & mr[None, :]
        tot = gl.zeros([BN, BM], gl.float32, ACC)
        if SPLIT:
            pc = gl.program_id(2)
            acc = _acc_any(pool, da, mna, dc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, pc * KCB,
                           gl.minimum(pc * KCB + KCB, NBLK), QT, BN, BM, KB, GP, PK, ST)
            tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
            gl.store(_partial_ptr(ws_ptr, tile, pc, NCH, BN * BM, BN, BM), acc)
            if _arrive(cnt_ptr, tile, NCH):
                for ch in range(0, NCH):
                    tot = tot + gl.load(_partial_ptr(ws_ptr, tile, ch, NCH, BN * BM, BN, BM),
                                        cache_modifier=".cg")
                gl.atomic_xchg(cnt_ptr + tile, 0)
                gl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=msk)
        else:
            for ch in range(0, NCH):
                tot = tot + _acc_any(pool, da, mna, dc, mnc, xq_ptr, jo, jm, xs_ptr, so, mr, ch * KCB,
                                     gl.minimum(ch * KCB + KCB, NBLK), QT, BN, BM, KB, GP, PK, ST)
            gl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=msk)

    @gluon.jit
    def _down_gl_kernel(xq_ptr, xs_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                        row_bytes, n_exp, KCB, QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        EP: gl.constexpr, ALIGNED: gl.constexpr, RA: gl.constexpr, KB: gl.constexpr,
                        SPLIT: gl.constexpr, GP: gl.constexpr = 0, PK: gl.constexpr = 0,
                        ST: gl.constexpr = 0):
        """triton_mmq._down_mmq_kernel (BF) with the A operand in registers: grid (H / BN, row blocks[, chunks])."""
        e, mb, base = _find_block(off_ptr, base_ptr, n_exp, gl.program_id(1), BM, EP)
        if base != -1:                  # -1 alone: not in this group (a negative offset is an expert)
            if PK == 2:                 # per expert: bit 0 of base flags mma_pack's layout (_pk_of)
                pk, base = _pk_of(base)
                if pk != 0:             # one expert a program: a uniform branch
                    _down_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                               row_bytes, KCB, e, mb, base, QT, BM, BN, ALIGNED, RA, KB, SPLIT, GP, 1, ST)
                else:                   # GGUF order: no ring (ST 0)
                    _down_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                               row_bytes, KCB, e, mb, base, QT, BM, BN, ALIGNED, RA, KB, SPLIT, GP, 0, 0)
            else:
                _down_body(xq_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                           row_bytes, KCB, e, mb, base, QT, BM, BN, ALIGNED, RA, KB, SPLIT, GP, PK, ST)

    KERNELS = {"gate_up": _gate_up_gl_kernel, "down": _down_gl_kernel}
    LAUNCH = {w: launcher(k) for w, k in KERNELS.items()}       # counted as triton_mmq's (triton_launch.COUNTS)
    CONSTS = {"gate_up": ("QT", "HAS_LIMIT", "BM", "BN", "EP", "ALIGNED", "RA", "KB", "SPLIT", "FUSE", "GP", "PK",
                          "ST"),
              "down": ("QT", "BM", "BN", "EP", "ALIGNED", "RA", "KB", "SPLIT", "GP", "PK", "ST")}


def launch(which: str, grid: tuple, args: list, consts: dict, kcb: int):
    """Launch the Gluon kernel `which` ('gate_up' | 'down') on triton_mmq._launch's arguments: args = (xq, xd, xs,
    pool, base, starts, rows, off, out, ws, cnt, H, F, row_bytes, n_exp[, k_top, limit]); xd unused (bf16: no scales
    of x), xs the x block sums (Q4_K's min term; unused by Q8_0 / MXFP4); consts: triton_mmq's constexprs, of which
    CONSTS[which] are this kernel's, and its schedule key NR (ptxas's register limit a thread where not 0)."""
    LAUNCH[which][grid](args[0], args[2], *args[3:], kcb, **{k: consts[k] for k in CONSTS[which]},
                        num_warps=SHAPE["num_warps"], num_stages=1, **_maxnreg(consts.get("NR", 0)))


def _maxnreg(nr: int) -> dict:
    """The compile option of the schedule key NR: {} for 0 (ptxas's choice), else ptxas's maxnreg."""
    return {"maxnreg": nr} if nr else {}


def compile_kernel(which: str = "gate_up", bucket: int = 16, arch: int = 90, hints: bool = True, qt: int = 0,
                   fuse: bool = False, gp: int = 0, pk: int = 0, nr: int = 0, st: int = 0):
    """The Gluon kernel of type code qt compiled for CUDA sm_`arch` without a GPU (no torch needed: Triton 3.6 or 3.9
    alone) at the bench geometry (H 2048, F 768: K 2048 for gate_up, 768 for down, 128 experts, k_top 8) for a rows
    bucket's launch (1: split-K over KCB 16 chunks; 16: walked), as triton_mmq.compile_kernel: (CompiledKernel,
    constexprs). hints: a device launch's alignment facts (16-byte aligned pointers, the int arguments that are
    multiples of 16); fuse: gate_up's FUSE form; gp, pk, st, nr: the schedule keys GP, PK and ST (_acc_part), NR
    (launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    K = 2048 if which == "gate_up" else 768
    rb = row_bytes(qt, K)
    ptr = {"xq_ptr": "*bf16", "xs_ptr": "*fp32", "pool": "*u8", "base_ptr": "*i64", "starts_ptr": "*i64",
           "rows_ptr": "*i32", "off_ptr": "*i32", "inter_ptr" if which == "gate_up" else "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    ints = {"H": 2048, "F": 768, "row_bytes": rb, "n_exp": 128}
    if which == "gate_up":
        ints.update(k_top=8)
    sig = {**ptr, **{k: "i32" for k in ints}, **({"limit": "fp32"} if which == "gate_up" else {}), "KCB": "i32"}
    ints["KCB"] = 16
    const = {"QT": qt, "BM": SHAPE["BM"], "BN": SHAPE["BN"], "EP": 256, "ALIGNED": True,
             "RA": min(16, rb & -rb), "KB": SHAPE["KB"], "SPLIT": bucket == 1 and K // 32 > 16, "GP": gp, "PK": pk,
             "ST": st}
    if which == "gate_up":
        const.update(HAS_LIMIT=False, FUSE=bool(fuse))
    fn = KERNELS[which]
    sig.update({k: "constexpr" for k in const})
    attrs = {}
    if hints:
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if sig.get(name, "").startswith("*") or ints.get(name, 1) % 16 == 0 and name in ints}
    k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": SHAPE["num_warps"], "num_stages": 1, **_maxnreg(nr)})
    return k, const
