"""kernels/triton_mmq.py's bf16 mode (act_quant "bf16", Triton interpreter): the bf16 MMA of the integer quants
against a numpy reference of its float ops on gguf-py's blocks (mmq_helpers.weight_parts: checked against gguf-py's
dequantization), within float noise of the torch path (betelgeuse/kernels/torch_moe.py), a row's bits alone and
among 5 and 16 rows (split-K and walked chunks), word loads == byte loads, and the setting's plumbing."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import DIMS, E, chunk_sum, experts, layer_ref, moe_ref, run  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402

TYPES = pytest.mark.parametrize("qt", [8, 39, 12, 13], ids=["Q8_0", "MXFP4", "Q4_K", "Q5_K"])
CODE = {8: 0, 39: 4, 12: 5, 13: 6}
DIMS.setdefault(13, (256, 256))         # Q5_K: one super-block a row (mmq_helpers. table has the q8_1 types)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32 (torch's x.to(bfloat16))."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def ref_mm_bf16(x, wq, dw, mw, per: int = 32, kcb: int = 0, order: int = 1):
    """[M, N] of the bf16 MMA's float ops: x [M, K] bf16 values (float32), per block b of 32 in ascending K (order -1:
    descending, the wrong schedule): dot = sum_j wq x (products exact; the sum in float64, rounded once: the MMA's
    fp32 sum is within its noise), then acc = fma(dot, dw, acc), or with a min term acc + fma(dot, dw, -(mw sx)),
    sx = the block's sum of x. per = 64: one block's scales for two (wrong). kcb: blocks a K chunk,
    tot = 0 + p_0 + p_1 + ..."""
    M, N = x.shape[0], wq.shape[0]
    nb = x.shape[1] // per
    if kcb and kcb < nb:
        return chunk_sum(M, N, nb, per, kcb,
                         lambda c, b: ref_mm_bf16(x[:, c], wq[:, c], dw[:, b], mw[:, b], per, 0, order))
    acc = np.zeros((N, M), np.float32)
    for kb in list(range(nb))[::order]:
        c = slice(kb * per, (kb + 1) * per)
        dot = (wq[:, c].astype(np.float64) @ x[:, c].astype(np.float64).T).astype(np.float32)
        b = kb * per // 32
        p = dot.astype(np.float64) * dw[:, b][:, None].astype(np.float64)       # exact: the fma's product
        if mw.any():
            sx = x[:, c].astype(np.float64).sum(1).astype(np.float32)
            t = (p - (mw[:, b][:, None] * sx[None, :]).astype(np.float32)).astype(np.float32)
            acc = (acc + t).astype(np.float32)
        else:
            acc = (p + acc).astype(np.float32)
    return acc.T


def moe_ref_bf16(qt, raw, h, ids, w, **kw):
    """numpy reference of the layer in the bf16 mode: h as bf16 -> gate, up -> silu(g) u (float32, written as the
    engine's float32) -> as bf16 -> down -> the weighted sum over ranks in order."""
    return layer_ref(qt, raw, h, ids, w, bf16, lambda x, *wp: ref_mm_bf16(x, *wp, **kw))


def _case(qt, seed, T=6, k=2):
    raw = experts(qt, seed)
    rng = np.random.default_rng(seed + 1)
    h = rng.standard_normal((T, DIMS[qt][0])).astype(np.float32) * np.float32(0.1)
    h[:, 32:64] *= 4                                   # blocks of different scales
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    return raw, h, ids, w


@TYPES
def test_bf16_mma_matches_the_numpy_reference_of_its_float_ops(qt):
    """The layer (gate/up and down on the bf16 MMA) against moe_ref_bf16 within float noise (the fp32 block dots'
    order); the wrong schedule -- one block's scales for two -- is caught."""
    raw, h, ids, w = _case(qt, 20)
    got = run(qt, raw, h, ids, w, "bf16")
    want = moe_ref_bf16(qt, raw, h, ids, w)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale <= 2e-6, np.abs(got - want).max() / scale
    assert np.abs(moe_ref_bf16(qt, raw, h, ids, w, per=64) - want).max() / scale > 1e-2


@TYPES
def test_bf16_mma_within_float_noise_of_the_torch_path(qt):
    """Activations that are bf16 values (the engine's dtype on the GPU: the bf16 mode rounds nothing in h): the
    layer within 4e-3 of the torch path (exact float math on gguf's dequantized weights; the float schedules: 4e-7)
    -- the one rounding left is the down input's to bf16 (the engine here holds float32; 2^-9 relative an element,
    measured 1.6e-3 to 2.0e-3 of max|y|) -- and 4 times tighter than q8_1's int8 rounding of the same inputs
    (measured: 5 to 10 times); split over two expert groups (tiers), the same bits."""
    raw, h, ids, w = _case(qt, 30)
    h = bf16(h)
    ref = run(qt, raw, h, ids, w, "torch")
    got = run(qt, raw, h, ids, w, "bf16")
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    if qt != 13:                                       # (Q5_K has no q8_1 schedule)
        q81 = np.abs(run(qt, raw, h, ids, w, "q8_1") - ref).max() / np.abs(ref).max()
        assert rel * 4 < q81, (rel, q81)
    assert rel < 4e-3, rel
    assert np.array_equal(run(qt, raw, h, ids, w, "bf16", groups=[[1], [0, 2]]), got)


def _one_expert_layer(qt, seed: int, rows: int):
    """At DIMS 256 x 256 (the caller's patch): one expert's parts (experts(qt, seed)), `rows` tokens of h (seed + 1;
    elements 64..95 x4, so a block's scale stands out) all routed to it with weight 1 -> (raw, h, ids, w)."""
    raw = experts(qt, seed)
    h = np.random.default_rng(seed + 1).standard_normal((rows, 256)).astype(np.float32)
    h[:, 64:96] *= 4
    return raw, h, np.zeros((rows, 1), np.int64), np.ones((rows, 1), np.float32)


@TYPES
def test_bf16_rows_bits_do_not_depend_on_the_launch(qt):
    """H = F = 256 (8 blocks), chunks of KCB = 2 blocks: token 0 alone (the 1-row bucket: split-K over programs,
    the tile's last program sums the chunks), among 5 and among 16 rows (chunks walked) -- the same bits, which
    are the numpy reference's chunked sums (within float noise); word loads (WL 1) and byte loads (WL 0) the same
    bits (MXFP4: both in the word loads' element order)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DIMS, qt, (256, 256))
        raw, h, ids, w = _one_expert_layer(qt, 40, 16)
        outs = {}
        for wl in (0, 1):
            mp.setitem(mq.TYPE_CONFIG, CODE[qt], {"KCB": 2, "WL": wl, "PF": wl})
            for n in (1, 5, 16):
                outs[wl, n] = run(qt, raw, h[:n], ids[:n], w[:n], "bf16")
        assert all(np.array_equal(outs[0, 16][0], o[0]) for o in outs.values())
        assert all(np.array_equal(outs[0, 16][:5], outs[wl, n][:5]) for wl in (0, 1) for n in (5, 16))
        want = moe_ref_bf16(qt, raw, h, ids, w, kcb=2)
        assert np.abs(outs[1, 16] - want).max() / np.abs(want).max() <= 2e-6



@pytest.mark.parametrize("act_quant", ["q8_1", "bf16"])
@pytest.mark.parametrize("T", [1, 7], ids=["rows1", "rows16"])
def test_experts_at_negative_offsets_are_computed(act_quant, T):
    """Issue 23: an expert's offset below the pool (negative: decode's at-hand table names flex chunks and host
    slots there, kernels.moe.Group) is an expert like any other; only -1 means "not in this group". The MMA kernels
    skipped every negative offset (base >= 0, where triton_moe's test base != -1), so such experts' rows of y kept
    torch.empty's bytes: NaN or stale values on CUDA whenever a flex chunk lay below the pool. MXFP4 (ds4's experts;
    q8_1's one-row bucket takes the MV schedule, bf16's the MMA), experts 0 and 1 below the pool: the numpy
    reference of the mode's float ops, and the bits of the same launch with every expert in the pool."""
    qt = 39
    raw = experts(qt, 50)
    rng = np.random.default_rng(51)
    h = rng.standard_normal((T, DIMS[qt][0])).astype(np.float32) * np.float32(0.1)
    ids = np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.int64)
    ids[0] = (0, 1)                                    # a row whose experts both lie below the pool
    w = rng.random((T, 2)).astype(np.float32)
    got = run(qt, raw, h, ids, w, act_quant, below=2)
    want = (moe_ref_bf16 if act_quant == "bf16" else moe_ref)(qt, raw, h, ids, w)
    assert np.abs(got - want).max() / np.abs(want).max() <= 2e-6, np.abs(got - want).max()
    assert np.array_equal(got, run(qt, raw, h, ids, w, act_quant))

def test_bf16_setting_and_plumbing():
    """engine.act_quant takes "bf16"; MoEKernels runs the MMQ types' parts on the bf16 MMA with it (route() makes
    h's bf16 tile, and the block sums only where gate/up is Q4_K), the float schedules with "off"; prepare_bf16
    keeps a bf16 input as it is and its sums are the blocks' sums."""
    from betelgeuse.errors import BetelgeuseError
    from betelgeuse.kernels.moe import MoEKernels
    from betelgeuse.config import EngineConfig
    assert EngineConfig(model_path="m.gguf", act_quant="bf16").act_quant == "bf16"
    with pytest.raises(BetelgeuseError, match="act_quant"):
        EngineConfig(model_path="m.gguf", act_quant="fp8")
    starts = torch.zeros(1, 3, 3, dtype=torch.int64)
    for gg, want_sums in ((8, False), (12, True), (13, True)):
        k = MoEKernels("triton", 3, 256, starts, [(gg, 8)], 16, act_quant="bf16")
        assert k.mmq_parts(0, 256) == (True, True)
        r = k.route(torch.randn(2, 256), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
        assert r.hq[0].dtype == torch.bfloat16 and r.hq[1] is None and (r.hq[2].shape == (2, 8)) == want_sums
    assert MoEKernels("triton", 3, 256, starts, [(8, 8)], 16, act_quant="off").mmq_parts(0, 256) == (False, False)
    assert MoEKernels("triton", 3, 256, starts, [(13, 13)], 16, act_quant="q8_1").mmq_parts(0, 256) == (False, False)
    # auto: the bf16 MMA for Q8_0 and MXFP4 only (the types the device measured faster), Q4_K / Q5_K stay float
    for gg, dd, want in ((8, 39, (True, True)), (12, 8, (False, True)), (13, 12, (False, False))):
        assert MoEKernels("triton", 3, 256, starts, [(gg, dd)], 16, act_quant="auto").mmq_parts(0, 256) == want
    assert EngineConfig(model_path="m.gguf", act_quant="auto").act_quant == "auto"
    x = torch.randn(3, 96).to(torch.bfloat16)
    xb, d, s = mq.prepare_bf16(x)
    assert xb is x and d is None
    assert torch.allclose(s, x.float().view(3, 3, 32).sum(-1), rtol=1e-6, atol=1e-6)


def test_bf16_compiles_to_bf16_tensor_core_mma_for_sm90_without_spills():
    """triton.compile for sm_90 without a GPU (in a child without TRITON_INTERPRET): each type's gate_up at the 1-row
    bucket (split-K) and down at the 16-row one run the bf16 wgmma (HGMMA ...F32.BF16 in the SASS) of ONE instruction
    shape, m64 n32 k16 (BN 64, N = KB 2 x BM 16) in both buckets -- the fixed order of the fp32 block dots -- and
    nothing spills."""
    from mmq_helpers import compile_reports
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4, 5, 6):\n for w, b in (('gate_up', 1), ('down', 16)):\n"
            "  print(json.dumps(mq.compile_report(w, qt, bucket=b, hints=True, bf=True)))\n")
    reports = compile_reports(["-c", code], timeout=120)
    assert len(reports) == 8, reports
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0 and r["regs"] <= 255, r
        assert set(r["imma"]) == {"HGMMA.64x32x16.F32.BF16"}, r
        assert [m for m in r["mma"] if "mma_async" in m] == ["wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"], r


@TYPES
def test_bf16_fused_gate_up_and_bn128_are_schedule_keys(qt):
    """FUSE 1 (gate_up's gate and up rows as one weight side of 2 BN rows: one MMA of M = 2 BN a K step against one
    block-diagonal activation tile) and BN 128 at 8 warps (a warpgroup per 64 rows) -- kernel_roofline's
    BF_CANDIDATES: fewer instructions per weight byte in tests/scripts/sass_profile.py -- give every row the bits of
    the shipped schedule (each output's MMA is the same m64 n32 k16 instruction on the same A row and B column, its
    float ops its own), alone (split-K) and among 5 rows; and it is the numpy reference's layer (within float
    noise)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DIMS, qt, (256, 256))
        raw, h, ids, w = _one_expert_layer(qt, 60, 5)
        outs = {}
        for i, c in enumerate(({}, {"FUSE": 1}, {"BN": 128, "num_warps": 8})):
            mp.setitem(mq.TYPE_CONFIG, CODE[qt], {"KCB": 2, **c})
            for n in (1, 5):
                outs[i, n] = run(qt, raw, h[:n], ids[:n], w[:n], "bf16")
        base = outs[0, 5]
        assert all(np.array_equal(o, base[:o.shape[0]]) for o in outs.values())
        want = moe_ref_bf16(qt, raw, h, ids, w, kcb=2)
        assert np.abs(base - want).max() / np.abs(want).max() <= 2e-6


def test_bf16_b_tile_loaded_as_it_is_equals_the_block_diagonal_select():
    """_bd_tile (the bf16 MMA's B tile [KB*32, KB*BM] loaded directly, the zeros masked off) holds exactly the values
    of the tile the int8 MMA builds -- xb = where(block i == k // 32, row m's tile, 0), reshaped and transposed --
    for every KB, each type's element order (MXFP4: _perm) and masked rows, at a K step past block 0: the same MMA
    operands, so the same bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiles(x_ptr, mr_ptr, a_ptr, b_ptr, K, kb0, QT: tl.constexpr, KB: tl.constexpr, BM: tl.constexpr):
        m = tl.arange(0, BM)
        mr = tl.load(mr_ptr + m) != 0
        xoff = m * K
        c = tl.arange(0, KB * 32)
        xc = mq._perm(c) if QT == 4 else c
        xq = tl.load(x_ptr + xoff[:, None] + kb0 * 32 + xc[None, :], mask=mr[:, None], other=0.0)
        i3 = tl.arange(0, KB)[:, None, None]
        xb = tl.where(i3 == (c // 32)[None, None, :], xq[None, :, :], tl.zeros_like(xq)[None, :, :])
        want = tl.trans(tl.reshape(xb, (KB * BM, KB * 32)))
        got = mq._bd_tile(x_ptr, xoff, mr, kb0, QT, KB)
        j = tl.arange(0, KB * BM)
        tl.store(a_ptr + c[:, None] * (KB * BM) + j[None, :], want)
        tl.store(b_ptr + c[:, None] * (KB * BM) + j[None, :], got)

    BM, K = 16, 512
    x = torch.randn(BM, K).to(torch.bfloat16)
    mr = torch.tensor([1, 0, 1, 1] * 4, dtype=torch.int32)
    for qt in (0, 4):
        for kb in (1, 2, 4):
            a = torch.full((kb * 32, kb * BM), 7.0, dtype=torch.bfloat16)
            b = a.clone()
            tiles[(1,)](x, mr, a, b, K, 4, QT=qt, KB=kb, BM=BM)
            assert torch.equal(a, b), (qt, kb)
            assert (b != 0).sum() == 12 * 32 * kb                   # 12 live rows, one block a column group


def test_bf16_candidates_compile_to_the_shipped_instruction_for_sm90():
    """deploy/device/kernel_roofline.py's BF_CANDIDATES -- FUSE 1 (gate_up: M = 128 at 4 warps) and BN 128 at 8
    warps (a warpgroup per 64 rows) -- compiled for sm_90 (Q8_0 and MXFP4, the 1-row bucket) keep the shipped
    schedule's one instruction, HGMMA m64 n32 k16 (what makes them schedule keys on the GPU: bits checked there),
    and spill nothing; 8 warps at BN 64 would split N (m64 n16 k16: another shape, never a candidate)."""
    from mmq_helpers import compile_reports
    code = ("import json\nfrom betelgeuse.kernels import triton_mmq as mq\n"
            "for qt in (0, 4):\n"
            " for w, o in (('gate_up', {'FUSE': 1}), ('gate_up', {'BN': 128, 'num_warps': 8}),"
            " ('down', {'BN': 128, 'num_warps': 8}), ('down', {'num_warps': 8})):\n"
            "  print(json.dumps(mq.compile_report(w, qt, bucket=1, hints=True, bf=True, over=o)))\n")
    reports = compile_reports(["-c", code], timeout=120)
    assert len(reports) == 8, reports
    for r in reports:
        assert r["ptxas_rc"] == 0 and r["spill_bytes"] == 0, r
        want = "HGMMA.64x16x16.F32.BF16" if r["config"]["BN"] == 64 and r["config"]["num_warps"] == 8 else \
            "HGMMA.64x32x16.F32.BF16"
        assert set(r["imma"]) == {want}, (r["config"], r["imma"])
