"""The Triton expert kernels (the GPU hot path), run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

1. Kernel level, per weight type (F32, F16, BF16, Q8_0, MXFP4: every E2M1 code, a range of E8M0 scales; Q6_K, Q5_K,
   Q4_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL, IQ3_XXS, IQ2_XS, IQ2_XXS: random valid blocks): the in-kernel dequantization
   equals gguf-py's values to float32 rounding (a fused multiply-add's last bit); the fused kernels against the torch reference (dequantize, then
   SwiGLU with F.linear) within float32 summation-order noise (~1e-6 x sqrt(K) relative; the tolerance
   2e-6 x scale x sqrt(H+F) would still catch a wrong scale, a swapped gate/up or a missed block by orders
   of magnitude); a row computed alone is bit-identical to the same row in a full launch; two launch groups
   that split the experts equal one group bit for bit; the clamped SwiGLU (DeepSeek-V4) matches its formula.
2. Engine level (qwen3moe Q8_0, deepseek4 MXFP4 with its clamp): the runner with kernels="triton" gives bit-identical logits across slot configurations,
   cold / warm / after consolidation and over decode steps (the store pass kept open), and stays within the
   float32 tolerance of the torch engine with the same greedy tokens.

Both run in a child process: the interpreter is chosen when triton is imported.
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


def _run(script: str, *args, timeout: int = 600, tuning: str | None = None) -> dict:
    """The script's last stdout line as JSON, run under the Triton interpreter. tuning="off": the kernels' default
    launch shapes instead of the committed H200 table (whose split-K shapes are many more interpreted programs;
    the split schedules have their own test)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if tuning is not None:
        env["BETELGEUSE_TRITON_TUNING"] = tuning
    p = subprocess.run([sys.executable, str(HERE / "scripts" / script), *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_triton_kernels_match_torch_and_are_row_invariant():
    res = _run("triton_kernel_check.py")
    assert set(res) == {"Q8_0", "F16", "BF16", "F32", "MXFP4", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K",
                        "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ3_XXS"}
    for name, r in res.items():
        assert r["tile_err"] <= 4e-7, (name, r)          # in-kernel dequantization == gguf-py's values to float32 ulps
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)
        assert r["row_invariant"], name
    for name in ("Q8_0", "MXFP4", "Q4_K", "IQ2_XXS"):
        r = res[name]
        assert r["split_equal"], name
        assert r["limit_max_abs"] <= 1e-5 * max(1.0, r["limit_scale"]), (name, r)


# the split-K schedules' types: one of 32-element blocks (K steps of 32), one of 256-element super-blocks (BK 128 of
# 256) and one codebook type (grid lookups); the chunk loop and the workspace do not depend on the type beyond its
# block size, and every type's dequantization is test_triton_kernels_match_torch_and_are_row_invariant's
SCHEDULE_TYPES = ("Q8_0", "Q4_K", "IQ2_XXS")


def test_split_k_schedules_match_torch_and_each_other_bit_for_bit():
    """Split-K (tests/scripts/triton_kernel_check.py --config chunked): K in chunks summed in chunk order; the 1-row
    bucket launches one program per chunk (partials in a workspace, summed by each tile's last program), the 16-row
    bucket walks the chunks in one program, at other output blocks, warps and stages. Within float noise of the torch
    path for a block-32, a super-block and a codebook type, and a row alone (bucket 1, split) == the same row in the
    full launch (bucket 16, walked); a split launch group equals one, the clamped SwiGLU matches its formula.
    chunked16: the 16-row bucket split, the 1-row bucket walked."""
    res = _run("triton_kernel_check.py", "--config", "chunked", *SCHEDULE_TYPES)
    assert set(res) == set(SCHEDULE_TYPES)
    for name, r in res.items():
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)
        assert r["row_invariant"], name
    for name in SCHEDULE_TYPES:
        assert res[name]["split_equal"], name
        assert res[name]["limit_max_abs"] <= 1e-5 * max(1.0, res[name]["limit_scale"]), (name, res[name])
    res = _run("triton_kernel_check.py", "--config", "chunked16", "Q8_0", "Q4_K")
    for name, r in res.items():
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)
        assert r["row_invariant"], name


def test_decode_schedule_matches_torch_and_is_row_invariant():
    """The mmvq-layout decode schedule (triton_mmvq; tests/scripts/triton_kernel_check.py --config mv): the tuning's
    MV = 1 for both buckets, 1 row x 32 / 64 columns a program in the 1-row bucket and 16 rows x 64 / 32 in the
    16-row one. Within float noise of the torch path; a row alone (bucket 1) == the same row in the full launch
    (bucket 16), bit for bit; the schedule really ran (every type: it can take these launches; Q8_0: its bits are
    not the MMA path's, and two runs equal: the dispatch is the same for every type); Q4_K also through the clamped
    SwiGLU and a split launch group. MXFP4's decode layout is test_decode_schedule_rows_a_program_keep_each_rows_bits'
    (row invariance, and against gguf-py)."""
    res = _run("triton_kernel_check.py", "--config", "mv", "Q8_0", "Q4_K", "Q5_K")
    assert set(res) == {"Q8_0", "Q4_K", "Q5_K"}
    for name, r in res.items():
        assert r["mv_taken"], (name, r)
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)
        assert r["row_invariant"], (name, r)
    assert res["Q8_0"]["differs_from_mma"] and res["Q8_0"]["run_to_run"], res["Q8_0"]
    assert res["Q4_K"]["split_equal"], res["Q4_K"]
    assert res["Q4_K"]["limit_max_abs"] <= 1e-5 * max(1.0, res["Q4_K"]["limit_scale"]), res["Q4_K"]


def test_decode_schedule_in_k_chunks_split_equals_walked():
    """The decode schedule with the reduction key KC (tests/scripts/triton_kernel_check.py --config mvchunk: K in
    chunks of 128, each chunk's tree total summed in chunk order): the 1-row bucket one program a chunk (the tile's
    last sums the partials), the 16-row bucket walks them at 16 rows a program. Within float noise of the torch path,
    a row alone (split) == the same row in the full launch (walked), two runs equal, and the bits differ from the
    unchunked schedule's (the chunks are real)."""
    res = _run("triton_kernel_check.py", "--config", "mvchunk", "Q8_0", "MXFP4")
    assert set(res) == {"Q8_0", "MXFP4"}
    for name, r in res.items():
        assert r["mv_taken"] and r["run_to_run"] and r["differs_from_unchunked"], (name, r)
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)
        assert r["row_invariant"], (name, r)


def test_decode_schedule_rows_a_program_keep_each_rows_bits():
    """The decode schedule's many-rows program (tests/scripts/mmvq_rows_check.py): one decoded weight tile applied to
    BM = 3 and 16 rows a program in turn, on launches of 1 or 3 and 16 tokens: every row bit-identical to the same row
    of the 1-row-a-program launch (a reduction whose order followed BM fails here: checked with tl.sum for BM > 1),
    and within float noise of gguf-py's dequantized experts."""
    res = _run("mmvq_rows_check.py", "Q8_0", "MXFP4")
    assert set(res) == {"Q8_0", "MXFP4"}
    for name, r in res.items():
        assert r["mv_taken"] and r["mismatch"] == [], (name, r)
        assert r["max_abs"] <= 2e-6 * r["scale"] * r["K"] ** 0.5, (name, r)


def test_triton_types_are_the_kernel_codes():
    """kinds.TRITON_QTYPES (what the runner checks without importing triton) is the set the kernels dispatch on."""
    from betelgeuse.kernels.kinds import TRITON_QTYPES
    from betelgeuse.kernels.triton_quants import QT_CODES
    assert TRITON_QTYPES == set(QT_CODES)
    assert sorted(QT_CODES.values()) == list(range(len(QT_CODES)))


def _check_engine_configs(res: dict, mixed: str, all_vram: str) -> None:
    """triton_engine_check.py's configs: each bit-identical across passes, within 1e-4 x max|logit| of the torch
    engine and its greedy tokens; and they really used their tiers (else the equality would be vacuous): `mixed`
    read from host and VRAM slots in its third pass, `all_vram` from VRAM alone (as many experts as its cold pass)."""
    for key, r in res.items():
        assert r["bit_identical"], key
        assert r["max_abs_vs_torch"] <= 1e-4 * r["max_logit"], (key, r)
        assert r["greedy_equal_torch"], key
    assert res[mixed]["reads"][2]["host"] > 0 and res[mixed]["reads"][2]["vram"] > 0
    assert res[all_vram]["reads"][2] == {"vram": sum(res[all_vram]["reads"][0].values()), "host": 0, "disk": 0}


@pytest.mark.slow
def test_engine_with_triton_kernels_is_location_invariant(tmp_path):
    out = _run("triton_engine_check.py", str(tmp_path / "engine.gguf"), tuning="off")
    res = out["configs"]
    assert len(res) == 2
    # launches per decode layer: gate_up + down per launch group, one combine; a layer with nothing on disk is one
    # group (moe_step._partial), so at most 3 launches
    for key, steps in out["decode_launches"].items():
        if key.startswith("triton"):
            for n, layers in steps:
                assert n == sum(2 * g + 1 for g, _ in layers), (key, n, layers)
                assert all(g <= 1 for g, disk in layers if not disk), (key, layers)
    _check_engine_configs(res, "3v8h", "16v0h")


@pytest.mark.slow
def test_deepseek4_engine_with_triton_mxfp4_is_location_invariant(tmp_path):
    """deepseek4 (ds4-tiny: MXFP4 routed experts, the clamped SwiGLU with a limit that binds) on the triton
    backend: bit-identical across slot configurations and passes, within float32 noise of the torch engine."""
    out = _run("triton_engine_check.py", str(tmp_path / "ds4.gguf"), "ds4-tiny", tuning="off")
    res = out["configs"]
    assert out["expert_act"] == ["swiglu", 0.25] and out["clamp_effect"] > 0.05, out   # the clamp changes logits
    assert len(res) == 2
    _check_engine_configs(res, "2v3h", "8v0h")
