"""The decode schedule's K-quant loop on sm_90, checked without a GPU (issue 23; tests/scripts/sass_profile.py).

Q4_K, Q5_K and MXFP4's one-row down kernels (triton_mmvq, BN 16 x 2 warps: kernel_roofline's CONFIGS 24) compiled
as launched at the bench geometry and disassembled: the K loop has no int->float conversion (I2F: a quarter-rate op;
the K-quants' 6-bit scales go through the magic-number add), spills nothing, loads the K-quants' qs words 16 bytes a
thread (LDG.E.128), and issues at most BOUND warp instructions per weight byte: Q4_K / Q5_K 0.45 (0.40 / 0.39 at
kq54; 0.76 / 0.58 before, with 0.5 I2F a weight), MXFP4 0.62 (0.59; 0.64 before: e2m1 fields shifted from the word
straight to their bits). Skipped where this Triton cannot compile for CUDA.
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
BOUND = {"Q4_K": 0.45, "Q5_K": 0.45, "MXFP4": 0.62}     # warp instructions per weight byte (module doc)


def test_k_quant_decode_loop_has_no_conversions_and_wide_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}      # compiled, not interpreted
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "sass_profile.py"), "--types", "Q4_K,Q5_K,MXFP4",
                        "--kernels", "down", "--scheds", "mmvq", "--mv", "16,2", "--jobs", "2", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    if isinstance(res, dict) and "skipped" in res:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res['skipped']}")
    assert [r["type"] for r in res] == ["Q4_K", "Q5_K", "MXFP4"], res
    for r in res:
        assert "error" not in r, r
        assert r["classes"].get("cvt", 0) == 0, r
        assert r["spill"] == 0, r
        assert r["instr_per_B"] <= BOUND[r["type"]], r
        if r["type"] != "MXFP4":                # (MXFP4's 17-byte blocks: word loads)
            assert r["ldg"].get("128", 0) >= 1, r
