#!/usr/bin/env python3
"""Issue 23: the expert kernels of every act_quant mode compute experts at negative offsets (below the pool).

    python3 deploy/device/check_mmq_offsets.py                  # cuda; a few seconds
    TRITON_INTERPRET=1 python3 deploy/device/check_mmq_offsets.py cpu

Decode's at-hand table (worker/at_hand.py) names flex chunks and host slots below the slot pool with negative byte
offsets; only -1 means "not in this group" (kernels.moe.Group). Four random MXFP4 experts (ds4's type), H 256,
F 128, 3 tokens x 2 ranks, through MoEKernels("triton") with act_quant bf16, q8_1 and off: once with every expert in
the pool, once with the pool starting at expert 2's slot (experts 0 and 1 at negative offsets). PASS per mode: the
output finite and bit-identical to the in-pool launch's. Before the fix the bf16 / q8_1 kernels skipped experts 0
and 1, whose rows of y kept torch.empty's bytes (NaN on CUDA when they happen to hold one). Exit status 1 on a FAIL.
"""

from __future__ import annotations

import sys

import _common  # noqa: F401  first: puts this checkout on sys.path
import torch

from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts


def main() -> int:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    g = torch.Generator().manual_seed(0)
    E, H, F, k = 4, 256, 128, 2

    def part(n: int, K: int) -> torch.Tensor:        # MXFP4 [n, K]: E8M0 118..121, random codes (17-byte blocks)
        b = torch.randint(0, 256, (n * K // 32, 17), generator=g, dtype=torch.uint8)
        b[:, 0] = 118 + b[:, 0] % 4
        return b.reshape(-1)

    pool, starts, base, slot = pack_experts(lambda e: [part(F, H), part(F, H), part(H, F)], range(E), E, dev)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32        # the engine's dtype there
    h = torch.randn(3, H, generator=g).to(dev, dtype)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], device=dev)           # token 0: both experts below the pool
    w = torch.rand(3, k, generator=g).to(dev, dtype)
    ok = True
    for aq in ("bf16", "q8_1", "off"):
        outs = []
        for below in (0, 2):                        # the pool the kernels get starts at expert `below`'s slot
            kern = MoEKernels("triton", E, F, starts[None], [(39, 39)], 16, act_quant=aq)
            b = base - below * slot
            r = kern.route(h, ids, w)
            kern.apply(r, 0, pool[below * slot:], Group(None, b, torch.from_numpy(b).to(dev)), slot)
            outs.append(kern.combine(r).float().cpu())
        good = bool(outs[1].isfinite().all()) and torch.equal(outs[0], outs[1])
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} act_quant {aq}: experts below the pool: finite "
              f"{bool(outs[1].isfinite().all())}, bit-identical to the in-pool launch {torch.equal(outs[0], outs[1])}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
