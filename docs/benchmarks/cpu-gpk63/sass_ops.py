"""docs/benchmarks/cpu-gpk63: gluon_mmq's kernels compiled for sm_90 without a GPU: registers, spills, and each
innermost MMA loop's SASS instructions a K step by opcode and by class (tests/scripts/sass_profile.CLASSES), one JSON
line a kernel. From the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-gpk63/sass_ops.py                       # this Triton (3.9)
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /tmp/t36i/bin/python docs/benchmarks/cpu-gpk63/sass_ops.py   # the device's 3.6

Arguments: cases as type:kernel:bucket:GP:PK (type Q8_0 / MXFP4 / Q4_K; default: Q4_K's fused 1-row gate_up and
16-row down at GP 0 / 1 / 2, PK 0 / 1, and Q8_0's and MXFP4's GP 1 PK 1 beside them); gate_up fused (FUSE 1, as
shipped). The opcode key is the SASS opcode and its first modifier (LDG.E.128, HADD2.BF16_V2, ...).
"""

import json
import re
import sys

sys.path.insert(0, "tests/scripts")
import sass_profile as sp  # noqa: E402
import triton  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402

QTS = {"Q8_0": 0, "MXFP4": 4, "Q4_K": 5}
CASES = [a.split(":") for a in sys.argv[1:]] or (
    [("Q4_K", w, b, gp, pk) for w, b in (("gate_up", 1), ("down", 16)) for gp in (0, 1, 2) for pk in (0, 1)]
    + [(t, w, b, 1, 1) for t in ("Q8_0", "MXFP4") for w, b in (("gate_up", 1), ("down", 16))])
for t, w, b, gp, pk in CASES:
    b, gp, pk = int(b), int(gp), int(pk)
    try:
        k, _ = gm.compile_kernel(w, b, qt=QTS[t], fuse=w == "gate_up", gp=gp, pk=pk)
    except Exception as e:          # a form this checkout does not have (main before GP for Q4_K)
        print(json.dumps({"triton": triton.__version__, "type": t, "kernel": w, "bucket": b, "gp": gp, "pk": pk,
                          "error": str(e).splitlines()[0][:200]}), flush=True)
        continue
    sass, res = sp.sass_of(k.asm["cubin"])
    loops = []
    for body in sp.mma_loops(sp.instructions(sass)):
        ops: dict = {}
        cls: dict = {}
        for _, op, rest in body:
            key = op + (rest.split()[0] if rest.startswith(".") else "")
            ops[key] = ops.get(key, 0) + 1
            c = sp.CLASSES.get(op.split(".")[0], "other")
            cls[c] = cls.get(c, 0) + 1
        loops.append({"n": len(body), "ldg_in_step": sp.ldg_in_step(body),
                      "cls": dict(sorted(cls.items(), key=lambda kv: -kv[1])),
                      "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    print(json.dumps({"triton": triton.__version__, "type": t, "kernel": w, "bucket": b, "gp": gp, "pk": pk,
                      "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\d+)", res).group(1)), "loops": loops}), flush=True)
