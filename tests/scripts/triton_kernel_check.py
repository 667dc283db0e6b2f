"""Run under TRITON_INTERPRET=1 (tests/kernels/test_kernels.py): the Triton expert kernels against the torch reference.

For each weight type: random experts quantized by gguf-py, random routing; prints one JSON line with the
max |diff| against the torch path (float32 compute), and three bit-for-bit properties the engine relies on:
a row alone equals the same row inside a full launch (row invariance), two groups that split the experts
equal one group (tier invariance), and the clamped SwiGLU matches its torch formula.
"""

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from betelgeuse.gguf.quants import dequantize  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402

E, H, FF, T, K = 6, 64, 96, 21, 3     # F = 96: a partial 64-column block; T = 21: a partial 16-row block
out = {}
for name, qt in (("Q8_0", 8), ("F16", 1), ("BF16", 30), ("F32", 0), ("MXFP4", 39)):
    g = torch.Generator().manual_seed(qt)
    W = [[torch.randn(FF, H, generator=g), torch.randn(FF, H, generator=g), torch.randn(H, FF, generator=g) * 0.1]
         for _ in range(E)]

    def q(x):
        if qt in (8, 39):
            return torch.from_numpy(gq.quantize(x.numpy(), QT(qt)).view(np.uint8).reshape(-1).copy())
        if qt == 30:
            return x.bfloat16().contiguous().view(torch.uint8).reshape(-1)
        return (x.half() if qt == 1 else x).contiguous().view(torch.uint8).reshape(-1)
    raw = [[q(m) for m in ws] for ws in W]
    if qt == 39:
        # gguf's quantizer never writes code 8 (-0) and keeps exponents near 127: expert 0 gets random blocks
        # (every code, exponents 114..127) so the kernel's code and scale tables are checked whole
        for i, m in enumerate(W[0]):
            blocks = torch.randint(0, 256, (m.numel() // 32, 17), generator=g, dtype=torch.uint8)
            blocks[:, 0] = torch.randint(114, 128, (blocks.shape[0],), generator=g, dtype=torch.uint8)
            raw[0][i] = blocks.reshape(-1)
        codes = torch.cat([torch.cat([r.view(-1, 17)[:, 1:] & 15, r.view(-1, 17)[:, 1:] >> 4]) for r in raw[0]])
        assert torch.bincount(codes.reshape(-1).long(), minlength=16).min() > 0
    deq = [[dequantize(r, qt, tuple(m.shape)) for r, m in zip(rs, ws)] for rs, ws in zip(raw, W)]
    h = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    tk = MoEKernels("triton", E, FF, starts[None], [(qt, qt)], 16)
    tr = MoEKernels("torch", E, FF, starts[None], [(qt, qt)], 16, weights_fn=lambda b, l, e: deq[e])
    full = Group(None, base, torch.from_numpy(base))

    def run(kern, hh, ii, ww, groups):
        r = kern.route(hh, ii, ww)
        for grp in groups:
            kern.apply(r, 0, pool, grp, slot)
        return kern.combine(r)
    o_t = run(tk, h, ids, w, [full])
    o_r = run(tr, h, ids, w, [full])
    alone = run(tk, h[5:6], ids[5:6], w[5:6], [full])
    b1, b2 = base.copy(), base.copy()
    b1[::2], b2[1::2] = -1, -1
    split = run(tk, h, ids, w, [Group(None, b, torch.from_numpy(b)) for b in (b2, b1)])
    # clamped SwiGLU (DeepSeek-V4): min(gate, L), clamp(up, -L, L)
    lim = 1.5
    tl_ = MoEKernels("triton", E, FF, starts[None], [(qt, qt)], 16, act_limit=lim)
    o_l = run(tl_, h, ids, w, [full])
    want = torch.zeros(T, H)
    for t in range(T):
        for r in range(K):
            gw, uw, dw = deq[int(ids[t, r])]
            a = F.silu(torch.clamp(h[t] @ gw.T, max=lim)) * torch.clamp(h[t] @ uw.T, -lim, lim)
            want[t] += w[t, r] * (a @ dw.T)
    out[name] = {"max_abs": float((o_t - o_r).abs().max()), "scale": float(o_r.abs().max()),
                 "row_invariant": bool(torch.equal(alone[0], o_t[5])), "split_equal": bool(torch.equal(split, o_t)),
                 "limit_max_abs": float((o_l - want).abs().max()), "limit_scale": float(want.abs().max())}
print(json.dumps(out))
