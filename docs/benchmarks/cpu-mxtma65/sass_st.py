"""docs/benchmarks/cpu-mxtma65: gluon_mmq's PK kernels compiled for sm_90 without a GPU, with and without the weight
ring (schedule key ST): registers, spills, shared memory bytes, CTAs a SM by registers and by shared memory, the
kernel's async copies (LDGSTS, UTMALDG), and each innermost MMA loop's SASS a K step (its loads: LDG, LDS, LDGSTS,
barriers), one JSON line a kernel. From the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-mxtma65/sass_st.py                       # this Triton (3.9)
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /tmp/t36i/bin/python docs/benchmarks/cpu-mxtma65/sass_st.py   # the device's 3.6

Arguments: cases as type:kernel:bucket:GP:PK:ST[:NR] (default: MXFP4 and Q4_K, gate_up fused and down, rows 1 and
16, GP 1 PK 1 at ST 0 / 2 / 3 / 4; NR: ptxas's register limit, 0 none).
"""

import json
import re
import sys

sys.path.insert(0, "tests/scripts")
import sass_profile as sp  # noqa: E402
import triton  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402

QTS = {"Q8_0": 0, "MXFP4": 4, "Q4_K": 5}
SMEM = 228 * 1024               # an H100 SM's shared memory (1 KiB of it reserved a CTA)
CASES = [a.split(":") for a in sys.argv[1:]] or [
    (t, w, b, 1, 1, s) for t in ("MXFP4", "Q4_K") for w in ("gate_up", "down") for b in (1, 16) for s in (0, 2, 3, 4)]


def ctas(regs: int, smem: int) -> tuple[int, int]:
    """CTAs of 4 warps a SM by the register file (65,536; a warp's registers rounded up to 256) and by shared memory."""
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * 4)
    return min(by_regs, 32), SMEM // (smem + 1024)


for t, w, b, gp, pk, st, *nr in CASES:
    b, gp, pk, st, nr = int(b), int(gp), int(pk), int(st), int(nr[0]) if nr else 0
    head = {"triton": triton.__version__, "type": t, "kernel": w, "bucket": b, "gp": gp, "pk": pk, "st": st, "nr": nr}
    try:
        k, _ = gm.compile_kernel(w, b, qt=QTS[t], fuse=w == "gate_up", gp=gp, pk=pk, nr=nr,
                                 **({"st": st} if st else {}))
    except Exception as e:          # a form this checkout does not have (main: no ST)
        print(json.dumps({**head, "error": str(e).splitlines()[0][:200]}), flush=True)
        continue
    sass, res = sp.sass_of(k.asm["cubin"])
    ins = sp.instructions(sass)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    smem = int(k.metadata.shared)
    whole: dict = {}
    for _, op, _rest in ins:
        o = op.split(".")[0]
        if o in ("LDGSTS", "UTMALDG", "LDGDEPBAR", "DEPBAR", "LDS", "LDG", "BAR", "SYNCS"):
            whole[o] = whole.get(o, 0) + 1
    loops = []
    for body in sp.mma_loops(ins):
        ops: dict = {}
        for _, op, rest in body:
            key = op + (rest.split()[0] if rest.startswith(".") else "")
            if key.split(".")[0] in ("LDG", "LDS", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR", "STS", "HGMMA"):
                ops[key] = ops.get(key, 0) + 1
        loops.append({"n": len(body), "ldg_in_step": sp.ldg_in_step(body), "ops": dict(sorted(ops.items()))})
    cr, cs = ctas(regs, smem)
    print(json.dumps({**head, "regs": regs, "local": int(re.search(r"LOCAL:(\d+)", res).group(1)), "smem": smem,
                      "ctas_regs": cr, "ctas_smem": cs, "whole": dict(sorted(whole.items())), "loops": loops}),
          flush=True)
