"""Q6_K on the decode schedule (triton_mmvq's _q6_tile; issue 23), without a GPU.

1. Interpreted (TRITON_INTERPRET=1, tests/scripts/triton_kernel_check.py --config mv): H = F = 256, so every row is
   one 210-byte super-block and every other row starts at 2 mod 4 (the aligned word pairs of _wat); MV = 1 at 1 row
   x 32 / 64 outputs a program (bucket 1) and 16 rows x 64 / 32 (bucket 16). Within float noise of the torch path
   (quants.dequantize: gguf-py's values), a row alone == the same row in the full launch, bit for bit. ~9 s.
   (tests/scripts/mmvq_rows_check.py Q6_K checks BM 3 / 16 against gguf-py too: ~25 s, run by hand.)
2. Compiled for sm_90 ahead of time (tests/scripts/sass_profile.py, the one-row down kernel at BN 16 x 2 warps,
   kernel_roofline's CONFIGS 24): the K loop has no int->float conversion (the int8 scales and the 6-bit quants
   go through the magic-number float), spills nothing, and issues <= 0.45 warp instructions per weight byte
   (0.42 at q6k54; the MMA path the table ships: 0.70, one I2F a weight). Skipped where Triton cannot compile
   for CUDA. ~5-8 s.
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


def _script(args: list, interpret: bool) -> object:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", ""))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_q6k_decode_schedule_matches_torch_and_is_row_invariant():
    res = _script([str(HERE / "scripts" / "triton_kernel_check.py"), "--config", "mv", "Q6_K"], True)
    r = res["Q6_K"]
    assert r["mv_taken"], r
    assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, r
    assert r["row_invariant"], r


def test_q6k_decode_loop_has_no_conversions_and_no_spills():
    res = _script([str(HERE / "scripts" / "sass_profile.py"), "--types", "Q6_K", "--kernels", "down", "--scheds",
                   "mmvq", "--mv", "16,2", "--jobs", "1", "--json"], False)
    if isinstance(res, dict) and "skipped" in res:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res['skipped']}")
    assert [r["type"] for r in res] == ["Q6_K"], res
    r = res[0]
    assert "error" not in r, r
    assert r["classes"].get("cvt", 0) == 0, r
    assert r["spill"] == 0, r
    assert r["instr_per_B"] <= 0.45, r
