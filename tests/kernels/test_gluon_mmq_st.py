"""kernels/gluon_mmq.py's schedule key ST (MXFP4 and Q4_K with PK and GP 1: the weight words of the next ST - 1 K steps
in flight through a cp.async ring in shared memory, cpu-mxtma65), on the CPU: Gluon has no interpreter and CI no GPU,
so the bits are the device's to check (deploy/device/check_gluon_mmq.py's `gluon GP1 PK ST<n>` forms: == the Triton
kernel's). Here: the ring compiles for sm_90 on both types, both kernels and both rows buckets without spills, its
copies are cp.async (LDGSTS.128) read back by LDS.128 in place of GP 1 PK's 128-bit weight loads, with the same float
ops and HGMMA as GP 1 PK; the config reaches the launch; the device check offers the forms."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import GLUON_CHILD_HEAD, compile_reports  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402
from betelgeuse.kernels import triton_mmq as mq  # noqa: E402

# (type code, kernel, rows bucket, PK, ST): GP 1 always, gate_up fused (as shipped); ST 0 is GP 1 PK, the reference
# of each ST 3 kernel; PK 2 (packed and GGUF experts in one launch) once: its packed body rings, its GGUF one does not
CASES = [(qt, w, b, 1, st) for qt in (4, 5) for w in ("gate_up", "down") for b in (1, 16) for st in (0, 3)] + [
    (5, "gate_up", 1, 2, 3)]
# a child without TRITON_INTERPRET: compile for sm_90, one JSON line a kernel, or {"skip": why}
_CHILD = """
CASES = """ + repr(CASES) + GLUON_CHILD_HEAD + """
for qt, w, b, pk, st in CASES:
    k, const = gm.compile_kernel(w, b, qt=qt, fuse=w == "gate_up", gp=1, pk=pk, st=st)
    sass, res = sp.sass_of(k.asm["cubin"])
    ins = sp.instructions(sass)
    loops = [kinds(body) for body in sp.mma_loops(ins)]
    print(json.dumps({"qt": qt, "kernel": w, "bucket": b, "pk": pk, "st": st, "smem": int(k.metadata.shared),
                      "loops": loops, "in_step": [sp.ldg_in_step(body) for body in sp.mma_loops(ins)],
                      "ldgsts": sum(op.startswith("LDGSTS") for _, op, _ in ins),
                      "fops": fops(k.asm["ptx"]),
                      "cp": sorted(set(re.findall(r"cp\\.async\\.[\\w.]+", k.asm["ptx"]))),
                      "wait": sorted(set(re.findall(r"cp\\.async\\.wait_group\\s+(\\d+)", k.asm["ptx"]))),
                      "regs": int(re.search(r"REG:(\\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\\d+)", res).group(1))}))
"""


def _ctas(regs: int, smem: int) -> tuple[int, int]:
    """CTAs of 4 warps a SM (H100): by the register file (65,536; 256 a warp's allocation unit) and by shared memory
    (228 KiB, 1 KiB of it reserved a CTA)."""
    return 65536 // (-(-regs * 32 // 256) * 256 * 4), 228 * 1024 // (smem + 1024)


def test_st_compiles_to_a_cp_async_ring_in_place_of_the_weight_loads():
    """ST 3 against GP 1 PK (ST 0) of the same launch, MXFP4 and Q4_K, gate_up (fused: 2 64-row tiles a step) and
    down (1), rows buckets 1 (split-K) and 16 (walked), for sm_90 without a GPU: no spills; the PTX's rounding float
    ops the same kinds and counts (the same decode, MMA and float ops: the same bits); the K loop's HGMMA the same;
    each tile's one 128-bit weight load a step replaced by one 16-byte cp.async (LDGSTS.128, cache-global) and one
    LDS.128 of the step's words, every other load as GP 1's (none read in the step that issues it); ST steps' copies
    in the kernel (ST - 1 before the loop, one in it), waited for down to ST - 2 groups; the ring's 4 slots (ST 3's
    power of two) of R / 2 x 16 words beside the B tile's 4 KiB, at least 3 CTAs a SM by shared memory; by registers
    ST 0's CTAs or 3, the fewer (Triton 3.6's Q4_K 1-row down: 122 -> 130 registers, 4 -> 3 CTAs). PK 2 with ST 3:
    two K loops, the packed body's with the ring, the GGUF body's without."""
    reports = compile_reports(["-c", _CHILD], timeout=120)
    if reports and "skip" in reports[0]:
        pytest.skip(f"no sm_90 compile toolchain here: {reports[0]['skip']}")
    assert [(r["qt"], r["kernel"], r["bucket"], r["pk"], r["st"]) for r in reports] == CASES
    ref = {(r["qt"], r["kernel"], r["bucket"]): r for r in reports if r["st"] == 0}
    for r in reports:
        assert r["local"] == 0, r
        if r["st"] == 0:
            assert r["ldgsts"] == 0 and not r["cp"], r
            continue
        g = ref[r["qt"], r["kernel"], r["bucket"]]
        t = 2 if r["kernel"] == "gate_up" else 1          # 64-row tiles a K step
        if r["pk"] == 2:                                  # the packed body and the GGUF body (GP 1, no ring)
            rings = sorted(lp.get("LDGSTS.E.BYPASS.128", 0) for lp in r["loops"])
            assert rings == [0, t], r
            assert r["fops"]["fma.rn.f32"] == 2 * g["fops"]["fma.rn.f32"], r
            continue
        assert r["fops"] == g["fops"], (r, g)
        (lp,), (lg,) = r["loops"], g["loops"]
        hg = [sum(v for k, v in d.items() if k.startswith("HGMMA")) for d in (lp, lg)]
        assert hg == [4 * t, 4 * t], (r, g)
        assert lp.get("LDGSTS.E.BYPASS.128") == t and lp.get("LDS.128") == t and lp.get("LDGDEPBAR") == 1, r
        assert not any(k.startswith("LDSM") for k in lp), r
        want = {k: v for k, v in lg.items() if k.startswith("LDG.")}
        want["LDG.E.128"] -= t                            # the weight words' 128-bit loads: the ring's now
        assert {k: v for k, v in lp.items() if k.startswith("LDG.") and v} == {k: v for k, v in want.items() if v}, (
            r, g)
        assert r["in_step"] == [0], r
        assert r["ldgsts"] == 3 * t and r["wait"] == ["0", "1"], r     # 1: ST - 2 in the loop, 0 after it
        assert "cp.async.cg.shared.global" in r["cp"], r
        assert r["smem"] == g["smem"] + 4 * t * 32 * 64, (r, g)       # 4 slots x [R / 2, 16] int32
        by_regs, by_smem = _ctas(r["regs"], r["smem"])
        assert by_smem >= 3 and by_regs >= min(3, _ctas(g["regs"], 0)[0]), (r, g)


def test_st_is_usable_and_reaches_the_launch_as_configured(monkeypatch):
    """ST (triton_mmq.CONFIG's 0; nothing in BF_TUNING): gluon_mmq.usable takes ST 2 .. 8 with PK 1 / 2 and GP 1 for
    MXFP4 and Q4_K and nothing else (Q8_0, GP 0 / 2, PK 0, ST 1 / 9); TYPE_CONFIG's ST reaches gluon_mmq.launch's
    constexprs for gate_up and down (a stand-in launch; usable() forced true: the CPU has no Gluon device), both
    kernels declare it, compile_kernel takes it; where the Gluon form cannot run, the packed launch raises."""
    assert mq.CONFIG["ST"] == 0 and not any(t.get("ST") for t in mq.BF_TUNING.values())
    assert all("ST" in c for c in gm.CONSTS.values())
    assert "st" in gm.compile_kernel.__code__.co_varnames
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    cuda = torch.device("cuda")
    for b in (1, 16):
        for qt in (0, 4, 5):
            c = {**mq.config(qt, b, bf=True), "GL": 1}
            for pk in (0, 1, 2):
                for gp in (0, 1, 2):
                    for st in (1, 2, 3, 4, 8, 9):
                        want = qt in (4, 5) and pk > 0 and gp == 1 and 2 <= st <= 8
                        assert gm.usable(qt, {**c, "GP": gp, "PK": pk, "ST": st}, 2, cuda) == want, (qt, pk, gp, st)
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(gm, "usable", lambda *a, **k: True)
    monkeypatch.setattr(gm, "launch", lambda which, grid, args, consts, kcb: seen.append((which, consts["ST"])))
    H, F, E, k = 256, 256, 4, 2
    for qt in (4, 5):
        rb_h, rb_f = gm.row_bytes(qt, H), gm.row_bytes(qt, F)
        pool = torch.zeros(E * (2 * F * rb_h + H * rb_f), dtype=torch.uint8)
        base = torch.arange(E, dtype=torch.int64) * (2 * F * rb_h + H * rb_f)
        starts = torch.tensor([[0, F * rb_h, 2 * F * rb_h]] * E, dtype=torch.int64)
        for T in (1, 16):
            rows = torch.arange(T * k, dtype=torch.int32)
            off = torch.tensor([0, T * k, T * k, T * k, T * k], dtype=torch.int32)
            for over, st in ((None, 0), ({"GL": 1, "GP": 1, "PK": 1, "ST": 3}, 3), ({"GL": 1, "GP": 1, "PK": 1,
                                                                                      "ST": 4, "NR": 168}, 4)):
                if over:
                    monkeypatch.setitem(mq.TYPE_CONFIG, qt, over)
                n = len(seen)
                inter = torch.zeros(T * k, F, dtype=torch.bfloat16)
                mq.gate_up(mq.prepare_bf16(torch.zeros(T, H)), pool, base, starts, rows, off, inter, F, k, qt, None,
                           rb_h, True)
                mq.down(mq.prepare_bf16(inter.float()), pool, base, starts, rows, off,
                        torch.zeros(T * k, H, dtype=torch.bfloat16), qt, rb_f, True)
                assert seen[n:] == [("gate_up", st), ("down", st)], (qt, T, over, seen[n:])
                monkeypatch.delitem(mq.TYPE_CONFIG, qt, raising=False)
    monkeypatch.undo()
    monkeypatch.setitem(mq.TYPE_CONFIG, 5, {"GL": 1, "GP": 1, "PK": 1, "ST": 3})
    with pytest.raises(ValueError, match="PK 1"):          # the CPU: no Gluon form, and no other kernel reads PK
        mq.gate_up(mq.prepare_bf16(torch.zeros(1, H)), pool, base, starts, rows, off, inter, F, k, 5, None,
                   gm.row_bytes(5, H), True)


def test_the_device_check_offers_the_st_forms(monkeypatch):
    """deploy/device/check_gluon_mmq.py's gl_forms: MXFP4 and Q4_K offer `gluon GP1 PK ST2` / `ST3` / `ST4` and
    `gluon GP1 PK2 ST3` (GP 1, PK, ST as named), Q4_K `gluon GP1 PK ST4 NR168` and `NR168/128`, MXFP4 `gluon GP1 PK ST4
    NR128`; Q8_0 none with ST; every offered ST form usable for its type on an sm_90 device (the check refuses a
    form that would fall back)."""
    path = Path(__file__).resolve().parents[2] / "deploy" / "device" / "check_gluon_mmq.py"
    spec = importlib.util.spec_from_file_location("check_gluon_mmq_st", path)
    cg = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", [*sys.path])         # the script puts its folders first
    spec.loader.exec_module(cg)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    offered = {}
    for name in ("Q8_0", "MXFP4", "Q4_K"):
        cg.set_type(name)
        offered[name] = {n: o for n, o in cg.gl_forms(mq).items() if o.get("ST")}
        c = mq.config(cg.QT, 16, bf=True)
        for n, o in offered[name].items():
            assert gm.usable(cg.QT, {**c, **o}, c["KB"], torch.device("cuda")), (name, n, o)
            assert o["GP"] == 1 and o["PK"] == (2 if "PK2" in n else 1) and f"ST{o['ST']}" in n, (n, o)
    both = {"gluon GP1 PK ST2", "gluon GP1 PK ST3", "gluon GP1 PK ST4", "gluon GP1 PK2 ST3"}
    assert offered["Q8_0"] == {}
    assert set(offered["MXFP4"]) == both | {"gluon GP1 PK ST4 NR128"}
    assert set(offered["Q4_K"]) == both | {"gluon GP1 PK ST4 NR168", "gluon GP1 PK ST4 NR168/128"}
