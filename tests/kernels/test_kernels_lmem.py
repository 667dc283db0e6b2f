"""The decode kernels' local memory per thread on sm_90 stays small, checked without a GPU (issue 21).

The CUDA driver reserves local memory for the largest per-thread local bytes (stack frame: spills) of any kernel a
context has launched, times every resident thread (132 SMs x 2048 on an H100 or H200: 270,336), and keeps it: VRAM
outside torch's allocator and outside the plan's terms. ds4-flash's decode_attend (680 B/thread: q whole as the
MMA's A operand) and ratio-128 compress_step (840 B: [128, 128] float32 tiles) reserved 175 and 217 MiB that way
before their fix (tests/scripts/kernel_lmem.py's table, Triton 3.9 / ptxas 13.4). BOUND = 256 B/thread: at most
66 MiB a context; today's largest decode variant is Q8_0's gate_up at 168 B (the tuning's rows1 schedule), the ds4
dense ones <= 144 B.

The variants: ds4-flash's decode attention in its three modes (window, CSA top-k, HCA), both compressor ratios, and
the expert kernels' decode bucket (rows1) for Q8_0 (the serve bench) and MXFP4 (ds4-flash), compiled as launched
(kernel_lmem.py: ptxas's "bytes stack frame"). Skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parents[1]
BOUND = 256                  # bytes of local memory per thread (module doc): <= 66 MiB on 270,336 threads
VARIANTS = """\
_decode_attn_kernel[RATIO=1,MODE=0,HD=512,HB=16,BS=32,IEEE=False]
_decode_attn_kernel[MODE=1,HD=512,HB=16,BS=32,IEEE=False]
_decode_attn_kernel[NE=1,MODE=2,HD=512,HB=16,BS=32,IEEE=False]
_compress_step_kernel[RATIO=128,ROWS=128,SLOTS=128,BD=128]
_compress_step_kernel[RATIO=4,ROWS=8,SLOTS=8,BD=128]
"""


def test_decode_kernels_local_memory_bounded(tmp_path):
    (tmp_path / "variants.txt").write_text(VARIANTS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "kernel_lmem.py"), "--jobs", "1", "--variants",
                        str(tmp_path / "variants.txt"), "--buckets", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    if "skipped" in res:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res['skipped']}")
    rows = res["kernels"]
    names = sorted({r["kernel"] for r in rows})
    assert len(rows) == 5 + 4 and any(n.startswith("_gate_up_kernel (Q8_0") for n in names), names
    assert all(r["regs"] > 0 for r in rows)              # ptxas really reported each one
    over = [(r["kernel"], r["constexprs"], r["stack"]) for r in rows if r["stack"] > BOUND]
    assert not over, f"local bytes per thread over {BOUND} on sm_90 (kernel, constexprs, bytes): {over}\n" \
                     f"{p.stderr[-3000:]}"
