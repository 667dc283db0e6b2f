"""kernels/gluon_mmq.py, the Gluon form of the bf16 MMA of Q8_0 / MXFP4 / Q4_K (triton_mmq's schedule key GL 1), on the
CPU: Gluon has no interpreter and CI no GPU, so its bits are the device's to check (deploy/device/check_gluon_mmq.py: ==
the Triton kernel's). Here: it compiles for sm_90 to the Triton kernel's instruction with the weights loaded straight
into wgmma's A registers (no shared memory for A), it applies exactly to the shipped bf16 schedule, and where it cannot
run (the CPU, the interpreter) GL 1 launches the Triton kernel, whose bits stay."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from test_mmq import DIMS, _compile_reports, experts, run  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402
from betelgeuse.kernels import triton_mmq as mq  # noqa: E402

# (type code, kernel, rows bucket): gate_up at the 1-row bucket (split-K; MXFP4's and Q4_K's fused), down at the 16-row
# one (walked; MXFP4's down left out: the same loop as Q8_0's but for _fetch's decode, cpu-gluon55 counted it -- the
# child stays within CI's 15 s with a cold Triton cache: 14.5 s with it here, 8 s without)
CASES = [(0, "gate_up", 1), (0, "down", 16), (4, "gate_up", 1), (5, "gate_up", 1), (5, "down", 16)]
# a child without TRITON_INTERPRET: compile the Gluon kernels for sm_90 and count their K loop's SASS
# (tests/scripts/sass_profile.py's loop and classes); one JSON line a kernel, or {"skip": why}
_CHILD = """
CASES = """ + repr(CASES) + """
import json, re, sys
sys.path.insert(0, "tests/scripts")
import kernel_smem
why = kernel_smem.probe()
from betelgeuse.kernels import gluon_mmq as gm
if why or not gm.HAVE_GLUON:
    print(json.dumps({"skip": why or "no Gluon"})); sys.exit(0)
import sass_profile as sp
from betelgeuse.kernels import triton_mmq as mq
FOPS = re.compile(r"^\\s*((?:ex2|div|rcp|fma|add|sub|mul|min|max)\\.[\\w.]*f32[\\w.]*"
                  r"|cvt\\.rn\\.bf16\\w*\\.f32)", re.M)
def fops(ptx):                      # the PTX's float ops that round, by kind (exact ones left out: cvt f16 -> f32, and
    # negation: Q4_K's -(dmin m * sx) is a sign flip of one factor, Triton's an xor of sx's sign bit, Gluon's a neg
    # of dmin m -- the same product bits either way)
    ops = {}
    for m in FOPS.findall(ptx):
        ops[m.replace("bf16x2", "bf16")] = ops.get(m.replace("bf16x2", "bf16"), 0) + (2 if "x2" in m else 1)
    return ops
for qt, w, b in CASES:
    fuse = bool(mq.config(qt, b, bf=True).get("FUSE")) and w == "gate_up"     # the shipped FUSE (MXFP4, Q4_K: 1)
    k, const = gm.compile_kernel(w, b, qt=qt, fuse=fuse)
    tk = mq.compile_kernel(w, qt, bucket=b, hints=True, bf=True)[0]
    sass, res = sp.sass_of(k.asm["cubin"])
    body = sp.k_loop(sp.instructions(sass), mma=True)
    ops = {}
    for _, op, rest in body:
        key = op + (rest.split()[0] if rest.startswith(".") else "")
        ops[key] = ops.get(key, 0) + 1
    print(json.dumps({"qt": qt, "kernel": w, "bucket": b, "split": const["SPLIT"], "fuse": fuse,
                      "a_op": sp.a_operand(body), "asm": "add.rn.bf16x2" in k.asm["ptx"],
                      "ops": ops, "fops": fops(k.asm["ptx"]), "triton_fops": fops(tk.asm["ptx"]),
                      "shapes": sorted(set(re.findall(r"\\b(HGMMA\\.[\\w.]+)", sass))),
                      "regs": int(re.search(r"REG:(\\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\\d+)", res).group(1))}))
"""


def test_gluon_compiles_to_the_bf16_mma_with_the_weights_in_registers():
    """Q8_0's, MXFP4's and Q4_K's gate_up at the 1-row bucket (split-K; the shipped FUSE: MXFP4's and Q4_K's gate and up
    rows in one K loop) and Q8_0's and Q4_K's down at the 16-row one (CASES), for sm_90 without a GPU: the one HGMMA
    shape of triton_mmq's bf16 MMA (m64 n32 k16, test_mmq_bf16's compile test), 4 a K step (K = KB 2 x 32 = 64, k16
    each; fused: 8, two m64 on the same B), A from registers; the K loop's only shared memory stores are the B tile's
    (64 x 32 bf16 = 32 bytes a thread of 128: 2 STS.128), no shared memory loads (Triton's loop: 8 STS.64 + 4 LDSM of
    the weights, the scales' STS + LDS), at most 2 barriers a step (Triton 3.9: 3-6; 3.6: 4-6), no spills (unfused Q8_0
    / MXFP4 within 168 registers: 3 CTAs a SM); Q4_K's nibbles through the PTX decode; and the PTX's rounding float ops
    (fma, add, mul, div, ex2, the bf16 stores' cvt) of the same kinds and counts as the Triton kernel's of the same
    launch (the same float ops: a dropped clamp or min term, an unfused or extra op would show)."""
    reports = _compile_reports(["-c", _CHILD], timeout=120)
    if reports and "skip" in reports[0]:
        pytest.skip(f"no sm_90 compile toolchain here: {reports[0]['skip']}")
    assert [(r["qt"], r["kernel"], r["bucket"], r["split"], r["fuse"]) for r in reports] == [
        (qt, w, b, b == 1, qt in (4, 5) and w == "gate_up") for qt, w, b in CASES]
    for r in reports:
        ops = r["ops"]
        assert r["shapes"] == ["HGMMA.64x32x16.F32.BF16"] and r["a_op"] == "R", r
        assert sum(v for k, v in ops.items() if k.startswith("HGMMA")) == (8 if r["fuse"] else 4), r
        assert r["asm"] == (r["qt"] == 5), r
        sts = {k: v for k, v in ops.items() if k.startswith(("STS", "STSM"))}
        assert sts == {"STS.128": 2}, r
        assert not any(k.startswith(("LDS", "LDSM")) for k in ops), r
        assert sum(v for k, v in ops.items() if k.startswith("BAR")) <= 2, r
        assert r["local"] == 0 and (r["regs"] <= 168 or r["qt"] == 5 or r["fuse"]), r   # 168: 3 CTAs a SM
        assert r["fops"] == r["triton_fops"] and r["fops"].get("fma.rn.f32"), r


def test_gl_applies_exactly_to_the_shipped_bf16_schedules(monkeypatch):
    """gluon_mmq implements one instruction shape (SHAPE); usable() must take it for the shipped bf16 launch of Q8_0,
    MXFP4 and Q4_K in both rows buckets (BF_TUNING over CONFIG, KB as _chunk launches it at the bench geometry; FUSE
    as shipped, 1 for MXFP4 and Q4_K, or 0) on an sm_90 device with aligned parts, and for nothing else: another type
    (Q5_K), another shape (BN 128 / 8 warps, KB 1: other fp32 sums), unaligned parts, sm_80, the CPU, the
    interpreter. GL is off by default."""
    assert mq.CONFIG["GL"] == 0 and all("GL" not in t for t in mq.BF_TUNING.values())
    assert [gm.row_bytes(q, 2048) for q in (0, 4, 5)] == [2176, 1088, 1152]      # gguf: 34 / 17 B a 32, 144 a 256
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cap = {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap["v"])
    cuda = torch.device("cuda")
    for b in (1, 16):
        for qt in (0, 4, 5):
            c = {**mq.config(qt, b, bf=True), "GL": 1}
            assert bool(c["FUSE"]) == (qt != 0), c
            for K in (2048, 768):
                kb = mq._chunk(c, qt, K)[0]
                assert gm.usable(qt, c, kb, cuda) and gm.usable(qt, {**c, "FUSE": 0}, kb, cuda), (qt, b, K, c)
                assert not gm.usable(qt, c, kb, cuda, aligned=False)
        c = {**mq.config(0, b, bf=True), "GL": 1}
        assert not gm.usable(6, {**mq.config(6, b, bf=True), "GL": 1}, 2, cuda)       # Q5_K: no Gluon form
        assert not gm.usable(0, {**c, "BN": 128, "num_warps": 8}, 2, cuda)
        assert not gm.usable(0, c, 1, cuda)
        assert not gm.usable(0, c, 2, torch.device("cpu"))
        cap["v"] = (8, 0)
        assert not gm.usable(0, c, 2, cuda) and not gm.usable(5, c, 2, cuda)
        cap["v"] = (9, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not gm.usable(0, {**mq.config(0, 1, bf=True), "GL": 1}, 2, cuda)


def test_gl_on_the_cpu_runs_the_triton_kernel_with_its_bits(monkeypatch):
    """Under the interpreter GL 1 is a schedule key that changes nothing: the layer's bits == GL 0's (Q8_0, bf16,
    the 1-row bucket's split-K and the 16-row bucket's walk), and the Gluon kernels are never launched."""
    from betelgeuse.kernels import triton_launch
    raw = experts(8, 55)
    rng = np.random.default_rng(56)
    for T in (1, 7):
        h = rng.standard_normal((T, DIMS[8][0])).astype(np.float32) * np.float32(0.1)
        ids = np.stack([rng.permutation(3)[:2] for _ in range(T)]).astype(np.int64)
        w = rng.random((T, 2)).astype(np.float32)
        want = run(8, raw, h, ids, w, "bf16")
        n0 = sum(triton_launch.COUNTS[n] for n in ("_gate_up_gl_kernel", "_down_gl_kernel"))
        monkeypatch.setitem(mq.TYPE_CONFIG, 0, {"GL": 1})
        got = run(8, raw, h, ids, w, "bf16")
        monkeypatch.delitem(mq.TYPE_CONFIG, 0)
        assert np.array_equal(got, want)
        assert sum(triton_launch.COUNTS[n] for n in ("_gate_up_gl_kernel", "_down_gl_kernel")) == n0
