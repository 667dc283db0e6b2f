"""docs/benchmarks/cpu-vram62: a digest of each shipped Gluon kernel's SASS (labels normalized), compiled for sm_90
without a GPU, so two checkouts can be compared: the body refactor (_gate_up_body / _down_body) must leave PK 0 / 1's
kernels, and the other types', instruction for instruction as they were. From a checkout's root:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python docs/benchmarks/cpu-vram62/sass_same.py
    (git archive 7427ff7 betelgeuse tests/scripts | tar -x -C /tmp/base; cd /tmp/base; the same with PYTHONPATH=/tmp/base
     and this file's path): the lines must be equal
"""

import hashlib
import re
import sys

sys.path.insert(0, "tests/scripts")
import sass_profile as sp  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402

for qt, w, b, gp, pk in [(0, "gate_up", 1, 1, 0), (0, "gate_up", 16, 1, 0), (0, "down", 1, 1, 0), (0, "down", 16, 1, 0),
                         (0, "gate_up", 1, 1, 1), (0, "down", 16, 1, 1), (5, "gate_up", 1, 0, 0), (4, "gate_up", 1, 0, 0)]:
    k, _ = gm.compile_kernel(w, b, qt=qt, fuse=w == "gate_up" and qt != 4, gp=gp, pk=pk)
    ins = sp.instructions(sp.sass_of(k.asm["cubin"])[0])
    text = re.sub(r"\.L_x_\d+", "L", "\n".join(f"{op} {rest}" for _, op, rest in ins))
    print(qt, w, b, gp, pk, len(ins), hashlib.sha1(text.encode()).hexdigest()[:12], flush=True)
