"""The bf16 MMA of Q8_0 and MXFP4 experts (act_quant bf16, triton_mmq's BF schedule) in Gluon: the weights loaded
straight into the wgmma's A registers (issue 23, docs/benchmarks/cpu-gluon55).

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
    chunk of KCB blocks;
  * MXFP4: the doubled e2m1 values in triton_mmq._perm's element order, for the weights (a thread's k pair is then
    the two nibbles of one byte: one byte load a pair) and the B tile alike, as the Triton kernel's BF tiles;
  * the chunk sums 0 + p_0 + p_1 + ... in chunk order: walked (16-row bucket) or split over programs (SPLIT, the
    1-row bucket: the tile's last program sums the stored partials, triton_moe's counter protocol);
  * gate_up: SwiGLU (the clamped form under HAS_LIMIT) as triton_moe._gu_store; down: y's bf16 store.
The schedule key GL (triton_mmq.CONFIG, 0 by default) asks for it; triton_mmq._launch takes it where `usable` says so
(CUDA sm_90, Gluon importable, Q8_0 or MXFP4 at these constants), else the Triton kernel runs (CPU, the interpreter:
Gluon has no interpreter). Compiles on Triton 3.6 (the device's) and 3.9: the one API difference used here is the
CTA barrier's name (gl.thread_barrier on 3.6, gl.barrier on 3.9); 3.6 has no gl.cumsum (an associative_scan here).
"""

from __future__ import annotations

import os

from betelgeuse.kernels.triton_launch import launcher

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    HAVE_GLUON = True
except ImportError:                 # a Triton without Gluon: triton_mmq's kernels only
    HAVE_GLUON = False

TYPES = {0: 34, 4: 17}              # kernel type codes (triton_quants.QT_CODES) -> block bytes: Q8_0, MXFP4
SHAPE = {"BN": 64, "BM": 16, "KB": 2, "num_warps": 4}   # the one schedule compiled here (BF_TUNING's)


def usable(qt: int, c: dict, kb: int, device) -> bool:
    """Whether a bf16 MMA launch of type qt with config c (KB kb as launched) can run here: Gluon imports, a CUDA
    device of capability 9.x (wgmma), not the interpreter, a type of TYPES at SHAPE's constants without FUSE."""
    if not HAVE_GLUON or qt not in TYPES or getattr(device, "type", "") != "cuda" or c.get("FUSE"):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if any(c[k] != v for k, v in SHAPE.items() if k != "KB") or kb != SHAPE["KB"]:
        return False
    import torch
    return torch.cuda.get_device_capability(device)[0] == 9


if HAVE_GLUON:
    _barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier   # 3.6 / 3.9's name
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
    def _perm(p):
        """triton_mmq._perm: MXFP4's element order in the bf16 MMA's tiles, position 32 a + 8 w + 2 c + h holds
        element 32 a + 16 h + 4 w + c (a thread's k pair (2 c', 2 c' + 1): the two nibbles of one byte)."""
        r = p % 32
        return (p // 32) * 32 + (r % 2) * 16 + (r // 8) * 4 + (r % 8) // 2

    @gluon.jit
    def _e2m1(v):
        """MXFP4 codes v (int32, 0..15) -> llama.cpp's kvalues_mxfp4, the doubled e2m1 values (0 1 2 3 4 6 8 12, bit 3
        the sign) as int8: the magnitudes packed 4 bits each in 0xC8643210 (triton_mmq._w_tile's values; as an int32
        constant, -932957680: the arithmetic shift's sign bits never reach the low 4 bits kept)."""
        mag = (-932957680 >> ((v & 7) * 4)) & 15
        return gl.where(v >= 8, -mag, mag).to(gl.int8)

    @gluon.jit
    def _scale(pool, rc, mc, kb, QT: gl.constexpr):
        """Block kb's weight scale d [BN] float32 of rows rc (mask mc): Q8_0's f16 d, MXFP4's 2^(e - 128) of its E8M0
        byte (ggml_e8m0_to_fp32_half, as triton_mmq._w_scale)."""
        if QT == 0:
            d = gl.load((pool + rc + kb * 34).to(gl.pointer_type(gl.float16)), mask=mc, other=0).to(gl.float32)
        else:
            e8 = gl.load(pool + rc + kb * 17, mask=mc, other=0).to(gl.int32)
            d = gl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(gl.float32, bitcast=True)
        return d

    @gluon.jit
    def _fetch(pool, ra, mn, rc, mc, xq_ptr, jo, jm, kb0, QT: gl.constexpr, KB: gl.constexpr):
        """K step kb0 .. kb0 + KB: (the weights [BN, KB*32] bf16 in AL of rows ra (mask mn): column c = block
        kb0 + c // 32's element c % 32 (Q8_0: the int8 at byte 34 kb + 2 + e) or element _perm(c) % 32 (MXFP4: the
        doubled e2m1 value of the nibble (e // 16) of byte 17 kb + 1 + e % 16) -- triton_mmq._w_tile's values; the
        scales d [BN] float32 of blocks kb0 and kb0 + 1 of rows rc (mask mc, ACC's rows); the B tile [KB*32, KB*BM]
        bf16 in BL: column j = i*BM + m holds activation row m's block kb0 + i (element offsets jo, mask jm) at rows
        32 i .. 32 i + 31 (MXFP4: element _perm(k)), zeros elsewhere -- triton_mmq._bd_tile's values)."""
        c = gl.arange(0, KB * 32, layout=gl.SliceLayout(0, AL))
        if QT == 0:
            w = gl.load(pool + ra[:, None] + ((kb0 + c // 32) * 34 + 2 + c % 32)[None, :], mask=mn[:, None], other=0)
            wb = w.to(gl.int8, bitcast=True).to(gl.bfloat16)
        else:                       # a thread's k pair (c, c + 1), c even: the low and high nibble of one byte
            p = _perm(c)
            o = gl.broadcast(ra[:, None], ((kb0 + p // 32) * 17 + 1 + p % 16)[None, :])
            o = o[0] + o[1]                                            # [BN, KB*32] byte offsets, pairs equal
            m = gl.broadcast(mn[:, None], o)[0]
            o1, o2 = gl.split(gl.reshape(o, [o.shape[0], KB * 16, 2]))    # one byte a pair (register moves)
            m1, m2 = gl.split(gl.reshape(m, [o.shape[0], KB * 16, 2]))
            v = gl.load(pool + o1, mask=m1, other=0).to(gl.int32)       # [BN, KB*16]
            w = gl.reshape(gl.join(_e2m1(v & 15), _e2m1(v >> 4)), [o.shape[0], KB * 32])
            wb = gl.convert_layout(w, AL).to(gl.bfloat16)
        d0 = _scale(pool, rc, mc, kb0, QT)
        d1 = _scale(pool, rc, mc, kb0 + 1, QT)
        k = gl.arange(0, KB * 32, layout=gl.SliceLayout(1, BL))
        jb = gl.arange(0, jo.shape[0], layout=gl.SliceLayout(0, BL)) // (jo.shape[0] // KB)
        m2 = jm[None, :] & (jb[None, :] == (k // 32)[:, None])
        if QT == 4:
            k = _perm(k)
        x = gl.load(xq_ptr + jo[None, :] + kb0 * 32 + k[:, None], mask=m2, other=0.0)
        return wb, d0, d1, x

    @gluon.jit
    def _acc_part(pool, ra, mn, rc, mc, xq_ptr, jo, jm, b0, b1, QT: gl.constexpr, BN: gl.constexpr,
                  BM: gl.constexpr, KB: gl.constexpr):
        """One part's partial [BN, BM] (ACC) over blocks b0 .. b1 (KB | b1 - b0), from zero: triton_mmq._mmq_step's
        float ops (module doc), the next step's loads issued before this step's MMA (triton_mmq's PF 1)."""
        gl.static_assert(KB == 2)
        acc = gl.zeros([BN, BM], gl.float32, ACC)
        z = gl.zeros([BN, KB * BM], gl.float32, MMA)
        wb, d0, d1, x = _fetch(pool, ra, mn, rc, mc, xq_ptr, jo, jm, b0, QT, KB)
        for kb0 in range(b0, b1, KB):
            more = kb0 + KB < b1                    # the next step's loads, masked off past b1
            wb2, e0, e1, x2 = _fetch(pool, ra, mn & more, rc, mc & more, xq_ptr, jo, jm & more, kb0 + KB, QT,
                                     KB)
            xs = gl.allocate_shared_memory(gl.bfloat16, [KB * 32, KB * BM], SH, x)
            hopper.fence_async_shared()
            dot = hopper.warpgroup_mma(wb, xs, z, use_acc=False, is_async=True)
            dot = hopper.warpgroup_mma_wait(0, deps=[dot])
            p0, p1 = gl.split(gl.permute(gl.reshape(dot, [BN, KB, BM]), [0, 2, 1]))     # column i*BM + m -> pi
            p0 = gl.convert_layout(p0, ACC)
            p1 = gl.convert_layout(p1, ACC)
            acc = gl.fma(p0, gl.broadcast(d0[:, None], acc)[0], acc)                  # ascending blocks
            acc = gl.fma(p1, gl.broadcast(d1[:, None], acc)[0], acc)
            wb, d0, d1, x = wb2, e0, e1, x2
        return acc

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
    def _gate_up_gl_kernel(xq_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                        row_bytes, n_exp, k_top, limit, KCB, QT: gl.constexpr, HAS_LIMIT: gl.constexpr,
                        BM: gl.constexpr,
                        BN: gl.constexpr, EP: gl.constexpr, ALIGNED: gl.constexpr, RA: gl.constexpr,
                        KB: gl.constexpr, SPLIT: gl.constexpr):
        """triton_mmq._gate_up_mmq_kernel (BF, QT 0, FUSE 0) with the A operand in registers: grid (F / BN, row
        blocks[, chunks])."""
        e, mb, base = _find_block(off_ptr, base_ptr, n_exp, gl.program_id(1), BM, EP)
        if base != -1:                  # -1 alone: not in this group (a negative offset is an expert)
            rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), BM)
            u1, jm, jflat = _rows_of(off_ptr, rows_ptr, e, mb,
                                     gl.arange(0, KB * BM, layout=gl.SliceLayout(0, BL)), BM)
            jo = (jflat // k_top) * H                               # the B tile's columns: their tokens' rows of h
            na = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
            nc = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
            mna = na < F
            mnc = nc < F
            ga = _part_rows(base, starts_ptr, e, 0, na, row_bytes, ALIGNED, RA)
            ua = _part_rows(base, starts_ptr, e, 1, na, row_bytes, ALIGNED, RA)
            gc = _part_rows(base, starts_ptr, e, 0, nc, row_bytes, ALIGNED, RA)
            uc = _part_rows(base, starts_ptr, e, 1, nc, row_bytes, ALIGNED, RA)
            NBLK = H // 32
            NCH = (NBLK + KCB - 1) // KCB
            totg = gl.zeros([BN, BM], gl.float32, ACC)
            totu = gl.zeros([BN, BM], gl.float32, ACC)
            if SPLIT:                   # this program: chunk program_id(2); the tile's last sums them in order
                pc = gl.program_id(2)
                b1 = gl.minimum(pc * KCB + KCB, NBLK)
                g = _acc_part(pool, ga, mna, gc, mnc, xq_ptr, jo, jm, pc * KCB, b1, QT, BN, BM, KB)
                u = _acc_part(pool, ua, mna, uc, mnc, xq_ptr, jo, jm, pc * KCB, b1, QT, BN, BM, KB)
                tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
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
            else:                       # the same chunk partials and sums, walked by one program
                for ch in range(0, NCH):
                    b1 = gl.minimum(ch * KCB + KCB, NBLK)
                    totg = totg + _acc_part(pool, ga, mna, gc, mnc, xq_ptr, jo, jm, ch * KCB, b1, QT, BN, BM, KB)
                    totu = totu + _acc_part(pool, ua, mna, uc, mnc, xq_ptr, jo, jm, ch * KCB, b1, QT, BN, BM, KB)
                _gu_store(totg, totu, inter_ptr, rows, mr, nc, mnc, F, limit, HAS_LIMIT)

    @gluon.jit
    def _down_gl_kernel(xq_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                     row_bytes, n_exp, KCB, QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                     EP: gl.constexpr,
                     ALIGNED: gl.constexpr, RA: gl.constexpr, KB: gl.constexpr, SPLIT: gl.constexpr):
        """triton_mmq._down_mmq_kernel (BF, QT 0) with the A operand in registers: grid (H / BN, row blocks[,
        chunks])."""
        e, mb, base = _find_block(off_ptr, base_ptr, n_exp, gl.program_id(1), BM, EP)
        if base != -1:
            rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), BM)
            jrows, jm, u1 = _rows_of(off_ptr, rows_ptr, e, mb,
                                     gl.arange(0, KB * BM, layout=gl.SliceLayout(0, BL)), BM)
            jo = jrows.to(gl.int64) * F                             # inter's rows are the sorted rows
            na = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
            nc = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
            mna = na < H
            mnc = nc < H
            da = _part_rows(base, starts_ptr, e, 2, na, row_bytes, ALIGNED, RA)
            dc = _part_rows(base, starts_ptr, e, 2, nc, row_bytes, ALIGNED, RA)
            NBLK = F // 32
            NCH = (NBLK + KCB - 1) // KCB
            ptr = y_ptr + flat[None, :] * H + nc[:, None]
            msk = mnc[:, None] & mr[None, :]
            tot = gl.zeros([BN, BM], gl.float32, ACC)
            if SPLIT:
                pc = gl.program_id(2)
                acc = _acc_part(pool, da, mna, dc, mnc, xq_ptr, jo, jm, pc * KCB, gl.minimum(pc * KCB + KCB, NBLK),
                                QT, BN, BM, KB)
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
                    tot = tot + _acc_part(pool, da, mna, dc, mnc, xq_ptr, jo, jm, ch * KCB,
                                          gl.minimum(ch * KCB + KCB, NBLK), QT, BN, BM, KB)
                gl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=msk)

    KERNELS = {"gate_up": _gate_up_gl_kernel, "down": _down_gl_kernel}
    LAUNCH = {w: launcher(k) for w, k in KERNELS.items()}       # counted as triton_mmq's (triton_launch.COUNTS)
    CONSTS = {"gate_up": ("QT", "HAS_LIMIT", "BM", "BN", "EP", "ALIGNED", "RA", "KB", "SPLIT"),
              "down": ("QT", "BM", "BN", "EP", "ALIGNED", "RA", "KB", "SPLIT")}


def launch(which: str, grid: tuple, args: list, consts: dict, kcb: int):
    """Launch the Gluon kernel `which` ('gate_up' | 'down') on triton_mmq._launch's arguments: args = (xq, xd, xs,
    pool, base, starts, rows, off, out, ws, cnt, H, F, row_bytes, n_exp[, k_top, limit]); xd, xs unused (bf16 of
    Q8_0 / MXFP4: no scales of x, no sums); consts: triton_mmq's constexprs, of which CONSTS[which] are this
    kernel's."""
    LAUNCH[which][grid](args[0], *args[3:], kcb, **{k: consts[k] for k in CONSTS[which]}, num_warps=SHAPE["num_warps"],
             num_stages=1)


def compile_kernel(which: str = "gate_up", bucket: int = 16, arch: int = 90, hints: bool = True, qt: int = 0):
    """The Gluon kernel of type code qt compiled for CUDA sm_`arch` without a GPU (no torch needed: Triton 3.6 or 3.9
    alone) at the bench geometry (H 2048, F 768: K 2048 for gate_up, 768 for down, 128 experts, k_top 8) for a rows
    bucket's launch (1: split-K over KCB 16 chunks; 16: walked), as triton_mmq.compile_kernel: (CompiledKernel,
    constexprs). hints: a device launch's alignment facts (16-byte aligned pointers, the int arguments that are
    multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    K = 2048 if which == "gate_up" else 768
    row_bytes = K // 32 * TYPES[qt]
    ptr = {"xq_ptr": "*bf16", "pool": "*u8", "base_ptr": "*i64", "starts_ptr": "*i64", "rows_ptr": "*i32",
           "off_ptr": "*i32", "inter_ptr" if which == "gate_up" else "y_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32"}
    ints = {"H": 2048, "F": 768, "row_bytes": row_bytes, "n_exp": 128}
    if which == "gate_up":
        ints.update(k_top=8)
    sig = {**ptr, **{k: "i32" for k in ints}, **({"limit": "fp32"} if which == "gate_up" else {}), "KCB": "i32"}
    ints["KCB"] = 16
    const = {"QT": qt, "BM": SHAPE["BM"], "BN": SHAPE["BN"], "EP": 256, "ALIGNED": True,
             "RA": min(16, row_bytes & -row_bytes), "KB": SHAPE["KB"], "SPLIT": bucket == 1 and K // 32 > 16}
    if which == "gate_up":
        const["HAS_LIMIT"] = False
    fn = KERNELS[which]
    sig.update({k: "constexpr" for k in const})
    attrs = {}
    if hints:
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if sig.get(name, "").startswith("*") or ints.get(name, 1) % 16 == 0 and name in ints}
    k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": SHAPE["num_warps"], "num_stages": 1})
    return k, const
