"""kernels/triton_mmq.py compiled for sm_90 without a GPU (the ptxas of the triton wheel, in a child without
TRITON_INTERPRET): each q8_1 kernel at both rows buckets runs the int8 wgmma (IGMMA in the SASS) KB blocks a commit,
or the shipped one-row MV schedule's word loads, and spills nothing."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import compile_reports  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402


def test_compiles_to_int8_tensor_core_mma_for_sm90_without_spills():
    """triton.compile for sm_90 (no GPU: the ptxas of the triton wheel), each kernel at both rows buckets (1: split-K):
    the int8 wgmma is in the PTX, KB of them per commit (a K step), IGMMA in the SASS, and no register spills. In a
    child without TRITON_INTERPRET (which turns every jit function into an interpreted one that cannot compile)."""
    reports = compile_reports(["-m", "betelgeuse.kernels.triton_mmq"], timeout=240)
    assert [(r["kernel"], r["qt"], r["bucket"]) for r in reports] == [
        (k, qt, b) for qt in sorted(mq.MMQ_TYPES) for k in ("gate_up", "down") for b in (1, 16)], reports
    for r in reports:
        assert r["config"]["SPLIT"] == (r["bucket"] == 1), r
        if (r["qt"], r["bucket"]) in mq.TYPE_BUCKET and mq.TYPE_BUCKET[r["qt"], r["bucket"]].get("MV"):
            # the shipped one-row schedule without tensor cores (triton_mmq_mv): word loads only, no MMA
            assert r["config"]["MV"] and not r["mma"] and r["spill_bytes"] == 0, r
            assert not any(w in k for k in r["loads"] for w in (".b8", ".u8", ".s8", ".b16", ".u16")), r
            continue
        assert any(".s32.s8.s8" in m for m in r["mma"]), r
        assert r["config"]["KB"] == mq.BUCKETS[r["bucket"]]["KB"], r
        # K steps: KB back-to-back k32 MMAs per commit (the block-diagonal activations: N = KB x BM per 2 warpgroups)
        n_mma = sum(v for m, v in r["mma"].items() if "mma_async" in m)
        assert n_mma == r["config"]["KB"] * r["mma"]["wgmma.commit_group.sync.aligned"], r
        assert any(m.startswith("IGMMA") or m.startswith("IMMA") for m in r["imma"]), r
        assert r["spill_bytes"] == 0 and r["regs"] <= 255, r
