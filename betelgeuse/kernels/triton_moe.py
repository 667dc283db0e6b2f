"""Triton kernels for one layer's routed experts, reading quantized bytes straight from slots.

vLLM's fused MoE idea (rows sorted by expert, one program per block of one expert's rows) with the
dequantization fused into the matmul (triton_quants.wdot) and the expert addressed by a byte offset into one
device pool (VRAM hot slots + execution ring), so a whole tier group of experts is one launch:

  gate_up   grid (cdiv(F, BN), row blocks[, K chunks]): program (n, b) takes row block b (rows = (token, rank)
            pairs sorted by expert; block b = rows mb*BM.. of expert e), computes g = W_gate x and u = W_up x for
            its BN output columns over H, writes act = silu(g) * u -> inter [R, F] (sorted-row order)
  down      grid (cdiv(H, BN), row blocks[, K chunks]): y[token*k + rank] = W_down act over F
  combine   grid (T, cdiv(H, BN)): out[t] = sum_r w[t, r] * y[t*k + r], r = 0..k-1 in order (fp32)

Row blocks are enumerated over the experts that have rows (each expert's rows in blocks of BM, found from the
row offsets in the kernel), so a decode launch has about one program column per routed expert, not one per
expert of the layer; the grid has the upper bound cdiv(R, BM) + min(R, E) (R = T*k) of such blocks and the
programs past the last block, or of experts whose base offset is -1 (not in this group), return at once.

The tile product is acc[BN, BM] += W[BN, BK] @ X^T[BK, BM]: the dequantized weights are the MMA's M side and the
rows (up to BM = 16) its N side, so a decode step (1 row per expert) and 16 rows cost the same weight traffic.
K runs in chunks of KC columns (split-K): each chunk's partial is accumulated from zero in BK steps and the
partials are summed in chunk order. A decode step has few experts (16 of a bank, 1 row each): one program per
(output block, row block) would leave most of 132 SMs idle, so SPLIT launches one program per chunk too; each
writes its partial [BN, BM] (fp32) to a workspace and bumps its tile's counter (acq_rel), and the tile's last
program sums the partials in chunk order, runs the epilogue and resets the counter (no atomics on values: the
sum's order is fixed whichever program arrives last). Without SPLIT one program walks the chunks.

Row invariance (DESIGN.md invariant 6): the reduction keys (BK, KC) are constants per weight type (never tuned by
the row count), every output is the same sum of the same chunk partials whether the chunks were split over
programs or walked, and tensor-core MMA computes each output element from its own row and column only, so a row's
bits depend neither on the other rows of its block nor on how many rows an expert has or the launch has (its rows
bucket picks only the schedule), nor on which group (tier) the expert is in.

Weight formats: triton_quants (QT codes, tile layouts and the in-kernel dequantization of each GGML type). An expert
may also be held in kernels/tile_layout's block-interleaved 64-row tiles (issue 23): a launch told `tiled` reads each
expert in the layout bit 0 of its base offset names (gate_up's doc), the same bits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from betelgeuse.kernels import triton_mmvq as mv
from betelgeuse.kernels.streams import stream_key
from betelgeuse.kernels.triton_launch import cdiv, launcher, pow2
from betelgeuse.kernels.tile_layout import unit
from betelgeuse.kernels.triton_quants import QT_CODES, SUPER, TILE_ROWS, tables, wdot  # noqa: F401

# Launch constants. Two kinds, so that a row's bits never depend on the launch (DESIGN.md invariant 6):
#   reduction keys (per weight type only, never per row count): BK = the K step of one tile product, KC = the K
#     chunk (elements, a multiple of BK; 0 = all of K): each output is sum_c p_c over the chunks c in order
#     (((p_0 + p_1) + p_2) ...), p_c accumulated over its chunk in BK steps from zero.
#   schedule keys (per weight type and rows bucket): BN / BN_GATE_UP output rows per program, SPLIT (1 = one
#     program per chunk, the partials written to a workspace and summed in chunk order by the tile's last program;
#     0 = one program walks the chunks and sums the same partials in the same order: the same bits), num_warps,
#     num_stages. They change which program computes what, not the arithmetic of an output (tensor-core MMA
#     computes each output from its own row and column; the sweep checks the buckets' configs agree bit for bit).
# MV (a reduction key) = 1: the decode schedule of triton_mmvq (llama.cpp's mmvq layout, float activations, no
# tensor cores) for the types it has, in both buckets: its own fixed arithmetic, so BN, BM_MV (rows per program),
# num_warps and num_stages may differ per bucket with the same bits; BK does not apply to it; KC (> 0, < K, a
# multiple of its step) cuts K in chunks whose totals are summed in chunk order (triton_mmvq's doc; other bits than
# KC 0, the same for both buckets) and SPLIT then spreads the chunks over programs as the MMA path's; a launch it
# cannot take (rows not 4-byte aligned, K or KC not whole steps) runs the MMA path (a property of the tensor's
# geometry and the type's KC, the same for every launch of it).
# BM (rows per block) is fixed: the MMA's N side. CONFIG is the default; triton_tuning.json (written by
# `deploy/device/kernel_roofline.py --sweep` on the GPU) overrides it per type and bucket; TYPE_CONFIG[qt] (tests,
# the roofline's candidates) overrides both for every bucket. F32 (code 3): BK 128, as a [64, 256] float32 weight
# tile per K step staged twice for gate and up by the software pipeliner needs 280 KiB of shared memory, over
# sm_90's 227 KiB (tests/scripts/kernel_smem.py checks every type).
CONFIG = {"BM": 16, "BN": 64, "BN_GATE_UP": 64, "BK": 256, "KC": 0, "SPLIT": 0, "num_warps": 4, "num_stages": 3,
          "MV": 0, "BM_MV": 4}
REDUCE_KEYS = frozenset({"BK", "KC", "MV"})
SCHEDULE_KEYS = frozenset({"BN", "BN_GATE_UP", "SPLIT", "num_warps", "num_stages", "BM_MV"})
BUCKETS = (1, 16)                     # rows per expert the launch is tuned for: bucket_of(rows, experts)
TYPE_CONFIG: dict[int, dict] = {3: {"BK": 128}}
TUNING_FILE = Path(__file__).with_name("triton_tuning.json")
TUNING_ENV = "BETELGEUSE_TRITON_TUNING"   # a tuning file to use instead of TUNING_FILE; "off": CONFIG only
WS_LIMIT = 64 << 20                   # bytes of split-K partials per launch; a larger launch walks its chunks


def load_tuning(path: Path | str | None = None) -> dict[int, dict]:
    """{kernel type code: {"reduce": {...}, bucket: {...}}} from a tuning file (`path`, else $BETELGEUSE_TRITON_TUNING,
    else TUNING_FILE): {"types": {"Q4_K": {"BK": 256, "KC": 512, "rows1": {schedule}, "rows16": {schedule}}}}.
    A key in the wrong place or a type the kernels do not read raises ValueError naming it."""
    from gguf.constants import GGMLQuantizationType as GT
    if path is None:
        path = os.environ.get(TUNING_ENV) or TUNING_FILE
        if str(path).lower() == "off":
            return {}
    path = Path(path)
    if not path.exists():
        if path == TUNING_FILE:
            return {}
        raise ValueError(f"{TUNING_ENV}: no tuning file at {path}")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    out: dict[int, dict] = {}
    for name, t in (doc.get("types") or {}).items():
        try:
            code = QT_CODES[int(GT[name])]
        except (KeyError, ValueError):
            raise ValueError(f"{path}: {name!r} is not a type the expert kernels read") from None
        ent: dict = {"reduce": {}}
        for k, v in t.items():
            if k in REDUCE_KEYS:
                ent["reduce"][k] = int(v)
            elif k.startswith("rows") and k[4:].isdigit() and int(k[4:]) in BUCKETS:
                bad = set(v) - SCHEDULE_KEYS
                if bad:
                    raise ValueError(f"{path}: {name}.{k} has {sorted(bad)}; a rows bucket sets only "
                                     f"{sorted(SCHEDULE_KEYS)} (the reduction keys {sorted(REDUCE_KEYS)} are per type)")
                ent[int(k[4:])] = {kk: int(vv) for kk, vv in v.items()}
            else:
                raise ValueError(f"{path}: {name}: unknown key {k!r} (per type: {sorted(REDUCE_KEYS)}, "
                                 f"rows{BUCKETS[0]}/rows{BUCKETS[1]}: schedules)")
        bk, kc = ent["reduce"].get("BK", CONFIG["BK"]), ent["reduce"].get("KC", 0)
        if bk not in (32, 64, 128, 256) or kc < 0 or kc % bk:
            raise ValueError(f"{path}: {name}: BK {bk} must be 32..256 (a power of two) and KC {kc} a multiple of it")
        if ent["reduce"].get("MV", 0) not in (0, 1) or (ent["reduce"].get("MV") and code not in mv.STEP):
            raise ValueError(f"{path}: {name}: MV must be 0 or 1, and 1 only for the types of the decode schedule "
                             f"({sorted(n for n, c in _names().items() if c in mv.STEP)})")
        for b in BUCKETS:
            if ent.get(b, {}).get("BM_MV", 1) not in (1, 2, 4, 8, 16):
                raise ValueError(f"{path}: {name}.rows{b}: BM_MV must be 1, 2, 4, 8 or 16")
        out[code] = ent
    return out


def _names() -> dict[str, int]:
    from gguf.constants import GGMLQuantizationType as GT
    return {GT(t).name: c for t, c in QT_CODES.items()}


TUNING: dict[int, dict] = load_tuning()


def bucket_of(rows: int, n_experts: int) -> int:
    """The rows bucket of a launch of `rows` (token, rank) rows over a layer of `n_experts`: 1 while the rows are at
    most one per expert on average (decode, short prompts), else 16."""
    return 1 if rows <= n_experts else 16


def config(qt: int, bucket: int = 16) -> dict:
    """The launch constants of kernel type code `qt` for a rows bucket: CONFIG, the tuning's reduction keys and
    bucket schedule, then TYPE_CONFIG's overrides."""
    t = TUNING.get(qt, {})
    return {**CONFIG, **t.get("reduce", {}), **t.get(bucket, {}), **TYPE_CONFIG.get(qt, {})}


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
def _part_rows(base, starts_ptr, e, part: tl.constexpr, n, row_bytes, ALIGNED: tl.constexpr, RA: tl.constexpr,
               TL: tl.constexpr = 0, TB: tl.constexpr = 0):
    """Byte addresses [BN] int64 in the pool of rows n of part `part` (gate 0, up 1, down 2) of expert e. ALIGNED:
    every row starts at a multiple of RA bytes (16-byte aligned part + row_bytes a multiple of RA), which lets the
    compiler load a block's bytes in RA-byte words (Triton only infers 16 | row_bytes by itself: rows of 252 or 330
    bytes were read byte by byte). TL = 1: the part in the tile layout (tile_layout), row n at its tile's start
    (n // TILE_ROWS) x TILE_ROWS x row_bytes + (n % TILE_ROWS) x TB (the type's block bytes); RA then that alignment."""
    b = base + tl.load(starts_ptr + e * 3 + part)
    if ALIGNED:
        b = tl.multiple_of(b, 16)
    if TL:
        n64 = n.to(tl.int64)
        r = b + (n64 // TILE_ROWS) * (TILE_ROWS * row_bytes) + (n64 % TILE_ROWS) * TB
    else:
        r = b + n.to(tl.int64) * row_bytes
    if ALIGNED:
        r = tl.multiple_of(r, RA)
    return r


@triton.jit
def _gu_chunk(h_ptr, xrow, mr, pool, tab, gra, ura, k0, k1, mn,
              QT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
              TL: tl.constexpr):
    """(gate, up) partial products [BN, BM] over K columns k0 .. k1 (BK steps), accumulated from zero."""
    accg = tl.zeros((BN, BM), dtype=tl.float32)
    accu = tl.zeros((BN, BM), dtype=tl.float32)
    for kk in range(k0, k1, BK):
        accg = wdot(accg, h_ptr, xrow, mr, pool, tab, gra, kk, mn, QT, BK, BN, IEEE, TL)
        accu = wdot(accu, h_ptr, xrow, mr, pool, tab, ura, kk, mn, QT, BK, BN, IEEE, TL)
    return accg, accu


@triton.jit
def _dn_chunk(x_ptr, xrow, mr, pool, tab, dra, k0, k1, mn,
              QT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
              TL: tl.constexpr):
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kk in range(k0, k1, BK):
        acc = wdot(acc, x_ptr, xrow, mr, pool, tab, dra, kk, mn, QT, BK, BN, IEEE, TL)
    return acc


@triton.jit
def _partial_ptr(ws_ptr, tile, c, NCH, WS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """[BN, BM] pointers to partial c of `tile` (WS floats per partial, the tile's NCH partials contiguous)."""
    o = (tile.to(tl.int64) * NCH + c) * WS
    return ws_ptr + o + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]


@triton.jit
def _arrive(cnt_ptr, tile, NCH):
    """After this program's partial is stored: True for the tile's last program to arrive (which then sums the
    partials in chunk order, 0 + p_0 + p_1 + ... as the walking loop does, and resets the counter for the next
    launch). The barrier + acq_rel atomic make every
    thread's partial visible before the count (CUTLASS's semaphore pattern); the last program reads with .cg."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == NCH - 1
    return done


@triton.jit
def _gate_up_kernel(h_ptr, pool, tab, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr,
                    H, F, row_bytes, n_exp, k_top, limit, KC,
                    QT: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr,
                    RA: tl.constexpr, SPLIT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr,
                    TB: tl.constexpr = 0, RAT: tl.constexpr = 1):
    """TB > 0 (the launch's bank may hold tile-layout experts; TB = the type's block bytes, RAT the tiled rows'
    alignment): bit 0 of an expert's base offset flags its slot in the tile layout (tile_layout), read with the
    tiled addresses (the bit masked off); TB 0: every expert GGUF, no check (the kernel as before)."""
    pn = tl.program_id(0)
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base != -1:
        if TB == 0:
            _gate_up_body(h_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                          row_bytes, k_top, limit, KC, pn, e, mb, base, QT, HAS_LIMIT, IEEE, ALIGNED, RA, SPLIT, BM, BN,
                          BK, 0, 0)
        elif (base & 1) == 0:
            _gate_up_body(h_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                          row_bytes, k_top, limit, KC, pn, e, mb, base, QT, HAS_LIMIT, IEEE, ALIGNED, RA, SPLIT, BM, BN,
                          BK, 0, TB)
        else:
            _gate_up_body(h_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                          row_bytes, k_top, limit, KC, pn, e, mb, base - 1, QT, HAS_LIMIT, IEEE, ALIGNED, RAT, SPLIT,
                          BM, BN, BK, 1, TB)


@triton.jit
def _gate_up_body(h_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                  k_top, limit, KC, pn, e, mb, base,
                  QT: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr,
                  RA: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  TL: tl.constexpr, TB: tl.constexpr):
    """_gate_up_kernel's program for row block mb of expert e at pool offset base, its weights in layout TL."""
    rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, BM)
    tok = flat // k_top
    n = pn * BN + tl.arange(0, BN)
    mn = n < F
    gra = _part_rows(base, starts_ptr, e, 0, n, row_bytes, ALIGNED, RA, TL, TB)
    ura = _part_rows(base, starts_ptr, e, 1, n, row_bytes, ALIGNED, RA, TL, TB)
    NCH = (H + KC - 1) // KC
    xrow = tok * H
    if SPLIT:                           # this program: chunk program_id(2) of the tile
        pc = tl.program_id(2)
        accg, accu = _gu_chunk(h_ptr, xrow, mr, pool, tab, gra, ura, pc * KC, tl.minimum(pc * KC + KC, H), mn,
                               QT, BN, BM, BK, IEEE, TL)
        tile = tl.program_id(1) * tl.num_programs(0) + pn
        pp = _partial_ptr(ws_ptr, tile, pc, NCH, 2 * BN * BM, BN, BM)
        tl.store(pp, accg)
        tl.store(pp + BN * BM, accu)
        last = _arrive(cnt_ptr, tile, NCH)
        if last:                        # 0 + p_0 + p_1 + ... in chunk order
            totg = tl.zeros((BN, BM), dtype=tl.float32)
            totu = tl.zeros((BN, BM), dtype=tl.float32)
            for c in range(0, NCH):
                pp = _partial_ptr(ws_ptr, tile, c, NCH, 2 * BN * BM, BN, BM)
                totg = totg + tl.load(pp, cache_modifier=".cg")
                totu = totu + tl.load(pp + BN * BM, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _gu_store(totg, totu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT)
    else:                               # the same partials and sums, in one (pipelined) loop over K
        totg = tl.zeros((BN, BM), dtype=tl.float32)
        totu = tl.zeros((BN, BM), dtype=tl.float32)
        accg = tl.zeros((BN, BM), dtype=tl.float32)
        accu = tl.zeros((BN, BM), dtype=tl.float32)
        for kk in range(0, H, BK):
            accg = wdot(accg, h_ptr, xrow, mr, pool, tab, gra, kk, mn, QT, BK, BN, IEEE, TL)
            accu = wdot(accu, h_ptr, xrow, mr, pool, tab, ura, kk, mn, QT, BK, BN, IEEE, TL)
            if ((kk + BK) % KC == 0) | (kk + BK >= H):          # a chunk ends: add its partial, restart
                totg = totg + accg
                totu = totu + accu
                accg = tl.zeros((BN, BM), dtype=tl.float32)
                accu = tl.zeros((BN, BM), dtype=tl.float32)
        _gu_store(totg, totu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT)


@triton.jit
def _gu_store(accg, accu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:                           # DeepSeek-V4's clamped SwiGLU
        accg = tl.minimum(accg, limit)
        accu = tl.minimum(tl.maximum(accu, -limit), limit)
    act = accg / (1.0 + tl.exp(-accg)) * accu
    ptr = inter_ptr + rows.to(tl.int64)[None, :] * F + n[:, None]
    tl.store(ptr, act.to(inter_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])


@triton.jit
def _down_kernel(inter_ptr, pool, tab, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr,
                 H, F, row_bytes, n_exp, KC,
                 QT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr, RA: tl.constexpr, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr,
                 TB: tl.constexpr = 0, RAT: tl.constexpr = 1):
    """TB, RAT: as _gate_up_kernel's (bit 0 of a base offset: a tile-layout slot)."""
    pn = tl.program_id(0)
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base != -1:
        if TB == 0:
            _down_body(inter_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                       KC, pn, e, mb, base, QT, IEEE, ALIGNED, RA, SPLIT, BM, BN, BK, 0, 0)
        elif (base & 1) == 0:
            _down_body(inter_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                       KC, pn, e, mb, base, QT, IEEE, ALIGNED, RA, SPLIT, BM, BN, BK, 0, TB)
        else:
            _down_body(inter_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                       KC, pn, e, mb, base - 1, QT, IEEE, ALIGNED, RAT, SPLIT, BM, BN, BK, 1, TB)


@triton.jit
def _down_body(inter_ptr, pool, tab, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes, KC,
               pn, e, mb, base, QT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr, RA: tl.constexpr,
               SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TL: tl.constexpr,
               TB: tl.constexpr):
    """_down_kernel's program for row block mb of expert e at pool offset base, its weights in layout TL."""
    rows, mr, flat = _rows_of(off_ptr, rows_ptr, e, mb, BM)
    n = pn * BN + tl.arange(0, BN)
    mn = n < H
    dra = _part_rows(base, starts_ptr, e, 2, n, row_bytes, ALIGNED, RA, TL, TB)
    xrow = rows.to(tl.int64) * F
    NCH = (F + KC - 1) // KC
    ptr = y_ptr + flat[None, :] * H + n[:, None]
    if SPLIT:
        pc = tl.program_id(2)
        acc = _dn_chunk(inter_ptr, xrow, mr, pool, tab, dra, pc * KC, tl.minimum(pc * KC + KC, F), mn,
                        QT, BN, BM, BK, IEEE, TL)
        tile = tl.program_id(1) * tl.num_programs(0) + pn
        tl.store(_partial_ptr(ws_ptr, tile, pc, NCH, BN * BM, BN, BM), acc)
        last = _arrive(cnt_ptr, tile, NCH)
        if last:
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            for c in range(0, NCH):
                tot = tot + tl.load(_partial_ptr(ws_ptr, tile, c, NCH, BN * BM, BN, BM), cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            tl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])
    else:
        tot = tl.zeros((BN, BM), dtype=tl.float32)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for kk in range(0, F, BK):
            acc = wdot(acc, inter_ptr, xrow, mr, pool, tab, dra, kk, mn, QT, BK, BN, IEEE, TL)
            if ((kk + BK) % KC == 0) | (kk + BK >= F):
                tot = tot + acc
                acc = tl.zeros((BN, BM), dtype=tl.float32)
        tl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])


@triton.jit
def _mv_rows(off_ptr, rows_ptr, e, mb, BM: tl.constexpr):
    """Block mb of expert e row by row: tuples of BM one-element tensors (sorted-row index, in range, token*k+rank
    int64 of the row, or of the expert's last row past its end: every row's activations can be read unmasked, and
    only rows in range are stored)."""
    r0 = tl.load(off_ptr + e) + mb * BM
    last = tl.load(off_ptr + e + 1) - 1
    rows, mrs, flats = (), (), ()
    for i in tl.static_range(BM):
        r = r0 + i + tl.arange(0, 1)
        rows, mrs = rows + (r,), mrs + (r <= last,)
        flats = flats + (tl.load(rows_ptr + tl.minimum(r, last)).to(tl.int64),)
    return rows, mrs, flats


@triton.jit
def _mv_zeros_rows(BN: tl.constexpr, BM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """BM accumulators [BN, D1, D2, D3] (a tuple: one per row, each in the weights' own layout)."""
    accs = ()
    for i in tl.static_range(BM):
        accs = accs + (mv.mv_zeros(BN, D1, D2, D3),)
    return accs


@triton.jit
def _mv_step(accs, w, xps, kk, BM: tl.constexpr):
    """One K step of BM rows with the weight tile w [BN, D1, D2, D3] held: row i's accumulator gets w x its row's
    activations at xps[i] + kk (mv_acc), the same float ops as a program of that row alone."""
    out = ()
    for i in tl.static_range(BM):
        out = out + (mv.mv_acc(accs[i], w, tl.load(xps[i] + kk).to(tl.float32)),)
    return out


@triton.jit
def _mv_gu_chunk(pool, gra, ura, mn, xps, k0, k1, QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, S: tl.constexpr):
    """The decode schedule's gate and up accumulators (BM rows each) over K columns k0 .. k1, from zero."""
    accg = _mv_zeros_rows(BN, BM, D1, D2, D3)
    accu = _mv_zeros_rows(BN, BM, D1, D2, D3)
    for kk in range(k0, k1, S):
        accg = _mv_step(accg, mv.mv_weights(pool, gra, kk, mn, QT, D1, D2, D3), xps, kk, BM)
        accu = _mv_step(accu, mv.mv_weights(pool, ura, kk, mn, QT, D1, D2, D3), xps, kk, BM)
    return accg, accu


@triton.jit
def _mv_dn_chunk(pool, dra, mn, xps, k0, k1, QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, S: tl.constexpr):
    acc = _mv_zeros_rows(BN, BM, D1, D2, D3)
    for kk in range(k0, k1, S):
        acc = _mv_step(acc, mv.mv_weights(pool, dra, kk, mn, QT, D1, D2, D3), xps, kk, BM)
    return acc


@triton.jit
def _mv_part_ptr(ws_ptr, tile, c, NCH, WS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, i: tl.constexpr):
    """[BN, 1] pointers to row i's column of partial c of `tile` ([BN, BM] floats, WS floats a partial)."""
    return ws_ptr + (tile.to(tl.int64) * NCH + c) * WS + tl.arange(0, BN)[:, None] * BM + i


@triton.jit
def _gate_up_mv_kernel(h_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                       row_bytes, n_exp, k_top, limit, KC, QT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       RA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                       D3: tl.constexpr, S: tl.constexpr, LOG2S: tl.constexpr, EP: tl.constexpr,
                       CHUNKS: tl.constexpr = False, SPLIT: tl.constexpr = False):
    """The decode schedule (triton_mmvq): BN output columns of gate and up for BM rows of one expert, all of H; each
    K step's weights are loaded and decoded once and applied to the BM rows in turn (llama.cpp's mmvq ncols_y).
    CHUNKS (the reduction key KC): each KC chunk's outputs (the tree over its accumulator) summed 0 + t_0 + t_1 + ...
    in chunk order; SPLIT: one program a chunk (program_id(2)), the tile's last sums the stored partials."""
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base != -1:
        rows, mrs, flats = _mv_rows(off_ptr, rows_ptr, e, mb, BM)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        mn = n < F
        gra = _part_rows(base, starts_ptr, e, 0, n, row_bytes, True, RA)
        ura = _part_rows(base, starts_ptr, e, 1, n, row_bytes, True, RA)
        xps = ()
        for i in tl.static_range(BM):
            xps = xps + (mv.mv_xptr(h_ptr, (flats[i] // k_top) * H, QT, D1, D2, D3),)
        if not CHUNKS:                      # one chunk: the schedule's arithmetic before K chunks, unchanged
            accg, accu = _mv_gu_chunk(pool, gra, ura, mn, xps, 0, H, QT, BM, BN, D1, D2, D3, S)
            for i in tl.static_range(BM):
                _gu_store(mv.mv_total(accg[i], BN, S, LOG2S), mv.mv_total(accu[i], BN, S, LOG2S), inter_ptr,
                          rows[i], mrs[i], n, mn, F, limit, HAS_LIMIT)
        else:
            NCH = (H + KC - 1) // KC
            WS: tl.constexpr = 2 * BN * BM
            if SPLIT:
                pc = tl.program_id(2)
                accg, accu = _mv_gu_chunk(pool, gra, ura, mn, xps, pc * KC, tl.minimum(pc * KC + KC, H), QT, BM, BN,
                                          D1, D2, D3, S)
                tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
                for i in tl.static_range(BM):
                    pp = _mv_part_ptr(ws_ptr, tile, pc, NCH, WS, BN, BM, i)
                    tl.store(pp, mv.mv_total(accg[i], BN, S, LOG2S))
                    tl.store(pp + BN * BM, mv.mv_total(accu[i], BN, S, LOG2S))
                if _arrive(cnt_ptr, tile, NCH):
                    for i in tl.static_range(BM):       # 0 + t_0 + t_1 + ... in chunk order, as the walk below
                        tg = tl.zeros((BN, 1), dtype=tl.float32)
                        tu = tl.zeros((BN, 1), dtype=tl.float32)
                        for c in range(0, NCH):
                            pp = _mv_part_ptr(ws_ptr, tile, c, NCH, WS, BN, BM, i)
                            tg = tg + tl.load(pp, cache_modifier=".cg")
                            tu = tu + tl.load(pp + BN * BM, cache_modifier=".cg")
                        _gu_store(tg, tu, inter_ptr, rows[i], mrs[i], n, mn, F, limit, HAS_LIMIT)
                    tl.atomic_xchg(cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), 0)
            else:
                tgs = _mv_zeros_rows(BN, BM, 1, 1, 1)
                tus = _mv_zeros_rows(BN, BM, 1, 1, 1)
                for c in range(0, NCH):
                    accg, accu = _mv_gu_chunk(pool, gra, ura, mn, xps, c * KC, tl.minimum(c * KC + KC, H), QT, BM,
                                              BN, D1, D2, D3, S)
                    tgs2, tus2 = (), ()
                    for i in tl.static_range(BM):
                        tgs2 = tgs2 + (tgs[i] + tl.reshape(mv.mv_total(accg[i], BN, S, LOG2S), (BN, 1, 1, 1)),)
                        tus2 = tus2 + (tus[i] + tl.reshape(mv.mv_total(accu[i], BN, S, LOG2S), (BN, 1, 1, 1)),)
                    tgs, tus = tgs2, tus2
                for i in tl.static_range(BM):
                    _gu_store(tl.reshape(tgs[i], (BN, 1)), tl.reshape(tus[i], (BN, 1)), inter_ptr, rows[i], mrs[i],
                              n, mn, F, limit, HAS_LIMIT)


@triton.jit
def _down_mv_kernel(inter_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F, row_bytes,
                    n_exp, KC, QT: tl.constexpr, RA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, S: tl.constexpr, LOG2S: tl.constexpr,
                    EP: tl.constexpr, CHUNKS: tl.constexpr = False, SPLIT: tl.constexpr = False):
    e, mb, base = _find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base != -1:
        rows, mrs, flats = _mv_rows(off_ptr, rows_ptr, e, mb, BM)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        mn = n < H
        dra = _part_rows(base, starts_ptr, e, 2, n, row_bytes, True, RA)
        xps = ()
        for i in tl.static_range(BM):
            xps = xps + (mv.mv_xptr(inter_ptr, tl.minimum(rows[i], tl.load(off_ptr + e + 1) - 1).to(tl.int64) * F,
                                    QT, D1, D2, D3),)
        if not CHUNKS:
            acc = _mv_dn_chunk(pool, dra, mn, xps, 0, F, QT, BM, BN, D1, D2, D3, S)
            for i in tl.static_range(BM):
                tot = mv.mv_total(acc[i], BN, S, LOG2S)
                tl.store(y_ptr + flats[i][None, :] * H + n[:, None], tot.to(y_ptr.dtype.element_ty),
                         mask=mn[:, None] & mrs[i][None, :])
        else:
            NCH = (F + KC - 1) // KC
            WS: tl.constexpr = BN * BM
            if SPLIT:
                pc = tl.program_id(2)
                acc = _mv_dn_chunk(pool, dra, mn, xps, pc * KC, tl.minimum(pc * KC + KC, F), QT, BM, BN, D1, D2, D3,
                                   S)
                tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
                for i in tl.static_range(BM):
                    tl.store(_mv_part_ptr(ws_ptr, tile, pc, NCH, WS, BN, BM, i), mv.mv_total(acc[i], BN, S, LOG2S))
                if _arrive(cnt_ptr, tile, NCH):
                    for i in tl.static_range(BM):
                        tot = tl.zeros((BN, 1), dtype=tl.float32)
                        for c in range(0, NCH):
                            tot = tot + tl.load(_mv_part_ptr(ws_ptr, tile, c, NCH, WS, BN, BM, i), cache_modifier=".cg")
                        tl.store(y_ptr + flats[i][None, :] * H + n[:, None], tot.to(y_ptr.dtype.element_ty),
                                 mask=mn[:, None] & mrs[i][None, :])
                    tl.atomic_xchg(cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), 0)
            else:
                tots = _mv_zeros_rows(BN, BM, 1, 1, 1)
                for c in range(0, NCH):
                    acc = _mv_dn_chunk(pool, dra, mn, xps, c * KC, tl.minimum(c * KC + KC, F), QT, BM, BN, D1, D2, D3,
                                       S)
                    t2 = ()
                    for i in tl.static_range(BM):
                        t2 = t2 + (tots[i] + tl.reshape(mv.mv_total(acc[i], BN, S, LOG2S), (BN, 1, 1, 1)),)
                    tots = t2
                for i in tl.static_range(BM):
                    tl.store(y_ptr + flats[i][None, :] * H + n[:, None], tl.reshape(tots[i], (BN, 1)).to(
                        y_ptr.dtype.element_ty), mask=mn[:, None] & mrs[i][None, :])


def _mv_dims(qt: int) -> dict:
    d1, d2, d3 = mv.DIMS[qt]
    return dict(D1=d1, D2=d2, D3=d3, S=mv.STEP[qt], LOG2S=mv.log2(mv.STEP[qt]))


def mv_ok(qt: int, K: int, row_bytes: int, aligned: bool, kc: int = 0) -> bool:
    """Whether a launch of type code qt over K columns can take the decode schedule (triton_mmvq): rows at 4-byte
    multiples (word loads), K whole steps, and K chunks of kc (the reduction key KC; 0 = one) whole steps."""
    return (qt in mv.STEP and aligned and row_bytes % mv.ROW_ALIGN.get(qt, 4) == 0 and K % mv.STEP[qt] == 0
            and (kc <= 0 or kc >= K or kc % mv.STEP[qt] == 0))


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, rows_ptr, H, k_top, BN: tl.constexpr, ROWS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = n < H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r in range(0, k_top):
        w = tl.load(w_ptr + t * k_top + r).to(tl.float32)
        yr = tl.load(y_ptr + (t * k_top + r) * H + n, mask=mn, other=0).to(tl.float32)
        acc = acc + w * yr
    o = tl.load(rows_ptr + t).to(tl.int64) if ROWS else t
    tl.store(out_ptr + o * H + n, acc.to(out_ptr.dtype.element_ty), mask=mn)


@triton.jit(do_not_specialize=["n"])
def _sort_rows_kernel(ids_ptr, n, counts_ptr, rows_ptr, off_ptr, E, EP: tl.constexpr, BI: tl.constexpr):
    """One program: a routing's rows (ids [n] expert ids, row i = token*k + rank) sorted by expert, stably as
    torch.argsort(ids, stable=True): row i goes to off[ids[i]] + the number of rows j < i of its expert. counts [E]
    int64 (rows per expert), off [E+1] int32 (0, then their running sum). Integers: the same values as the torch ops
    (sort_rows)."""
    e = tl.arange(0, EP)
    me = e < E
    cnt = tl.zeros((EP,), dtype=tl.int32)
    for i0 in range(0, n, BI):
        i = i0 + tl.arange(0, BI)
        f = tl.load(ids_ptr + i, mask=i < n, other=-1)
        cnt += tl.sum((f[None, :] == e[:, None]).to(tl.int32), axis=1)
    tl.store(counts_ptr + e, cnt.to(tl.int64), mask=me)
    tl.store(off_ptr + 1 + e, tl.cumsum(cnt, axis=0), mask=me)
    tl.store(off_ptr + e, cnt * 0, mask=e == 0)
    tl.debug_barrier()                               # off written before any program thread reads it back
    for i0 in range(0, n, BI):
        i = i0 + tl.arange(0, BI)
        mi = i < n
        f = tl.load(ids_ptr + i, mask=mi, other=-1)
        rank = tl.zeros((BI,), dtype=tl.int32)
        for j0 in range(0, i0 + BI, BI):             # the rows before i (only the blocks up to i's)
            j = j0 + tl.arange(0, BI)
            g = tl.load(ids_ptr + j, mask=j < n, other=-2)
            rank += tl.sum(((g[None, :] == f[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
        start = tl.load(off_ptr + f, mask=mi, other=0)
        tl.store(rows_ptr + start + rank, i.to(tl.int32), mask=mi)


def _launch_rows(R: int, E: int, BM: int) -> int:
    """Upper bound of the row blocks of R rows over E experts (each expert with rows adds at most one partial block;
    blocks of one row: exactly R)."""
    return R if BM == 1 else cdiv(R, BM) + min(R, E)


_WS: dict = {}
_WS_OLD: list = []        # replaced counters stay alive: a captured CUDA graph may still point at them


def _workspace(dev: torch.device, n_floats: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials >= n_floats, int32 tile counters >= n_tiles, all zero) for launches on the current stream
    of `dev`: launches on one stream run one after the other, and each tile's last program resets its counter.

    The partials are allocated once per stream at WS_LIMIT (every split launch's partials fit it: _plan's launches
    walk their chunks otherwise), never grown: a workspace grown launch by launch left each smaller one
    alive (a captured graph may point at it), ~4.5x the largest over decode's T = 1..8 (~120 MB on the bench
    geometry: the attach warm-ups' +200 MiB of torch's reserve, docs/benchmarks/gpu-run46-serve). So a stream holds
    exactly WS_LIMIT: the plan counts two (store/plan.py SPLITK_WORKSPACE_BYTES: eager passes, graph captures)."""
    key = (dev, stream_key(dev.index) if dev.type == "cuda" else 0)      # the stream without a Stream (streams.py)
    ws, cnt = _WS.get(key, (None, None))
    if ws is None:
        ws = torch.empty(max(n_floats, WS_LIMIT // 4), dtype=torch.float32, device=dev)
    assert ws.numel() >= n_floats, (n_floats, ws.numel())    # split launches' partials are held to WS_LIMIT
    if cnt is None or cnt.numel() < n_tiles:
        if cnt is not None:
            _WS_OLD.append(cnt)
        cnt = torch.zeros(max(n_tiles, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=dev)
    _WS[key] = (ws, cnt)
    return ws, cnt


_GGUF_TYPE = {c: t for t, c in QT_CODES.items()}       # kernel type code -> GGML type


def tile_consts(qt: int) -> dict:
    """The constexprs of a launch whose bank may hold tile-layout experts of kernel type code qt: TB the type's block
    bytes (tile_layout.unit), RAT the alignment of a tiled row (a multiple of TB in its 16-byte aligned part)."""
    tb = unit(_GGUF_TYPE[qt])[1]
    return dict(TB=tb, RAT=_row_align(tb))


def _row_align(row_bytes: int) -> int:
    """The largest power of two <= 16 dividing row_bytes (with 16-byte aligned parts: every row's alignment)."""
    return min(16, row_bytes & -row_bytes)


# the launches, counted per kernel (kernels/triton_launch.py)
_GATE_UP, _DOWN, _GATE_UP_MV, _DOWN_MV, _COMBINE, _SORT_ROWS = map(launcher, (
    _gate_up_kernel, _down_kernel, _gate_up_mv_kernel, _down_mv_kernel, _combine_kernel, _sort_rows_kernel))
# routings of up to this many rows (T x k; decode's: max_running x k) are sorted by _sort_rows_kernel in one launch;
# more (prefill) by torch's ops (~8 launches: counts, argsort, the offsets), whose values are the same
SORT_ROWS_MAX = 1024


def gate_up(h, pool, base, starts, rows, off, inter, n_ff: int, k_top: int, qt: int, limit: float | None,
            row_bytes: int, aligned: bool, tiled: bool = False):
    """h [T,H]; base [E] int64 (-1 = skip); starts [E,3] int64; rows [R] int32 sorted (token*k+rank);
    off [E+1] int32 row offsets per expert; inter [R, F] (written for the rows of experts in the group);
    row_bytes: bytes of one H-element row of gate/up; aligned: every tensor start is 16-byte aligned. tiled: the
    bank may hold experts in the tile layout (tile_layout; bit 0 of such an expert's base set, its parts' rows whole
    tiles): the kernel reads each expert in its layout, the same bits; off by default (the launch as before)."""
    H = h.shape[1]
    dev = pool.device
    _, _, nf, nt, kernel, grid, mv_, tail, kw, tab = _plan("gate_up", qt, rows.numel(), base.numel(), H, n_ff, k_top,
                                                            limit, row_bytes, aligned, h.dtype, dev, tiled)
    ws, cnt = _workspace(dev, nf, nt)
    head = (h, pool, base, starts, rows, off, inter) if mv_ else (h, pool, tab, base, starts, rows, off, inter)
    kernel[grid](*head, ws, cnt, *tail, **kw)


def down(inter, pool, base, starts, rows, off, y, n_tokens: int, qt: int, row_bytes: int, aligned: bool,
         tiled: bool = False):
    """inter [R, F]; y [T*k, H] (rows of experts in the group written); row_bytes: of one F-element down row;
    tiled: as gate_up's."""
    dev = pool.device
    _, _, nf, nt, kernel, grid, mv_, tail, kw, tab = _plan("down", qt, rows.numel(), base.numel(), inter.shape[1],
                                                            y.shape[1], 0, None, row_bytes, aligned, inter.dtype, dev,
                                                            tiled)
    ws, cnt = _workspace(dev, nf, nt)
    head = (inter, pool, base, starts, rows, off, y) if mv_ else (inter, pool, tab, base, starts, rows, off, y)
    kernel[grid](*head, ws, cnt, *tail, **kw)


# the launches' plans (_plan) by what they depend on besides the tensors: a decode step's groups repeat a few shapes,
# and building one (the configs, grid, workspace size and constexprs) is ~2/3 of a group's Python before Triton's
# dispatch (docs/benchmarks/cpu-host47). Each use checks the plan's configs against config()'s now: TUNING and
# TYPE_CONFIG may be edited in place (tests, the tuning scripts), and an edit makes a new plan. Bounded: prefill's
# rows take any count (a chunk's T x k), so past PLANS_MAX plans the memo starts over (decode's few come back at once).
_PLANS: dict = {}
PLANS_MAX = 4096


def _plan(which: str, qt: int, R: int, E: int, K: int, N: int, k_top: int, limit: float | None, row_bytes: int,
          aligned: bool, dtype: torch.dtype, device, tiled: bool = False) -> tuple:
    """gate_up (K = H, N = n_ff) or down (K = F, N = H) of R rows over E experts -> (its config, config(qt), workspace
    floats, tiles, kernel, grid, mv, the positional arguments after ws/cnt, the keywords, tables or None): exactly the
    arguments of the launch rules below, built once per key and configs. tiled: gate_up's (the MMA path's kernels
    with TB, the type's block bytes, and RAT; the decode schedule (MV) reads GGUF only: a tiled launch its config
    would give it raises, as it would read the tiled experts wrong)."""
    c, c16 = config(qt, bucket_of(R, E)), config(qt)
    key = (which, qt, R, E, K, N, k_top, limit, row_bytes, aligned, dtype, device, tiled)
    p = _PLANS.get(key)
    if p is not None and p[0] == c and p[1] == c16:
        return p
    gu = which == "gate_up"
    bn = c["BN_GATE_UP"] if gu else c["BN"]
    grid_n = cdiv(N, bn)
    lim = float(limit) if limit is not None else 0.0
    if c["MV"] and mv_ok(qt, K, row_bytes, aligned, c["KC"]):
        if tiled:
            raise ValueError(f"kernel type {qt}: the decode schedule (MV) has no tile layout")
        # the decode schedule: grid (output blocks, row blocks[, chunks]); K chunks (KC, a reduction key) when
        # 0 < KC < K, as programs when the bucket says SPLIT and the partials fit WS_LIMIT, else walked: the same sums
        consts = (dict(QT=qt, HAS_LIMIT=limit is not None, RA=_row_align(row_bytes), BN=bn) if gu else
                  dict(QT=qt, RA=_row_align(row_bytes), BN=bn))
        per = (2 if gu else 1) * bn * c["BM_MV"]
        kc = c["KC"] if 0 < c["KC"] < K else 0
        nrb = _launch_rows(R, E, c["BM_MV"])
        nch = cdiv(K, kc) if kc else 1
        split = kc > 0 and bool(c["SPLIT"]) and grid_n * nrb * nch * per * 4 <= WS_LIMIT
        nf, nt = (grid_n * nrb * nch * per, grid_n * nrb) if split else (1, 1)
        tail = ((K, N, row_bytes, E, k_top, lim) if gu else (N, K, row_bytes, E)) + (kc,)
        kw = dict(**consts, BM=c["BM_MV"], **_mv_dims(qt), EP=pow2(E), CHUNKS=kc > 0, SPLIT=split,
                  num_warps=c["num_warps"], num_stages=c["num_stages"])
        p = (c, c16, nf, nt, _GATE_UP_MV if gu else _DOWN_MV, (grid_n, nrb, nch) if split else (grid_n, nrb), True,
             tail, kw, None)
    else:
        # grid (output blocks, row blocks[, chunks]); chunks as programs when the bucket says SPLIT and the partials
        # fit WS_LIMIT, else walked by one program (the same sums)
        H, F = (K, N) if gu else (N, K)
        consts = dict(QT=qt, HAS_LIMIT=limit is not None) if gu else dict(QT=qt)
        consts.update(IEEE=dtype == torch.float32, ALIGNED=aligned, RA=_row_align(row_bytes))
        if tiled:               # bit 0 of a base offset: a tile-layout expert (rows at multiples of its block bytes)
            consts.update(tile_consts(qt))
        bk = block_k(qt, H, F)
        kc = chunk(qt, K, bk)
        nch = cdiv(K, kc)
        nrb = _launch_rows(R, E, c["BM"])
        per = (2 if gu else 1) * bn * c["BM"]
        split = bool(c["SPLIT"]) and nch > 1 and grid_n * nrb * nch * per * 4 <= WS_LIMIT
        nf, nt = (grid_n * nrb * nch * per, grid_n * nrb) if split else (1, 1)
        tail = ((H, N, row_bytes, E, k_top, lim) if gu else (H, F, row_bytes, E)) + (kc,)
        kw = dict(**consts, SPLIT=split, BM=c["BM"], BN=bn, BK=bk, EP=pow2(E), num_warps=c["num_warps"],
                  num_stages=c["num_stages"])
        p = (c, c16, nf, nt, _GATE_UP if gu else _DOWN, (grid_n, nrb, nch) if split else (grid_n, nrb), False, tail,
             kw, tables(device))
    if len(_PLANS) >= PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = p
    return p


def launch_kinds(qg: int, qd: int, E: int, H: int, F: int, k: int, limit: float | None, rg: int, rd: int,
                 aligned: bool, dtype: torch.dtype, device, t_max: int) -> list[int]:
    """The fewest tokens T (1..t_max, T x k rows) that launch each distinct pair of (gate_up, down) variants: a
    variant's key is its kernel and constexprs (the rows bucket's schedule, split-K or walked, BM/BN/..), which R
    only picks through bucket_of and WS_LIMIT (both thresholds in R); the runtime ints are R-free. So warming these
    T compiles every variant a pass of up to t_max tokens can launch (MoEKernels.warm: prefill's too, issue 21; a
    16-token request launches split-K rows-1 variants, a 512-token prompt unsplit rows-16 ones)."""
    seen, out = set(), []
    for T in range(1, t_max + 1):
        R = T * k
        g = _plan("gate_up", qg, R, E, H, F, k, limit, rg, aligned, dtype, device)
        d = _plan("down", qd, R, E, F, H, 0, None, rd, aligned, dtype, device)
        key = tuple((p[4].name, len(p[5]), tuple(sorted(p[8].items()))) for p in (g, d))
        if key not in seen:
            seen.add(key)
            out.append(T)
        if bucket_of(R, E) == 16 and not g[8]["SPLIT"] and not d[8]["SPLIT"]:
            break       # past the last threshold: more rows keep the rows-16 bucket and walk their chunks
    return out


def sort_rows(flat: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flat [n] int64 expert ids (n <= SORT_ROWS_MAX) -> (counts [E] int64, rows [n] int32 = argsort(flat, stable),
    off [E+1] int32 = 0, cumsum(counts)) in one launch (_sort_rows_kernel)."""
    n = flat.shape[0]
    assert n <= SORT_ROWS_MAX, n
    counts = torch.empty(E, dtype=torch.int64, device=flat.device)
    rows = torch.empty(n, dtype=torch.int32, device=flat.device)
    off = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
    _SORT_ROWS[(1,)](flat, n, counts, rows, off, E, EP=pow2(E), BI=32)
    return counts, rows, off


def combine(y, w, out, rows=None):
    """y [T*k, H], w [T, k] -> out [T, H] = sum over ranks in order (float32 accumulation); rows [T]: row t into
    out[rows[t]] instead (out [B, H] contiguous: the batched decode lanes' rows, no index_copy_)."""
    T, k = w.shape
    H = y.shape[1]
    assert out.is_contiguous() and out.shape[1] == H, (out.shape, H)
    _COMBINE[(T, cdiv(H, 256))](y, w.contiguous(), out, rows if rows is not None else w, H, k, BN=256,
                                              ROWS=rows is not None)
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


def chunk(qt: int, K: int, bk: int) -> int:
    """The K chunk (elements) of type code qt over K columns: its config's KC (a multiple of bk), all of K for KC 0
    or KC >= K. A reduction key: the same for every rows bucket."""
    kc = config(qt)["KC"]
    if kc <= 0 or kc >= K:
        return K
    assert kc % bk == 0, (qt, kc, bk)
    return kc
