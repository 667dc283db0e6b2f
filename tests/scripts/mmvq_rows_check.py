"""Run under TRITON_INTERPRET=1 (tests/kernels/test_kernels.py): the decode schedule's many-rows program.

triton_mmvq's programs load and decode a K step of BN weight rows once and apply it to BM activation rows in turn,
each row with its own accumulator and the same fused multiply-adds and pairwise tree as a program of one row. For
each type given (default Q8_0, MXFP4, at K 128; Q4_K, Q5_K at K 256, one super-block): one expert with 16 rows (16
tokens, top-1) and a second one with 3, run with BM = 3 and 16 rows a program (a different BN each) on the first 1
or 3 and all 16 tokens of the launch (CASES); every output row must be bit-identical to the same row of the
1-row-a-program full launch, and within float noise of gguf-py's dequantized experts (numpy, float64 SwiGLU).
Prints one JSON line {type: {"mismatch": [[BM, tokens], ...], "mv_taken", "max_abs", "scale", "K"}}.

    mmvq_rows_check.py [TYPE ...]
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from betelgeuse.gguf.qtypes import row_nbytes  # noqa: E402
from betelgeuse.gguf.quants_synth import quantize  # noqa: E402
from betelgeuse.kernels import triton_moe  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402
from betelgeuse.kernels.triton_quants import QT_CODES  # noqa: E402

E, T = 2, 19
KS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q3_K": 256, "Q2_K": 256}        # H = FF = K: one step of a super-block type; else 128: one MXFP4 step, two Q8_0
PROGRAMS = {1: 64, 3: 32, 16: 128}     # rows a program (BM_MV) -> output rows a program (BN)
# (BM, tokens), each against the same rows of the 1-row-a-program launch of 16 tokens: one row in a block of 3,
# 16 + 3 rows in blocks of 3 (the last of expert 0 partial), 3 rows in a block of 16, 16 + 3 rows in blocks of 16
# (expert 1's partial); BM = 1 on fewer tokens is the decode schedule's row invariance (test_kernels.py's
# test_decode_schedule_matches_torch_and_is_row_invariant)
CASES = ((3, 1), (3, 16), (16, 3), (16, 16))


def check(name: str) -> dict:
    qt = int(QT[name])
    code = QT_CODES[qt]
    H = FF = KS.get(name, 128)
    rng = np.random.default_rng(qt)
    shapes = [(FF, H), (FF, H), (H, FF)]
    raw = [[quantize(rng.standard_normal(s).astype(np.float32) * (1.0 if k < 2 else 0.1), qt, s, rng, 1.0)
            for k, s in enumerate(shapes)] for _ in range(E)]
    parts = [[torch.from_numpy(np.ascontiguousarray(r).view(np.uint8).reshape(-1).copy()) for r in rs] for rs in raw]
    pool, starts, base, slot = pack_experts(lambda e: parts[e], range(E), E, "cpu")
    grp = Group(None, base, torch.from_numpy(base))
    g = torch.Generator().manual_seed(qt)
    h = torch.randn(T, H, generator=g)
    ids = torch.tensor([[0]] * 16 + [[1]] * 3)          # expert 0: 16 rows (tokens 0..15), expert 1: 3
    w = torch.rand(T, 1, generator=g)

    def run(bm: int, n: int) -> torch.Tensor:
        sched = {"BM_MV": bm, "BN": PROGRAMS[bm], "BN_GATE_UP": PROGRAMS[bm], "num_warps": 1, "num_stages": 1}
        triton_moe.TUNING[code] = {"reduce": {"MV": 1}, 1: sched, 16: sched}
        k = MoEKernels("triton", E, FF, starts[None], [(qt, qt)], 16)
        rows = list(range(n)) + ([16, 17, 18] if n == 16 else [])     # the 16-token launch: both experts
        r = k.route(h[rows], ids[rows], w[rows])
        k.apply(r, 0, pool, grp, slot)
        return k.combine(r)
    ref = run(1, 16)
    mismatch = [[bm, n] for bm, n in CASES if not torch.equal(run(bm, n), ref if n == 16 else ref[:n])]
    # gguf-py's dequantization, float64 SwiGLU experts
    deq = [[gq.dequantize(r, qt).reshape(s).astype(np.float64) for r, s in zip(rs, shapes)] for rs in raw]
    want = np.zeros((T, H))
    for t in range(T):
        gw, uw, dw = deq[int(ids[t, 0])]
        x = h[t].double().numpy()
        a, u = gw @ x, uw @ x
        want[t] = float(w[t, 0]) * ((a / (1.0 + np.exp(-a)) * u) @ dw.T)
    got = ref.double().numpy()
    aligned = slot % 16 == 0 and bool((torch.as_tensor(starts) % 16 == 0).all())
    return {"mismatch": mismatch, "max_abs": float(np.abs(got - want).max()), "scale": float(np.abs(want).max()),
            "K": H + FF, "mv_taken": all(triton_moe.mv_ok(code, kk, row_nbytes(qt, kk), aligned) for kk in (H, FF))}


print(json.dumps({name: check(name) for name in (sys.argv[1:] or ["Q8_0", "MXFP4"])}))
