"""Triton kernels for one layer's routed experts, reading quantized bytes straight from slots.

vLLM's fused MoE idea (rows sorted by expert, one program per block of one expert's rows) with the
dequantization fused into the matmul (triton_quants.wdot) and the expert addressed by a byte offset into one
device pool (VRAM hot slots + execution ring), so a whole tier group of experts is one launch:

  gate_up   grid (cdiv(F, BN), row blocks): program (n, b) takes row block b (rows = (token, rank) pairs
            sorted by expert; block b = rows mb*BM.. of expert e), computes g = W_gate x and u = W_up x for
            its BN output columns over H in BK steps, writes act = silu(g) * u -> inter [R, F] (sorted-row order)
  down      grid (cdiv(H, BN), row blocks): y[token*k + rank] = W_down act over F
  combine   grid (T, cdiv(H, BN)): out[t] = sum_r w[t, r] * y[t*k + r], r = 0..k-1 in order (fp32)

Row blocks are enumerated over the experts that have rows (each expert's rows in blocks of BM, found from the
row offsets in the kernel), so a decode launch has about one program column per routed expert, not one per
expert of the layer; the grid has the upper bound cdiv(R, BM) + min(R, E) (R = T*k) of such blocks and the
programs past the last block, or of experts whose base offset is -1 (not in this group), return at once.

The tile product is acc[BN, BM] += W[BN, BK] @ X^T[BK, BM]: the dequantized weights are the MMA's M side and the
rows (up to BM = 16) its N side, so a decode step (1 row per expert) and 16 rows cost the same weight traffic.

Row invariance (DESIGN.md invariant 6): block sizes are constants per weight type (never tuned by the row count),
the K loop runs in the same BK steps, and tensor-core MMA computes each output element from its own row and column
only, so a row's bits depend neither on the other rows of its block nor on how many rows an expert has, nor on
which group (tier) the expert is in.

Weight formats: triton_quants (QT codes, tile layouts and the in-kernel dequantization of each GGML type).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from betelgeuse.kernels.triton_quants import QT_CODES, SUPER, tables, wdot  # noqa: F401

# rows per block, output columns per program (down; gate_up), K step, warps, pipeline depth: constants for every
# launch whatever the row count (row invariance); TYPE_CONFIG[qt] overrides them per weight type, as
# deploy/device/kernel_roofline.py picks them on the H200 (BN 64 = wgmma's M: the weights feed it from registers)
# F32 (code 3): BK 128, as a [64, 256] float32 weight tile per K step staged twice for gate and up by the software
# pipeliner needs 280 KiB of shared memory, over sm_90's 227 KiB (tests/scripts/kernel_smem.py checks every type)
CONFIG = {"BM": 16, "BN": 64, "BN_GATE_UP": 64, "BK": 256, "num_warps": 4, "num_stages": 3}
TYPE_CONFIG: dict[int, dict] = {3: {"BK": 128}}


def config(qt: int) -> dict:
    """The launch constants of kernel type code `qt`: CONFIG with the type's overrides."""
    return {**CONFIG, **TYPE_CONFIG.get(qt, {})}


@triton.jit
def _find_block(off_ptr, base_ptr, n_exp, b, BM: tl.constexpr, EP: tl.constexpr):
    """Row block b -> (expert e, its block index mb, e's pool offset): the experts' blocks in expert order,
    cdiv(rows, BM) each; offset -1 past the last block or for an expert not in this group."""
    ei = tl.arange(0, EP)
    me = ei < n_exp
    lo = tl.load(off_ptr + ei, mask=me, other=0)
    hi = tl.load(off_ptr + ei + 1, mask=me, other=0)
    nb = (hi - lo + BM - 1) // BM
    cum = tl.cumsum(nb, 0)                                   # inclusive
    e = tl.sum((cum <= b).to(tl.int32), 0)
    first = tl.sum(tl.where(ei == e, cum - nb, 0), 0)
    base = tl.load(base_ptr + tl.minimum(e, n_exp - 1))
    return e, b - first, tl.where(e < n_exp, base, -1)


@triton.jit
def _rows_of(off_ptr, rows_ptr, e, mb, BM: tl.constexpr):
    """Block mb of expert e: (sorted-row indices [BM], their mask, their token*k+rank values int64)."""
    rows = tl.load(off_ptr + e) + mb * BM + tl.arange(0, BM)
    mr = rows < tl.load(off_ptr + e + 1)
    return rows, mr, tl.load(rows_ptr + rows, mask=mr, other=0).to(tl.int64)


@triton.jit
def _part_rows(base, starts_ptr, e, part: tl.constexpr, n, row_bytes, ALIGNED: tl.constexpr):
    """Byte addresses [BN] int64 in the pool of rows n of part `part` (gate 0, up 1, down 2) of expert e."""
    b = base + tl.load(starts_ptr + e * 3 + part)
    if ALIGNED:
        b = tl.multiple_of(b, 16)
    return b + n.to(tl.int64) * row_bytes


@triton.jit
def _gate_up_kernel(h_ptr, pool, tab, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr,
                    H, F, row_bytes, n_exp, k_top, limit,
                    QT: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr):
    pn = tl.program_id(0)
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base >= 0:
        rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, BM)
        tok = flat // k_top
        n = pn * BN + tl.arange(0, BN)
        mn = n < F
        gra = _part_rows(base, starts_ptr, e, 0, n, row_bytes, ALIGNED)
        ura = _part_rows(base, starts_ptr, e, 1, n, row_bytes, ALIGNED)
        accg = tl.zeros((BN, BM), dtype=tl.float32)
        accu = tl.zeros((BN, BM), dtype=tl.float32)
        for kk in range(0, H, BK):
            accg = wdot(accg, h_ptr, tok * H, mr, pool, tab, gra, kk, mn, QT, BK, BN, IEEE)
            accu = wdot(accu, h_ptr, tok * H, mr, pool, tab, ura, kk, mn, QT, BK, BN, IEEE)
        if HAS_LIMIT:                       # DeepSeek-V4's clamped SwiGLU
            accg = tl.minimum(accg, limit)
            accu = tl.minimum(tl.maximum(accu, -limit), limit)
        act = accg / (1.0 + tl.exp(-accg)) * accu
        ptr = inter_ptr + rows.to(tl.int64)[None, :] * F + n[:, None]
        tl.store(ptr, act.to(inter_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])


@triton.jit
def _down_kernel(inter_ptr, pool, tab, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr,
                 H, F, row_bytes, n_exp,
                 QT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr):
    pn = tl.program_id(0)
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base >= 0:
        rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, BM)
        n = pn * BN + tl.arange(0, BN)
        mn = n < H
        dra = _part_rows(base, starts_ptr, e, 2, n, row_bytes, ALIGNED)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        xrow = rows.to(tl.int64) * F
        for kk in range(0, F, BK):
            acc = wdot(acc, inter_ptr, xrow, mr, pool, tab, dra, kk, mn, QT, BK, BN, IEEE)
        ptr = y_ptr + flat[None, :] * H + n[:, None]
        tl.store(ptr, acc.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, k_top, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = n < H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r in range(0, k_top):
        w = tl.load(w_ptr + t * k_top + r).to(tl.float32)
        yr = tl.load(y_ptr + (t * k_top + r) * H + n, mask=mn, other=0).to(tl.float32)
        acc = acc + w * yr
    tl.store(out_ptr + t * H + n, acc.to(out_ptr.dtype.element_ty), mask=mn)


def _launch_rows(R: int, E: int, BM: int) -> int:
    """Upper bound of the row blocks of R rows over E experts (each expert with rows adds at most one partial block)."""
    return triton.cdiv(R, BM) + min(R, E)


def gate_up(h, pool, base, starts, rows, off, inter, n_ff: int, k_top: int, qt: int, limit: float | None,
            row_bytes: int, aligned: bool):
    """h [T,H]; base [E] int64 (-1 = skip); starts [E,3] int64; rows [R] int32 sorted (token*k+rank);
    off [E+1] int32 row offsets per expert; inter [R, F] (written for the rows of experts in the group);
    row_bytes: bytes of one H-element row of gate/up; aligned: every tensor start is 16-byte aligned."""
    T, H = h.shape
    E = base.numel()
    c = config(qt)
    bk = block_k(qt, H, n_ff)
    grid = (triton.cdiv(n_ff, c["BN_GATE_UP"]), _launch_rows(rows.numel(), E, c["BM"]))
    _gate_up_kernel[grid](h, pool, tables(pool.device), base, starts, rows, off, inter, H, n_ff, row_bytes, E, k_top,
                          float(limit) if limit is not None else 0.0,
                          QT=qt, HAS_LIMIT=limit is not None, IEEE=h.dtype == torch.float32, ALIGNED=aligned,
                          BM=c["BM"], BN=c["BN_GATE_UP"], BK=bk, EP=triton.next_power_of_2(E),
                          num_warps=c["num_warps"], num_stages=c["num_stages"])


def down(inter, pool, base, starts, rows, off, y, n_tokens: int, qt: int, row_bytes: int, aligned: bool):
    """inter [R, F]; y [T*k, H] (rows of experts in the group written); row_bytes: of one F-element down row."""
    F = inter.shape[1]
    H = y.shape[1]
    E = base.numel()
    c = config(qt)
    grid = (triton.cdiv(H, c["BN"]), _launch_rows(rows.numel(), E, c["BM"]))
    _down_kernel[grid](inter, pool, tables(pool.device), base, starts, rows, off, y, H, F, row_bytes, E,
                       QT=qt, IEEE=inter.dtype == torch.float32, ALIGNED=aligned, BM=c["BM"], BN=c["BN"],
                       BK=block_k(qt, H, F), EP=triton.next_power_of_2(E),
                       num_warps=c["num_warps"], num_stages=c["num_stages"])


def combine(y, w, out):
    """y [T*k, H], w [T, k] -> out [T, H] = sum over ranks in order (float32 accumulation)."""
    T, k = w.shape
    H = y.shape[1]
    _combine_kernel[(T, triton.cdiv(H, 256))](y, w.contiguous(), out, H, k, BN=256)
    return out


def block_k(qt: int, H: int, F: int) -> int:
    """The K step of type code qt: its config's BK (128 or 256 for the 256-element super-block types, whose rows
    are multiples of 256), else the largest multiple of 32 <= BK dividing both H and F (tiny test models)."""
    bk = config(qt)["BK"]
    if qt in SUPER:
        assert bk in (128, 256) and H % 256 == 0 and F % 256 == 0, (bk, H, F)
        return bk
    while bk > 32 and (H % bk or F % bk):
        bk //= 2
    assert H % bk == 0 and F % bk == 0, (H, F, bk)
    return bk
