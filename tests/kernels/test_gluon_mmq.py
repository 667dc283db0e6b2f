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
from mmq_helpers import DIMS, GLUON_CHILD_HEAD, compile_reports, experts, run  # noqa: E402

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402
from betelgeuse.kernels import triton_mmq as mq  # noqa: E402

# (type code, kernel, rows bucket, GP, PK): gate_up at the 1-row bucket (split-K; fused, as shipped), down at the
# 16-row one (walked; MXFP4's down left out: the same loop as Q8_0's but for _fetch's decode, cpu-gluon55 counted it --
# the child stays within CI's 15 s with a cold Triton cache: 14.5 s with it here, 8 s without); Q8_0's 16-row gate_up
# with the loads carried to the step that uses them (GP 1, 2: cpu-gluon16r57; Q8_0's down runs the same K loop,
# _acc_part, and Q4_K's down the same kernel body); Q8_0's shipped GP 1 on mma_pack's layout (PK 1: cpu-pack62) in
# both buckets, gate_up (fused, 128 rows: PW2) and down (64 rows: PW) -- 4 more Gluon compiles and one Triton, ~3 s;
# PK 2 (per expert, base's bit 0: engine.pack_experts, cpu-vram62), both K loops in one kernel: the 1-row gate_up and
# the 16-row down (the buckets' other kernels run the same two bodies) -- 2 more, ~2 s; Q4_K's PK 1 (mma_pack's Q4_K
# layout, cpu-packk62: the 16-row fused gate_up, the 1-row down) and PK 2 (the shipped Q4_K cases' launches, against
# whose registers they are held) -- 4 more, ~5 s; MXFP4's PK (mma_pack's MXFP4 layout, cpu-mxpk63): its Gluon form
# (GP 0) at PK 1 (the 16-row fused gate_up, the 1-row down) and PK 2 (the 1-row gate_up, against the shipped case's
# registers), and GP 1 at PK 1 (the 16-row gate_up: the loads carried) -- 4 more Gluon compiles and 2 Triton, ~12 s;
# Q4_K's loads carried (_load_raw_k, cpu-gpk63): GP 1 at PK 1 (the 1-row fused gate_up, the 16-row down) and in GGUF
# order (the 16-row down), GP 2 at PK 1 (the 16-row fused gate_up), and GP 1 PK 1's 1-row fused gate_up under NR 168
# (a 6th field: ptxas's register limit, 3 CTAs a SM) -- 5 more Gluon compiles and 1 Triton, ~8 s
CASES = [(0, "gate_up", 1, 0, 0), (0, "gate_up", 16, 1, 0), (0, "gate_up", 16, 2, 0), (4, "gate_up", 1, 0, 0),
         (5, "gate_up", 1, 0, 0), (5, "down", 16, 0, 0), (0, "gate_up", 1, 1, 1), (0, "gate_up", 16, 1, 1),
         (0, "down", 1, 1, 1), (0, "down", 16, 1, 1), (0, "gate_up", 1, 1, 2), (0, "down", 16, 1, 2),
         (5, "gate_up", 16, 0, 1), (5, "down", 1, 0, 1), (5, "gate_up", 1, 0, 2), (5, "down", 16, 0, 2),
         (4, "gate_up", 16, 0, 1), (4, "down", 1, 0, 1), (4, "gate_up", 1, 0, 2), (4, "gate_up", 16, 1, 1),
         (5, "gate_up", 1, 1, 1), (5, "down", 16, 1, 1), (5, "down", 16, 1, 0), (5, "gate_up", 16, 2, 1),
         (5, "gate_up", 1, 1, 1, 168)]
# a child without TRITON_INTERPRET: compile the Gluon kernels for sm_90 and count their K loop's SASS
# (tests/scripts/sass_profile.py's loop and classes); one JSON line a kernel, or {"skip": why}
_CHILD = """
CASES = """ + repr(CASES) + GLUON_CHILD_HEAD + """
TK = {}
for qt, w, b, gp, pk, *nr in CASES:
    fuse = bool(mq.config(qt, b, bf=True).get("FUSE")) and w == "gate_up"     # the shipped FUSE (all: 1)
    nr = nr[0] if nr else 0
    k, const = gm.compile_kernel(w, b, qt=qt, fuse=fuse, gp=gp, pk=pk, nr=nr)
    if (qt, w, b) not in TK:                # the Triton kernel of the launch, once for its GP cases
        TK[qt, w, b] = fops(mq.compile_kernel(w, qt, bucket=b, hints=True, bf=True)[0].asm["ptx"])
    sass, res = sp.sass_of(k.asm["cubin"])
    ins = sp.instructions(sass)
    body = sp.k_loop(ins, mma=True)
    ops = kinds(body)
    loops = [{o: v for o, v in kinds(lp).items() if o.startswith("LDG")} for lp in sp.mma_loops(ins)]  # K loops' loads
    sizes = [len(lp) for lp in sp.mma_loops(ins)]                           # ... and SASS instructions
    print(json.dumps({"qt": qt, "kernel": w, "bucket": b, "gp": gp, "pk": pk, "nr": nr, "split": const["SPLIT"],
                      "fuse": fuse,
                      "a_op": sp.a_operand(body), "asm": "add.rn.bf16x2" in k.asm["ptx"], "sizes": sizes,
                      "lut": "mov.b32 t1, 0x0C080604;" in k.asm["ptx"],
                      "ldg_in_step": sp.ldg_in_step(body), "ldg": sum(v for o, v in ops.items() if o.startswith("LDG")),
                      "ops": ops, "fops": fops(k.asm["ptx"]), "triton_fops": TK[qt, w, b], "loops": loops,
                      "shapes": sorted(set(re.findall(r"\\b(HGMMA\\.[\\w.]+)", sass))),
                      "regs": int(re.search(r"REG:(\\d+)", res).group(1)),
                      "local": int(re.search(r"LOCAL:(\\d+)", res).group(1))}))
"""


def test_gluon_compiles_to_the_bf16_mma_with_the_weights_in_registers():
    """Q8_0's, MXFP4's and Q4_K's gate_up at the 1-row bucket (split-K; the shipped FUSE: gate's and up's rows in one
    K loop), Q8_0's at the 16-row one with GP 1 and 2 and Q4_K's down at the 16-row one (CASES), for
    sm_90 without a GPU: the one HGMMA shape of triton_mmq's bf16 MMA (m64 n32 k16, test_mmq_bf16's compile test), 4
    a K step (K = KB 2 x 32 = 64, k16 each; fused: 8, two m64 on the same B), A from registers; the K loop's only
    shared memory stores are the B tile's (64 x 32 bf16 = 32 bytes a thread of 128: 2 STS.128), no shared memory loads
    (Triton's loop: 8 STS.64 + 4 LDSM of the weights, the scales' STS + LDS), at most 2 barriers a step (Triton 3.9:
    3-6; 3.6: 4-6), no spills (unfused Q8_0 / MXFP4 within 168 registers: 3 CTAs a SM); Q4_K's nibbles through the
    PTX decode; and the PTX's rounding float ops (fma, add, mul, div, ex2, the bf16 stores' cvt) of the same kinds and
    counts as the Triton kernel's of the same launch (the same float ops: a dropped clamp or min term, an unfused or
    extra op would show). GP 1 / 2 (Q8_0): no load of the loop is read in the step that issues it
    (sass_profile.ldg_in_step: a conversion, repacking or copy of the loaded register there would wait for it; GP 0's
    loop, the control, waits for all 22); GP 2's loop holds 2 steps (its counts doubled). PK 1 (mma_pack's layout,
    Q8_0 GP 1): the same HGMMA, shared memory, barriers and float ops, its weights by 128-bit loads (a thread's 16
    contiguous bytes of a 64-row tile: 2 a tile a step) and a row's two scales one 32-bit word, nothing else (the
    words' bf16 order by register moves: no shared memory, no shuffles). PK 2 (per expert by base's bit 0: both
    layouts in one kernel): exactly two K loops, PK 1's and GGUF order's (GP 1's pair loads), no spills within the
    shipped form's 3 CTAs a SM, each body's block fmas. Q4_K's PK 1 / 2 (cpu-packk62): its byte pairs by 128-bit
    loads (a thread's 16 contiguous bytes of a 64-row tile, one a tile a step) where the shipped form has 8 16-bit
    loads a tile, every other load, the HGMMA, shared memory and float ops as shipped, no shuffles or shared memory
    loads (the pairs moved to QL's threads by register moves); PK 2 both loops and the shipped launch's CTAs a SM.
    MXFP4's PK 1 / 2 (cpu-mxpk63): its nibble bytes by 128-bit loads (a thread's 16 contiguous bytes of a 64-row tile,
    one a tile a step, where GGUF order has 16 byte loads) and a row's two scale bytes one 16-bit load (GGUF: 2 byte
    loads), the HGMMA, shared memory and float ops as shipped, no shuffles or shared memory loads; PK 2 both loops
    within the shipped launch's CTAs a SM; GP 1's loads all read a step later. MXFP4 (cpu-mxlut63): the nibbles
    decoded by _e2m1x8's PTX table (in the PTX), a K step's SASS at most 250 a 64-row tile with packed loads, 350
    with GGUF order's (the compiler's decode: 461-1,147), the 1-row kernels within 168 registers (3 CTAs a SM), and
    the B tile's 16 bf16 loads 4 64-bit runs, but for FUSE's GP 0 form."""
    reports = compile_reports(["-c", _CHILD], timeout=120)
    if reports and "skip" in reports[0]:
        pytest.skip(f"no sm_90 compile toolchain here: {reports[0]['skip']}")
    assert [(r["qt"], r["kernel"], r["bucket"], r["gp"], r["pk"], r["split"], r["fuse"]) for r in reports] == [
        (qt, w, b, gp, pk, b == 1, w == "gate_up") for qt, w, b, gp, pk, *_ in CASES]
    shipped = {(r["qt"], r["kernel"], r["bucket"]): r["regs"] for r in reports if r["qt"] in (4, 5) and not r["pk"]
               and not r["gp"]}
    for r in reports:
        ops = r["ops"]
        n = 2 if r["gp"] == 2 else 1               # GP 2: two K steps a loop iteration
        assert r["shapes"] == ["HGMMA.64x32x16.F32.BF16"] and r["a_op"] == "R", r
        assert sum(v for k, v in ops.items() if k.startswith("HGMMA")) == (8 if r["fuse"] else 4) * n, r
        assert r["asm"] == (r["qt"] == 5) and r["lut"] == (r["qt"] == 4), r
        sts = {k: v for k, v in ops.items() if k.startswith(("STS", "STSM"))}
        assert sts == {"STS.128": 2 * n}, r
        assert not any(k.startswith(("LDS", "LDSM")) for k in ops), r
        assert sum(v for k, v in ops.items() if k.startswith("BAR")) <= 2 * n, r
        assert r["local"] == 0 and (r["regs"] <= 168 or r["qt"] == 5 or r["fuse"] or r["gp"] == 2), r   # 3 CTAs a SM
        assert r["regs"] <= (r["nr"] or 255), r    # NR: ptxas's limit (Q4_K's fused GP 1 at 168: no spills, above)
        want = dict(r["triton_fops"])
        if r["gp"] == 2:                           # the block fmas in 3 places: the loop's 2 steps, an odd last step
            want["fma.rn.f32"] *= 3                # (Q4_K: its block muls too, below)
        t = 2 if r["fuse"] else 1                  # 64-row tiles a K step
        if r["qt"] == 5:                           # Q4_K a K loop's loads: GGUF 8 pairs a tile, its 2 headers, x;
            gguf = {"LDG.E.U16": 8 * t, "LDG.E.128": 2 * t + 2, "LDG.E": 8}     # packed: the pairs one 16-byte load
            packed = {"LDG.E.128": 3 * t + 2, "LDG.E": 8}
        elif r["qt"] == 4:                         # MXFP4: GGUF a byte a pair (16 a tile) and a scale (2 a row); the
            xl = {"LDG.E.64": 4}                    # B tile's 16 bf16 (_perm's order) as 4 runs of 4 elements (cpu-
            if r["fuse"] and not r["gp"]:          # mxlut63), but FUSE's GP 0 form's 16 bf16 loads; packed: one
                xl = {"LDG.E.U16": 16}             # 16-byte load a tile, a 16-bit load a row's 2 scales
            gguf = {"LDG.E.U8": 20 * t, **xl}
            packed = {"LDG.E.128": t, **xl}
            packed["LDG.E.U16"] = packed.get("LDG.E.U16", 0) + 2 * t
        else:                                      # Q8_0: GGUF order's 20 pairs a tile, packed 2 words
            gguf, packed = {"LDG.E.U16": 20 * t, "LDG.E.128": 2}, {"LDG.E.128": 2 * t + 2, "LDG.E": 2 * t}
        if r["pk"] == 2:                           # two bodies: each K loop's block fmas, the epilogue's ops once or
            assert r["fops"]["fma.rn.f32"] == 2 * want["fma.rn.f32"], r     # twice (the compiler may merge the tails)
            assert r["fops"].keys() == want.keys() and all(want[k] <= v <= 2 * want[k] for k, v in r["fops"].items()), r
            # the shipped form's CTAs a SM: Q8_0's 3 (its 165 / 127 on 3.9); Q4_K's launch's (registers by the
            # register file alone: 65,536 a SM, allocated 256 a warp, 4 warps a CTA)
            ctas = [65536 // (-(-g * 32 // 256) * 256 * 4)
                    for g in (r["regs"], shipped.get((r["qt"], r["kernel"], r["bucket"]))) if g]
            assert r["regs"] <= 168 if r["qt"] == 0 else ctas[0] >= ctas[1], r
            assert sorted(map(sorted, (d.items() for d in r["loops"]))) == sorted(map(sorted, (d.items() for d in (
                gguf, packed)))), r
        else:
            if r["qt"] == 5 and r["gp"] == 2:      # Q4_K's other block ops in the 2 more places: a step's f fmas
                f = r["triton_fops"]["fma.rn.f32"]  # (PTX's per thread), f adds (acc +), f min products dmin m * sx
                want["add.f32"] += 2 * f           # and f / 2 of d sc, dmin m (a thread's rows: [R] vectors)
                want["mul.f32"] += 2 * (f + f // 2)
            assert r["fops"] == want and r["fops"].get("fma.rn.f32"), r
            assert len(r["loops"]) == 1, r
            if r["qt"] in (4, 5):                  # Q4_K's / MXFP4's loop: GGUF order's loads or (PK 1) the packed
                assert r["loops"] == [{k: v * n for k, v in (packed if r["pk"] else gguf).items()}], r
        if r["qt"] == 4:                           # MXFP4's decode by _e2m1x8's table (cpu-mxlut63): a K step's SASS
            print("MXFP4", r["kernel"], r["bucket"], "GP", r["gp"], "PK", r["pk"], "SASS a step", r["sizes"],
                  "registers", r["regs"])         # (the compiler's decode: 1026 GGUF / 804 PK, fused 1-row gate_up)
            for ld, size in zip(r["loops"], r["sizes"]):
                assert size <= (250 if "LDG.E.128" in ld else 350) * t, r
            assert r["bucket"] != 1 or r["regs"] <= 168, r     # the 1-row kernels (the engine's decode): 3 CTAs a SM
        loads = 42 if r["fuse"] else 22           # Q8_0's loads a K step (fused: gate's and up's weight words)
        if r["qt"] == 5:
            loads = sum((packed if r["pk"] else gguf).values())
        if r["pk"]:                                # the packed loads alone (Q8_0: 2 x 128 bits a tile, 2 scale words)
            assert {k: v for k, v in ops.items() if k.startswith("LDG")} == {k: v * n for k, v in packed.items()}, r
            assert not any(k.startswith("SHFL") for k in ops), r
            loads = sum(packed.values()) if r["qt"] in (4, 5) else 4 * t + 2
        if r["gp"]:                                # every load read only after the back edge: a whole step to land
            assert r["ldg_in_step"] == 0 and r["ldg"] == loads * n, r
            if r["qt"] == 5:                       # Q4_K (cpu-gpk63): GP 1 within GP 0's CTAs a SM (registers)
                print("Q4_K", r["kernel"], r["bucket"], "GP", r["gp"], "PK", r["pk"], "NR", r["nr"], "SASS a step",
                      r["sizes"], "registers", r["regs"])
        elif r["qt"] == 0:                         # GP 0 (the control): every load waited for in its own step
            assert r["ldg_in_step"] == r["ldg"] == loads, r


def test_gl_applies_exactly_to_the_shipped_bf16_schedules(monkeypatch):
    """gluon_mmq implements one instruction shape (SHAPE); usable() must take it for the shipped bf16 launch of Q8_0,
    MXFP4 and Q4_K in both rows buckets (BF_TUNING over CONFIG, KB as _chunk launches it at the bench geometry; FUSE
    as shipped, 1 for MXFP4 and Q4_K, or 0) on an sm_90 device with aligned parts, and for nothing else: another type
    (Q5_K), another shape (BN 128 / 8 warps, KB 1: other fp32 sums), unaligned parts, sm_80, the CPU, the
    interpreter. GL is off by default and shipped for Q8_0 and Q4_K (gpu-run63) and MXFP4 (gpu-run65 / 66). PK: Q8_0
    with GP >= 1, Q4_K, MXFP4 at any GP (mma_pack's layouts), nothing else; Q4_K and MXFP4 at every GP."""
    assert mq.CONFIG["GL"] == 0 and {q: t.get("GL", 0) for q, t in mq.BF_TUNING.items()} == {0: 1, 4: 1, 5: 1, 6: 0}
    assert [gm.row_bytes(q, 2048) for q in (0, 4, 5)] == [2176, 1088, 1152]      # gguf: 34 / 17 B a 32, 144 a 256
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cap = {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap["v"])
    cuda = torch.device("cuda")
    for b in (1, 16):
        for qt in (0, 4, 5):
            c = {**mq.config(qt, b, bf=True), "GL": 1}
            assert c["FUSE"] == 1, c
            for K in (2048, 768):
                kb = mq._chunk(c, qt, K)[0]
                assert gm.usable(qt, c, kb, cuda) and gm.usable(qt, {**c, "FUSE": 0}, kb, cuda), (qt, b, K, c)
                assert not gm.usable(qt, c, kb, cuda, aligned=False)
        c = {**mq.config(0, b, bf=True), "GL": 1}
        assert gm.usable(0, {**c, "PK": 1}, 2, cuda)                     # PK: Q8_0 with its loads carried (GP)
        assert not gm.usable(0, {**c, "PK": 1, "GP": 0}, 2, cuda)
        for pk in (0, 1, 2):                                             # Q4_K (cpu-packk62, cpu-gpk63) and MXFP4
            for gp in (0, 1, 2):                                         # (cpu-mxpk63): every GP form reads mma_pack's
                for qt in (4, 5):                                        # layout
                    assert gm.usable(qt, {**mq.config(qt, b, bf=True), "GL": 1, "GP": gp, "PK": pk}, 2, cuda)
        assert not gm.usable(6, {**mq.config(6, b, bf=True), "PK": 1}, 2, cuda)       # no layout, no form
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
        monkeypatch.setitem(mq.TYPE_CONFIG, 0, {"GL": 0})
        want = run(8, raw, h, ids, w, "bf16")
        n0 = sum(triton_launch.COUNTS[n] for n in ("_gate_up_gl_kernel", "_down_gl_kernel"))
        monkeypatch.setitem(mq.TYPE_CONFIG, 0, {"GL": 1})
        got = run(8, raw, h, ids, w, "bf16")
        monkeypatch.delitem(mq.TYPE_CONFIG, 0)
        assert np.array_equal(got, want)
        assert sum(triton_launch.COUNTS[n] for n in ("_gate_up_gl_kernel", "_down_gl_kernel")) == n0


def test_gp_reaches_the_gluon_launch_as_configured(monkeypatch):
    """The schedule keys GP (triton_mmq.CONFIG, 0; BF_TUNING's 1 for Q8_0, gpu-run63, and Q4_K, gpu-run66) and PK (0
    everywhere: mma_pack's layout, cpu-pack62) reach gluon_mmq.launch's constexprs as the config says: Q8_0's shipped GP 1, PK 0,
    TYPE_CONFIG's GP 0 / 1 / 2 and PK 1 under GL 1, no Gluon launch under GL 0, for gate_up and down and both rows
    buckets (a stand-in launch records them; usable() forced true: the CPU has no Gluon device), and gate_up / down's
    pk 2 (engine.pack_experts) over the shipped config -- MXFP4's too (cpu-mxpk63); Q4_K's shipped GP 1 and
    TYPE_CONFIG's GP 0 / 2 (cpu-gpk63), GP 2 with PK 1, GP 1 with PK 1 and NR 168 (ptxas's register limit:
    gluon_mmq.launch's maxnreg, 0 none), with NRD 128 (the down's). Where the Gluon form cannot run (the real usable()
    here), PK 1 and pk 2 raise: no other kernel reads packed weights."""
    assert mq.CONFIG["GP"] == 0 and {q: t.get("GP", 0) for q, t in mq.BF_TUNING.items()} == {0: 1, 4: 0, 5: 1, 6: 0}
    assert mq.CONFIG["PK"] == 0 and not any(t.get("PK") for t in mq.BF_TUNING.values())
    seen = []
    nrs = []                                         # the launches' NR (ptxas's register limit; 0: its choice)
    monkeypatch.setattr(gm, "usable", lambda *a, **k: True)
    monkeypatch.setattr(gm, "launch", lambda which, grid, args, consts, kcb: seen.append((which, consts["GP"],
                                                                                         consts["PK"]))
                        or nrs.append(consts["NR"]))
    H, F, E, k = 256, 128, 4, 2
    rb_h, rb_f = gm.row_bytes(0, H), gm.row_bytes(0, F)
    pool = torch.zeros(E * (2 * F * rb_h + H * rb_f), dtype=torch.uint8)
    base = torch.arange(E, dtype=torch.int64) * (2 * F * rb_h + H * rb_f)
    starts = torch.tensor([[0, F * rb_h, 2 * F * rb_h]] * E, dtype=torch.int64)
    for T in (1, 16):                                # 2 rows (the 1-row bucket) and 32 rows (16)
        rows = torch.arange(T * k, dtype=torch.int32)
        off = torch.tensor([0, T * k, T * k, T * k, T * k], dtype=torch.int32)
        hb = mq.prepare_bf16(torch.zeros(T, H))
        for over, gp, pk in ((None, 1, 0), ({"GL": 0}, None, 0), ({"GL": 1, "GP": 0}, 0, 0), ({"GL": 1, "GP": 1}, 1, 0),
                             ({"GL": 1, "GP": 2}, 2, 0), ({"GL": 1, "GP": 1, "PK": 1}, 1, 1)):
            if over:
                monkeypatch.setitem(mq.TYPE_CONFIG, 0, over)
            else:
                monkeypatch.delitem(mq.TYPE_CONFIG, 0, raising=False)
            n = len(seen)
            inter = torch.zeros(T * k, F, dtype=torch.bfloat16)
            mq.gate_up(hb, pool, base, starts, rows, off, inter, F, k, 0, None, rb_h, True)
            mq.down(mq.prepare_bf16(inter.float()), pool, base, starts, rows, off,
                    torch.zeros(T * k, H, dtype=torch.bfloat16), 0, rb_f, True)
            assert seen[n:] == ([] if gp is None else [("gate_up", gp, pk), ("down", gp, pk)]), (T, over, seen[n:])
        monkeypatch.delitem(mq.TYPE_CONFIG, 0, raising=False)     # engine.pack_experts: MoEKernels' pk 2 over the
        n = len(seen)                                               # shipped config
        mq.gate_up(hb, pool, base, starts, rows, off, inter, F, k, 0, None, rb_h, True, pk=2)
        mq.down(mq.prepare_bf16(inter.float()), pool, base, starts, rows, off,
                torch.zeros(T * k, H, dtype=torch.bfloat16), 0, rb_f, True, pk=2)
        assert seen[n:] == [("gate_up", 1, 2), ("down", 1, 2)], (T, seen[n:])
        mx_h, mx_f = gm.row_bytes(4, H), gm.row_bytes(4, F)             # MXFP4 (GL 1 shipped): the Gluon form, GP 0
        n = len(seen)
        mq.gate_up(hb, pool, base, starts, rows, off, inter, F, k, 4, None, mx_h, True, pk=2)
        mq.down(mq.prepare_bf16(inter.float()), pool, base, starts, rows, off,
                torch.zeros(T * k, H, dtype=torch.bfloat16), 4, mx_f, True, pk=2)
        assert seen[n:] == [("gate_up", 0, 2), ("down", 0, 2)] and mq.config(4, 1, bf=True)["GL"], seen[n:]
        k4_h, k4_f = gm.row_bytes(5, H), gm.row_bytes(5, F)             # Q4_K: shipped GP 1, GP 0 / 2 (cpu-gpk63)
        for over, gp, pk, nr in ((None, 1, 0, (0, 0)), ({"GL": 1, "GP": 0}, 0, 0, (0, 0)),
                                 ({"GL": 1, "GP": 2, "PK": 1}, 2, 1, (0, 0)),
                                 ({"GL": 1, "GP": 1, "PK": 1, "NR": 168}, 1, 1, (168, 168)),
                                 ({"GL": 1, "GP": 1, "PK": 1, "NR": 168, "NRD": 128}, 1, 1, (168, 128))):
            if over:
                monkeypatch.setitem(mq.TYPE_CONFIG, 5, over)
            n = len(seen)
            mq.gate_up(mq.prepare_bf16(torch.zeros(T, H)), pool, base, starts, rows, off, inter, F, k, 5, None, k4_h,
                       True)
            mq.down(mq.prepare_bf16(inter.float()), pool, base, starts, rows, off,
                    torch.zeros(T * k, H, dtype=torch.bfloat16), 5, k4_f, True)
            assert seen[n:] == [("gate_up", gp, pk), ("down", gp, pk)], (T, over, seen[n:])
            assert nrs[-2:] == list(nr), (T, over, nrs[-2:])     # gate_up's NR, down's NRD where set
            monkeypatch.delitem(mq.TYPE_CONFIG, 5, raising=False)
    assert mq.CONFIG["NR"] == mq.CONFIG["NRD"] == 0 and not any(t.get("NR") or t.get("NRD")
                                                                  for t in mq.BF_TUNING.values())
    monkeypatch.undo()
    got = []                                         # gluon_mmq.launch: NR -> the launch's maxnreg option, 0 -> none
    for nr in (0, 168):
        monkeypatch.setitem(gm.LAUNCH, "down", {(1, 1): lambda *a, **kw: got.append(kw.get("maxnreg"))})
        gm.launch("down", (1, 1), list(range(15)), {c: 0 for c in gm.CONSTS["down"]} | {"NR": nr}, 16)
    assert got == [None, 168]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="PK 2"):
        mq.gate_up(hb, pool, base, starts, rows, off, inter, F, k, 0, None, rb_h, True, pk=2)
    monkeypatch.setitem(mq.TYPE_CONFIG, 0, {"GL": 1, "GP": 1, "PK": 1})
    with pytest.raises(ValueError, match="PK 1"):
        mq.gate_up(hb, pool, base, starts, rows, off, inter, F, k, 0, None, rb_h, True)


def test_q8_pair_conversion_ptx_is_the_int8_to_bf16_conversion():
    """gluon_mmq._q8_bf16x2's PTX (prmt of the pair under 0x43, the two masks, sub.bf16x2) emulated bit for bit on
    every 16-bit pair: each half equals torch's int8 -> bf16 of its byte (low half the low byte), so GP 1 / 2's
    weights are GP 0's (the compiler's conversion). The emulation follows the PTX text, which is checked too."""
    import inspect
    src = inspect.getsource(gm._q8_bf16x2.fn if hasattr(gm._q8_bf16x2, "fn") else gm._q8_bf16x2)
    for line in ("prmt.b32 t, $1, 0x43, 0x4140;", "and.b32 a, t, 0xff7fff7f;", "and.b32 b, t, 0xff80ff80;",
                 "sub.rn.bf16x2 $0, a, b;"):
        assert line in src, line
    w = np.arange(1 << 16, dtype=np.uint32)
    b0, b1 = w & 0xFF, w >> 8
    t = b0 | (0x43 << 8) | (b1 << 16) | (0x43 << 24)           # prmt selector 0x4140: a.b0, 0x43, a.b1, 0x43
    a, b = t & 0xFF7FFF7F, t & 0xFF80FF80

    def halves(v):                                   # bf16x2 -> its two values as float32 (exact)
        return [torch.from_numpy(((v >> s) & 0xFFFF).astype(np.int32) << 16).view(torch.float32) for s in (0, 16)]
    got = [(x - y).to(torch.bfloat16) for x, y in zip(halves(a), halves(b))]   # exact: |x - y| < 256, integers
    for g, byte in zip(got, (b0, b1)):
        want = torch.from_numpy(byte.astype(np.uint8).view(np.int8)).to(torch.bfloat16)
        assert torch.equal(g.view(torch.int16), want.view(torch.int16))


def _mxfp4_unit(raw: np.ndarray) -> np.ndarray:
    """MXFP4 GGUF blocks [.., 17] with every E8M0 byte 128 (ggml_e8m0_to_fp32_half: 1.0), so gguf-py's dequantization
    is llama.cpp's kvalues_mxfp4 itself, the doubled e2m1 values (the scales are _e8m0's, a separate path)."""
    raw = raw.copy()
    raw[..., 0] = 128
    return raw


def _bf16_bits(f: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(f, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)


def test_mxfp4_ptx_decode_is_gguf_kvalues():
    """gluon_mmq._e2m1x8's PTX (prmt table lookups, the integer bias, the bf16 spread and sub.bf16x2), run by a numpy
    interpreter of its own asm text (gluon_emu), on every byte value (4 a word, packed by _mx_words' PTX): byte i's
    bf16x2 o_i holds the low nibble's value (low half) and the high nibble's, bit for bit gguf-py's MXFP4
    dequantization at scale 1 (kvalues_mxfp4: 0 1 2 3 4 6 8 12 and their negatives; code 8 +0, as the shipped int8 ->
    bf16 of 0)."""
    import gluon_emu
    from gguf import quants as gq
    from gguf.constants import GGMLQuantizationType as GT
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")
    asm = gluon_emu.asm_of(gm._e2m1x8)
    assert asm.count("prmt.b32") == 8 and asm.count("sub.rn.bf16x2") == 4 and "cvt" not in asm
    b = np.arange(256).reshape(64, 4)                              # word r: bytes 4 r .. 4 r + 3
    w = gluon_emu.run(gluon_emu.asm_of(gm._mx_words), 1, b[:, 0], b[:, 1], b[:, 2], b[:, 3])[0]
    assert np.array_equal(w, (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24).astype(np.uint32))
    o = np.stack(gluon_emu.run(asm, 4, w), -1).reshape(256)       # byte 4 r + i's bf16x2
    blocks = _mxfp4_unit(np.concatenate([np.zeros((16, 1), np.uint8), np.arange(256, dtype=np.uint8).reshape(16, 16)],
                                        axis=1))
    dq = gq.dequantize(blocks, GT.MXFP4).astype(np.float32)       # [16, 32]: block r's element j < 16 = byte 16 r + j's
    lo, hi = dq[:, :16].reshape(256), dq[:, 16:].reshape(256)     # low nibble, 16 + j its high
    assert sorted(set(lo.tolist())) == [-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12]
    assert np.array_equal(o & 0xFFFF, _bf16_bits(lo)) and np.array_equal(o >> 16, _bf16_bits(hi))


@pytest.mark.parametrize("R", [64, 128])
def test_mxfp4_a_operand_is_gguf_dequant_in_perm_order(R):
    """The GGUF form's A operand of a K step, emulated from the source (gluon_emu: _mx_words' moves and PTX, _mx_a's
    moves and _e2m1x8's PTX, the lines checked): column k of row n is the doubled e2m1 value of element
    triton_mmq._perm(k) % 32 of block kb0 + k // 32 (the Triton kernel's BF tile order), gguf-py's dequantization at
    scale 1, bit for bit (R 128: FUSE's gate and up rows). PK's words equal these words (test_mma_pack), so PK's
    operand is this one."""
    import gluon_emu
    from gguf import quants as gq
    from gguf.constants import GGMLQuantizationType as GT
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")
    gluon_emu.mx_source_lines(gm)
    K = 128
    rng = np.random.default_rng(R)
    x = rng.standard_normal((R, K)).astype(np.float32)
    gg = _mxfp4_unit(gq.quantize(x, GT.MXFP4).reshape(R, K // 32, 17))
    dq = gq.dequantize(gg.reshape(R, -1), GT.MXFP4).astype(np.float32).reshape(R, K)
    k = np.arange(64)
    for kb0 in range(0, K // 32, 2):
        q = np.arange(32)                               # _fetch's byte column q: byte 1 + q % 16 of kb0 + q // 16
        v = gg[:, kb0 + q // 16, 1 + q % 16].astype(np.int64)
        a = gluon_emu.mx_a(gm, gluon_emu.mx_words(gm, v))
        want = _bf16_bits(dq[:, 32 * kb0 + 32 * (k // 32) + mq._perm(k) % 32])
        assert np.array_equal(a, want), kb0


def test_mxfp4_b_tile_runs_reach_perm_order():
    """MXFP4's B tile loaded in element order, 2 runs of 4 contiguous elements a thread's column (every form but FUSE's
    GP 0): GP 0's bf16 tile (_mx_x_load: row e is element e % 32 of block kb0 + e // 32) and GP >= 1's int32 words
    carried as loaded (_mx_x_words: row j, word u = elements 2 u, 2 u + 1 of activation row j, then _bf16x2 and a
    transpose in _conv_raw), moved to BL by _mx_x_perm (all emulated from their checked source lines): position k holds
    element triton_mmq._perm(k), the order of the weights' A operand and of the Triton kernel's BF tiles, so the MMA's B
    is the one _perm's loads gave (the same values, the same bits)."""
    import gluon_emu
    if not gm.HAVE_GLUON:
        pytest.skip("no Gluon")
    gluon_emu.mx_source_lines(gm)
    x = np.arange(64)[:, None] + 64 * np.arange(32)[None, :]         # [KB*32, KB*BM]: element e of column j
    k = np.arange(64)
    want = x[32 * (k // 32) + mq._perm(k) % 32]
    assert np.array_equal(gluon_emu.mx_x_perm(x), want)
    words = x[0::2].T | x[1::2].T << 16                               # [KB*BM, KB*16]: word u of column j
    assert np.array_equal(gluon_emu.mx_x_perm(gluon_emu.bf16x2(words).T), want)
