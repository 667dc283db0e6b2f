"""docs/benchmarks/cpu-tile62: a digest of triton_moe's float kernels' SASS (labels normalized), compiled for sm_90
without a GPU (tests/scripts/kernel_smem's launch specializations, bench geometry, the committed tuning), so two
checkouts can be compared: the body refactor (_gate_up_body / _down_body, wdot's TL) must leave the TB 0 kernels (every
launch without the tile flag) instruction for instruction as they were. With --tb also the TB > 0 kernels' registers,
spills and size (both layouts' bodies in one kernel); with --mmq triton_mmq's Triton kernels (TB 0) instead. From a
checkout's root:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python docs/benchmarks/cpu-tile62/sass_same.py [--tb | --mmq]
    (git archive 6ab4ff2 betelgeuse tests/scripts | tar -x -C /tmp/base; cd /tmp/base; the same with
     PYTHONPATH=/tmp/base and this file's path, without --tb): the lines must be equal
"""

import hashlib
import re
import sys

sys.path.insert(0, "tests/scripts")
import kernel_smem as ks  # noqa: E402
import sass_profile as sp  # noqa: E402

TB = "--tb" in sys.argv


def digest(k) -> str:
    """'instructions sha registers stack smem' of a compiled kernel."""
    sass, res = sp.sass_of(k.asm["cubin"])
    ins = sp.instructions(sass)
    text = re.sub(r"\.L_x_\d+", "L", "\n".join(f"{op} {rest}" for _, op, rest in ins))
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return (f"{len(ins)} {hashlib.sha1(text.encode()).hexdigest()[:12]} regs {regs.group(1) if regs else '?'} "
            f"stack {stack.group(1) if stack else '?'} smem {k.metadata.shared}")


if "--mmq" in sys.argv:         # triton_mmq's Triton kernels (TB 0), q8_1 and bf16, as compile_report builds them
    from betelgeuse.kernels import triton_mmq as mq
    for qt in (0, 4, 5):
        for bf in (False, True):
            for which in ("gate_up", "down"):
                for bucket in (1, 16):
                    k, _, _ = mq.compile_kernel(which, qt, bucket=bucket, hints=True, bf=bf)
                    print(qt, "bf16" if bf else "q8_1", which, bucket, digest(k), flush=True)
    sys.exit(0)
for name in ("Q8_0", "MXFP4", "Q4_K", "Q6_K", "IQ4_XS", "F16"):
    for which in ("gate_up", "down"):
        for bucket in (1, 16):
            fn, sig, ints, cst, cfg = ks.expert_spec(name, which, {}, bucket=bucket)
            if TB:
                from gguf.constants import GGMLQuantizationType as GT

                from betelgeuse.kernels import tile_layout, triton_moe
                tb = tile_layout.unit(int(GT[name]))[1]
                cst = {**cst, "TB": tb, "RAT": triton_moe._row_align(tb)}
            print(name, which, bucket, digest(ks.compile_sm90(fn, sig, ints, cst, cfg)), flush=True)
