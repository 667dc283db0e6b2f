#!/usr/bin/env python3
"""The Gluon bf16 MMA of Q8_0, MXFP4 and Q4_K (betelgeuse/kernels/gluon_mmq.py, triton_mmq's schedule key GL 1)
against triton_mmq's shipped bf16 MMA on the GPU (issue 23, docs/benchmarks/cpu-gluon55, cpu-gluonk57): bits, then
GB/s (H100 / H200, about two minutes for the three types, most of it compiles).

    PYTHONPATH=$PWD python3 deploy/device/check_gluon_mmq.py [--types Q8_0,MXFP4,Q4_K] [--forms NAMES] [--reps 32]
        [--no-time]
    TRITON_INTERPRET=1 .venv/bin/python deploy/device/check_gluon_mmq.py --dry-run   # CPU: the plumbing (~3 min)

Bits, per type: the bench geometry (H 2048, F 768, 128 experts, k_top 8), experts with valid scales (Q8_0 f16 in
[1e-3, 1e-2), MXFP4 E8M0 2^-10 .. 2^-7, Q4_K f16 d and dmin in [1e-4, 1e-3), random 6-bit scales and mins) and
random quants, random routing over a bank of 16 experts of which experts
0 and 1 lie BELOW the pool (negative offsets, as decode's at-hand table:
tests/kernels/test_mmq_bf16.py::test_experts_at_negative_offsets_are_computed), 2 tokens (16 rows: the 1-row bucket,
split-K) and 32 tokens (256 rows: the 16-row bucket, chunks walked), without and with the clamped SwiGLU (limit 7).
Per case and Gluon form (gl_forms: GL 1 at the shipped FUSE and unfused; GP 1 and 2 (the K loop's loads carried to
the step that uses them: cpu-gluon16r57; Q8_0 ships GL 1, FUSE 1, GP 1, Q4_K GL 1: gpu-run63; Q8_0's `gluon GP1 PK`:
the shipped form reading the bank packed by mma_pack on the GPU (pack_pool), cpu-pack62; `gluon GP1 PK2`: each
expert's layout from bit 0 of its base, a bank of packed and GGUF experts, cpu-vram62; Q4_K's `gluon PK` / `gluon
PK2` alike, cpu-packk62, and its GP forms `gluon GP1` / `gluon GP2` / `gluon GP1 PK` / `gluon GP2 PK` / `gluon GP1
PK2` / `gluon GP1 unfused` / `gluon GP1 PK unfused` / `gluon GP1 NR168` / `gluon GP1 PK NR168` / `gluon GP1 PK
NR128` / `gluon GP1 PK NR168/128` (NR, NRD: ptxas's register limit), cpu-gpk63; MXFP4's `gluon PK` / `gluon PK2` and
`gluon GP1 PK` / `gluon GP2 PK` / `gluon GP1 PK2`, cpu-mxpk63; MXFP4's and Q4_K's `gluon GP1 PK ST2` / `ST3` /
`ST4` / `gluon GP1 PK2 ST3`, Q4_K's `gluon GP1 PK ST4 NR168` / `NR168/128`, MXFP4's `gluon GP1 PK ST4 NR128`: the
weight words through a cp.async ring, cpu-mxtma65);
FUSE, GP, PK, ST, NR and NRD are schedule keys)
gate_up's inter and down's y (down on the same inter for both) must be torch.equal to the Triton kernel's (TRITON:
GL 0), and the Gluon kernels must have been launched (triton_launch.COUNTS); both are also held to a float reference
(the dequantized weights in float64 on the same bf16 activations; relative max error < 1e-2) so that two equal wrong
answers fail too (Q4_K's dequantization: checked against gguf.quants on the CPU by --dry-run).
PASS / FAIL line per check; exit 1 on any FAIL.
GB/s: expert bytes of a bank of 16 experts at 1 and 16 rows an expert (kernel_roofline's routing: each expert
exactly `rows` rows), CUDA-graph replays of `reps` launches rotating over banks > 512 MB (beyond the L2), median of 5:
gate_up, down and the pair, Triton beside each Gluon form, on the same warm GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))     # kernel_roofline (graph_gbps imports it when timing)

import torch  # noqa: E402

H, F, E, K_TOP, BANK = 2048, 768, 128, 8, 16          # the bench geometry; a ring bank of 16 experts
TYPES = {"Q8_0": (0, 32, 34), "MXFP4": (4, 32, 17), "Q4_K": (5, 256, 144)}  # name -> (type code, block elements,
QT, QK, BS = TYPES["Q8_0"]                             # block bytes); the type under test (set_type)
ROW_H, ROW_F = H // QK * BS, F // QK * BS               # its row bytes
KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]   # MXFP4's doubled e2m1 (llama.cpp kvalues_mxfp4)
dev = torch.device("cuda")
DT = torch.bfloat16                                    # inter's and y's dtype (the engine's; --dry-run: float32)
ONLY: list[str] | None = None                          # --forms
PAIR: dict = {}                                        # (type, form) -> {rows an expert: the pair's Gluon / Triton}


def set_type(name: str):
    global QT, QK, BS, ROW_H, ROW_F
    QT, QK, BS = TYPES[name]
    ROW_H, ROW_F = H // QK * BS, F // QK * BS


def slot_layout() -> tuple[list[int], int]:
    """(part starts in a slot, slot bytes): gate | up | down, parts 64-byte aligned, slots of 4 KiB (the worker's)."""
    starts, o = [], 0
    for n in (F * ROW_H, F * ROW_H, H * ROW_F):
        starts.append(o)
        o += -(-n // 64) * 64
    return starts, -(-o // 4096) * 4096


def make_pool(n_slots: int, slot: int, starts: list[int], g: torch.Generator) -> torch.Tensor:
    """n_slots experts of the type: random quants; Q8_0's f16 scales uniform in [1e-3, 1e-2), MXFP4's E8M0 bytes in
    118 .. 121 (2^-10 .. 2^-7; random bytes would be NaN / inf), Q4_K's f16 d and dmin in [1e-4, 1e-3) (its 6-bit
    scales and mins: any bytes)."""
    pool = torch.randint(0, 256, (n_slots * slot,), dtype=torch.uint8, device=dev, generator=g)
    for s in range(n_slots):
        for p, (rows, rb) in enumerate(((F, ROW_H), (F, ROW_H), (H, ROW_F))):
            blk = pool[s * slot + starts[p]: s * slot + starts[p] + rows * rb].view(-1, BS)
            if QT == 0:
                d = torch.empty(blk.shape[0], dtype=torch.float32, device=dev).uniform_(1e-3, 1e-2, generator=g)
                blk[:, :2] = d.half().view(torch.uint8).view(-1, 2)
            elif QT == 5:
                d = torch.empty(blk.shape[0], 2, dtype=torch.float32, device=dev).uniform_(1e-4, 1e-3, generator=g)
                blk[:, :4] = d.half().view(torch.uint8).view(-1, 4)
            else:
                blk[:, 0] = torch.randint(118, 122, (blk.shape[0],), dtype=torch.uint8, device=dev, generator=g)
    return pool


def pack_pool(pool: torch.Tensor, n_slots: int, slot: int, starts: list[int], which=None) -> torch.Tensor:
    """A copy of pool (n_slots slots of the type's experts: Q8_0, MXFP4 or Q4_K) with every part of the slots `which`
    (default all) in mma_pack's layout, what PK 1 reads (PK 2: those whose base has bit 0): a gather on the pool's
    device, part by part."""
    from betelgeuse.kernels import mma_pack
    out = pool.clone()
    for s in range(n_slots) if which is None else which:
        for p, (rows, K) in enumerate(((F, H), (F, H), (H, F))):
            at, n = s * slot + starts[p], rows * (K // QK * BS)
            out[at:at + n] = mma_pack.pack(pool[at:at + n], rows, K, QT)
    return out


def dequant(pool: torch.Tensor, at: int, rows: int, rb: int) -> torch.Tensor:
    """rows rows of the type at byte `at` of pool -> [rows, K] float64 (q * d; gguf's dequantization)."""
    blk = pool[at: at + rows * rb].view(rows, rb // BS, BS)
    if QT == 5:                     # super-blocks: d * sc_j * q - dmin * m_j, sub-block j of 32 (get_scale_min_k4)
        d = blk[:, :, 0:2].contiguous().view(torch.float16).double()                  # [rows, nsb, 1]
        dmin = blk[:, :, 2:4].contiguous().view(torch.float16).double()
        s = blk[:, :, 4:16].long()
        j = torch.arange(8, device=pool.device)
        lo = j < 4
        a, b, c = s[:, :, j % 4], s[:, :, 4 + j % 4], s[:, :, 8 + j % 4]      # [rows, nsb, 8]: scales[j % 4] ...
        sc = torch.where(lo, a & 63, (c & 15) | ((a >> 6) << 4)).double()
        mn = torch.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4)).double()
        qs = blk[:, :, 16:].long().view(rows, -1, 4, 1, 32)                          # group g: sub-blocks 2g, 2g+1
        q = torch.cat([qs & 15, qs >> 4], dim=3).view(rows, -1, 8, 32).double()
        return (d[..., None] * sc[..., None] * q - dmin[..., None] * mn[..., None]).reshape(rows, -1)
    if QT == 0:
        d = blk[:, :, :2].contiguous().view(torch.float16).double()           # [rows, nblk, 1]
        q = blk[:, :, 2:].contiguous().view(torch.int8).double()
    else:                           # d = 2^(e - 128); element j < 16: low nibble of byte 1 + j, else the high one
        d = torch.exp2(blk[:, :, :1].double() - 128)
        qs = blk[:, :, 1:].long()
        kv = torch.tensor(KVALUES, dtype=torch.float64, device=pool.device)
        q = torch.cat([kv[qs & 15], kv[qs >> 4]], dim=2)
    return (q * d).reshape(rows, -1)


def route(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (rows [R] int32: the token*k+rank indices sorted by expert, stable; off [E + 1] int32)."""
    flat = ids.reshape(-1)
    rows = torch.argsort(flat, stable=True).to(torch.int32)
    off = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    off[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    return rows, off


FORMS = {"gluon": {"GL": 1, "GP": 0}, "gluon unfused": {"GL": 1, "FUSE": 0, "GP": 0},  # name -> TYPE_CONFIG overrides
         "gluon GP1": {"GL": 1, "GP": 1}, "gluon GP2": {"GL": 1, "GP": 2},
         "gluon GP1 split16": {"GL": 1, "GP": 1, "SPLIT": 1}, "gluon GP1 PK": {"GL": 1, "GP": 1, "PK": 1},
         "gluon GP2 PK": {"GL": 1, "GP": 2, "PK": 1}, "gluon GP1 PK split16": {"GL": 1, "GP": 1, "PK": 1, "SPLIT": 1},
         "gluon GP1 PK2": {"GL": 1, "GP": 1, "PK": 2}, "gluon PK": {"GL": 1, "GP": 0, "PK": 1},
         "gluon PK2": {"GL": 1, "GP": 0, "PK": 2}, "gluon GP1 unfused": {"GL": 1, "FUSE": 0, "GP": 1},
         "gluon GP1 PK unfused": {"GL": 1, "FUSE": 0, "GP": 1, "PK": 1},
         "gluon GP1 NR168": {"GL": 1, "GP": 1, "NR": 168}, "gluon GP1 PK NR168": {"GL": 1, "GP": 1, "PK": 1, "NR": 168},
         "gluon GP1 PK NR128": {"GL": 1, "GP": 1, "PK": 1, "NR": 128},
         "gluon GP1 PK NR168/128": {"GL": 1, "GP": 1, "PK": 1, "NR": 168, "NRD": 128},
         # the down's limit alone (gpu-run66: NR 168 cost the 16-row gate_up 767 -> 479 GB/s, NRD 128 gave the down
         # 605 -> 711)
         "gluon GP1 NRD128": {"GL": 1, "GP": 1, "NRD": 128},
         "gluon GP1 PK NRD128": {"GL": 1, "GP": 1, "PK": 1, "NRD": 128},
         # ST: the next ST - 1 K steps' weight words in flight through shared memory (cp.async ring), cpu-mxtma65
         **{f"gluon GP1 PK ST{n}": {"GL": 1, "GP": 1, "PK": 1, "ST": n} for n in (2, 3, 4)},
         "gluon GP1 PK2 ST3": {"GL": 1, "GP": 1, "PK": 2, "ST": 3},
         # ... with ptxas's register limit: Q4_K's fused gate_up 3 CTAs a SM (168), its down and MXFP4's gate_up 4
         "gluon GP1 PK ST4 NR168": {"GL": 1, "GP": 1, "PK": 1, "ST": 4, "NR": 168},
         "gluon GP1 PK ST4 NR168/128": {"GL": 1, "GP": 1, "PK": 1, "ST": 4, "NR": 168, "NRD": 128},
         "gluon GP1 PK ST4 NR128": {"GL": 1, "GP": 1, "PK": 1, "ST": 4, "NR": 128}}
# the Triton launch each Gluon form is held against: GL 0 at the FUSE each type had before GL shipped (Q8_0 unfused,
# MXFP4 and Q4_K fused: gpu-run58-kernels); Q8_0's shipped fused GP 1 Gluon form is "gluon GP1" here (gpu-run63)
TRITON = {0: {"GL": 0, "GP": 0, "FUSE": 0}, 4: {"GL": 0}, 5: {"GL": 0}}


def gl_forms(mq, only: list[str] | None = None) -> dict:
    """The Gluon forms checked, name -> TYPE_CONFIG overrides (FORMS over BF_TUNING; `only`: those names): GL 1 at
    the shipped FUSE (`gluon`; Q8_0's fused since gpu-run63, MXFP4's and Q4_K's since gpu-run58-kernels: the same bits
    as unfused) and unfused; the loads carried to the step that uses them, GP 1 and 2 (gluon_mmq._acc_part:
    cpu-gluon16r57; Q4_K's _load_raw_k, cpu-gpk63), and GP 1 with the K chunks split over programs at 16 rows too
    (SPLIT 1: 4x the 16-row gate_up's 192 programs; the 1-row bucket's kernels); Q8_0's GP 1, GP 2 and GP 1 split16
    on the bank packed (PK 1: mma_pack's layout, pack_pool), and GP 1 with PK 2 (engine.pack_experts' form: each
    expert's layout from bit 0 of its base; the bits' bank: every odd expert packed, flagged, the even ones GGUF; the
    GB/s banks: every expert packed, as an engine whose experts are all in VRAM); Q4_K's shipped form on its packed
    bank, PK 1 and 2 (`gluon PK`, `gluon PK2`: mma_pack's Q4_K layout, cpu-packk62) and with its loads carried (`gluon
    GP1 PK`, `gluon GP2 PK`, `gluon GP1 PK2`, cpu-gpk63; `gluon GP1 unfused` / `gluon GP1 PK unfused`: gate_up's 64
    rows a K loop at 156-171 registers, 3 CTAs a SM at 1 row, where the fused form's 219-247 give 2; NR168 / NR128:
    ptxas's register limit, 3 / 4 CTAs a SM -- the fused gate_up at 168 and the down at 128 without spills;
    NR168/128: gate_up's 168, down's 128, NRD); MXFP4's alike
    at GP 0 (its `gluon` form) and GP 1 / 2 (`gluon GP1 PK`, `gluon GP2 PK`, `gluon GP1 PK2`: mma_pack's MXFP4 layout,
    cpu-mxpk63); MXFP4's and Q4_K's GP 1 PK with the weight words ST - 1 steps ahead in a shared-memory ring (`gluon
    GP1 PK ST2` / `ST3` / `ST4`; `gluon GP1 PK2 ST3`: the packed experts' ring beside GGUF ones; with ptxas's
    register limit, Q4_K's `gluon GP1 PK ST4 NR168` (3 CTAs a SM for the fused gate_up) and `NR168/128` (the down's
    4), MXFP4's `gluon GP1 PK ST4 NR128` (4), no spills on 3.6 or 3.9: cpu-mxtma65). Each against TRITON's launch (on
    the bank as GGUF lays it)."""
    names = ["gluon", "gluon unfused", "gluon GP1", "gluon GP2"] + (["gluon GP1 split16"] if QT != 5 else [])
    names += ["gluon GP1 PK", "gluon GP2 PK", "gluon GP1 PK split16", "gluon GP1 PK2"] if QT == 0 else []
    names += ["gluon PK", "gluon PK2", "gluon GP1 PK", "gluon GP2 PK", "gluon GP1 PK2"] if QT in (4, 5) else []
    names += ["gluon GP1 PK ST2", "gluon GP1 PK ST3", "gluon GP1 PK ST4", "gluon GP1 PK2 ST3"] if QT in (4, 5) else []
    names += ["gluon GP1 PK ST4 NR168", "gluon GP1 PK ST4 NR168/128"] if QT == 5 else []
    names += ["gluon GP1 PK ST4 NR128"] if QT == 4 else []
    names += ["gluon GP1 unfused", "gluon GP1 PK unfused", "gluon GP1 NR168", "gluon GP1 PK NR168",
              "gluon GP1 PK NR128", "gluon GP1 PK NR168/128", "gluon GP1 NRD128", "gluon GP1 PK NRD128"] if QT == 5 \
        else []
    return {n: FORMS[n] for n in names if only is None or n in only}


def run(mq, gl: dict | None, hb, pool, base, st, rows, off, limit, inter=None):
    """(inter [R, F], y [T k, H]) of triton_mmq's gate_up then down (down on `inter` where given), TYPE_CONFIG = gl
    (None: TRITON's launch)."""
    mq.TYPE_CONFIG[QT] = dict(gl or TRITON[QT])
    try:
        R = rows.numel()
        out_i = torch.full((R, F), float("nan"), dtype=DT, device=dev)
        mq.gate_up(hb, pool, base, st, rows, off, out_i, F, K_TOP, QT, limit, ROW_H, True)
        y = torch.full((R, H), float("nan"), dtype=DT, device=dev)
        mq.down(mq.prepare_bf16(out_i if inter is None else inter, QT == 5), pool, base, st, rows, off, y, QT, ROW_F,
                True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out_i, y
    finally:
        mq.TYPE_CONFIG.pop(QT, None)


def reference(pool, base, starts, hb, ids, rows, off, limit, inter):
    """Float64 inter [R, F] and y [T k, H] from the dequantized experts on the same bf16 activations (down on
    `inter`, the kernels' bf16 one)."""
    R = rows.numel()
    ri, ry = torch.zeros(R, F, dtype=torch.float64, device=dev), torch.zeros(R, H, dtype=torch.float64, device=dev)
    x = hb[0].double()
    for e in range(E):
        lo, hi = int(off[e]), int(off[e + 1])
        if lo == hi:
            continue
        b = int(base[e])
        wg, wu = (dequant(pool, b + starts[p], F, ROW_H) for p in (0, 1))
        wd = dequant(pool, b + starts[2], H, ROW_F)
        r = rows[lo:hi].long()
        xe = x[r // K_TOP]
        g, u = xe @ wg.T, xe @ wu.T
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        ri[lo:hi] = g / (1 + torch.exp(-g)) * u
        ry[r] = inter[lo:hi].double() @ wd.T
    return ri, ry


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def graph_gbps(fn, reps: int, nbytes: float) -> float:
    """GB/s of nbytes a fn(i) call: kernel_roofline.graph_time's CUDA graph of reps calls, median of 5 replays."""
    from kernel_roofline import graph_time
    return nbytes / graph_time(fn, reps) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--types", default="Q8_0,MXFP4,Q4_K")
    ap.add_argument("--forms", default="", help="comma-separated FORMS names (default: each type's, gl_forms)")
    ap.add_argument("--odd", action="store_true", help="last: GP 2's and ST's bits at a geometry whose K chunks have "
                    "an odd number of K steps, the last one step (H 2112, F 832: rows 4-byte aligned, other compiles), "
                    "Q8_0 / MXFP4")
    ap.add_argument("--dry-run", action="store_true", help="the CPU under TRITON_INTERPRET=1, H = F = 256: the "
                    "script's plumbing and reference only (GL falls back to Triton there: 'gluon ran' FAILs)")
    a = ap.parse_args()
    if a.dry_run:
        global H, F, dev, DT
        H, F, dev, DT = 256, 256, torch.device("cpu"), torch.float32
        a.no_time = True
    elif not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    import triton
    from betelgeuse.kernels import gluon_mmq as gm
    from betelgeuse.kernels import triton_launch
    from betelgeuse.kernels import triton_mmq as mq
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name} torch {torch.__version__} triton {triton.__version__} gluon {gm.HAVE_GLUON}")
    fails = 0
    g = torch.Generator(device=dev).manual_seed(55)
    types = a.types.split(",")
    global ONLY
    ONLY = a.forms.split(",") if a.forms else None
    offered = set()                             # the forms some asked type has (gl_forms), checked before any run
    for tname in types:
        set_type(tname)
        offered |= gl_forms(mq).keys()
    if ONLY and set(ONLY) - offered:
        print(f"FAIL --forms {sorted(set(ONLY) - offered)}: not a form of {types} (gl_forms; FORMS has "
              f"{sorted(FORMS)})")
        return 2
    for tname in types:
        set_type(tname)
        if ONLY and set(ONLY) - gl_forms(mq).keys():
            print(f"{tname}: not its forms, skipped: {sorted(set(ONLY) - gl_forms(mq).keys())}")
        c = mq.config(QT, 16, bf=True)
        bad = [n for n, o in gl_forms(mq, ONLY).items() if not gm.usable(QT, {**c, **o}, c["KB"], dev)]
        if bad and not a.dry_run:
            print(f"FAIL {tname}: gluon_mmq.usable is False here for {bad} (config {c}): GL would fall back")
            fails += 1
            continue
        if a.dry_run and QT == 5:
            fails += check_dequant(g)
        fails += check_type(tname, mq, triton_launch, g)
    if not a.no_time:
        print("\n| type | rows/expert | kernel | Triton GB/s | Gluon form | Gluon GB/s | Gluon / Triton |")
        print("|---|---|---|---|---|---|---|")
        for tname in types:
            set_type(tname)
            time_type(tname, mq, g, a.reps)
        print()
        for (tname, form), r in PAIR.items():      # a schedule key ships only if it wins in both rows buckets
            verdict = "faster at both rows" if min(r.values()) > 1 else "not faster at both rows"
            print(f"{tname} {form}: pair / Triton " + ", ".join(f"{k} row(s) {v:.2f}" for k, v in sorted(r.items()))
                  + f": {verdict}")
    if a.odd:                           # after the timing: a run cut short keeps the table
        odd = {n: o for n, o in FORMS.items() if (o.get("GP") == 2 or o.get("ST")) and (ONLY is None or n in ONLY)}
        H0, F0 = H, F
        H, F = (320, 320) if a.dry_run else (2112, 832)     # K steps a chunk: down 8 then 5, gate_up 8 x 4 then 1
        for tname in types:
            if TYPES[tname][1] == 32:
                set_type(tname)
                fails += check_type(tname, mq, triton_launch, g, ((2, None), (32, None)),
                                    {n: o for n, o in odd.items() if n in gl_forms(mq)})
        H, F = H0, F0
    print(f"\n{'FAIL' if fails else 'PASS'}: {fails} failed checks")
    return 1 if fails else 0


def check_type(tname: str, mq, triton_launch, g, cases=((2, None), (32, None), (2, 7.0), (32, 7.0)),
               forms: dict | None = None) -> int:
    """The bits and reference checks of one type (module doc) for cases (tokens, SwiGLU limit) and the Gluon forms
    (default: gl_forms'): the number of FAILs."""
    fails = 0
    starts, slot = slot_layout()
    below = 2                                      # experts 0, 1 of the bank lie below the pool (negative offsets)
    big = make_pool(BANK, slot, starts, g)
    pool = big[below * slot:]
    forms = gl_forms(mq, ONLY) if forms is None else forms
    if dev.type != "cuda":              # PK: the Gluon forms alone read the packed bank (the CPU has none)
        forms = {n: o for n, o in forms.items() if not o.get("PK")}
    # per PK the bank it reads: 1 every expert packed, 2 the odd ones (expert 1 below the pool: a negative offset
    # with bit 0), flagged in its base table
    packs = {pk: pack_pool(big, BANK, slot, starts, None if pk == 1 else range(1, BANK, 2))[below * slot:]
             for pk in {o.get("PK") for o in forms.values()} if pk}
    base = torch.full((E,), -1, dtype=torch.int64, device=dev)
    base[:BANK] = torch.arange(BANK, device=dev) * slot - below * slot
    flagged = base.clone()
    flagged[1:BANK:2] |= 1
    st = torch.tensor([starts] * E, dtype=torch.int64, device=dev)
    geo = "" if (H, F) == (2048, 768) or dev.type != "cuda" and (H, F) == (256, 256) else f" H {H} F {F}"
    for T, limit in cases:
        ids = torch.stack([torch.randperm(BANK, device=dev, generator=g)[:K_TOP] for _ in range(T)])
        ids[0, :2] = torch.tensor([0, 1], device=dev)                       # a token on both experts below the pool
        h = torch.randn(T, H, device=dev, generator=g)
        hb = mq.prepare_bf16(h, QT == 5)                                    # Q4_K: the x block sums too
        rows, off = route(ids)
        bucket = 1 if rows.numel() <= E else 16
        it, yt = run(mq, None, hb, pool, base, st, rows, off, limit)
        ri, ry = reference(big, base + below * slot, starts, hb, ids, rows, off, limit, it)
        for form, over in forms.items():
            n0 = dict(triton_launch.COUNTS)
            ig, yg = run(mq, over, hb, packs[over["PK"]] if over.get("PK") else pool,
                         flagged if over.get("PK") == 2 else base, st, rows, off, limit, inter=it)
            ran = {k: triton_launch.COUNTS[k] - n0.get(k, 0) for k in ("_gate_up_gl_kernel", "_down_gl_kernel")}
            case = f"{tname} {form}{geo} T {T} rows {rows.numel()} bucket {bucket} limit {limit}"
            checks = {"gluon ran": ran == {"_gate_up_gl_kernel": 1, "_down_gl_kernel": 1},
                      "gate_up bits ==": bool(torch.equal(ig, it)), "down bits ==": bool(torch.equal(yg, yt)),
                      "finite": bool(torch.isfinite(it).all() and torch.isfinite(yt).all())}
            errs = {"triton inter": rel(it, ri), "gluon inter": rel(ig, ri), "triton y": rel(yt, ry),
                    "gluon y": rel(yg, ry)}
            checks["within 1e-2 of float64"] = max(errs.values()) < 1e-2
            for k, ok in checks.items():
                fails += not ok
                print(f"{'PASS' if ok else 'FAIL'} {case}: {k}")
            diff = int((ig != it).sum()) + int((yg != yt).sum())
            print("     rel err vs float64: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
                  + f"; differing outputs {diff}")
    return fails


def check_dequant(g) -> int:
    """--dry-run, Q4_K: dequant() of random valid super-blocks == gguf.quants.dequantize (float32, an independent
    implementation) to float32 rounding: the reference's own check. The number of FAILs (0 or 1)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    starts, slot = slot_layout()
    pool = make_pool(1, slot, starts, g)
    got = dequant(pool, starts[2], 64, ROW_F)
    want = dequantize(pool[starts[2]: starts[2] + 64 * ROW_F].numpy().reshape(64, ROW_F), GGMLQuantizationType.Q4_K)
    err = float((got - torch.from_numpy(np.asarray(want, dtype=np.float64))).abs().max() / got.abs().max())
    ok = err < 1e-6
    print(f"{'PASS' if ok else 'FAIL'} Q4_K dequant == gguf.quants.dequantize (rel. err. {err:.1e})")
    return 0 if ok else 1


def time_type(tname: str, mq, g, reps: int):
    """GB/s rows of one type's table: banks of 16 experts rotating beyond the L2, each expert exactly `rows` rows
    (kernel_roofline.routing), Triton then Gluon."""
    starts, slot = slot_layout()
    st = torch.tensor([starts] * E, dtype=torch.int64, device=dev)
    bank_b = BANK * (2 * F * ROW_H + H * ROW_F)
    n_banks = max(2, math.ceil(512e6 / bank_b))
    pool = make_pool(n_banks * BANK, slot, starts, g)
    packed = pack_pool(pool, n_banks * BANK, slot, starts) if any(o.get("PK") for o in gl_forms(mq, ONLY).values()) \
        else None
    bases = []
    for b in range(n_banks):
        t = torch.full((E,), -1, dtype=torch.int64, device=dev)
        t[:BANK] = (b * BANK + torch.arange(BANK, device=dev)) * slot
        bases.append(t)
    flagged = [torch.where(t >= 0, t | 1, t) for t in bases]     # PK 2: every expert packed (an all-VRAM engine's)
    for rpe in (1, 16):
        T = BANK * rpe // K_TOP
        ids = ((torch.arange(T, device=dev)[:, None] * K_TOP + torch.arange(K_TOP, device=dev)[None, :]) % BANK)
        hb = mq.prepare_bf16(torch.randn(T, H, device=dev, generator=g), QT == 5)
        rows, off = route(ids)
        R = rows.numel()
        inter = torch.empty(R, F, dtype=torch.bfloat16, device=dev)
        ib = mq.prepare_bf16(torch.randn(R, F, device=dev, generator=g) * 0.1, QT == 5)
        y = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
        gu_b, dn_b = BANK * 2 * F * ROW_H, BANK * H * ROW_F
        use = {"pool": pool, "bases": bases}               # the banks a form reads (PK 1 / 2: packed)

        def gu(i):
            mq.gate_up(hb, use["pool"], use["bases"][i % n_banks], st, rows, off, inter, F, K_TOP, QT, None, ROW_H,
                       True)

        def dn(i):
            mq.down(ib, use["pool"], use["bases"][i % n_banks], st, rows, off, y, QT, ROW_F, True)

        def pair(i):
            gu(i)
            dn(i)
        res = {}
        for name, over in (("triton", None), *gl_forms(mq, ONLY).items()):
            mq.TYPE_CONFIG[QT] = dict(over or TRITON[QT])
            use["pool"] = packed if (over or {}).get("PK") else pool
            use["bases"] = flagged if (over or {}).get("PK") == 2 else bases
            try:
                res[name] = [graph_gbps(gu, reps, gu_b), graph_gbps(dn, reps, dn_b), graph_gbps(pair, reps, bank_b)]
            finally:
                mq.TYPE_CONFIG.pop(QT, None)
        for form in gl_forms(mq, ONLY):
            for j, k in enumerate(("gate_up", "down", "pair")):
                t, q = res["triton"][j], res[form][j]
                print(f"| {tname} | {rpe} | {k} | {t:.0f} | {form} | {q:.0f} | {q / t:.2f} |", flush=True)
        for form in gl_forms(mq, ONLY):
            PAIR.setdefault((tname, form), {})[rpe] = res[form][2] / res["triton"][2]
    pool = packed = None            # freed before the next type's banks
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
