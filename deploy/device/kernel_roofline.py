#!/usr/bin/env python3
"""The expert kernels against the memory roofline, per GGML type, on the GPU (< 3 minutes on a bare H200).

    python3 deploy/device/kernel_roofline.py                 # every type, both geometries; OUT=/dir for the files
    python3 deploy/device/kernel_roofline.py --types Q4_K,Q8_0 --geoms bench --configs 0
    python3 deploy/device/kernel_roofline.py --sweep         # the launch table: $OUT/triton_tuning.json (~4 min)
    python3 deploy/device/kernel_roofline.py --act-quant bf16  # float vs the bf16 MMA (and q8_1's kernels), checked
    python3 deploy/device/kernel_roofline.py --tiles         # the float kernels on a tile-layout bank vs GGUF, checked

--sweep times every CONFIGS entry per type at 1 and 16 rows (bench geometry unless --geoms), checks each against
the torch path (both rows buckets, two runs bit-equal, rows alone == in the full launch), and picks per type one
pair of reduction keys (BK, KC) and per rows bucket the fastest schedule (BN, SPLIT, warps, stages) whose outputs
equal the other bucket's pick bit for bit. It prints a table (type, rows, best config, GB/s, share of the copy
bandwidth, the baseline config's GB/s) and writes $OUT/triton_tuning.json (commit it as
betelgeuse/kernels/triton_tuning.json: the kernels load it at import) and $OUT/kernel_sweep.md; then it loads the
table as the kernels do and checks rows alone == in 16-row launches once more. Exit 1 if any check failed.

For each expert type (Q8_0, MXFP4, the K-quants, the i-quants) and geometry (the bench's: hidden 2048, expert FFN
768, 128 experts; ds4-flash's: 4096, 2048, 256 experts, its clamped SwiGLU): a bank of 16 experts (one ring bank of
the engine) in a device pool laid out as slots (gate | up | down), applied through the engine's own kernels
(MoEKernels "triton": gate_up + down; routing prepared once) to 1, 16 and 64 rows per expert. Timed by CUDA-graph
replays of many launches that rotate over enough banks that the bytes are several times the L2 (random bytes: the
kernels' speed does not depend on the values). GB/s = expert bytes read / time; the launch pair and each kernel.

Each type runs the launch configurations of CONFIGS (block sizes, warps, pipeline depth: constants per type,
never the row count's) and keeps the fastest at 1 + 16 rows; the kept one is then checked on valid blocks against
the torch path (quants.dequantize -> bf16 -> SwiGLU experts; relative max error), for row invariance (one token's
rows alone == the same rows in the full launch, bit for bit) and for its in-kernel weights (triton_quants.dequantize
vs quants.dequantize, bf16). Compiles are done first by worker processes in parallel (the Triton cache).

Prints a markdown table (targets: 1 row >= 1500 GB/s, 16 rows >= 1200 GB/s) and the TYPE_CONFIG to keep; writes
$OUT/kernel_roofline.{md,json}. gguf is installed from .whl/ into /tmp/site where this Python lacks it
(`bash deploy/device/wheels.sh` here, then carry .whl). One device run that checks the kernels of every type, then
times them (check_cuda also needs services/pb/betelgeuse carried; ~5 minutes in all):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:$PWD python3 deploy/device/check_cuda.py --only kernels && \
      PYTHONPATH=/tmp/site:$PWD python3 deploy/device/kernel_roofline.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
T0 = time.perf_counter()


def _ensure_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        whl = sorted((REPO / ".whl").glob("gguf-*.whl"))
        if not whl:
            sys.exit("kernel_roofline: gguf is missing and .whl/ has no gguf wheel (run deploy/device/wheels.sh "
                     "here and carry .whl)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", "/tmp/site", *map(str, whl)], check=True)
        sys.path.insert(0, "/tmp/site")


_ensure_gguf()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

from betelgeuse.gguf.qtypes import row_nbytes  # noqa: E402
from betelgeuse.kernels.moe import Group  # noqa: E402

TYPES = ["Q8_0", "MXFP4", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ2_XS", "IQ2_XXS"]
# name: (hidden H, expert FFN F, experts per layer E, SwiGLU limit)
GEOMS = {"bench": (2048, 768, 128, None), "ds4-flash": (4096, 2048, 256, 10.0)}
BANK = 16                         # experts per launch group (a ring bank: EngineConfig.ring_slots / 2)
K_TOP = 8
ROWS = (1, 16, 64)
# candidate launch constants per type (triton_moe keys; TYPE_CONFIG overrides every bucket with one): the
# baseline, split-K in 4 / 8 chunks at 64, 32, 16 output rows per program (one program per chunk: enough
# programs for 132 SMs on one expert), the same chunks walked by one program (for 16 rows), and one without the
# software pipeline (no shared-memory staging: more programs per SM hide the latency instead). Configs with the
# same (BK, KC) give the same bits, so --sweep may take one for 1 row and another for 16 rows.
CONFIGS = [
    {"BK": 256, "KC": 0, "BN": 64, "BN_GATE_UP": 64, "SPLIT": 0, "num_warps": 4, "num_stages": 3},
    {"BK": 256, "KC": 512, "BN": 64, "BN_GATE_UP": 64, "SPLIT": 1, "num_warps": 4, "num_stages": 3},
    {"BK": 256, "KC": 512, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 1, "num_warps": 4, "num_stages": 3},
    {"BK": 256, "KC": 512, "BN": 16, "BN_GATE_UP": 16, "SPLIT": 1, "num_warps": 2, "num_stages": 3},
    {"BK": 256, "KC": 512, "BN": 64, "BN_GATE_UP": 64, "SPLIT": 0, "num_warps": 4, "num_stages": 3},
    {"BK": 256, "KC": 256, "BN": 64, "BN_GATE_UP": 64, "SPLIT": 1, "num_warps": 4, "num_stages": 2},
    {"BK": 256, "KC": 256, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 1, "num_warps": 2, "num_stages": 2},
    {"BK": 256, "KC": 256, "BN": 64, "BN_GATE_UP": 64, "SPLIT": 0, "num_warps": 4, "num_stages": 3},
    {"BK": 256, "KC": 512, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 1, "num_warps": 4, "num_stages": 1},
    # the decode schedule (triton_mmvq, MV = 1: its own arithmetic, the same bits at every BN / BM_MV / warps /
    # stages, so both buckets pick from these; Q8_0, MXFP4, Q4_K, Q5_K only): BN output rows x BM_MV rows a program.
    # One row a program (the 1-row bucket), then BM_MV rows sharing each decoded weight tile (the 16-row bucket; per
    # thread 2 x BM_MV x BN x step / threads accumulator registers in gate_up: these stay under 255 registers for
    # Q8_0 and MXFP4 on sm_90, tests/scripts/kernel_smem.py compiles them)
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 8, "BN_GATE_UP": 8, "SPLIT": 0, "num_warps": 4, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 16, "BN_GATE_UP": 16, "SPLIT": 0, "num_warps": 4, "num_stages": 2},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 0, "num_warps": 8, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 4, "BN_GATE_UP": 4, "SPLIT": 0, "num_warps": 2, "num_stages": 2},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 16, "BN": 2, "BN_GATE_UP": 2, "SPLIT": 0, "num_warps": 4, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 16, "BN": 4, "BN_GATE_UP": 2, "SPLIT": 0, "num_warps": 2, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 16, "BN": 8, "BN_GATE_UP": 4, "SPLIT": 0, "num_warps": 4, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 8, "BN": 4, "BN_GATE_UP": 4, "SPLIT": 0, "num_warps": 4, "num_stages": 1},
    # the decode schedule in K chunks (issue 23; the reduction key KC with MV = 1: other bits than KC 0, one pair of
    # buckets per KC): the 1-row bucket one program a chunk (a bank's 16 one-row experts fill 132 SMs 4x more),
    # partials summed in chunk order by the tile's last; the 16-row bucket the same chunks walked (or split)
    {"BK": 256, "KC": 512, "MV": 1, "BM_MV": 1, "BN": 16, "BN_GATE_UP": 16, "SPLIT": 1, "num_warps": 4,
     "num_stages": 1},
    {"BK": 256, "KC": 512, "MV": 1, "BM_MV": 1, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 1, "num_warps": 4,
     "num_stages": 1},
    {"BK": 256, "KC": 512, "MV": 1, "BM_MV": 1, "BN": 8, "BN_GATE_UP": 8, "SPLIT": 1, "num_warps": 2,
     "num_stages": 1},
    {"BK": 256, "KC": 512, "MV": 1, "BM_MV": 16, "BN": 4, "BN_GATE_UP": 2, "SPLIT": 0, "num_warps": 2,
     "num_stages": 1},
    {"BK": 256, "KC": 512, "MV": 1, "BM_MV": 8, "BN": 4, "BN_GATE_UP": 4, "SPLIT": 1, "num_warps": 4,
     "num_stages": 1},
    {"BK": 256, "KC": 1024, "MV": 1, "BM_MV": 1, "BN": 16, "BN_GATE_UP": 16, "SPLIT": 1, "num_warps": 4,
     "num_stages": 1},
    {"BK": 256, "KC": 1024, "MV": 1, "BM_MV": 16, "BN": 4, "BN_GATE_UP": 2, "SPLIT": 0, "num_warps": 2,
     "num_stages": 1},
    # one row a program with more weight rows a thread (issue 23, kq54): Q4_K / Q5_K load a group's 4 qs words a
    # thread (LDG.128) once BN x 32 words fill the threads 4 deep; tests/scripts/sass_profile.py --mv 16,2: 0.38-0.40
    # warp instructions per weight byte (BN 4 x 2 warps: 0.47-0.55)
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 16, "BN_GATE_UP": 16, "SPLIT": 0, "num_warps": 2, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 8, "BN_GATE_UP": 8, "SPLIT": 0, "num_warps": 2, "num_stages": 1},
    {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 32, "BN_GATE_UP": 32, "SPLIT": 0, "num_warps": 4, "num_stages": 1},
]
for _c in CONFIGS:                  # the MMA path's entries: MV 0 (BM_MV, a key of the decode schedule, unused)
    _c.setdefault("MV", 0)
    _c.setdefault("BM_MV", 4)
TARGET = {1: 1500.0, 16: 1200.0}
# --act-quant q8_1: triton_mmq's schedule candidates, overrides of its table (TYPE_CONFIG: KB quant blocks a K step,
# SPLIT the 1-row bucket's chunks over programs, FUSE gate_up's gate and up rows in one MMA, warps); all keep the
# reduction key KCB, so all give the same bits (checked). MMQ_OTHER: schedules with other bits, timed only:
# "before" is the schedule before K steps and split-K (one block a step, one chunk, 4 warps), the others another
# reduction key KCB (chunks of 8 / 32 blocks).
MMQ_CONFIGS = [{}, {"KB": 2}, {"KB": 4}, {"KB": 1, "num_warps": 4}, {"KB": 2, "SPLIT": 0}, {"KB": 2, "SPLIT": 1},
               {"KB": 2, "FUSE": 1},
               # MV 1 (issue 23): the decode schedule without tensor cores (triton_mmq_mv), the MMA's bits: BN output
               # rows x BM_MV rows a program, NS word groups a K step, split-K in the 1-row bucket as the MMA's
               {"MV": 1, "BN": 32, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 16, "num_warps": 2, "num_stages": 1},
               {"MV": 1, "BN": 64, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 32, "NS": 2, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 16, "NS": 2, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 32, "FUSE": 1, "num_warps": 8, "num_stages": 1},
               {"MV": 1, "BN": 32, "FUSE": 1, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 16, "FUSE": 1, "NS": 2, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "BN": 16, "BM_MV": 4, "num_warps": 4, "num_stages": 1},
               # DP4A 1: the block dots by PTX dp4a on the int32 words (Q8_0, Q4_K; MXFP4 keeps the float dots)
               {"MV": 1, "DP4A": 1, "BN": 32, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "DP4A": 1, "BN": 64, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "DP4A": 1, "BN": 32, "FUSE": 1, "num_warps": 4, "num_stages": 1},
               {"MV": 1, "DP4A": 1, "BN": 32, "NS": 2, "num_warps": 4, "num_stages": 1}]
# WL 1 (issue 23, the 16-row bucket): the MMA with its tiles read as int32 words (the same tiles: the same bits), its
# launch constants all given (TYPE_BUCKET's one-row MV schedule would otherwise stand in for the 1-row figure);
# PF 1 the next K step's words fetched before this step's MMA (register double-buffering), else Triton's cp.async
# pipeline of num_stages (PF 2: that for the quants, the scale words one step ahead in registers); SPLIT 1 the
# 16-row bucket's chunks over programs too (gate_up's 12 x 16 tiles of BN 64 leave an H100's 132 SMs one or two programs each); BN 32 (mma.sync m16n8k32): twice the programs
# WL 2: MXFP4's codes by the byte-permute table (the other types take WL 1's kernel); {"WL": 1}: MXFP4's arithmetic
# decode, for the comparison
WL_BASE = {"MV": 0, "WL": 2, "BN": 64, "KB": 1, "num_warps": 4, "num_stages": 3, "FUSE": 0, "PF": 0}
WL_CONFIGS = [{}, {"WL": 1}, {"PF": 1}, {"PF": 2}, {"num_stages": 4}, {"KB": 2}, {"KB": 2, "PF": 1}, {"KB": 2, "PF": 2},
              {"KB": 2, "num_warps": 8}, {"SPLIT": 1}, {"KB": 2, "SPLIT": 1}, {"PF": 1, "SPLIT": 1},
              {"PF": 2, "SPLIT": 1}, {"KB": 2, "PF": 2, "SPLIT": 1}, {"BN": 32}, {"BN": 32, "SPLIT": 1},
              {"BN": 32, "PF": 1, "SPLIT": 1}, {"FUSE": 1, "num_warps": 8}, {"KB": 4, "PF": 1, "num_warps": 8}]
MMQ_CONFIGS += [{**WL_BASE, **c} for c in WL_CONFIGS]
MMQ_OTHER = {"before": {"KB": 1, "KCB": 0, "SPLIT": 0, "num_warps": 4, "num_stages": 3}, "KCB8": {"KCB": 8},
             "KCB32": {"KCB": 32}}
MMQ_TYPES_DEFAULT = "Q8_0,Q4_K,MXFP4"
BF16_TYPES_DEFAULT = "Q8_0,Q4_K,MXFP4,Q5_K"     # --act-quant bf16 (triton_mmq.BF_TYPES)
# --act-quant bf16: schedule-key candidates over BF_TUNING (triton_mmq.TYPE_CONFIG, both kernels), timed beside the
# shipped schedule (kernels alone) and checked for its bits (bf16_check: every row == the shipped launch's). Each keeps
# the shipped instruction, HGMMA m64 n32 k16 on the same A row and B column per output, and 2x the weight bytes of a
# K step: "fuse" gate_up's gate and up rows as one weight side (M = 128 at 4 warps: one K loop a chunk instead of two,
# one block-diagonal activation tile for both); "bn128w8" 128 rows a program at 8 warps (a warpgroup per 64 rows;
# 8 warps at BN 64 would split N: m64 n16 k16, another shape). cpu-mma55 (tests/scripts/sass_profile.py, the K
# loop's sm_90 SASS at 1 row, warp instructions per weight byte, shipped gate_up -> fuse gate_up / bn128w8 gate_up,
# down): Q8_0 0.30 -> 0.25 / 0.31, 0.27; MXFP4 0.83 -> 0.69 / 0.78, 0.77; Q4_K 0.66 -> 0.49 / 0.59, 0.63 (fuse
# spills on Q5_K: 255 registers).
BF_CANDIDATES = {"fuse": {"FUSE": 1}, "bn128w8": {"BN": 128, "num_warps": 8}}


def applies(tname: str, ci: int) -> bool:
    """Whether CONFIGS[ci] is a candidate for type tname: the decode schedule's only for the types it has."""
    from betelgeuse.kernels.triton_mmvq import STEP
    from betelgeuse.kernels.triton_quants import QT_CODES
    c = CONFIGS[ci]
    return c is None or not c.get("MV") or QT_CODES[int(GT[tname])] in STEP


def table_keys(c: dict, keys) -> dict:
    """The launch table's entry of config c for `keys` (REDUCE_KEYS or SCHEDULE_KEYS): the decode schedule's keys
    only where it is on."""
    return {k: c[k] for k in sorted(keys) if c["MV"] or k not in ("MV", "BM_MV")}
dev = torch.device("cuda")
DRY = False                       # --dry-run: the CPU under TRITON_INTERPRET=1, tiny geometries, no graphs
DTYPE = torch.bfloat16            # the engine's CUDA dtype (the dry run: float32, which the interpreter emulates)


def expert_nbytes(qt: int, H: int, F: int) -> int:
    return 2 * F * row_nbytes(qt, H) + H * row_nbytes(qt, F)


def part_sizes(qt: int, H: int, F: int) -> list[int]:
    return [F * row_nbytes(qt, H), F * row_nbytes(qt, H), H * row_nbytes(qt, F)]


def slot_layout(qt: int, H: int, F: int) -> tuple[list[int], int]:
    """(part starts in a slot, slot bytes): parts 64-byte aligned, slot a multiple of 4 KiB (as the worker's)."""
    starts, o = [], 0
    for n in part_sizes(qt, H, F):
        starts.append(o)
        o += -(-n // 64) * 64
    return starts, -(-o // 4096) * 4096


def kernels_for(qt: int, H: int, F: int, E: int, limit, weights_fn=None, backend="triton", act_quant="off"):
    from betelgeuse.kernels.moe import MoEKernels
    starts, slot = slot_layout(qt, H, F)
    st = torch.tensor([starts] * E, dtype=torch.int64, device=dev)[None]
    return MoEKernels(backend, E, F, st, [(qt, qt)], 16, weights_fn=weights_fn, act_limit=limit,
                      act_quant=act_quant), slot


def routing(n: int, rows: int, k: int, H: int, seed: int = 0):
    """T tokens x k ranks over experts 0..n-1, each expert exactly `rows` rows (distinct experts per token)."""
    T = n * rows // k
    ids = ((torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % n).to(dev)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dev, DTYPE)
    w = torch.rand(T, k, generator=g).to(dev, DTYPE)
    return h, ids, w


def base_table(E: int, first_slot: int, n: int, slot: int) -> torch.Tensor:
    b = torch.full((E,), -1, dtype=torch.int64)
    b[:n] = (first_slot + torch.arange(n)) * slot
    return b.to(dev)


def set_config(code: int, cfg: dict | None):
    from betelgeuse.kernels import triton_moe
    if cfg is None:
        triton_moe.TYPE_CONFIG.pop(code, None)
    else:
        triton_moe.TYPE_CONFIG[code] = dict(cfg)


# ---- compile workers ------------------------------------------------------------------------------------

def warm(tasks: list[tuple[str, str, int]]):
    """Compile the kernels of (geometry, type, config) tasks by launching them once on the timed routings (the same
    specializations and the same split-or-walk choice as the timed launches: same H, F, E, rows, dtypes, limit)."""
    from betelgeuse.kernels.triton_quants import QT_CODES
    for gname, tname, ci in tasks:
        try:
            _warm_one(gname, tname, ci, QT_CODES)
        except Exception as e:                         # the timed run reports it; compile the other tasks
            print(f"warm {gname}/{tname}/{ci}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
    torch.cuda.synchronize()


def _warm_one(gname: str, tname: str, ci: int, QT_CODES: dict):
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    set_config(QT_CODES[qt], CONFIGS[ci])
    kern, slot = kernels_for(qt, H, F, E, limit)
    pool = torch.zeros(BANK * slot, dtype=torch.uint8, device=dev)
    for rows in ROWS:
        r = kern.route(*routing(BANK, rows, K_TOP, H))
        kern.apply(r, 0, pool, Group(None, None, base_table(E, 0, BANK, slot)), slot)
        kern.combine(r)
    if ci == 0:                                    # the check's in-kernel weights (triton_quants.dequantize)
        from betelgeuse.kernels import triton_quants
        for K in (H, F):
            raw = torch.zeros(64 * row_nbytes(qt, K), dtype=torch.uint8, device=dev)
            triton_quants.dequantize(raw, qt, (64, K), dtype=DTYPE)


def warm_parallel(tasks: list[tuple[str, str, int]], workers: int, timeout: float, flag: str = "--warm") -> float:
    import tempfile
    t = time.perf_counter()
    chunks = [tasks[i::workers] for i in range(workers) if tasks[i::workers]]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in chunks]
    job = {"rows": ROWS, "tuned": CONFIGS == [None]}
    procs = [subprocess.Popen([sys.executable, __file__, flag, json.dumps({**job, "tasks": c})],
                              stdout=subprocess.DEVNULL, stderr=log) for c, log in zip(chunks, logs)]
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t)))
            if p.returncode:
                log.seek(0)
                err = log.read().strip().splitlines()
                print(f"  (a compile worker failed: {err[-1] if err else p.returncode})", flush=True)
        except subprocess.TimeoutExpired:
            p.kill()
            print("  (a compile worker ran out of time: the rest compiles in the main process)", flush=True)
        log.close()
    return time.perf_counter() - t


# ---- timing ---------------------------------------------------------------------------------------------

def graph_time(fn, reps: int) -> float:
    """Seconds per fn() call: a CUDA graph of `reps` calls (fn gets the call index), median of 5 replays."""
    if DRY:
        t = time.perf_counter()
        fn(0)
        return time.perf_counter() - t
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    del g
    return float(np.median(ts))


def measure(gname: str, tname: str, cfgs: list[int]) -> dict:
    """GB/s of the launch pair (and of gate_up, down) at ROWS for each config in cfgs, on rotating banks."""
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    nbytes = expert_nbytes(qt, H, F)
    bank_bytes = BANK * nbytes
    n_banks = 2 if DRY else max(2, math.ceil(512e6 / bank_bytes))          # several times the 60 MB L2
    _, slot = slot_layout(qt, H, F)
    pool = torch.randint(0, 256, (n_banks * BANK * slot,), dtype=torch.uint8, device=dev)
    bases = [base_table(E, b * BANK, BANK, slot) for b in range(n_banks)]
    reps = max(n_banks, min(64, math.ceil(2e9 / bank_bytes)))
    out = {}
    for ci in cfgs:
        set_config(code, CONFIGS[ci])
        kern, _ = kernels_for(qt, H, F, E, limit)
        res = {}
        try:
            _time_config(kern, tk, code, qt, H, F, limit, pool, bases, slot, n_banks, reps, bank_bytes, res)
        except Exception as e:                         # e.g. OutOfResources: this config is out, not the type
            out[ci] = {"config": dict(CONFIGS[ci] or {}), "error": f"{type(e).__name__}: {str(e)[:160]}"}
            print(f"  {gname}/{tname} config {ci}: {out[ci]['error']}", flush=True)
            continue
        out[ci] = {"config": {**tk.config(code)}, "rows": res}
    pool = None                   # the banks are freed before the next type
    torch.cuda.empty_cache()
    return {"expert_bytes": nbytes, "bpw": nbytes * 8 / (3 * H * F), "banks": n_banks, "reps": reps,
            "configs": out}


def _time_config(kern, tk, code, qt, H, F, limit, pool, bases, slot, n_banks, reps, bank_bytes, res):
    E = kern.E
    for rows in ROWS:
        h, ids, w = routing(BANK, rows, K_TOP, H)
        r = kern.route(h, ids, w)
        kern.apply(r, 0, pool, Group(None, None, bases[0]), slot)           # compile check outside the graph
        st = kern.starts[0]
        aligned = kern._aligned

        def gu(i):
            tk.gate_up(r.h, pool, bases[i % n_banks], st, r.rows, r.off, r.inter, F, K_TOP, code, limit,
                       row_nbytes(qt, H), aligned)

        def dn(i):
            tk.down(r.inter, pool, bases[i % n_banks], st, r.rows, r.off, r.y, r.ids.shape[0], code,
                    row_nbytes(qt, F), aligned)
        t_gu, t_dn = graph_time(gu, reps), graph_time(dn, reps)
        gu_bytes, dn_bytes = BANK * 2 * F * row_nbytes(qt, H), BANK * H * row_nbytes(qt, F)
        res[rows] = {"us": (t_gu + t_dn) * 1e6, "gbps": bank_bytes / (t_gu + t_dn) / 1e9,
                     "gate_up_gbps": gu_bytes / t_gu / 1e9, "down_gbps": dn_bytes / t_dn / 1e9,
                     "gate_up_us": t_gu * 1e6, "down_us": t_dn * 1e6}


# ---- checks ---------------------------------------------------------------------------------------------

def check_setup(gname: str, tname: str) -> dict:
    """Valid blocks of 2 experts in a pool, their torch-path outputs (quants.dequantize -> bf16 -> SwiGLU experts)
    on a 1-row-bucket routing (16 tokens) and a 16-row-bucket one (E/2 + 8 tokens: more rows than experts)."""
    from betelgeuse.gguf.quants import dequantize
    from betelgeuse.gguf.quants_synth import quantize, random_blocks
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    rng = np.random.default_rng(qt)
    shapes = [(F, H), (F, H), (H, F)]
    starts, slot = slot_layout(qt, H, F)
    n = 2
    pool = torch.zeros(n * slot, dtype=torch.uint8)
    parts = []
    for e in range(n):
        ps = []
        for k, (shp, o) in enumerate(zip(shapes, starts)):
            std = 0.02 if k < 2 else 0.005
            if qt in (8, 39):                             # random valid blocks (gguf-py's quantizer is slow here)
                raw = random_blocks(qt, shp[0] * shp[1] // 32, rng, std / 74 if qt == 8 else std / 4)
            else:
                raw = quantize(None, qt, shp, rng, std)
            t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
            pool[e * slot + o: e * slot + o + t.numel()] = t
            ps.append(t.to(dev))
        parts.append(ps)
    pool = pool.to(dev)
    deq = [[dequantize(p, qt, s, DTYPE) for p, s in zip(ps, shapes)] for ps in parts]
    ref, _ = kernels_for(qt, H, F, E, limit, weights_fn=lambda b, l, e: deq[e], backend="torch")
    g = torch.Generator().manual_seed(1)
    base = base_table(E, 0, n, slot)
    ctx = {"qt": qt, "geom": (H, F, E, limit), "pool": pool, "slot": slot, "parts": parts, "deq": deq,
           "shapes": shapes, "grp": Group(np.arange(n), base.cpu().numpy(), base), "cases": {}}
    for name, T in (("rows1", min(16, E // 2)), ("rows16", E // 2 + 8)):      # 2 rows per token
        h = torch.randn(T, H, generator=g).to(dev, DTYPE)
        ids = torch.tensor([[0, 1]] * T, device=dev)
        w = torch.rand(T, 2, generator=g).to(dev, DTYPE)
        ctx["cases"][name] = (h, ids, w, run_moe(ctx, ref, h, ids, w))
    return ctx


def run_moe(ctx: dict, kern, h, ids, w) -> torch.Tensor:
    r = kern.route(h, ids, w)
    kern.apply(r, 0, ctx["pool"], ctx["grp"], ctx["slot"])
    return kern.combine(r).float()


def check_config(ctx: dict, cfg: dict | None) -> tuple[dict, dict]:
    """One launch config (None: the tuning as loaded) on the check's experts: (results, outputs). results: relative
    max error vs the torch path per routing, finite, deterministic (two runs equal bit for bit), row invariance (a
    token's rows alone, in the 1-row bucket, == the same rows in the 16-row routing's launch); outputs: the triton
    outputs per routing, for bit comparisons between configs."""
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = ctx["geom"]
    qt = ctx["qt"]
    set_config(QT_CODES[qt], cfg)
    tri, _ = kernels_for(qt, H, F, E, limit)
    res, outs = {"finite": True, "deterministic": True}, {}
    for name, (h, ids, w, o_r) in ctx["cases"].items():
        o_t = run_moe(ctx, tri, h, ids, w)
        again = run_moe(ctx, tri, h, ids, w)
        res["rel_err_" + name] = float((o_t - o_r).abs().max() / o_r.abs().max())
        res["finite"] &= bool(torch.isfinite(o_t).all())
        res["deterministic"] &= bool(torch.equal(o_t, again))
        outs[name] = o_t
    h, ids, w, _ = ctx["cases"]["rows16"]
    alone = run_moe(ctx, tri, h[5:6], ids[5:6], w[5:6])
    res["row_invariant"] = bool(torch.equal(alone[0], outs["rows16"][5]))
    res["rel_err"] = max(v for k, v in res.items() if k.startswith("rel_err_"))
    res["ok"] = res["finite"] and res["deterministic"] and res["row_invariant"] and res["rel_err"] < 3e-2
    return res, outs


def check(gname: str, tname: str, ci: int) -> dict:
    """On valid blocks (2 experts): the kernels vs the torch path (bf16), row invariance, the in-kernel weights."""
    from betelgeuse.kernels import triton_quants
    ctx = check_setup(gname, tname)
    res, _ = check_config(ctx, CONFIGS[ci])
    qt = ctx["qt"]
    res["weights_rel_err"] = max(float((triton_quants.dequantize(p, qt, s, dtype=DTYPE).to(DTYPE).float()
                                        - d.float()).abs().max() / d.float().abs().max())
                                 for p, s, d in zip(ctx["parts"][0], ctx["shapes"], ctx["deq"][0]))
    return res


def mv_configs(tname: str, kc: int | None = 0) -> list[int]:
    """The CONFIGS indices of the decode schedule (MV = 1) for type tname at K chunks kc (a reduction key: one bits
    per KC; None: every KC): none where triton_mmvq lacks it."""
    return [ci for ci, c in enumerate(CONFIGS) if c is not None and c.get("MV") and applies(tname, ci)
            and (kc is None or c["KC"] == kc)]


def check_rows(ctx: dict, checked: dict | None = None, cis: list[int] | None = None) -> dict:
    """The decode schedule's rows a program (the MV CONFIGS: BM_MV 1, 8, 16) keep each row's bits: every one's
    outputs on both routings (16 / E/2 + 8 tokens, 2 rows each) equal the first's bit for bit, and the first 1 and 3
    tokens launched alone equal the same rows of the full launch; checked: {ci: check_config(ctx, ...)} already
    run (the sweep's), the rest are run here; cis: those configs only. {"ok", "configs", "mismatch": [ci or
    (ci, tokens), ...]}."""
    from betelgeuse.kernels.triton_quants import QT_CODES
    cis = mv_configs(GT(ctx["qt"]).name) if cis is None else cis
    got = {ci: (checked or {}).get(ci) or check_config(ctx, CONFIGS[ci]) for ci in cis}
    bad = [ci for ci in cis if not got[ci][0]["ok"]
           or any(not torch.equal(got[ci][1][k], got[cis[0]][1][k]) for k in got[ci][1])]
    h, ids, w, _ = ctx["cases"]["rows16"]
    H, F, E, limit = ctx["geom"]
    for ci in cis:
        set_config(QT_CODES[ctx["qt"]], CONFIGS[ci])
        tri, _ = kernels_for(ctx["qt"], H, F, E, limit)
        bad += [(ci, n) for n in (1, 3) if not torch.equal(run_moe(ctx, tri, h[:n], ids[:n], w[:n]),
                                                           got[cis[0]][1]["rows16"][:n])]
    return {"ok": bool(cis) and not bad, "configs": cis, "mismatch": bad}


# ---- act_quant q8_1 (kernels/triton_mmq.py) beside the float schedules -------------------------------------

def _report(lines: list[str], fails: list[str], meta: dict, res, name: str) -> int:
    """An --act-quant table's end: the checks' verdict, printed and (with OUT) written as name.md and name.json ->
    the exit status (1: a check failed)."""
    md = "\n".join(lines) + "\n\nchecks: " + ("all pass" if not fails else "FAIL " + ", ".join(fails)) + \
        f"  ({time.perf_counter() - T0:.0f} s)"
    print("\n" + md, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.md").write_text(md + "\n")
        (Path(out) / f"{name}.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1, default=str))
    return 1 if fails else 0


def _check_into(out: dict, check, *args):
    """out["check"] = check(*args), or the error it raised: the figures already in `out` stay in the table."""
    try:
        out["check"] = check(*args)
    except Exception as e:
        out["check"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:120]}"}


def _bank_rows(gname: str, tname: str, out: dict):
    """The rotating banks of one type at a geometry (set up once; the caller has set its launch table), then per rows
    in (1, 16): the float path's GB/s into out["float"][rows], and yield (rows, r, gbps, mma): r the routing,
    gbps(fn) the GB/s of expert bytes of fn(i) (bank i % banks) as graph replays, mma(x, y) -> fn(i) launching
    triton_mmq's gate_up on x() and its down on y() (x, y: the activations' preparation, timed with the launch, or a
    tensor made once). The pool is freed after the last rows."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    bank_bytes = BANK * expert_nbytes(qt, H, F)
    n_banks = 2 if DRY else max(2, math.ceil(512e6 / bank_bytes))
    _, slot = slot_layout(qt, H, F)
    pool = torch.randint(0, 256, (n_banks * BANK * slot,), dtype=torch.uint8, device=dev)
    bases = [base_table(E, b * BANK, BANK, slot) for b in range(n_banks)]
    reps = max(n_banks, min(64, math.ceil(2e9 / bank_bytes)))
    kern, _ = kernels_for(qt, H, F, E, limit)
    gbps = lambda fn: bank_bytes / graph_time(fn, reps) / 1e9                  # noqa: E731
    for rows in (1, 16):
        r = kern.route(*routing(BANK, rows, K_TOP, H))
        kern.apply(r, 0, pool, Group(None, None, bases[0]), slot)
        st, al, gb, db = kern.starts[0], kern._aligned, row_nbytes(qt, H), row_nbytes(qt, F)

        def flt(i):
            tk.gate_up(r.h, pool, bases[i % n_banks], st, r.rows, r.off, r.inter, F, K_TOP, code, limit, gb, al)
            tk.down(r.inter, pool, bases[i % n_banks], st, r.rows, r.off, r.y, r.ids.shape[0], code, db, al)
        out["float"][rows] = gbps(flt)

        def mma(x, y):
            def fn(i):
                mq.gate_up(x(), pool, bases[i % n_banks], st, r.rows, r.off, r.inter, F, K_TOP, code, limit, gb, al)
                mq.down(y(), pool, bases[i % n_banks], st, r.rows, r.off, r.y, code, db, al)
            return fn
        yield rows, r, gbps, mma
    pool = None
    torch.cuda.empty_cache() if not DRY else None


def act_quant_case(gname: str, tname: str) -> dict:
    """One type: GB/s of the float path (the installed launch table) and of the q8_1 path (quantize + int8 MMA
    kernels; and the kernels alone, best of MMQ_CONFIGS, and each MMQ_OTHER schedule) at 1 and 16 rows on rotating
    banks; the q8_1 check (vs the torch path, rows alone == in the full launch, every candidate the same bits)."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    set_config(code, None)
    has = mq.mmq_ok(code, H) and mq.mmq_ok(code, F)
    out = {"float": {}, "q8_1": {}, "q8_1_kernels": {}, "other": {k: {} for k in MMQ_OTHER}, "mmq": has}
    for rows, r, gbps, mma in _bank_rows(gname, tname, out):
        if not has:
            continue
        hq, iq = mq.quantize_q8_1(r.h), mq.quantize_q8_1(r.inter)
        q81 = mma(lambda: mq.quantize_q8_1(r.h), lambda: mq.quantize_q8_1(r.inter))
        kq = mma(lambda: hq, lambda: iq)
        best = None
        for ci, c in [*MMQ_OTHER.items(), *enumerate(MMQ_CONFIGS)]:
            mq.TYPE_CONFIG[code] = dict(c)
            try:
                g = gbps(kq)
            except Exception as e:
                out.setdefault("config_errors", {})[ci] = f"{type(e).__name__}: {str(e)[:100]}"
                continue
            if ci in MMQ_OTHER:
                out["other"][ci][rows] = g
                continue
            out.setdefault("q8_1_kernels_by_config", {}).setdefault(ci, {})[rows] = g
            if best is None or g > best[0]:
                best = (g, ci)
        if best is None:                                # every schedule failed: the float figures stay
            mq.TYPE_CONFIG.pop(code, None)
            out["q8_1_error"] = "no mmq schedule ran"
            continue
        mq.TYPE_CONFIG[code] = dict(MMQ_CONFIGS[best[1]])
        out.setdefault("best_config", {})[rows] = best[1]
        out["q8_1"][rows] = gbps(q81)
        out["q8_1_kernels"][rows] = best[0]
        mq.TYPE_CONFIG.pop(code, None)
    if has:
        _check_into(out, act_quant_check, gname, tname, qt, H, F, E, limit)
    return out


def act_quant_check(gname: str, tname: str, qt: int, H: int, F: int, E: int, limit) -> dict:
    """The q8_1 path on valid blocks: relative max error vs the torch path (bf16) per routing, finite, a token's rows
    alone (1-row bucket: split-K) == in the full launch (16-row bucket: chunks walked), every MMQ_CONFIGS schedule
    the same bits."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    code = QT_CODES[qt]
    ctx = check_setup(gname, tname)
    tri, _ = kernels_for(qt, H, F, E, limit, act_quant="q8_1")
    chk = {"configs_same_bits": True}
    mq.TYPE_CONFIG.pop(code, None)
    for name, (h, ids, w, o_r) in ctx["cases"].items():
        o_t = run_moe(ctx, tri, h, ids, w)
        for ci, c in enumerate(MMQ_CONFIGS):            # every schedule: the same bits
            mq.TYPE_CONFIG[code] = dict(c)
            same = bool(torch.equal(run_moe(ctx, tri, h, ids, w), o_t))
            chk["configs_same_bits"] &= same
            if not same:                                # which candidates differ (MMQ_CONFIGS indices)
                chk.setdefault("configs_differ", []).append((name, ci))
        mq.TYPE_CONFIG.pop(code, None)
        chk["rel_err_" + name] = float((o_t - o_r).abs().max() / o_r.abs().max())
        chk["finite"] = chk.get("finite", True) and bool(torch.isfinite(o_t).all())
        if name == "rows16":
            alone = run_moe(ctx, tri, h[5:6], ids[5:6], w[5:6])
            chk["row_invariant"] = bool(torch.equal(alone[0], o_t[5]))
    chk["rel_err"] = max(v for k, v in chk.items() if k.startswith("rel_err_"))
    chk["ok"] = chk["finite"] and chk["row_invariant"] and chk["configs_same_bits"] and chk["rel_err"] < 3e-2
    return chk


def warm_mmq(tasks: list[tuple[str, str, int]]):
    """Compile the q8_1 kernels of (geometry, type, candidate) tasks (candidate: an index into MMQ_CONFIGS, a key
    of MMQ_OTHER, or -1: the float path and the quantizer) by launching them at 1 and 16 rows as act_quant_case does
    (the same specializations)."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    for gname, tname, ci in tasks:
        try:
            H, F, E, limit = GEOMS[gname]
            qt = int(GT[tname])
            code = QT_CODES[qt]
            kern, slot = kernels_for(qt, H, F, E, limit)
            pool = torch.zeros(BANK * slot, dtype=torch.uint8, device=dev)
            base = base_table(E, 0, BANK, slot)
            gb, db = row_nbytes(qt, H), row_nbytes(qt, F)
            for rows in (1, 16):
                r = kern.route(*routing(BANK, rows, K_TOP, H))
                if ci == -1:
                    kern.apply(r, 0, pool, Group(None, None, base), slot)
                    mq.quantize_q8_1(r.h), mq.quantize_q8_1(r.inter)
                    continue
                mq.TYPE_CONFIG[code] = dict(MMQ_OTHER[ci] if ci in MMQ_OTHER else MMQ_CONFIGS[ci])
                hq, iq = mq.quantize_q8_1(r.h), mq.quantize_q8_1(r.inter)
                st, al = kern.starts[0], kern._aligned
                mq.gate_up(hq, pool, base, st, r.rows, r.off, r.inter, F, K_TOP, code, limit, gb, al)
                mq.down(iq, pool, base, st, r.rows, r.off, r.y, code, db, al)
            mq.TYPE_CONFIG.pop(code, None)
        except Exception as e:                         # the timed run reports it
            print(f"warm_mmq {gname}/{tname}/{ci}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
    torch.cuda.synchronize()


def _error_row(lines: list[str], fails: list[str], key: str, r: dict, cols: int) -> bool:
    """Whether case r errored; if so its row of a `cols`-column table goes to lines and its key to fails (a time
    budget's skip is no failure)."""
    if "error" not in r:
        return False
    lines.append(f"| {key} | | {r['error']} |" + " |" * (cols - 3))
    fails += [] if r["error"].startswith("skipped") else [key]
    return True


def _act_table(res: dict, title: str, cols: tuple, rates, check_cell) -> tuple[list[str], list[str]]:
    """The markdown table of an activation-schedule run -> (lines, failed case keys). res {case: result}; cols the
    names of its three GB/s columns and its check column; rates(result) -> those three {rows: GB/s} (the middle one
    also against the targets); check_cell(check) -> the check's cell. A case fails on an error (not a skip), a check
    that is not ok, or its own `errors`."""
    f = lambda d, n: f"{d[n]:.0f}" if n in d else "–"                        # noqa: E731
    ratio = lambda d, n: f"{d[n] / TARGET[n]:.2f}" if n in d else "–"        # noqa: E731
    lines = [title, "", f"| case | rows | float | {cols[0]} | {cols[1]} | ÷ target | {cols[2]} | {cols[3]} |",
             "|---|---|---|---|---|---|---|---|"]
    fails = []
    for key, r in res.items():
        if _error_row(lines, fails, key, r, 8):
            continue
        c = r.get("check")
        cs = "no mmq schedule" if c is None else f"FAIL {c['error']}" if "error" in c else check_cell(c)
        fails += [key] if (c is not None and not c["ok"]) or r.get("errors") else []
        a, b, o = rates(r)
        for n in (1, 16):
            lines.append(f"| {key} | {n} | {f(r['float'], n)} | {f(a, n)} | {f(b, n)} | {ratio(b, n)} | {f(o, n)} | "
                         f"{cs if n == 1 else ''} |")
    return lines, fails


def _cases(geoms: list[str], types: list[str], budget: float, case) -> dict:
    """{"geom/type": case(geom, type)} for each pair while the time budget lasts (the rest: a "skipped" error); a
    case that raises gives its error and the traceback on stderr, so one table holds every case."""
    res = {}
    for g in geoms:
        for t in types:
            key = f"{g}/{t}"
            if time.perf_counter() - T0 > budget:
                res[key] = {"error": "skipped (time budget)"}
                continue
            try:
                res[key] = case(g, t)
            except Exception as e:
                import traceback
                traceback.print_exc()
                res[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            print(f"{key}: {json.dumps(res[key], default=str)}  ({time.perf_counter() - T0:.0f} s)", flush=True)
    return res


def act_quant_run(types: list[str], geoms: list[str], meta: dict, budget: float, workers: int) -> int:
    """--act-quant q8_1: the sm_90 compile report (int8 MMA, registers, spills, shared memory; a child process) and
    the kernels compiled by `workers` processes, then per type and geometry the float and q8_1 GB/s at 1 and 16 rows
    beside the targets; a table whatever fails. Exit 1 if a check failed or a case errored."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    mine = [t for t in types if QT_CODES[int(GT[t])] in mq.MMQ_TYPES]
    reps = []                   # (title, child): the shipped schedules' report, then the WL candidates' (hints)
    if not DRY and mine:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        wl = [json.dumps(MMQ_CONFIGS[-len(WL_CONFIGS):])]
        for title, argv in (("shipped", []), ("WL candidates at 16 rows, a device launch's alignment facts", wl)):
            reps.append((title, subprocess.Popen([sys.executable, "-m", "betelgeuse.kernels.triton_mmq", *argv],
                                                 cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.DEVNULL, text=True)))
    if workers > 0:
        tasks = [(g, t, ci) for g in geoms for t in mine for ci in [-1, *MMQ_OTHER, *range(len(MMQ_CONFIGS))]]
        print(f"compiling the q8_1 kernels of {len(tasks)} (type, schedule) tasks in {workers} workers ...",
              flush=True)
        meta["compile_s"] = warm_parallel(tasks, workers, timeout=budget * 0.5, flag="--warm-mmq")
        print(f"  done in {meta['compile_s']:.0f} s", flush=True)
    res = _cases(geoms, types, budget, act_quant_case)
    title = (f"## act_quant q8_1 vs float on {meta['device']} (bank of {BANK}, GB/s of expert bytes, "
             f"gate_up + down; q8_1 includes its two quantize launches, 'kernels' not; before: one block a step, "
             f"no split; targets 1 row >= {TARGET[1]:.0f}, 16 rows >= {TARGET[16]:.0f})")
    lines, fails = _act_table(res, title, ("q8_1", "q8_1 kernels", "before (kernels)", "q8_1 check"),
                              lambda r: (r["q8_1"], r["q8_1_kernels"], r["other"]["before"]), lambda c: (
        f"{'ok' if c['ok'] else 'FAIL'} rel {c['rel_err']:.2e} rows {'==' if c['row_invariant'] else '!='}"
        f" configs {'==' if c['configs_same_bits'] else '!= ' + str(c.get('configs_differ'))}"))
    lines += ["", "MMQ_CONFIGS (overrides of triton_mmq's table, the same bits): " + json.dumps(MMQ_CONFIGS)
              + "; best per case and rows: " + json.dumps({k: r.get("best_config") for k, r in res.items()}),
              "GB/s per candidate: " + json.dumps({k: {ci: {n: round(v) for n, v in d.items()}
                                                      for ci, d in r.get("q8_1_kernels_by_config", {}).items()}
                                                  for k, r in res.items()}),
              "GB/s of schedules with other bits (MMQ_OTHER): " + json.dumps(
                  {k: {o: {n: round(v) for n, v in d.items()} for o, d in r.get("other", {}).items()}
                   for k, r in res.items()})]
    for title, rep in reps:
        try:
            so, _ = rep.communicate(timeout=max(5.0, budget - (time.perf_counter() - T0)))
            lines += ["", f"compile report, {title} (sm_90, bench geometry: kernel type bucket KB KCB SPLIT warps "
                      "WL PF BN stages | MMA | regs spills smem | global loads by width):"]
            names = {c: n for n, c in ((t, QT_CODES[int(GT[t])]) for t in TYPES)}
            for ln in so.splitlines():
                x = json.loads(ln)
                k = x["config"]
                lines.append(f"  {x['kernel']} {names.get(x['qt'], x['qt'])} rows{x['bucket']} KB {k['KB']} KCB "
                             f"{k['KCB']} split {int(k['SPLIT'])} w{k['num_warps']} WL {k.get('WL', 0)} PF "
                             f"{k.get('PF', 0)} BN {k['BN']} st {k['num_stages']} | {x['imma']} | {x['regs']} "
                             f"{x['spill_bytes']} {x['smem']} | {x['loads']}")
        except Exception as e:
            rep.kill()
            lines += ["", f"compile report ({title}): {type(e).__name__}"]
    return _report(lines, fails, meta, res, "act_quant")


# ---- act_quant bf16 (triton_mmq's BF mode: the bf16 MMA of the integer quants) beside the float schedules ----------

def bf16_case(gname: str, tname: str) -> dict:
    """One type: GB/s of the float path (the installed launch table), of the bf16 MMA (prepare_bf16 + kernels; and
    the kernels alone) and of the q8_1 MMA's kernels (shipped constants, for comparison) at 1 and 16 rows on
    rotating banks, then bf16_check. The bf16 schedule is triton_mmq's (BF_TUNING): one per type, no candidates."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    set_config(code, None)
    mq.TYPE_CONFIG.pop(code, None)
    has = mq.mmq_ok(code, H, bf=True) and mq.mmq_ok(code, F, bf=True)
    q81 = mq.mmq_ok(code, H) and mq.mmq_ok(code, F)     # (Q5_K: no q8_1 schedule)
    out = {"float": {}, "bf16": {}, "bf16_kernels": {}, "q8_1_kernels": {}, "mmq": has}
    sums = code in (5, 6)                               # Q4_K's and Q5_K's min term takes the block sums of x
    for rows, r, gbps, mma in _bank_rows(gname, tname, out):
        if not has:
            continue
        hb, ib = mq.prepare_bf16(r.h, sums), mq.prepare_bf16(r.inter, sums)
        hq, iq = mq.quantize_q8_1(r.h), mq.quantize_q8_1(r.inter)
        bf = mma(lambda: mq.prepare_bf16(r.h, sums), lambda: mq.prepare_bf16(r.inter, sums))
        kb, kq = mma(lambda: hb, lambda: ib), mma(lambda: hq, lambda: iq)
        for key, fn in (("bf16", bf), ("bf16_kernels", kb), ("q8_1_kernels", kq))[:3 if q81 else 2]:
            try:
                out[key][rows] = gbps(fn)
            except Exception as e:                      # the other figures stay
                out.setdefault("errors", {})[f"{key}/{rows}"] = f"{type(e).__name__}: {str(e)[:120]}"
        for name, c in BF_CANDIDATES.items():           # the schedule keys' candidates, kernels alone
            mq.TYPE_CONFIG[code] = dict(c)
            try:
                out.setdefault("bf16_cands", {}).setdefault(name, {})[rows] = gbps(kb)
            except Exception as e:
                out.setdefault("errors", {})[f"{name}/{rows}"] = f"{type(e).__name__}: {str(e)[:120]}"
            finally:
                mq.TYPE_CONFIG.pop(code, None)
    if has:
        _check_into(out, bf16_check, gname, tname, qt, H, F, E, limit)
    return out


def bf16_check(gname: str, tname: str, qt: int, H: int, F: int, E: int, limit) -> dict:
    """The bf16 MMA on valid blocks: relative max error vs the torch path per routing beside the float path's (the
    same bf16 activations: within float noise, so under 1e-2 and at most 2x the float path's + 1e-3; the dry run's
    float32 activations round to bf16: + 1e-2), finite, a token's rows alone (1-row bucket: split-K) == in the full
    launch (16-row bucket: chunks walked), byte loads (WL 0) == the shipped word loads; KB 1 (another instruction
    shape, N 16 instead of 32: the fp32 sums may round otherwise) and BF_CANDIDATES' bits == the shipped reported
    (`<name>_same_bits`), not required (a candidate that differs is not a schedule key)."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    code = QT_CODES[qt]
    ctx = check_setup(gname, tname)
    tri, _ = kernels_for(qt, H, F, E, limit, act_quant="bf16")
    flt, _ = kernels_for(qt, H, F, E, limit)
    chk = {"wl0_same_bits": True, "kb1_same_bits": True, **{f"{n}_same_bits": True for n in BF_CANDIDATES}}
    mq.TYPE_CONFIG.pop(code, None)
    for name, (h, ids, w, o_r) in ctx["cases"].items():
        o_t = run_moe(ctx, tri, h, ids, w)
        for key, c in (("wl0_same_bits", {"WL": 0, "PF": 0}), ("kb1_same_bits", {"KB": 1}),
                       *((f"{n}_same_bits", c) for n, c in BF_CANDIDATES.items())):
            mq.TYPE_CONFIG[code] = c
            chk[key] &= bool(torch.equal(run_moe(ctx, tri, h, ids, w), o_t))
            mq.TYPE_CONFIG.pop(code, None)
        chk["rel_err_" + name] = float((o_t - o_r).abs().max() / o_r.abs().max())
        chk["float_rel_err_" + name] = float((run_moe(ctx, flt, h, ids, w) - o_r).abs().max() / o_r.abs().max())
        chk["finite"] = chk.get("finite", True) and bool(torch.isfinite(o_t).all())
        if name == "rows16":
            alone = run_moe(ctx, tri, h[5:6], ids[5:6], w[5:6])
            chk["row_invariant"] = bool(torch.equal(alone[0], o_t[5]))
    chk["rel_err"] = max(v for k, v in chk.items() if k.startswith("rel_err_"))
    chk["float_rel_err"] = max(v for k, v in chk.items() if k.startswith("float_rel_err_"))
    chk["ok"] = (chk["finite"] and chk["row_invariant"] and chk["wl0_same_bits"] and chk["rel_err"] < 1e-2
                 and chk["rel_err"] <= 2 * chk["float_rel_err"] + (1e-3 if DTYPE == torch.bfloat16 else 1e-2))
    return chk


def bf16_run(types: list[str], geoms: list[str], meta: dict, budget: float) -> int:
    """--act-quant bf16: per type and geometry the float, bf16 and q8_1-kernel GB/s at 1 and 16 rows beside the
    targets, and bf16_check; then the sm_90 compile report of the bf16 kernels. Exit 1 if a check failed or a case
    errored."""
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    res = _cases(geoms, types, budget, bf16_case)
    title = (f"## act_quant bf16 (the bf16 MMA of the integer quants) vs float on {meta['device']} (bank of {BANK}, "
             f"GB/s of expert bytes, gate_up + down; bf16 includes prepare_bf16's launches (Q4_K: the block sums), "
             f"'kernels' not; q8_1 kernels: the shipped int8 MMA for comparison; targets 1 row >= {TARGET[1]:.0f}, "
             f"16 rows >= {TARGET[16]:.0f})")
    lines, fails = _act_table(res, title, ("bf16", "bf16 kernels", "q8_1 kernels", "bf16 check"),
                              lambda r: (r["bf16"], r["bf16_kernels"], r["q8_1_kernels"]), lambda c: (
        f"{'ok' if c['ok'] else 'FAIL'} rel {c['rel_err']:.2e} (float {c['float_rel_err']:.2e}) rows "
        f"{'==' if c['row_invariant'] else '!='} WL0 {'==' if c['wl0_same_bits'] else '!='} KB1 "
        f"{'==' if c['kb1_same_bits'] else '!='}"))
    lines += ["", "bf16 schedule-key candidates (BF_CANDIDATES over BF_TUNING; kernels alone, GB/s at 1 / 16 rows, "
              "beside the shipped schedule's `bf16 kernels`; bits: every row == the shipped launch's):", ""]
    for key, r in res.items():
        c = r.get("check") or {}
        for n, cand in r.get("bf16_cands", {}).items():
            same = c.get(f"{n}_same_bits")
            lines.append(f"  {key} {n} {json.dumps(BF_CANDIDATES[n])}: " + " / ".join(
                f"{cand[k]:.0f}" if k in cand else "–" for k in (1, 16)) + " (shipped " + " / ".join(
                f"{r['bf16_kernels'][k]:.0f}" if k in r["bf16_kernels"] else "–" for k in (1, 16))
                + f"), bits {'==' if same else '!=' if same is not None else '?'}")
    lines += ["", "BF_TUNING: " + json.dumps({str(k): v for k, v in mq.BF_TUNING.items()}),
              "errors: " + json.dumps({k: r["errors"] for k, r in res.items() if r.get("errors")})]
    if not DRY:
        lines += ["", "compile report (sm_90, bench geometry, bf16: kernel type bucket | MMA | regs spills smem):"]
        for t in types:
            code = QT_CODES[int(GT[t])]
            if code not in mq.BF_TYPES:
                continue
            for w in ("gate_up", "down"):
                for b in (1, 16):
                    try:
                        x = mq.compile_report(w, code, bucket=b, hints=True, bf=True)
                        lines.append(f"  {w} {t} rows{b} | {x['imma']} | {x['regs']} {x['spill_bytes']} {x['smem']}")
                    except Exception as e:
                        lines.append(f"  {w} {t} rows{b}: {type(e).__name__}: {str(e)[:100]}")
    return _report(lines, fails, meta, res, "act_quant_bf16")


# ---- --tiles: the tile layout (kernels/tile_layout, issue 23) --------------------------------------------------

def tile_bank(pool: torch.Tensor, qt: int, H: int, F: int, slot: int) -> torch.Tensor:
    """A copy of `pool` (whole slots of `slot` bytes, parts at slot_layout's starts) with every slot's gate, up and
    down in the tile layout, tiled on the device: a part of all slots at once is one [slots x rows, K] matrix (its
    rows whole tiles a slot, so no tile crosses slots)."""
    from betelgeuse.kernels import tile_layout
    out = pool.clone()
    n = pool.numel() // slot
    src, dst = pool.view(n, slot), out.view(n, slot)
    starts, _ = slot_layout(qt, H, F)
    for s0, nb, (rows, K) in zip(starts, part_sizes(qt, H, F), ((F, H), (F, H), (H, F))):
        dst[:, s0:s0 + nb] = tile_layout.tile(src[:, s0:s0 + nb].contiguous(), n * rows, K, qt).view(n, nb)
    return out


def same_bits(a: tuple, b: tuple, a_out: tuple, b_out: tuple) -> bool:
    """Run launch pairs a and b (gate_up, down callables) once on bank 0 -> whether their outputs a_out / b_out
    (inter, y) are the same bits (int16 words)."""
    for gu, dn in (a, b):
        gu(0)
        dn(0)
    if not DRY:
        torch.cuda.synchronize()
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a_out, b_out))


def tiles_case(gname: str, tname: str) -> dict:
    """One type and geometry: triton_moe's float kernels (the kernels' own tuning) over rotating banks of GGUF slots
    (tiled False: the launch as the engine makes it), the same banks tiled (tile_bank; bit 0 of every base set, tiled
    True) and the GGUF banks with the tile flag on (tiled True, no expert flagged: the branch's cost); GB/s of the
    expert bytes at ROWS, gate_up + down and each. Bits: gate_up's inter and down's y of the tiled banks == the
    GGUF banks' (as int16 words: random bytes may make NaNs, whose bits are compared too). For the types of
    triton_mmq's MMA schedules the same for its q8_1 and bf16 kernels (mmq_q8_1 / mmq_bf16: the shipped schedule on
    the GGUF banks, Gluon's where it runs, against the tiled launch's byte-load MMA, with its bits check)."""
    from betelgeuse.kernels import tile_layout
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    if not (tile_layout.usable(F, H, qt) and tile_layout.usable(H, F, qt)):
        return {"error": f"skipped (not tileable: {H} x {F})"}
    set_config(code, None)
    nbytes = expert_nbytes(qt, H, F)
    bank_bytes = BANK * nbytes
    n_banks = 2 if DRY else max(2, math.ceil(512e6 / bank_bytes))          # several times the 60 MB L2
    _, slot = slot_layout(qt, H, F)
    pool = torch.randint(0, 256, (n_banks * BANK * slot,), dtype=torch.uint8, device=dev)
    tpool = tile_bank(pool, qt, H, F, slot)
    bases = [base_table(E, b * BANK, BANK, slot) for b in range(n_banks)]
    tbases = [torch.where(b >= 0, b | 1, b) for b in bases]
    reps = max(n_banks, min(64, math.ceil(2e9 / bank_bytes)))
    kern, _ = kernels_for(qt, H, F, E, limit)
    st, aligned = kern.starts[0], kern._aligned
    rg, rd = row_nbytes(qt, H), row_nbytes(qt, F)
    out = {"expert_bytes": nbytes, "banks": n_banks, "bits_equal": {}}
    for rows in ROWS:
        h, ids, w = routing(BANK, rows, K_TOP, H)
        r = kern.route(h, ids, w)
        inter_t = torch.empty_like(r.inter)
        y_t = torch.empty_like(r.y)

        def pair(p, bs, tiled, inter, y):
            def gu(i):
                tk.gate_up(r.h, p, bs[i % n_banks], st, r.rows, r.off, inter, F, K_TOP, code, limit, rg, aligned,
                           tiled)

            def dn(i):
                tk.down(r.inter, p, bs[i % n_banks], st, r.rows, r.off, y, r.ids.shape[0], code, rd, aligned, tiled)
            return gu, dn
        cases = {"gguf": pair(pool, bases, False, r.inter, r.y), "tiled": pair(tpool, tbases, True, inter_t, y_t),
                 "flag_on": pair(pool, bases, True, inter_t, y_t)}
        out["bits_equal"][rows] = same_bits(cases["gguf"], cases["tiled"], (r.inter, r.y), (inter_t, y_t))
        for mode, prep in (("q8_1", mq.quantize_q8_1), ("bf16", mq.prepare_bf16)):
            if not mq.mmq_ok(code, H, mode == "bf16") or not mq.mmq_ok(code, F, mode == "bf16"):
                continue
            hq, iq = prep(r.h), prep(r.inter)

            def mpair(p, bs, tiled, inter, y):
                def gu(i):
                    mq.gate_up(hq, p, bs[i % n_banks], st, r.rows, r.off, inter, F, K_TOP, code, limit, rg, aligned,
                               tiled=tiled)

                def dn(i):
                    mq.down(iq, p, bs[i % n_banks], st, r.rows, r.off, y, code, rd, aligned, tiled=tiled)
                return gu, dn
            g_io, t_io = (torch.empty_like(r.inter), torch.empty_like(r.y)), (inter_t, y_t)
            cases[f"mmq_{mode}"] = mpair(pool, bases, False, *g_io)
            cases[f"mmq_{mode}_tiled"] = mpair(tpool, tbases, True, *t_io)
            out["bits_equal"][f"mmq_{mode}/{rows}"] = same_bits(cases[f"mmq_{mode}"], cases[f"mmq_{mode}_tiled"],
                                                                 g_io, t_io)
        for name, (gu, dn) in cases.items():
            out.setdefault(name, {})
            t_gu, t_dn = graph_time(gu, reps), graph_time(dn, reps)
            out[name][rows] = {"gbps": bank_bytes / (t_gu + t_dn) / 1e9,
                               "gate_up_gbps": BANK * 2 * F * rg / t_gu / 1e9, "down_gbps": BANK * H * rd / t_dn / 1e9}
    pool = tpool = None
    torch.cuda.empty_cache()
    return out


def tiles_run(types: list[str], geoms: list[str], meta: dict, budget: float) -> int:
    """--tiles: per type and geometry the float kernels' GB/s on GGUF banks, tiled banks and GGUF banks with the flag
    on, at ROWS, and the bits check. Exit 1 if a tiled bank's bits differ or a case errored."""
    res = _cases(geoms, types, budget, tiles_case)
    f = lambda d, n, k="gbps": f"{d[n][k]:.0f}" if n in d else "–"          # noqa: E731
    lines = [f"## The tile layout (kernels/tile_layout) vs GGUF order on {meta['device']}: triton_moe's float kernels "
             f"(bank of {BANK}, the kernels' tuning, GB/s of expert bytes; gate_up + down, then gate_up / down; "
             f"targets 1 row >= {TARGET[1]:.0f}, 16 rows >= {TARGET[16]:.0f})", "",
             "| case | rows | GGUF | tiled | tiled ÷ GGUF | GGUF, flag on | GGUF gu / dn | tiled gu / dn | bits |",
             "|---|---|---|---|---|---|---|---|---|"]
    fails = []
    for key, r in res.items():
        if _error_row(lines, fails, key, r, 9):
            continue
        for n in ROWS:
            g, t = r["gguf"].get(n), r["tiled"].get(n)
            eq = r["bits_equal"].get(n)
            fails += [] if eq else [f"{key}/{n}"]
            lines.append(f"| {key} | {n} | {f(r['gguf'], n)} | {f(r['tiled'], n)} | "
                         f"{t['gbps'] / g['gbps']:.2f} | {f(r['flag_on'], n)} | "
                         f"{f(r['gguf'], n, 'gate_up_gbps')} / {f(r['gguf'], n, 'down_gbps')} | "
                         f"{f(r['tiled'], n, 'gate_up_gbps')} / {f(r['tiled'], n, 'down_gbps')} | "
                         f"{'==' if eq else '!='} |")
    lines += ["", "triton_mmq's MMA kernels (shipped schedule on GGUF banks vs the tiled launch's byte-load MMA; GB/s "
              "gate_up + down at each rows count; bits):", ""]
    for key, r in res.items():
        for mode in ("q8_1", "bf16"):
            g, t = r.get(f"mmq_{mode}"), r.get(f"mmq_{mode}_tiled")
            if not g:
                continue
            eqs = [r["bits_equal"].get(f"mmq_{mode}/{n}") for n in ROWS]
            fails += [f"{key}/mmq_{mode}"] if not all(eqs) else []
            lines.append(f"  {key} {mode}: " + ", ".join(
                f"{n} rows {f(g, n)} -> {f(t, n)} ({t[n]['gbps'] / g[n]['gbps']:.2f}x)" for n in ROWS)
                + f"; bits {'==' if all(eqs) else '!='}")
    return _report(lines, fails, meta, res, "tiles")


# ---- main -----------------------------------------------------------------------------------------------

def table(results: dict, meta: dict) -> str:
    lines = [f"## Expert kernels vs the memory roofline on {meta['device']} (torch {meta['torch']}, triton "
             f"{meta['triton']})", "",
             f"Bank of {BANK} experts, bf16 activations, gate_up + down per launch pair; copy bandwidth "
             f"{meta['copy_gbps']:.0f} GB/s (read + write). Targets: 1 row >= {TARGET[1]:.0f} GB/s, 16 rows >= "
             f"{TARGET[16]:.0f} GB/s.", "",
             "| geometry | type | bpw | MB/expert | config (BN/BK/warps/stages) | 1 row GB/s | 16 rows | 64 rows | "
             "gate_up / down GB/s @1 | µs @1 | vs torch | weights | row-inv |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        gname, tname = key.split("/")
        if "best" not in r:
            lines.append(f"| {gname} | {tname} | | | | {r.get('error', 'not run')} | | | | | | | |")
            continue
        b = r["configs"][r["best"]]
        c, rw = b["config"], b["rows"]
        ck = r.get("check", {})

        def mark(rows):
            if rows not in rw:
                return "-"
            v = rw[rows]["gbps"]
            return f"{v:.0f}" + (" ✓" if rows in TARGET and v >= TARGET[rows] else "")
        lines.append(f"| {gname} | {tname} | {r['bpw']:.2f} | {r['expert_bytes'] / 1e6:.2f} | "
                     f"{c['BN']}/{c['BK']}/{c['num_warps']}/{c['num_stages']} | {mark(1)} | {mark(16)} | {mark(64)} | "
                     f"{rw[1]['gate_up_gbps']:.0f} / {rw[1]['down_gbps']:.0f} | {rw[1]['us']:.0f} | "
                     f"{ck.get('rel_err', float('nan')):.1e} | {ck.get('weights_rel_err', float('nan')):.1e} | "
                     f"{'yes' if ck.get('row_invariant') else 'NO' if ck else '?'} |")
    return "\n".join(lines)


# ---- the sweep: a launch table per (type, rows bucket) -------------------------------------------------------

def label(c: dict) -> str:
    if c.get("MV"):
        return (f"mmvq BN {c['BN']}/{c['BN_GATE_UP']} rows {c['BM_MV']} KC {c['KC'] or 'K'} "
                f"{'split' if c['SPLIT'] and c['KC'] else 'walk'} w{c['num_warps']} s{c['num_stages']}")
    return (f"BN {c['BN']}/{c['BN_GATE_UP']} BK {c['BK']} KC {c['KC'] or 'K'} {'split' if c['SPLIT'] else 'walk'} "
            f"w{c['num_warps']} s{c['num_stages']}")


def choose(per_geom: dict, cfgs: list[int]) -> tuple[int, int] | None:
    """(config for 1 row, config for 16 rows) of one type from {geometry: {"m": measure(), "ck": {ci: (res, outs)}}}:
    both with the same reduction keys (BK, KC) and the same output bits on the check's routings (so a row's bits do
    not depend on the bucket it is launched in), checks passed, least time summed over the geometries relative to
    the first config's; None if no config passes."""
    from betelgeuse.kernels.triton_moe import REDUCE_KEYS

    def rel(ci, rows):                 # relative to the first config (absolute µs if it did not run)
        return sum(d["m"]["configs"][ci]["rows"][rows]["us"]
                   / (d["m"]["configs"][cfgs[0]]["rows"][rows]["us"] if cfgs[0] in d["ck"] else 1.0)
                   for d in per_geom.values())

    def same_bits(a, b):
        return all(torch.equal(d["ck"][a][1][k], d["ck"][b][1][k]) for d in per_geom.values() for k in d["ck"][a][1])
    ok = [ci for ci in cfgs if all(ci in d["ck"] and d["ck"][ci][0]["ok"] for d in per_geom.values())]
    best, score = None, math.inf
    for key in {tuple(CONFIGS[ci][k] for k in sorted(REDUCE_KEYS)) for ci in ok}:
        grp = [ci for ci in ok if tuple(CONFIGS[ci][k] for k in sorted(REDUCE_KEYS)) == key]
        b16 = min(grp, key=lambda ci: rel(ci, 16))
        b1 = min((ci for ci in grp if same_bits(ci, b16)), key=lambda ci: rel(ci, 1))
        if rel(b1, 1) + rel(b16, 16) < score:
            best, score = (b1, b16), rel(b1, 1) + rel(b16, 16)
    return best


def sweep(types: list[str], geoms: list[str], cfgs: list[int], meta: dict, budget: float) -> int:
    """Time every candidate config per type at 1 and 16 rows, check each against the torch path, pick a table
    (choose), write it as triton_tuning.json ($OUT or /tmp), then load it as the kernels do and check again that a
    row launched alone (1-row bucket) equals the same row in a 16-row launch, bit for bit."""
    from betelgeuse.kernels import triton_moe
    from betelgeuse.kernels.triton_moe import SCHEDULE_KEYS, REDUCE_KEYS
    from betelgeuse.kernels.triton_quants import QT_CODES
    data: dict = {}
    for t in types:
        for g in geoms:
            if time.perf_counter() - T0 > budget:
                print(f"{g}/{t}: skipped (time budget)", flush=True)
                continue
            try:
                m = measure(g, t, [ci for ci in cfgs if applies(t, ci)])
                ctx = check_setup(g, t)
                ran = [ci for ci in cfgs if "rows" in m["configs"].get(ci, {})]
                ck = {ci: check_config(ctx, CONFIGS[ci]) for ci in ran}
                data.setdefault(t, {})[g] = {"m": m, "ck": ck, "ctx": ctx}
                for ci in ran:
                    rw = m["configs"][ci]["rows"]
                    gbps = " / ".join(f"{rw[n]['gbps']:5.0f}" for n in ROWS)
                    print(f"{g}/{t} [{ci}] {label(CONFIGS[ci]):40s} {gbps}"
                          + f" GB/s at {ROWS} rows; err {ck[ci][0]['rel_err']:.1e}"
                          + ("" if ck[ci][0]["ok"] else f" CHECK FAILED {ck[ci][0]}"), flush=True)
            except Exception as e:                     # one table with every case
                import traceback
                traceback.print_exc()
                print(f"{g}/{t}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    types_out, figures, lines, fails = {}, {}, [], []
    for t, per in data.items():                        # the decode schedule: one row's bits at every BM_MV
        for g, d in per.items():
            every = [ci for ci in mv_configs(t, None) if ci in d["ck"]]
            for kc in sorted({CONFIGS[ci]["KC"] for ci in every}):        # one bits per KC
                ran = [ci for ci in every if CONFIGS[ci]["KC"] == kc]
                rr = check_rows(d["ctx"], d["ck"], ran)
                print(f"{g}/{t} mmvq KC {kc or 'K'} rows a program {[CONFIGS[ci]['BM_MV'] for ci in rr['configs']]}: "
                      + ("same bits" if rr["ok"] else f"MISMATCH {rr['mismatch']}"), flush=True)
                if not rr["ok"]:
                    fails.append(f"{g}/{t}: mmvq KC {kc} rows {rr['mismatch']}")
    for t, per in data.items():
        pick = choose(per, [ci for ci in cfgs if applies(t, ci)])
        if pick is None:
            fails.append(f"{t}: no config passes its checks")
            continue
        b1, b16 = pick
        types_out[t] = {**table_keys(CONFIGS[b1], REDUCE_KEYS), "rows1": table_keys(CONFIGS[b1], SCHEDULE_KEYS),
                        "rows16": table_keys(CONFIGS[b16], SCHEDULE_KEYS)}
        for g, d in per.items():
            for rows, ci in ((1, b1), (16, b16)):
                v = d["m"]["configs"][ci]["rows"][rows]["gbps"]
                v0 = d["m"]["configs"][cfgs[0]].get("rows", {}).get(rows, {}).get("gbps", float("nan"))
                figures[f"{g}/{t}/rows{rows}"] = {"gbps": round(v, 1), "baseline_gbps": round(v0, 1), "config": ci}
                ok = "✓" if v >= TARGET[rows] else ""
                lines.append(f"| {g} | {t} | {rows} | {label(CONFIGS[ci])} | {v:.0f} {ok} | "
                             f"{100 * v / meta['copy_gbps']:.0f}% | {v0:.0f} | {d['ck'][ci][0]['rel_err']:.1e} |")
    tuning = {"about": "expert kernel launch table per type and rows bucket (betelgeuse/kernels/triton_moe.py); "
                       "written by deploy/device/kernel_roofline.py --sweep",
              "device": meta["device"], "torch": meta["torch"], "triton": meta["triton"],
              "copy_gbps": round(meta["copy_gbps"], 1), "types": types_out, "figures": figures}
    out = Path(os.environ.get("OUT") or "/tmp")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "triton_tuning.json"
    path.write_text(json.dumps(tuning, indent=1) + "\n")
    # the table as the kernels load it: no overrides; a row alone (bucket 1) == in a 16-row launch (bucket 16)
    triton_moe.TUNING = triton_moe.load_tuning(path)
    for t, per in data.items():
        if t not in types_out:
            continue
        for g, d in per.items():
            res, _ = check_config(d["ctx"], None)
            if not res["ok"]:
                fails.append(f"{g}/{t} with the table: {res}")
    md = "\n".join([
        f"## Expert kernel launch sweep on {meta['device']} (torch {meta['torch']}, triton {meta['triton']})", "",
        f"Bank of {BANK} experts, bf16 activations, gate_up + down; copy {meta['copy_gbps']:.0f} GB/s (read + "
        f"write). Targets: 1 row >= {TARGET[1]:.0f} GB/s, 16 rows >= {TARGET[16]:.0f} GB/s. {len(cfgs)} configs "
        "per type.", "",
        "| geometry | type | rows | best config | GB/s | vs copy | baseline GB/s | vs torch |",
        "|---|---|---|---|---|---|---|---|", *lines, "",
        "checks: " + ("all pass (every config tried; the table loaded: rows alone == in 16-row launches)"
                      if not fails else "FAIL " + "; ".join(fails)),
        f"\ntable written to {path} ({time.perf_counter() - T0:.0f} s, compiles {meta['compile_s']:.0f} s)"])
    print("\n" + md)
    print("\n" + json.dumps({"types": types_out}))
    (out / "kernel_sweep.md").write_text(md + "\n")
    return 1 if fails else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", help=f"default: every type (--act-quant: {MMQ_TYPES_DEFAULT})")
    p.add_argument("--geoms", help=f"default: {','.join(GEOMS)} (--sweep: bench)")
    p.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))), help="indices into CONFIGS")
    p.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 2))
    p.add_argument("--budget", type=float,
                   help="seconds: later cases are skipped past it (default 160, --sweep 270)")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU under TRITON_INTERPRET=1 on tiny geometries (checks this script, not the GPU)")
    p.add_argument("--sweep", action="store_true",
                   help="time every config at 1 and 16 rows, check each, write the per-(type, rows bucket) table "
                        "$OUT/triton_tuning.json (for betelgeuse/kernels/triton_tuning.json)")
    p.add_argument("--tuned", action="store_true",
                   help="time the launch table as the kernels load it (betelgeuse/kernels/triton_tuning.json, "
                        "$BETELGEUSE_TRITON_TUNING) instead of CONFIGS")
    p.add_argument("--act-quant", choices=("q8_1", "bf16"),
                   help="time the q8_1 activation path (kernels/triton_mmq.py) beside the float one at 1 and 16 "
                        "rows, check it, print the sm_90 compile report (default types Q8_0,Q4_K,MXFP4, geometry "
                        "bench, budget 110 s); bf16: the bf16 MMA of the integer quants (triton_mmq's BF mode) beside "
                        "the float path and the q8_1 kernels, no candidates (budget 150 s)")
    p.add_argument("--tiles", action="store_true",
                   help="time the float kernels on tile-layout banks (kernels/tile_layout) beside the GGUF banks at "
                        "1 and 16 rows, bits checked (default geometry bench, every type, budget 200 s)")
    p.add_argument("--warm", help=argparse.SUPPRESS)
    p.add_argument("--warm-mmq", help=argparse.SUPPRESS)
    a = p.parse_args()
    global DRY, dev, ROWS, BANK, DTYPE, K_TOP
    if a.warm:
        job = json.loads(a.warm)
        ROWS = tuple(job["rows"])
        if job.get("tuned"):
            CONFIGS[:] = [None]
        warm([tuple(t) for t in job["tasks"]])
        return 0
    if a.warm_mmq:
        warm_mmq([tuple(t) for t in json.loads(a.warm_mmq)["tasks"]])
        return 0
    a.geoms = a.geoms or ("bench" if a.sweep or a.act_quant or a.tiles else ",".join(GEOMS))
    a.types = a.types or (BF16_TYPES_DEFAULT if a.act_quant == "bf16" else MMQ_TYPES_DEFAULT if a.act_quant
                          else ",".join(TYPES))
    a.budget = a.budget or (270.0 if a.sweep else 150.0 if a.act_quant == "bf16" else 110.0 if a.act_quant
                            else 200.0 if a.tiles else 160.0)
    if a.sweep or a.tiles:
        ROWS = (1, 16)
    if a.tuned:
        if a.sweep:
            print("kernel_roofline: error: --tuned times the installed table; --sweep makes one (not both)")
            return 2
        CONFIGS[:] = [None]                            # set_config(code, None): no override, the table
        a.configs = "0"
    if a.dry_run:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1"
        DRY, dev, ROWS, BANK, DTYPE, a.workers, a.budget = True, torch.device("cpu"), (1, 16), 2, torch.float32, 0, 1e9
        K_TOP = 2                  # 2 experts a bank: 1 row each = 1 token (bucket 1), 16 rows = 16 tokens (16)
        for g in list(GEOMS):      # K 512 / 256: KC 256 splits gate_up in 2 chunks
            GEOMS[g] = (512, 256, 8, GEOMS[g][3])
    elif not torch.cuda.is_available():
        print("kernel_roofline: error: CUDA is not available")
        return 2
    import triton
    types, geoms = a.types.split(","), a.geoms.split(",")
    cfgs = [int(i) for i in a.configs.split(",")]
    bad = [t for t in types if t not in TYPES] + [g for g in geoms if g not in GEOMS]
    if bad:
        print(f"kernel_roofline: error: unknown {bad} (types: {TYPES}; geometries: {list(GEOMS)})")
        return 2
    x = torch.empty(1 << (16 if DRY else 28), dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    copy_s = graph_time(lambda i: y.copy_(x), 8)
    meta = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": 2 * x.numel() * 4 / copy_s / 1e9, "configs": CONFIGS}
    x = y = None
    if a.act_quant == "bf16":
        return bf16_run(types, geoms, meta, a.budget)
    if a.act_quant:
        return act_quant_run(types, geoms, meta, a.budget, a.workers)
    if a.tiles:
        return tiles_run(types, geoms, meta, a.budget)
    tasks = [(g, t, c) for g in geoms for t in types for c in cfgs if applies(t, c)]
    print(f"compiling {len(tasks) * 2} kernels in {a.workers} workers ...", flush=True)
    meta["compile_s"] = warm_parallel(tasks, a.workers, timeout=a.budget * 0.45) if a.workers > 0 else 0.0
    print(f"  done in {meta['compile_s']:.0f} s", flush=True)
    if a.sweep:
        return sweep(types, geoms, cfgs, meta, a.budget)
    results = {}
    for g in geoms:
        for t in types:
            key = f"{g}/{t}"
            if time.perf_counter() - T0 > a.budget:
                results[key] = {"error": "skipped (time budget)"}
                continue
            try:
                r = measure(g, t, [ci for ci in cfgs if applies(t, ci)])
                r["best"] = min((ci for ci in r["configs"] if "rows" in r["configs"][ci]),
                                key=lambda ci: sum(r["configs"][ci]["rows"][n]["us"] for n in ROWS[:2]))
                r["check"] = check(g, t, r["best"])
                results[key] = r
                b = r["configs"][r["best"]]["rows"]
                print(f"{key:18s} best config {r['best']}: " + " / ".join(f"{b[n]['gbps']:.0f}" for n in ROWS)
                      + f" GB/s at {ROWS} rows; check {r['check']}  ({time.perf_counter() - T0:.0f} s)", flush=True)
            except Exception as e:                     # one table with every case
                import traceback
                traceback.print_exc()
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    md = table(results, meta)
    keep = {}
    from betelgeuse.kernels.triton_quants import QT_CODES
    for t in types:                                    # the faster config over the geometries measured
        rs = [results[f"{g}/{t}"] for g in geoms if "best" in results.get(f"{g}/{t}", {})]
        if rs:
            ran = [c for c in cfgs if all("rows" in r["configs"].get(c, {}) for r in rs)]
            ci = min(ran, key=lambda c: sum(r["configs"][c]["rows"][n]["us"] / r["configs"][ran[0]]["rows"][n]["us"]
                                            for r in rs for n in ROWS[:2]))
            keep[QT_CODES[int(GT[t])]] = dict(CONFIGS[ci] or {"tuned": "triton_tuning.json"})
    fails = [k for k, r in results.items()
             if ("check" in r and not (r["check"]["row_invariant"] and r["check"]["finite"] and r["check"]["rel_err"] < 3e-2))
             or ("error" in r and not r["error"].startswith("skipped"))]
    md += ("\n\nTYPE_CONFIG = " + json.dumps({str(k): v for k, v in keep.items()}) + "\n\nchecks: "
           + ("all pass" if not fails else "FAIL " + ", ".join(fails))
           + f"\n\n({time.perf_counter() - T0:.0f} s, compiles {meta['compile_s']:.0f} s)")
    print("\n" + md)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kernel_roofline.md").write_text(md + "\n")
        (Path(out) / "kernel_roofline.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                                                    default=str))
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
