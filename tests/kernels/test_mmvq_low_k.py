"""Q6_K, Q3_K and Q2_K on the decode schedule (triton_mmvq's _q6_tile, _q3_tile, _q2_tile; issue 23), no GPU.

1. Interpreted (TRITON_INTERPRET=1, tests/scripts/triton_kernel_check.py --config mv): H = F = 256, one super-block
   a row (Q6_K's 210 and Q3_K's 110 bytes: every other row starts at 2 mod 4, read through _wat's word pairs);
   MV = 1 at 1 row x 32 / 64 outputs a program (bucket 1) and 16 rows x 64 / 32 (bucket 16). Within float noise
   of the torch path (quants.dequantize: gguf-py's values), a row alone == the same row in the full launch, bit for
   bit. ~6-10 s each.
   (tests/scripts/mmvq_rows_check.py Q6_K Q3_K Q2_K checks BM 3 / 16 against gguf-py too: ~75 s, by hand.)
2. Compiled for sm_90 ahead of time (tests/scripts/sass_profile.py, the one-row down kernel at BN 16 x 2 warps,
   kernel_roofline's CONFIGS 24): the K loop has no int->float conversion (scales and quants through the
   magic-number floats), spills nothing (local memory, nor ptxas' stack: BM_MV 2 x BN 16's gate_up has
   2.3 KB of it at 32 registers), and issues at most BOUND warp instructions per weight byte: Q6_K 0.35
   (0.30 at q6k54; 0.42 with one qh word a thread; the MMA path main ships: 0.70, one I2F a weight), Q3_K 0.62
   (0.58; MMA 0.88), Q2_K 0.62 (0.60; MMA 0.84). Skipped where Triton cannot compile for CUDA. ~3-8 s each.
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
BOUND = {"Q6_K": 0.35, "Q3_K": 0.62, "Q2_K": 0.62}  # warp instructions per weight byte (module doc)


def _script(args: list, interpret: bool) -> object:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", ""))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["Q6_K", "Q3_K", "Q2_K"])
def test_decode_schedule_matches_torch_and_is_row_invariant(name):
    res = _script([str(HERE / "scripts" / "triton_kernel_check.py"), "--config", "mv", name], True)
    r = res[name]
    assert r["mv_taken"], r
    assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, r
    assert r["row_invariant"], r


@pytest.mark.parametrize("name", ["Q6_K", "Q3_K", "Q2_K"])
def test_decode_loop_has_no_conversions_and_no_spills(name):
    res = _script([str(HERE / "scripts" / "sass_profile.py"), "--types", name, "--kernels", "down", "--scheds",
                   "mmvq", "--mv", "16,2", "--jobs", "1", "--json"], False)
    if isinstance(res, dict) and "skipped" in res:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res['skipped']}")
    assert [r["type"] for r in res] == [name], res
    r = res[0]
    assert "error" not in r, r
    assert r["classes"].get("cvt", 0) == 0, r
    assert r["spill"] == 0 and r["stack"] == 0, r
    assert r["instr_per_B"] <= BOUND[name], r
