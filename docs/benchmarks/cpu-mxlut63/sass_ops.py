"""docs/benchmarks/cpu-mxlut63: gluon_mmq's MXFP4 kernels compiled for sm_90 without a GPU: registers, spills, and each
innermost MMA loop's SASS instructions a K step by opcode, one JSON line a kernel. From the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-mxlut63/sass_ops.py                  # this Triton (3.9)
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /tmp/t36i/bin/python docs/benchmarks/cpu-mxlut63/sass_ops.py   # the device's 3.6

Arguments: cases as kernel:bucket:GP:PK (default: every kernel, bucket, GP 0 / 1 and PK 0 / 1 / 2); gate_up fused
(FUSE 1, as shipped). The opcode key is the SASS opcode and its first modifier (LDG.E.U8, HADD2.BF16_V2, ...).
"""

import json
import re
import sys

sys.path.insert(0, "tests/scripts")
import sass_profile as sp  # noqa: E402
import triton  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402

CASES = [a.split(":") for a in sys.argv[1:]] or [(w, b, gp, pk) for w in ("gate_up", "down") for b in (1, 16)
                                                 for gp in (0, 1) for pk in (0, 1, 2)]
for w, b, gp, pk in CASES:
    b, gp, pk = int(b), int(gp), int(pk)
    k, _ = gm.compile_kernel(w, b, qt=4, fuse=w == "gate_up", gp=gp, pk=pk)
    sass, res = sp.sass_of(k.asm["cubin"])
    loops = []
    for body in sp.mma_loops(sp.instructions(sass)):
        ops: dict = {}
        for _, op, rest in body:
            key = op + (rest.split()[0] if rest.startswith(".") else "")
            ops[key] = ops.get(key, 0) + 1
        loops.append({"n": len(body), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    print(json.dumps({"triton": triton.__version__, "kernel": w, "bucket": b, "gp": gp, "pk": pk,
                      "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\d+)", res).group(1)), "loops": loops}), flush=True)
