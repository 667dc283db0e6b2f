"""deepseek4's fused Triton kernels (kernels/triton_ds4.py TritonOps, the CUDA path) against TorchOps (the CPU
path, itself exact against transformers: tests/test_deepseek4_oracle.py), method by method under Triton's
interpreter (TRITON_INTERPRET=1), in float32 (IEEE dots: within summation-order noise) and bfloat16 (the CUDA
compute dtype: within a few bf16 ulps).

Also bit-for-bit: the ids each routing / indexer kernel picks, the state rows the decode steps copy (window ring,
compressor rows), and batch invariance: each row of a launch computed alone equals the same row in the full
launch (DESIGN.md invariant 6: a sequence's bits do not depend on what else runs). The engine-level checks on a
GPU (eager vs graph replay, batch invariance of a whole decode step) are deploy/device/check_ds4.py's.

The check runs in a child process: the interpreter is chosen when triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "ds4_kernel_check.py")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


METHODS = ("hc_pre", "hc_post", "rms_rope", "rope", "rms", "compress_step", "index_topk", "decode_attend",
           "route_topk", "route_hash", "shared_ffn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_ops_match_torch_ops(results, dtype):
    sys.path.insert(0, str(HERE / "scripts"))
    from ds4_kernel_check import failures     # the tolerances (float32: summation-order noise, bf16: a few ulps)
    cases = {k: v for k, v in results.items() if k.split("/")[1] == dtype}
    assert {k.split("/")[0] for k in cases} == set(METHODS)
    assert failures(cases) == [], {k: cases[k] for k in failures(cases)}


def test_triton_ops_are_batch_invariant(results):
    inv = {k: v["row_invariant"] for k, v in results.items() if "row_invariant" in v}
    # every row-batched method is covered (the decode-step kernels run one sequence per launch)
    assert {k.split("/")[0] for k in inv} == {"hc_pre", "hc_post", "rms_rope", "rope", "rms", "route_topk",
                                              "route_hash", "shared_ffn"}
    assert all(inv.values()), [k for k, v in inv.items() if not v]
