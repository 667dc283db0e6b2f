"""kernels/triton_mmq.py's decode schedule without tensor cores (MV = 1, triton_mmq_mv: word loads, the block dots on
the float units; Triton interpreter): the int8 MMA's bits, which are the numpy reference's (mmq_helpers), for a
token alone and 5 rows; and, compiled for sm_90 without a GPU, word loads only, no MMA, no spills."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import compile_reports, moe_ref, one_expert, run  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_decode_schedule_without_mma_gives_the_mma_bits(qt):
    """triton_mmq_mv (MV = 1: word loads, the block dots on the float units) gives the int8 MMA's bits: H = F = 256
    (8 blocks) in chunks of KCB = 4 blocks (Q4_K: 512, chunks of 8, its word group), a token alone (1-row bucket,
    split-K over programs) and 5 rows of one expert (walked), at 1 / 4 rows a program and 1 / 2 word groups a
    step, gate and up fused or not; the MMA's bits are the numpy reference's (within its float noise) and differ from
    the unchunked ones (the chunks are real). A launch the schedule cannot take (KCB not a multiple of its step) runs
    the MMA: the same bits."""
    K, kcb = (512, 8) if qt == 12 else (256, 4)
    with pytest.MonkeyPatch.context() as mp:
        raw, h, ids, w, code = one_expert(mp, qt, K, rows=5, seed_experts=10, seed=9)

        def with_cfg(n, **cfg):
            mp.setitem(mq.TYPE_CONFIG, code, {"KCB": kcb, **cfg})
            return run(qt, raw, h[:n], ids[:n], w[:n])
        # the MMA at 1 row (split-K) really: MV 0 over TYPE_BUCKET's one-row MV of MXFP4 and Q4_K (with it, mma1 was
        # the decode schedule's own bits, the (1, 1, 0) case below all but the same launch), at 64 outputs a program
        # (the MMA's 16-row BN, Q8_0's one-row one; its bits do not depend on BN: test_a_rows_bits_do_not_depend_...)
        mma1, mma5 = with_cfg(1, KB=1, MV=0, BN=64), with_cfg(5, KB=2)
        assert np.array_equal(mma1[0], mma5[0])
        want = moe_ref(qt, raw, h, ids, w, kcb=kcb)
        assert np.abs(mma5 - want).max() / np.abs(want).max() <= 1e-6
        assert not np.array_equal(mma5, with_cfg(5, KCB=0))
        taken = []                                      # the launches' choice: the decode schedule or the MMA
        ok = mq.mv.mv_ok
        mp.setattr(mq.mv, "mv_ok", lambda *a: taken.append(ok(*a)) or taken[-1])
        ns = 2 if qt == 8 else 1                        # word groups a step that divide KCB
        for bm, ns_, fuse in [(1, 1, 0), (4, ns, 1)]:                   # 1 and 4 rows a program (CI's time)
            taken.clear()
            assert np.array_equal(with_cfg(1, MV=1, BM_MV=bm, NS=ns_, FUSE=fuse)[0], mma1[0]), (bm, ns_, fuse)
            assert np.array_equal(with_cfg(5, MV=1, BM_MV=bm, NS=ns_, FUSE=fuse, SPLIT=0), mma5), (bm, ns_, fuse)
            assert taken == [True] * 4, taken           # gate_up and down, both runs
        taken.clear()
        # 8+ blocks a step > KCB: the MMA runs (at BN 64, as mma1: mv_ok does not look at BN)
        assert np.array_equal(with_cfg(1, MV=1, NS=4, BN=64)[0], mma1[0])
        assert taken == [False, False], taken


def test_decode_schedule_compiles_to_word_loads_without_spills_for_sm90():
    """The decode schedule (MV = 1, 32 outputs a program, 4 warps; the bench geometry, 1-row bucket) compiled for
    sm_90 without a GPU: the weights read as 32-bit words (no byte or half-word loads: the MMA schedule's 34- and
    17-byte blocks are read byte by byte), no tensor-core MMA, no spills and at most 128 registers (4 programs of 4
    warps an SM at least); DP4A 1 puts dp4a in the PTX (and MXFP4's byte-permute code table). In a child without
    TRITON_INTERPRET."""
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4, 5):\n for w in ('gate_up', 'down'):\n  for d in (0, 1):\n"
            "   print(json.dumps(mq.compile_report(w, qt, bucket=1, over={'MV': 1, 'BN': 32, 'num_warps': 4, "
            "'num_stages': 1, 'DP4A': d})))\n")
    reports = compile_reports(["-c", code], timeout=300)
    assert len(reports) == 12, reports
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0 and r["regs"] <= 128, r
        assert not r["mma"] and not r["imma"], r
        assert not any(".b8" in k or ".b16" in k or ".u8" in k or ".s8" in k for k in r["loads"]), r
        assert (r["dp4a"] > 0) == (r["config"]["DP4A"] == 1), r
        assert ("prmt" in r["asm"]) == (r["config"]["DP4A"] == 1 and r["qt"] == 4), r      # MXFP4's code table
