"""Static instruction profile of the decode (1-row) expert kernels on sm_90, compiled ahead of time: no GPU needed.

Each type's gate_up and down kernels are compiled for CUDA capability 90 with a real launch's specializations
(kernel_smem.expert_spec: bf16 activations, bench geometry H 2048 / F 768 / 128 experts, the rows-1 bucket) and
disassembled with the nvdisasm Triton ships. The K loop is the backward branch whose body holds the most global
loads; per loop iteration (one K step of the program: the decode schedule's step S, the MMA path's BK) it counts
the SASS instructions by class and divides by the weight bytes the program reads in that iteration
(parts x BN rows x the step's bytes), which is the figure of merit without a GPU:

  instr/B   warp instructions issued per weight byte (per-thread count x warps / bytes). An H100 SXM issues
            4 warp instructions / clk / SM: 132 SMs x 1.755 GHz x 4 = 927 G/s, so the issue ceiling in GB/s is
            927 / instr/B (1.5 TB/s needs <= 0.62 instr/B with nothing else in the way);
  cvt/w     int->float conversions (I2F, I2FP) and float->float (F2F) per weight (thread ops / weights): H100 runs
            16 conversions / clk / SM against 128 FFMA;
  ffma/w    FFMA per weight (the exact schedule's floor is 2: one decode fma, one accumulate fma);
  alu/w     LOP3 + SHF + PRMT + SGXT + IMAD.SHL + IADD3 (integer unpacking) per weight;
  ldg       the global load widths in the loop (LDG.E.128 / .64 / 32-bit / .U8 / .U16 counts per thread);
  regs, spill  registers per thread and spill bytes (local memory) from cuobjdump -res-usage.

    sass_profile.py [--types Q4_K,Q5_K,Q6_K,Q8_0,MXFP4] [--kernels gate_up,down] [--scheds mmvq,table]
                    [--mv BN,warps[,stages]] [--bf-over JSON] [--json] [--dump DIR]

Schedules: `mmvq` (the decode schedule, triton_mmvq, MV = 1, gpu-run24's fastest one-row config: BN 4 x 1 row a
program, 2 warps; --mv another) where the type has it, `table` (the shipped launch of the rows-1 bucket:
triton_tuning.json), and `bf16` / `bf16r16` (act_quant bf16: triton_mmq's bf16 MMA of the integer quants,
BF_TYPES only, the rows-1 / rows-16 bucket's launch: config(bf=True), --bf-over JSON overrides on top; one K loop
iteration = one K step of KB blocks on BN rows of ONE part, FUSE 0); `gluon` / `gluonr16`: the same schedule in
Gluon (betelgeuse/kernels/gluon_mmq.py, triton_mmq's GL 1: the weights loaded straight into wgmma's A registers),
Q8_0, MXFP4 and Q4_K, FUSE as the Triton row's (config(bf=True) with --bf-over: gate_up's loop then holds both
parts; the keys GP, gluon_mmq's load distance, PK, mma_pack's layout, and NR, the register limit, from --bf-over
too). The MMA rows add the shared memory traffic of the loop (sts / lds per thread: STS + STSM, LDS + LDSM; bar: BAR),
where the tensor-core instruction takes its A operand (the weights): `R` registers (HGMMA Rd, Ra, gdesc[..]),
`smem` a descriptor, and how many of the loop's LDG are read in the step that issues them (ldg_in_step: waited for
there). Prints a markdown table; --json one JSON line; --dump writes each kernel's SASS.
Static counts only: latency, occupancy and the memory system are not modelled (the device measures GB/s:
deploy/device/kernel_roofline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import kernel_smem  # noqa: E402  (beside this script: compile_sm90, expert_spec, probe)

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"]
ISSUE_G = 132 * 1.755 * 4          # H100 SXM: warp instructions issued per ns (SMs x GHz x schedulers)
# the decode schedule's one-row config (gpu-run24-mmvq: the fastest one-row candidate of kernel_roofline.CONFIGS)
MV_CONFIG = {"BK": 256, "KC": 0, "MV": 1, "BM_MV": 1, "BN": 4, "BN_GATE_UP": 4, "SPLIT": 0, "num_warps": 2,
             "num_stages": 2}
CLASSES = {                        # opcode (before the first '.') -> class
    "I2F": "cvt", "I2FP": "cvt", "F2F": "cvt", "F2FP": "cvt", "F2I": "cvt", "HADD2": "f16", "HMUL2": "f16",
    "FFMA": "ffma", "FMUL": "fmul", "FADD": "fadd", "FSEL": "fsel", "FMNMX": "fsel",
    "LOP3": "alu", "SHF": "alu", "PRMT": "alu", "SGXT": "alu", "IADD3": "alu", "LEA": "addr", "IMAD": "imad",
    "LDG": "ldg", "HMMA": "mma", "HGMMA": "mma", "LDS": "lds", "LDSM": "lds", "STS": "sts", "STSM": "sts",
    "BAR": "bar", "MOV": "mov",
    "CS2R": "mov", "SEL": "sel", "ISETP": "setp", "FSETP": "setp",
}


def _tool(name: str) -> str:
    import triton
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(p)


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(nvdisasm's SASS, cuobjdump -res-usage) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return sass, res


_INS = re.compile(r"/\*[0-9a-f]+\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*(.*?);")


def instructions(sass: str) -> list[tuple[str, str, str]]:
    """[(label or '', opcode, modifiers + operands)] in order; a label line yields ('L', name, '')."""
    out = []
    for line in sass.splitlines():
        s = line.strip()
        if s.startswith(".L_") and s.endswith(":"):
            out.append(("L", s[:-1], ""))
            continue
        m = _INS.search(line)
        if m:
            out.append(("", m.group(2), (m.group(3) or "") + " " + m.group(4)))
    return out


def _loops(ins: list) -> list[tuple[int, int]]:
    """(label, branch) indices in ins of the backward branches (a label before its branch: a loop), in branch order."""
    labels = {x[1]: i for i, x in enumerate(ins) if x[0] == "L"}
    out = []
    for i, (kind, op, rest) in enumerate(ins):
        if kind or op != "BRA":
            continue
        m = re.search(r"`\((\.L_x_\d+)\)", rest)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            out.append((labels[m.group(1)], i))
    return out


def mma_loops(ins: list) -> list[list]:
    """The innermost loops holding a tensor-core instruction (each holds no other such loop), as k_loop's bodies: a
    kernel with several K loops (gluon_mmq's PK 2: the packed layout's and GGUF order's) has one each."""
    spans = [(s, e) for s, e in _loops(ins) if any(x[1] in ("HGMMA", "HMMA") for x in ins[s:e + 1] if not x[0])]
    inner = [(s, e) for s, e in spans if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans)]
    return [[x for x in ins[s + 1:e + 1] if not x[0]] for s, e in inner]


def k_loop(ins: list, mma: bool = False) -> list:
    """The body of the backward branch whose body holds the most LDG (the K loop); mma: the shortest body holding a
    tensor-core instruction (the innermost loop of the MMA: an outer loop over K chunks, or gate_up's walk of the
    gate's then the up's K loop, holds it too)."""
    if mma:
        return min(mma_loops(ins), key=len, default=[])
    best: list = []
    for s, e in _loops(ins):
        body = [x for x in ins[s + 1:e + 1] if not x[0]]
        if sum(x[1] == "LDG" for x in body) > sum(x[1] == "LDG" for x in best):
            best = body
    return best


def mix(body: list) -> dict:
    """Instruction counts by class (per thread, one loop iteration), LDG widths, IMAD used as a shift."""
    c: dict = {}
    ldg: dict = {}
    for _, op, rest in body:
        k = CLASSES.get(op, "other")
        if op == "IMAD" and (".SHL" in rest or ".MOV" in rest):
            k = "alu" if ".SHL" in rest else "mov"
        c[k] = c.get(k, 0) + 1
        if op == "LDG":
            w = next((t for t in ("128", "64", "U8", "S8", "U16", "S16") if f".{t}" in rest.split()[0]), "32")
            ldg[w] = ldg.get(w, 0) + 1
    c["total"] = len(body)
    return {"classes": c, "ldg": ldg}


def ldg_reads(body: list) -> list[tuple[int, bool]]:
    """For each of the loop's LDG: (instructions from it to the first instruction that reads its destination, counted
    across the back edge; whether that read is in the same iteration). The reads of an instruction: its register
    operands after the first (the destination), all of them for a store; an LDG.128 / .64 writes 4 / 2 registers. A
    copy (MOV) or a repacking (PRMT) of the loaded register counts as a read: it waits for the load too."""
    n = len(body)
    out = []
    for i, (_, op, rest) in enumerate(body):
        if op != "LDG":
            continue
        width = next((t for t in ("128", "64") if f".{t}" in rest.split()[0]), "")
        d0 = int(re.search(r"\bR(\d+)", rest).group(1))
        dst = set(range(d0, d0 + {"128": 4, "64": 2}.get(width, 1)))
        for k in list(range(i + 1, n)) + list(range(0, i)):
            _, op2, rest2 = body[k]
            srcs = rest2 if op2 in ("STS", "STG", "ST") else ",".join(rest2.split(",")[1:])
            if dst & {int(r) for r in re.findall(r"\bR(\d+)\b", srcs)}:
                out.append(((k - i) % n, k > i))
                break
    return out


def ldg_in_step(body: list) -> int:
    """How many of the loop's LDG are read (first) later in the same iteration rather than only after the back edge
    (ldg_reads): such a load is waited for in the step that issues it, its latency exposed each step
    (cpu-gluon16r57); a load read only in a later iteration overlaps the loop's end."""
    return sum(same for _, same in ldg_reads(body))


def step_bytes(gtype: int, elems: int) -> int:
    from betelgeuse.gguf.qtypes import row_nbytes
    return row_nbytes(gtype, elems)


BF_SCHED = {"bf16": 1, "bf16r16": 16}      # act_quant bf16's schedules: the rows bucket whose launch is compiled
BF_OVER: dict = {}                         # --bf-over: triton_mmq config overrides of the bf16 rows
GL_SCHED = {"gluon": 1, "gluonr16": 16}    # the same, gluon_mmq's kernel (A loaded in place; Q8_0, MXFP4)


def a_operand(body: list) -> str:
    """Where the loop's HGMMA reads A: 'R' (registers: `HGMMA.. Rd, Ra, gdesc[..]`), 'smem' (a descriptor:
    `HGMMA.. Rd, gdesc[..]`), '-' (none in the loop); body: instructions()' (kind, opcode, operands) rows."""
    ops = [rest.split(",")[1].strip() for _, op, rest in body if op == "HGMMA" and "," in rest]
    return "/".join(sorted({"R" if o.startswith("R") else "smem" for o in ops})) or "-"


def profile_bf(name: str, which: str, sched: str) -> dict:
    """Compile and count act_quant bf16's kernel (triton_mmq, BF) of type `name` for the sched's rows bucket."""
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.gguf.qtypes import row_nbytes
    from betelgeuse.kernels import triton_mmq as mq
    from betelgeuse.kernels.triton_quants import QT_CODES
    gtype = int(GT[name])
    if sched in GL_SCHED:           # gluon_mmq's form of the same schedule (BF_TUNING's shape; FUSE as the Triton
        from betelgeuse.kernels import gluon_mmq as gm      # row's: config(bf=True) and --bf-over)
        cf = {**mq.config(QT_CODES[gtype], GL_SCHED[sched], bf=True), **BF_OVER}
        fuse = bool(cf.get("FUSE"))
        k, const = gm.compile_kernel(which, GL_SCHED[sched], qt=QT_CODES[gtype], fuse=fuse, gp=int(cf.get("GP", 0)),
                                     pk=int(cf.get("PK", 0)), nr=int(cf.get("NR", 0)))
        c = {"KB": const["KB"], "num_warps": gm.SHAPE["num_warps"], "FUSE": fuse,
             "steps": 2 if const["GP"] == 2 else 1}    # GP 2 (Q4_K's too: cpu-gpk63): a loop iteration = 2 steps
    else:
        k, c, const = mq.compile_kernel(which, QT_CODES[gtype], bucket=BF_SCHED[sched], over=dict(BF_OVER),
                                        hints=True, bf=True)
    sass, res = sass_of(k.asm["cubin"])
    kb, bn, warps = c["KB"], const["BN"], c["num_warps"]
    wbytes = bn * row_nbytes(gtype, 256) * kb * 32 / 256      # one part's BN rows x KB blocks (FUSE 0: a part a loop)
    weights = bn * kb * 32
    if c.get("FUSE") and which == "gate_up":      # FUSE: gate's and up's rows in one loop
        wbytes, weights = 2 * wbytes, 2 * weights
    wbytes, weights = wbytes * c.get("steps", 1), weights * c.get("steps", 1)
    body = k_loop(instructions(sass), mma=True)
    m = mix(body)
    cl = m["classes"]
    per_w = 32 * warps / weights
    ipb = cl["total"] * warps / wbytes
    return {"type": name, "kernel": which, "sched": sched, "BN": bn, "warps": warps, "step": kb * 32,
            "bytes_iter": round(wbytes), "regs": int(re.search(r"REG:(\d+)", res).group(1)),
            "spill": int(re.search(r"LOCAL:(\d+)", res).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
            "shared": int(k.metadata.shared), "instr_iter": cl["total"], "instr_per_B": round(ipb, 3),
            "issue_GBps": round(ISSUE_G / ipb), "cvt_per_w": round(cl.get("cvt", 0) * per_w, 3),
            "ffma_per_w": round(cl.get("ffma", 0) * per_w, 3), "alu_per_w": round(cl.get("alu", 0) * per_w, 3),
            "bar": cl.get("bar", 0), "sts": cl.get("sts", 0), "lds": cl.get("lds", 0), "mma": cl.get("mma", 0),
            "a_op": a_operand(body), "ldg_in_step": ldg_in_step(body),
            "ldg_dist": sorted(d for d, _ in ldg_reads(body)),
            "mma_shapes": sorted(set(re.findall(r"\b(HGMMA\.[\w.]+)", sass))),
            "classes": cl, "ldg": m["ldg"], "_sass": sass}


def profile(name: str, which: str, sched: str) -> dict:
    """Compile and count one kernel (type name, 'gate_up' | 'down', 'mmvq' | 'table' | 'bf16' | 'bf16r16')."""
    if sched in BF_SCHED or sched in GL_SCHED:
        return profile_bf(name, which, sched)
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.kernels import triton_mmvq
    from betelgeuse.kernels import triton_moe
    from betelgeuse.kernels.triton_quants import QT_CODES
    gtype = int(GT[name])
    qt = QT_CODES[gtype]
    over = dict(MV_CONFIG) if sched == "mmvq" else {}
    keep = triton_moe.TYPE_CONFIG.get(qt)         # expert_spec overrides it (a pool worker runs several tasks)
    try:
        spec = kernel_smem.expert_spec(name, which, over, bucket=1)
    finally:
        triton_moe.TYPE_CONFIG.pop(qt, None)
        if keep is not None:
            triton_moe.TYPE_CONFIG[qt] = keep
    fn, sig, ints, cst, cfg = spec
    k = kernel_smem.compile_sm90(*spec)
    sass, res = sass_of(k.asm["cubin"])
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"LOCAL:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))    # ptxas' call stack: spills LOCAL does not count
    mv = "S" in cst                               # the decode schedule's constexprs (triton_moe._mv_dims)
    step = triton_mmvq.STEP[qt] if mv else cst["BK"]
    bn = cst["BN"]
    parts = 2 if which == "gate_up" else 1
    wbytes = parts * bn * step_bytes(gtype, step)
    weights = parts * bn * step
    body = k_loop(instructions(sass))
    m = mix(body)
    warps = cfg["num_warps"]
    cl = m["classes"]
    per_w = 32 * warps / weights                  # thread ops per weight for one per-thread instruction
    ipb = cl["total"] * warps / wbytes
    return {"type": name, "kernel": which, "sched": sched, "BN": bn, "warps": warps, "step": step,
            "bytes_iter": wbytes, "regs": regs, "spill": local, "stack": stack, "shared": int(k.metadata.shared),
            "instr_iter": cl["total"], "instr_per_B": round(ipb, 3), "issue_GBps": round(ISSUE_G / ipb),
            "cvt_per_w": round(cl.get("cvt", 0) * per_w, 3), "ffma_per_w": round(cl.get("ffma", 0) * per_w, 3),
            "alu_per_w": round(cl.get("alu", 0) * per_w, 3), "bar": cl.get("bar", 0),
            "classes": cl, "ldg": m["ldg"], "_sass": sass}


def _task(t):
    BF_OVER.update(json.loads(os.environ.get("SASS_PROFILE_BF_OVER", "{}")))
    try:
        return profile(*t)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a row of the table, not a crash
        return {"type": t[0], "kernel": t[1], "sched": t[2], "error": f"{type(e).__name__}: {str(e)[:200]}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--kernels", default="gate_up,down")
    p.add_argument("--scheds", default="mmvq,table")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--mv", default="", help="the decode schedule's config instead of MV_CONFIG: BN,warps[,stages]")
    p.add_argument("--bf-over", default="", help="JSON: triton_mmq config overrides of the bf16 / bf16r16 rows")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default="", help="write each kernel's SASS to this folder")
    a = p.parse_args()
    if a.mv:
        v = [int(x) for x in a.mv.split(",")]
        MV_CONFIG.update(BN=v[0], BN_GATE_UP=v[0], num_warps=v[1], num_stages=v[2] if len(v) > 2 else 1)
    if a.bf_over:
        BF_OVER.update(json.loads(a.bf_over))
    why = kernel_smem.probe()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.kernels.triton_mmq import BF_TYPES
    from betelgeuse.kernels.triton_mmvq import STEP
    from betelgeuse.kernels.triton_quants import QT_CODES
    tasks = [(t, w, s) for t in a.types.split(",") for s in a.scheds.split(",") for w in a.kernels.split(",")
             if (s != "mmvq" or QT_CODES[int(GT[t])] in STEP)
             and (s not in BF_SCHED or QT_CODES[int(GT[t])] in BF_TYPES)
             and (s not in GL_SCHED or t in ("Q8_0", "MXFP4", "Q4_K"))]
    if a.jobs > 1 and BF_OVER:          # the pool's workers import this module afresh: pass the overrides along
        os.environ["SASS_PROFILE_BF_OVER"] = json.dumps(BF_OVER)
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=a.jobs) as ex:
            rows = list(ex.map(_task, tasks))
    else:
        rows = [_task(t) for t in tasks]
    if a.dump:
        Path(a.dump).mkdir(parents=True, exist_ok=True)
    for r in rows:
        sass = r.pop("_sass", None)
        if a.dump and sass:
            (Path(a.dump) / f"{r['type']}_{r['kernel']}_{r['sched']}.sass").write_text(sass)
    if a.json:
        print(json.dumps(rows))
        return 0
    print("| type | kernel | sched | BN x warps | regs | spill | B/iter | instr/iter | instr/B | issue GB/s | cvt/w "
          "| ffma/w | alu/w | bar | ldg widths |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['type']} | {r['kernel']} | {r['sched']} | {r['error']} |")
            continue
        ldg = " ".join(f"{k}:{v}" for k, v in sorted(r["ldg"].items()))
        print(f"| {r['type']} | {r['kernel']} | {r['sched']} | {r['BN']}x{r['warps']} | {r['regs']} | {r['spill']} "
              f"| {r['bytes_iter']} | {r['instr_iter']} | {r['instr_per_B']} | {r['issue_GBps']} | {r['cvt_per_w']} "
              f"| {r['ffma_per_w']} | {r['alu_per_w']} | {r['bar']} | {ldg} |")
    mma = [r for r in rows if "a_op" in r]
    if mma:                         # the MMA rows' shared memory traffic and A operand
        print("\n| type | kernel | sched | KB x 32 | smem B | sts | lds | bar | mma | A | LDG waited in step "
              "| shapes |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in mma:
            print(f"| {r['type']} | {r['kernel']} | {r['sched']} | {r['step']} | {r['shared']} | {r['sts']} "
                  f"| {r['lds']} | {r['bar']} | {r['mma']} | {r['a_op']} "
                  f"| {r['ldg_in_step']} / {sum(r['ldg'].values())} | {' '.join(r['mma_shapes'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
