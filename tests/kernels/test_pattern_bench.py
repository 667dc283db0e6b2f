"""deploy/device/pattern_bench.py (the Q8_0 Gluon kernel's weight reads without its MMA) and tests/scripts/
inflight_account.py (its bytes in flight an SM), on the CPU (docs/benchmarks/cpu-inflight61): the bench's `pairs`
loop issues the shipped kernel's loads (the same LDG.U16 count a step, none read in the step that issues them),
`words` the same bytes as coalesced 32-bit words, `ring` them by cp.async into shared memory stages, `tiled` the
kernel's loads on a tile-major layout and `packed` 128-bit loads of mma_pack's layout (cpu-pack62), and each case's
shared memory (reservation, ring) caps the CTAs an SM at its CTAS by the account's occupancy rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from mmq_helpers import compile_reports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
sys.path.insert(0, str(ROOT / "deploy" / "device"))

import inflight_account as ia  # noqa: E402

# a child without TRITON_INTERPRET: compile the shipped Gluon gate_up (fused, GP 1, the 1-row bucket) and the bench's
# cases for sm_90; one JSON line a kernel, or {"skip": why}
_CHILD = """
import json, re, sys
sys.path.insert(0, "tests/scripts")
sys.path.insert(0, "deploy/device")
import kernel_smem
why = kernel_smem.probe()
from betelgeuse.kernels import gluon_mmq as gm
if why or not gm.HAVE_GLUON:
    print(json.dumps({"skip": why or "no Gluon"})); sys.exit(0)
import sass_profile as sp
import pattern_bench as pb
def row(name, k):
    sass, res = sp.sass_of(k.asm["cubin"])
    ins = sp.instructions(sass)
    body = sp.k_loop(ins)
    print(json.dumps({"name": name, "ldg": sp.mix(body)["ldg"], "in_step": sp.ldg_in_step(body),
                      "ldgsts": sum(op == "LDGSTS" for _, op, _ in ins),
                      "all_ldg": sum(op == "LDG" for _, op, _ in ins),
                      "regs": int(re.search(r"REG:(\\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\\d+)", res).group(1)), "shared": int(k.metadata.shared)}))
row("kernel", gm.compile_kernel("gate_up", 1, qt=0, fuse=True, gp=1)[0])
for name in ("pairs", "words", "flat r16", "ring4", "tiled", "packed r16"):
    row(name, pb.compile_case(name))
"""


def test_occupancy_rule():
    """ctas_an_sm: registers a warp in 256s (the shipped fused gate_up's 168 at 4 warps: 3 an SM, 96: 5, 255: 2;
    100 rounds up to 104: 4, not 5), shared memory with 1 KiB a CTA reserved, and the 2,048-thread cap."""
    assert [ia.ctas_an_sm(r, 4, 4096) for r in (96, 100, 114, 134, 168, 198, 255)] == [5, 4, 4, 3, 3, 2, 2]
    assert ia.ctas_an_sm(32, 4, 0) == 16 and ia.ctas_an_sm(32, 4, 73744) == 3
    row = ia.account("gate_up", 1, True, 1, 168, 4096)
    assert (row["programs"], row["resident"], row["step_bytes"], row["steps_a_program"]) == (768, 3, 8704, 8)
    assert row["implied_latency_us"] == round(3 * 8704 * 132 / 1031e3, 2)


def test_pattern_bench_reads_as_the_kernel_and_caps_ctas():
    reports = compile_reports(["-c", _CHILD], timeout=120)
    if reports and "skip" in reports[0]:
        pytest.skip(f"no sm_90 compile toolchain here: {reports[0]['skip']}")
    r = {x["name"]: x for x in reports}
    assert set(r) == {"kernel", "pairs", "words", "flat r16", "ring4", "tiled", "packed r16"}, reports
    assert all(x["local"] == 0 and x["in_step"] == 0 for x in reports), reports
    kernel_u16 = r["kernel"]["ldg"]["U16"]                  # the weight pairs and scales (its x: 2 LDG.128 more)
    assert r["pairs"]["ldg"] == r["tiled"]["ldg"] == {"U16": kernel_u16} == {"U16": 40}, reports
    # packed (mma_pack's layout): a thread's 32 quant words as 128-bit loads (a warp load 512 contiguous bytes), the
    # scales one 32-bit word a row (its two blocks' f16 d) for its 4 rows
    assert r["packed r16"]["ldg"] == {"128": 4, "32": 4}, reports
    assert r["words"]["ldg"] == {"32": 32}, reports           # [128, 32] words, one row's 17 a warp load
    assert r["flat r16"]["ldg"] == {"128": 4}, reports         # 8 KiB a step over 128 threads
    # ring4: words' 32 copies a thread a step by cp.async (3 steps before the loop, one in it), no register loads
    assert r["ring4"]["ldgsts"] == 4 * 32 and r["ring4"]["all_ldg"] == 0, reports
    assert all(r[n]["ldgsts"] == 0 for n in ("pairs", "words", "flat r16")), reports
    import pattern_bench as pb
    for name in ("pairs", "words", "flat r16", "ring4", "tiled", "packed r16"):
        want = pb.CASES[name][3]
        assert ia.ctas_an_sm(r[name]["regs"], 4, r[name]["shared"]) == want, (name, r[name])
