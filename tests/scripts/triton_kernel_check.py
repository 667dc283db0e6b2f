"""Run under TRITON_INTERPRET=1 (tests/kernels/test_kernels.py): the Triton expert kernels against the torch reference.

For each weight type the kernels read (F32, F16, BF16, Q8_0, MXFP4 and the K-/i-quants): random experts (gguf-py's
quantizer where it has one, else random valid blocks: every code, sign and scale pattern), random routing; prints
one JSON line with, per type: how far the weights the kernels multiply (triton_quants.wdot against the identity)
are from the torch path's (= gguf-py's) values, relative to the largest (float32 rounding: ~1e-7), the max |diff| of the fused kernels against the torch path (float32
compute), and the bit-for-bit property the engine relies on: a row alone equals the same row inside a full
launch (row invariance); for the types in FULL also that two groups that split the experts equal one group
(tier invariance) and that the clamped SwiGLU matches its torch formula. Q4_K also runs in bfloat16 (the GPU's dtype: the tile rounded to bf16).

    triton_kernel_check.py [--config NAME] [TYPE ...]       # default: every type, the committed launch constants

--config chunked runs the kernels with split-K: K in chunks (KC) whose partials are summed in chunk order, the
1-row bucket's launches one program per chunk (partials in a workspace, summed by each tile's last program), the
16-row bucket's one program walking the chunks, at different output blocks per program; so the row-invariance
check (a row alone is in bucket 1, the full launch in bucket 16) also checks that both schedules give the same
bits. --config chunked16 splits the 16-row bucket too (and walks the 1-row one).
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from interp_dot import install as _row_independent_dots  # noqa: E402  (tests/scripts: the script's own dir)
from betelgeuse.gguf.quants import dequantize  # noqa: E402
from betelgeuse.gguf.quants_synth import quantize  # noqa: E402
from betelgeuse.gguf.qtypes import block_size, row_nbytes  # noqa: E402
from betelgeuse.kernels import triton_moe, triton_quants  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402

# the group split and the clamped SwiGLU (the kernels' epilogue and grid, not the dequantization) on these
FULL = ("Q8_0", "MXFP4", "Q4_K", "IQ2_XXS")
TYPES = ["Q8_0", "F16", "BF16", "F32", "MXFP4", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XXS",
         "IQ2_XS", "IQ3_XXS"]


_row_independent_dots()

def experts_of(qt: int, E: int, H: int, FF: int, g: torch.Generator):
    """E experts' (gate [FF,H], up [FF,H], down [H,FF]) raw bytes: gguf-py's quantizer of random values where it has
    one (expert 0 of MXFP4: random blocks, every code and exponents 114..127), else random valid blocks."""
    rng = np.random.default_rng(qt)
    shapes = [(FF, H), (FF, H), (H, FF)]
    out = []
    for e in range(E):
        parts = []
        for k, shp in enumerate(shapes):
            std = 1.0 if k < 2 else 0.1
            if qt == 39 and e == 0:
                blocks = torch.randint(0, 256, (shp[0] * shp[1] // 32, 17), generator=g, dtype=torch.uint8)
                blocks[:, 0] = torch.randint(114, 128, (blocks.shape[0],), generator=g, dtype=torch.uint8)
                parts.append(blocks.reshape(-1))
                continue
            x = (torch.randn(shp, generator=g) * std).numpy()
            raw = quantize(x, qt, shp, rng, std)
            parts.append(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy()))
        out.append(parts)
    return out


def set_config(qt: int, name: str, super_block: bool):
    """The tuning of `name` for kernel type qt (see the module doc), at the test models' K (256, or 64 / 96)."""
    code = triton_quants.QT_CODES[qt]
    triton_moe.TUNING.pop(code, None)
    if name == "default":
        return
    if name == "mv":        # the decode schedule: 1 row x 32 / 64 columns a program (bucket 1), 16 x 64 / 32 (16)
        triton_moe.TUNING[code] = {"reduce": {"MV": 1},
                                   1: {"BM_MV": 1, "BN": 32, "BN_GATE_UP": 64, "num_warps": 1, "num_stages": 1},
                                   16: {"BM_MV": 16, "BN": 64, "BN_GATE_UP": 32, "num_warps": 4, "num_stages": 2}}
        return
    if name == "mvchunk":   # the decode schedule in K chunks of 128 (2 a row): split over programs (bucket 1), walked
        triton_moe.TUNING[code] = {"reduce": {"MV": 1, "KC": 128},
                                   1: {"BM_MV": 1, "BN": 32, "BN_GATE_UP": 64, "SPLIT": 1, "num_warps": 1,
                                       "num_stages": 1},
                                   16: {"BM_MV": 16, "BN": 64, "BN_GATE_UP": 32, "SPLIT": 0, "num_warps": 4,
                                        "num_stages": 2}}
        return
    split, walk = ({"SPLIT": 1, "BN": 16, "BN_GATE_UP": 32, "num_warps": 2, "num_stages": 2},
                   {"SPLIT": 0, "BN": 64, "BN_GATE_UP": 64, "num_warps": 4, "num_stages": 3})
    if name == "chunked16":
        split, walk = {**walk, "SPLIT": 1, "BN": 32}, {**split, "SPLIT": 0}
    # 2 chunks of 256; 2 of 64, 3 of 96 (chunked16: 1 of 64, 2 of 96, the first two K steps long)
    reduce = {"BK": 128, "KC": 128} if super_block else {"KC": 64 if name == "chunked16" else 32}
    triton_moe.TUNING[code] = {"reduce": reduce, 1: split, 16: walk}


def check(name: str, config: str = "default") -> dict:
    qt = int(QT[name])
    g = torch.Generator().manual_seed(qt)
    super_block = block_size(qt)[0] == 256
    set_config(qt, config, super_block)
    # F = 96: a partial 32/64-column block; T = 21: a partial 16-row block (K-quant rows are 256-multiples, so the
    # super-block types run the smallest such experts, two of them: the interpreter's time is per program)
    E, H, FF, T, K = (2, 256, 256, 9, 2) if super_block or config.startswith("mv") else (6, 64, 96, 21, 3)
    # the row alone (T*k <= E experts: the 1-row bucket; the full launch: the 16-row bucket)
    assert triton_moe.bucket_of(K, E) == 1 and triton_moe.bucket_of(T * K, E) == 16
    raw = experts_of(qt, E, H, FF, g)
    shapes = [(FF, H), (FF, H), (H, FF)]
    deq = [[dequantize(r, qt, s) for r, s in zip(rs, shapes)] for rs in raw]
    # the weights the kernels multiply (the first 16 rows of gate and down), at each K step a config may use (BK 256
    # and 128 for the 256-element types): gguf-py's to the last bit or two of float32 (one fused rounding), relative
    # to the rows' largest; the default config only (the dequantization does not depend on the schedule: the split
    # and mv configs' tests check the products)
    tile_err = 0.0 if config != "default" else max(float((triton_quants.dequantize(r[:16 * r.numel() // s[0]], qt, (16, s[1]), bk=bk) - d[:16]).abs().max()
                         / d[:16].abs().max())
                   for k, (r, s, d) in enumerate(zip(raw[0], shapes, deq[0])) if k != 1
                   for bk in (((256, 128) if k == 0 else (256,)) if super_block else (32,)))
    h = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    full = Group(None, base, torch.from_numpy(base))

    def kern(backend, limit=None):
        return MoEKernels(backend, E, FF, starts[None], [(qt, qt)], 16, act_limit=limit,
                          weights_fn=lambda b, l, e: deq[e])

    def run(k, hh, ii, ww, groups):
        r = k.route(hh, ii, ww)
        for grp in groups:
            k.apply(r, 0, pool, grp, slot)
        return k.combine(r)
    tk = kern("triton")
    o_t = run(tk, h, ids, w, [full])
    o_r = run(kern("torch"), h, ids, w, [full])
    alone = run(tk, h[5:6], ids[5:6], w[5:6], [full])
    res = {"tile_err": tile_err, "max_abs": float((o_t - o_r).abs().max()), "scale": float(o_r.abs().max()),
           "K": H + FF, "row_invariant": bool(torch.equal(alone[0], o_t[5]))}
    if config == "mv":      # the schedule really ran: it can take these launches, and its bits are not the MMA path's
        code = triton_quants.QT_CODES[qt]
        aligned = slot % 16 == 0 and bool((torch.as_tensor(starts) % 16 == 0).all())
        res["mv_taken"] = all(triton_moe.mv_ok(code, k, row_nbytes(qt, k), aligned) for k in (H, FF))
    if config == "mv" and name == "Q8_0":   # the dispatch (MV and mv_ok) is the same for every type: one type
        res["run_to_run"] = bool(torch.equal(run(tk, h, ids, w, [full]), o_t))
        tun = triton_moe.TUNING.pop(code)
        res["differs_from_mma"] = not torch.equal(run(kern("triton"), h, ids, w, [full]), o_t)
        triton_moe.TUNING[code] = tun
    if config == "mvchunk":  # the chunks ran (the schedule took them, and its bits are not the unchunked schedule's)
        code = triton_quants.QT_CODES[qt]
        aligned = slot % 16 == 0 and bool((torch.as_tensor(starts) % 16 == 0).all())
        res["mv_taken"] = all(triton_moe.mv_ok(code, k, row_nbytes(qt, k), aligned, 128) for k in (H, FF))
        res["run_to_run"] = bool(torch.equal(run(tk, h, ids, w, [full]), o_t))
        triton_moe.TUNING[code]["reduce"]["KC"] = 0
        res["differs_from_unchunked"] = not torch.equal(run(kern("triton"), h, ids, w, [full]), o_t)
        triton_moe.TUNING[code]["reduce"]["KC"] = 128
        return res
    if name not in FULL or (config == "mv" and name != "Q4_K"):     # mv: the epilogue's clamp on one type
        return res
    b1, b2 = base.copy(), base.copy()
    b1[::2], b2[1::2] = -1, -1
    split = run(tk, h, ids, w, [Group(None, b, torch.from_numpy(b)) for b in (b2, b1)])
    # clamped SwiGLU (DeepSeek-V4): min(gate, L), clamp(up, -L, L)
    lim = 1.5
    o_l = run(kern("triton", lim), h, ids, w, [full])
    want = torch.zeros(T, H)
    for t in range(T):
        for r in range(K):
            gw, uw, dw = deq[int(ids[t, r])]
            a = F.silu(torch.clamp(h[t] @ gw.T, max=lim)) * torch.clamp(h[t] @ uw.T, -lim, lim)
            want[t] += w[t, r] * (a @ dw.T)
    res.update(split_equal=bool(torch.equal(split, o_t)), limit_max_abs=float((o_l - want).abs().max()),
               limit_scale=float(want.abs().max()))
    return res


args = sys.argv[1:]
cfg = "default"
if args[:1] == ["--config"]:
    cfg, args = args[1], args[2:]
print(json.dumps({name: check(name, cfg) for name in (args or TYPES)}))
