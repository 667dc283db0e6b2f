"""Run under TRITON_INTERPRET=1 (tests/kernels/test_tile_layout.py): triton_moe's float kernels read a bank mixing
tile-layout and GGUF experts (tile_layout; bit 0 of a tiled expert's base offset) to the same bits as the all-GGUF
bank, for gate_up and down, in both rows buckets (1: a row or two over 3 experts, split-K for the types in SPLIT;
16: more rows than experts, the chunks walked).

    tile_kernel_check.py [TYPE ...]          # default: TYPES
    tile_kernel_check.py --mmq [TYPE ...]    # triton_mmq's q8_1 and bf16 MMA kernels instead (default: MMQ_TYPES)

--mmq: the shipped schedules of the GGUF bank (word loads, the q8_1 decode schedule of MXFP4 / Q4_K in bucket 1)
against the tiled launch's byte-load MMA: schedule keys of the same bits, so the mixed bank must give the GGUF bank's.

Prints one JSON line: per type and bucket, whether the mixed bank's inter / y equal the GGUF bank's (eq_gu, eq_dn),
for Q8_0 whether the GGUF bank launched with the tile flag on (no expert flagged) does too (eq_flag_on); per type
whether tiling moved the bytes of gate / down (moved_gu / _dn: not where a row is one block, a super-block type's
256-element row)."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

from betelgeuse.gguf.qtypes import row_nbytes  # noqa: E402
from betelgeuse.gguf.quants_synth import random_blocks  # noqa: E402
from betelgeuse.kernels import tile_layout, triton_mmq, triton_moe  # noqa: E402
from betelgeuse.kernels.moe import pack_experts  # noqa: E402
from betelgeuse.kernels.triton_quants import QT_CODES  # noqa: E402

TYPES = ["Q8_0", "MXFP4", "Q4_K", "IQ4_XS", "F16"]       # the CI test: all but IQ4_XS (time)
MMQ_TYPES = ["Q8_0", "MXFP4", "Q4_K"]
SPLIT = ("Q8_0",)          # split-K in bucket 1 (K in 2 chunks: the partials' path), walked chunks in bucket 16
E, TILED = 3, (0, 2)        # experts; those the mixed bank holds tiled


def parts(qt: int, H: int, FF: int, rng) -> list[torch.Tensor]:
    """One expert's (gate [FF,H], up [FF,H], down [H,FF]) GGUF bytes: random valid blocks (F16: normal values)."""
    out = []
    for rows, K in ((FF, H), (FF, H), (H, FF)):
        if qt == GT.F16:
            b = (rng.standard_normal(rows * K) * 0.1).astype(np.float16).view(np.uint8)
        else:
            b = random_blocks(qt, rows * K // tile_layout.unit(qt)[0], rng).reshape(-1)
        out.append(torch.from_numpy(np.ascontiguousarray(b)))
    return out


def check(name: str, mmq: bool = False) -> dict:
    qt = int(GT[name])
    code = QT_CODES[qt]
    sup = tile_layout.unit(qt)[0] == 256
    # rows whole tiles (gate/up FF rows, down H rows); a row of one super-block tiles to GGUF's order, so each
    # super-block type has one kernel over 2 (Q4_K: gate_up, IQ4_XS: down), the interpreter's time kept small
    H, FF = {"Q4_K": (512, 256), "IQ4_XS": (256, 512)}.get(name, (256, 256) if sup else (64, 128))
    if mmq and not sup:
        FF = 64                 # one tile: the interpreter runs the MMA programs many times slower than the float
    rng = np.random.default_rng(qt)
    raw = [parts(qt, H, FF, rng) for _ in range(E)]
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    tpool, tbase = pool.clone(), base.copy()
    for e in TILED:             # tile each part in place; flag the expert (every real offset is even: 64-byte slots)
        for p, (rows, K) in enumerate(((FF, H), (FF, H), (H, FF))):
            o = int(base[e] + starts[e, p])
            n = rows * row_nbytes(qt, K)
            tpool[o:o + n] = tile_layout.tile(pool[o:o + n], rows, K, qt)
        tbase[e] |= 1
    triton_moe.TUNING.pop(code, None)
    if name in SPLIT:
        triton_moe.TUNING[code] = {"reduce": {"BK": 32, "KC": 32},
                                   1: {"SPLIT": 1, "BN": 64, "BN_GATE_UP": 64, "num_warps": 2, "num_stages": 2},
                                   16: {"SPLIT": 0}}
    g = torch.Generator().manual_seed(qt)
    res = {}
    for bucket, T in ((1, 1), (16, 5)):
        k = 2
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        assert triton_moe.bucket_of(T * k, E) == bucket
        flat = ids.reshape(-1)
        rows = torch.argsort(flat, stable=True).to(torch.int32)
        off = torch.zeros(E + 1, dtype=torch.int32)
        off[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
        h = torch.randn(T, H, generator=g)
        x = torch.randn(T * k, FF, generator=g)           # down's input: the same for every bank

        def run(p, b, tiled, act=None):
            bt = torch.from_numpy(b)
            inter = torch.zeros(T * k, FF)
            y = torch.zeros(T * k, H)
            if act is None:
                triton_moe.gate_up(h, p, bt, starts, rows, off, inter, FF, k, code, None, row_nbytes(qt, H), True,
                                   tiled)
                triton_moe.down(x, p, bt, starts, rows, off, y, T, code, row_nbytes(qt, FF), True, tiled)
            else:
                triton_mmq.gate_up(act(h), p, bt, starts, rows, off, inter, FF, k, code, None, row_nbytes(qt, H),
                                   True, tiled=tiled)
                triton_mmq.down(act(x), p, bt, starts, rows, off, y, code, row_nbytes(qt, FF), True, tiled=tiled)
            return inter, y
        if mmq:
            for mode, act in (("q8_1", triton_mmq.quantize_q8_1), ("bf16", triton_mmq.prepare_bf16)):
                gi, gy = run(pool, base, False, act)
                ti, ty = run(tpool, tbase, True, act)
                res[f"{mode}/{bucket}"] = {"eq_gu": bool(torch.equal(gi, ti)), "eq_dn": bool(torch.equal(gy, ty))}
            continue
        gi, gy = run(pool, base, False)
        ti, ty = run(tpool, tbase, True)
        res[bucket] = {"eq_gu": bool(torch.equal(gi, ti)), "eq_dn": bool(torch.equal(gy, ty))}
        if name == "Q8_0":      # the TB > 0 kernel's GGUF branch (bit 0 clear)
            fi, fy = run(pool, base, True)
            res[bucket]["eq_flag_on"] = bool(torch.equal(gi, fi) and torch.equal(gy, fy))
    for p, key in ((0, "moved_gu"), (2, "moved_dn")):
        o, n = int(base[0] + starts[0, p]), raw[0][p].numel()
        res[key] = not torch.equal(pool[o:o + n], tpool[o:o + n])
    triton_moe.TUNING.pop(code, None)
    return res


args = sys.argv[1:]
mmq = args[:1] == ["--mmq"]
args = args[1:] if mmq else args
print(json.dumps({name: check(name, mmq) for name in (args or (MMQ_TYPES if mmq else TYPES))}))
