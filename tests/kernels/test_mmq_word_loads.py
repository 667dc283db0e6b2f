"""kernels/triton_mmq.py's word loads (WL: the MMA's tiles from int32 words, unpacked in registers; PF: fetched a K
step ahead; Triton interpreter): the byte-load MMA's bits, which are the numpy reference's (mmq_helpers), at 1 / 5 /
16 rows and K steps of 1-8 blocks; and, compiled for sm_90 without a GPU, 32-bit or wider loads only, no spills."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import compile_reports, moe_ref, one_expert, run  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_word_loads_give_the_byte_load_bits(qt):
    """WL = 1 (the MMA's weight and activation tiles from int32 word loads, unpacked in registers; PF = 1: the next
    K step's words fetched before this step's MMA, PF = 2 its scale words only) gives the bits of the byte-load MMA:
    H = F = 512 (16 blocks: Q8_0's even and odd blocks, MXFP4's blocks at every byte offset mod 4, Q4_K's two
    super-blocks) in chunks of KCB = 8, 1 / 5 / 16 rows of one expert (the 1-row bucket split over programs, the
    16-row bucket walked), K steps of KB = 1 / 2 / 4 / 8 blocks, gate and up fused or not, and one chunk (KCB 0);
    the byte-load bits are the numpy reference's (within its float noise). The launches really take the word loads
    (wl_ok), and a launch whose rows are not word aligned reads bytes (the same bits)."""
    K, kcb = 512, 8
    with pytest.MonkeyPatch.context() as mp:
        raw, h, ids, w, code = one_expert(mp, qt, K, rows=16, seed_experts=12, seed=11)

        def with_cfg(n, **cfg):     # the MMA in both buckets, 64 outputs a program in both (as Q8_0's one-row
            # bucket: MXFP4's and Q4_K's 16 there are their MV schedule's; the MMA's bits do not depend on BN,
            # test_a_rows_bits_do_not_depend_on_its_block) - a quarter of the one-row launches' interpreted programs
            mp.setitem(mq.TYPE_CONFIG, code, {"KCB": kcb, "MV": 0, "BN": 64, **cfg})
            return run(qt, raw, h[:n], ids[:n], w[:n])
        taken = []                                      # the launches' choice: word loads or bytes
        ok = mq.wl_ok
        mp.setattr(mq, "wl_ok", lambda *a: taken.append(ok(*a)) or taken[-1])
        ref = {n: with_cfg(n, KB=1, WL=0, PF=0) for n in (1, 5, 16)}
        assert taken == [], taken                       # WL 0: byte loads (wl_ok not asked)
        assert all(np.array_equal(ref[n][0], ref[16][0]) for n in (1, 5))
        want = moe_ref(qt, raw, h, ids, w, kcb=kcb)
        assert np.abs(ref[16] - want).max() / np.abs(want).max() <= 1e-6
        # (KB, PF, FUSE) per row count: every PF and FUSE value and KB 2-8 at 16 rows (KB 1: the one-row bucket, split,
        # and an odd row count), fewer than every combination: the interpreter takes ~6 s a launch pair here
        for n, cases in [(1, [(1, 2, 1), (4, 0, 0)]), (5, [(1, 0, 0)]),
                         (16, [(2, 1, 1), (4, 0, 0), (8, 2, 0)])]:
            for kb, pf, fuse in cases:
                taken.clear()
                got = with_cfg(n, KB=kb, WL=1, PF=pf, FUSE=fuse, SPLIT=int(n == 1))
                assert np.array_equal(got, ref[n]), (n, kb, pf, fuse)
                assert taken == [True, True], taken
        one = with_cfg(16, KB=1, KCB=0, WL=0, PF=0)    # one chunk
        assert not np.array_equal(one, ref[16])
        assert np.array_equal(with_cfg(16, KB=2, KCB=0, WL=1, PF=1), one)
        taken.clear()                                   # rows not word aligned: bytes, the same bits
        assert not ok(code, 34 * 3, True) and ok(code, 144, True) and not ok(code, 144, False)
        mp.setattr(mq, "wl_ok", lambda *a: taken.append(False) or False)
        assert np.array_equal(with_cfg(16, KB=2, WL=1, PF=1), ref[16]) and taken == [False, False]


def test_word_loads_compile_for_sm90_to_word_loads_without_spills():
    """WL = 1 at KB 1, BN 64, 4 warps (PF 0, 1 and 2), the shipped 16-row bucket (WL 2, PF 1, KB 2) and WL = 2 at
    KB 1, PF 2 (MXFP4's codes through the byte-permute table; the other types: WL 1), beside the byte-load MMA
    (WL 0), compiled for sm_90 without a GPU, with and without the alignment facts of a device launch (hints): the
    int8 tensor-core MMA is there, every
    global load of the kernel is 32 bits or wider (no ld.global.b8 / .b16, cp.async copies of 4 or 16 bytes: the byte
    MMA reads Q8_0 in half-words, MXFP4 and Q4_K's scales in bytes), and nothing spills. In a child without
    TRITON_INTERPRET."""
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4, 5):\n for w in ('gate_up', 'down'):\n"
            "  for o, h in (({'WL': 0, 'PF': 0, 'KB': 1}, 1), ({'WL': 1, 'PF': 0, 'KB': 1}, 0),\n"
            "               ({'WL': 1, 'PF': 0, 'KB': 1}, 1), ({'WL': 1, 'PF': 1, 'KB': 1}, 1),\n"
            "               ({'WL': 1, 'PF': 2, 'KB': 1}, 1), ({}, 1), ({'WL': 2, 'PF': 2, 'KB': 1}, 1)):\n"
            "   print(json.dumps(mq.compile_report(w, qt, bucket=16, over=o, hints=bool(h))))\n")
    reports = compile_reports(["-c", code], timeout=600)
    assert len(reports) == 42, reports
    narrow = lambda r: [k for k in r["loads"] if any(w in k for w in (".b8", ".b16", ".u8", ".s8", ".u16", ".s16"))
                        or k.startswith("cp.async") and int(k.rsplit(".", 1)[1]) < 4]      # noqa: E731
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0 and r["regs"] <= 255, r
        assert any(m.startswith("IGMMA") for m in r["imma"]), r
        if r["config"]["WL"]:
            assert not narrow(r), r
        else:                                           # the byte-load MMA (what WL replaces) does read narrow words
            assert narrow(r), r
    prm = [r for r in reports if r["qt"] == 4 and r["config"]["WL"] == 2]   # MXFP4's codes by PTX prmt
    assert len(prm) == 4 and all("prmt" in r["asm"] for r in prm), prm
    assert not any(r["config"]["WL"] == 2 for r in reports if r["qt"] != 4)          # the others: WL 1's decode
    q4k = [r for r in reports if r["qt"] == 5 and r["hints"] and r["config"]["WL"] and not r["config"]["PF"]]
    assert all(r["loads"].get("cp.async.cg.shared.global.16") for r in q4k), q4k       # Q4_K's quants: 16-byte copies
