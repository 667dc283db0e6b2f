"""docs/benchmarks/cpu-vram62: gluon_mmq's Q8_0 GP 1 kernels at PK 0 / 1 / 2 (GGUF order, packed, per expert by bit 0
of its base), both kernels and rows buckets, compiled for sm_90 without a GPU: registers, spills, and each innermost
MMA loop's SASS instructions and loads, one JSON line a kernel. From the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-vram62/regs.py             # this Triton (3.9)
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /tmp/t36i/bin/python docs/benchmarks/cpu-vram62/regs.py   # the device's 3.6

An argument 5: Q4_K's shipped form (GP 0) at PK 0 / 1 / 2 instead (docs/benchmarks/cpu-packk62); 4: MXFP4's Gluon
form (GP 0, or the second argument's GP; docs/benchmarks/cpu-mxpk63).
"""

import json
import re
import sys

sys.path.insert(0, "tests/scripts")
import sass_profile as sp  # noqa: E402
import triton  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402

QT = int(sys.argv[1]) if len(sys.argv) > 1 else 0           # 0 Q8_0 (GP 1), 5 Q4_K (GP 0): the shipped forms
GP = int(sys.argv[2]) if len(sys.argv) > 2 else int(QT == 0)   # MXFP4: 0 (its `gluon` form) or 1 / 2
for w, b in (("gate_up", 1), ("gate_up", 16), ("down", 1), ("down", 16)):
    for pk in (0, 1, 2):
        k, _ = gm.compile_kernel(w, b, qt=QT, fuse=w == "gate_up", gp=GP, pk=pk)
        sass, res = sp.sass_of(k.asm["cubin"])
        loops = []
        for body in sp.mma_loops(sp.instructions(sass)):
            ldg: dict = {}
            for _, op, rest in body:
                if op == "LDG":
                    ldg[op + rest.split()[0]] = ldg.get(op + rest.split()[0], 0) + 1
            loops.append((len(body), ldg))
        print(json.dumps({"triton": triton.__version__, "qt": QT, "gp": GP, "kernel": w, "bucket": b, "pk": pk,
                          "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                          "local": int(re.search(r"LOCAL:(\d+)", res).group(1)), "loops": loops}), flush=True)
