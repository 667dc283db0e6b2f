"""Static account of the float decode schedule (triton_mmvq, MV = 1) at one row: per kernel, the SASS of one K step
and of the rest (prologue, the pairwise tree, the store), registers, CTAs a SM, the grid's waves over 132 SMs, and
the bytes a SM has in flight, turned into three ceilings (GB/s of expert bytes):

  issue   927 G warp instructions/s (132 SMs x 1.755 GHz x 4 schedulers) / (warp instructions per weight byte of a
          whole program: prologue + steps x loop + tree, not the loop alone as sass_profile);
  little  bytes in flight over the device / LAT: PF_MV 0 reads each load of a step 4-40 instructions after it
          (`read after`: sass_profile.ldg_reads, min-max), so a program has one step's bytes in flight (PF_MV 1:
          two); a SM min(CTAs a SM, programs / 132) programs;
  model   a program's time = DEP x LAT (DEP dependent loads before its first weight load: off -> base / rows ->
          starts -> the row addresses, read from the kernel source) + its non-loop issue + steps x (LAT + C), C a
          step's issue time of all the SM's resident warps (in the same phase: they start together); PF_MV:
          steps x max(LAT, C), the next step's loads in flight during this one's arithmetic. The grid in
          ceil(waves) rounds of that time.
No GPU: latency, clocks and DRAM are modelled by LAT only. Compiled by tests/scripts/kernel_smem.py's compile_sm90.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-mv63/account.py [--json] [--pf=0,1]
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
sys.path.insert(0, str(ROOT))

import kernel_smem  # noqa: E402
import sass_profile as sp  # noqa: E402

SMS, CTA_MAX, WARPS_MAX, REGS_SM, SMEM_SM = 132, 32, 64, 65536, 228 * 1024      # sm_90 (H100 SXM)
ISSUE_G = sp.ISSUE_G
LAT = 700e-9                      # s, a DRAM load under load (the brief's 600-800 ns)
DEP = 3                           # dependent global loads before the first weight load (triton_moe._find_block ->
                                  # _mv_rows / _part_rows -> the row addresses)
BANK = 16                         # experts a launch, one row each (kernel_roofline's 1-row bank)
GEOMS = {"bench": (2048, 768, 128, 8, False), "ds4-flash": (4096, 2048, 256, 6, True)}
# (type, geometry, BN, warps, stages): the device's best one-row candidates (gpu-run24: Q8_0 BN 4 x 2 warps, 2
# stages, 1,145 GB/s on the H200; gpu-run55: MXFP4 BN 16 x 2 647, Q4_K BN 8 x 2 730, H100) and BN 16 x 2 for all
CASES = [("Q8_0", "bench", 4, 2, 2), ("Q8_0", "bench", 16, 2, 1), ("MXFP4", "bench", 16, 2, 1),
         ("MXFP4", "bench", 4, 2, 1), ("Q4_K", "bench", 8, 2, 1), ("Q4_K", "bench", 16, 2, 1),
         ("MXFP4", "ds4-flash", 16, 2, 1), ("MXFP4", "ds4-flash", 4, 2, 1)]


def ctas_per_sm(regs: int, warps: int, smem: int) -> int:
    per_warp = math.ceil(regs * 32 / 256) * 256                 # registers are allocated 256 a warp
    return min(CTA_MAX, WARPS_MAX // warps, REGS_SM // (per_warp * warps), SMEM_SM // max(smem, 1))


def account(name: str, geom: str, which: str, bn: int, warps: int, stages: int, pf: int) -> dict:
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.gguf.qtypes import row_nbytes
    from betelgeuse.kernels import triton_mmvq, triton_moe
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, k, lim = GEOMS[geom]
    qt = QT_CODES[int(GT[name])]
    over = {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": bn, "BN_GATE_UP": bn, "SPLIT": 0, "num_warps": warps,
            "num_stages": stages, "PF_MV": pf}
    keep = triton_moe.TYPE_CONFIG.get(qt)
    try:
        spec = kernel_smem.expert_spec(name, which, over, geom=(H, F, E, k), bucket=1,
                                       has_limit=lim and which == "gate_up")
    finally:
        triton_moe.TYPE_CONFIG.pop(qt, None)
        if keep is not None:
            triton_moe.TYPE_CONFIG[qt] = keep
    kern = kernel_smem.compile_sm90(*spec)
    sass, res = sp.sass_of(kern.asm["cubin"])
    ins = sp.instructions(sass)
    body = sp.k_loop(ins)
    allins = [x for x in ins if not x[0]]
    rest = len(allins) - len(body)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    spill = int(re.search(r"LOCAL:(\d+)", res).group(1)) + int(re.search(r"STACK:(\d+)", res).group(1))
    smem = int(kern.metadata.shared)
    S = triton_mmvq.STEP[qt]
    K, N = (H, F) if which == "gate_up" else (F, H)
    parts = 2 if which == "gate_up" else 1
    steps = K // S
    step_b = parts * bn * row_nbytes(int(GT[name]), S)
    prog_b = steps * step_b
    programs = math.ceil(N / bn) * BANK
    cta = ctas_per_sm(regs, warps, smem)
    waves = programs / (SMS * cta)
    ldg = sum(x[1] == "LDG" for x in body)
    ipb = (rest + steps * len(body)) * warps / prog_b
    # bytes a SM waits for at once: a step's (PF_MV: two steps', the next one's issued before this one is read)
    flight = min(cta, programs / SMS) * step_b * (2 if pf else 1)
    # the step model: a SM's resident programs run in the same phase, sharing its 4 schedulers; a step costs its
    # loads' latency plus the arithmetic of every resident warp (LAT + C), with PF_MV the larger of the two
    res_ctas = min(cta, math.ceil(programs / SMS))
    clk = ISSUE_G / SMS / 4                                     # G cycles/s
    C = res_ctas * warps * len(body) / 4 / clk * 1e-9
    rest_s = res_ctas * warps * rest / 4 / clk * 1e-9
    t_prog = DEP * LAT + rest_s + steps * (max(LAT, C) if pf else LAT + C)
    chain_s = math.ceil(waves) * t_prog
    total_b = programs * prog_b
    return {"type": name, "geom": geom, "kernel": which, "BN": bn, "warps": warps, "stages": stages, "PF_MV": pf,
            "S": S, "steps": steps, "step_B": step_b, "loop_instr": len(body), "rest_instr": rest,
            "ldg": ldg, "ldg_in_step": sp.ldg_in_step(body),
            "read_after": sorted(d for d, _ in sp.ldg_reads(body)), "classes": sp.mix(body)["classes"],
            "ldg_w": sp.mix(body)["ldg"], "regs": regs, "spill": spill, "smem": smem, "cta_sm": cta,
            "programs": programs,
            "waves": round(waves, 2), "instr_B": round(ipb, 3), "issue_GBps": round(ISSUE_G / ipb),
            "flight_KB_sm": round(flight / 1024, 1), "little_GBps": round(flight * SMS / LAT / 1e9),
            "model_GBps": round(total_b / chain_s / 1e9), "step_ns": round(C * 1e9), "bytes": total_b}


def main() -> int:
    why = kernel_smem.probe()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    pfs = [int(v) for v in next((a[5:] for a in sys.argv if a.startswith("--pf=")), "0,1").split(",")]
    rows = [account(t, g, w, bn, wp, st, pf) for t, g, bn, wp, st in CASES for pf in pfs
            for w in ("gate_up", "down")]
    if "--json" in sys.argv:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("| type | geom | kernel | BN x warps, stages, PF_MV | steps x B | loop instr (ldg, read after) "
          "| rest instr | regs | CTA/SM | programs | waves | instr/B | issue | KB in flight/SM | little | step issue ns | model |")
    print("|" + "---|" * 17)
    for r in rows:
        print(f"| {r['type']} | {r['geom']} | {r['kernel']} | {r['BN']} x {r['warps']}, {r['stages']}, "
              f"{r['PF_MV']} | "
              f"{r['steps']} x {r['step_B']} | {r['loop_instr']} ({r['ldg']}, "
              f"{r['read_after'][0]}-{r['read_after'][-1]}) | "
              f"{r['rest_instr']} | "
              f"{r['regs']}{' spill ' + str(r['spill']) if r['spill'] else ''} | {r['cta_sm']} | {r['programs']} | "
              f"{r['waves']} | {r['instr_B']} | {r['issue_GBps']} | "
              f"{r['flight_KB_sm']} | {r['little_GBps']} | {r['step_ns']} | {r['model_GBps']} |")
    # a launch pair's model: the sum of gate_up's and down's times at each ceiling's rate
    print()
    for i in range(0, len(rows), 2):
        g, d = rows[i], rows[i + 1]
        b = g["bytes"] + d["bytes"]
        f = {c: round(b / (g["bytes"] / g[c] + d["bytes"] / d[c])) for c in ("issue_GBps", "little_GBps", "model_GBps")}
        print(f"pair {g['type']} {g['geom']} BN {g['BN']} x {g['warps']}, {g['stages']} PF_MV {g['PF_MV']}: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
