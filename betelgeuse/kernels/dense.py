"""The library's dense products of deepseek4's ops (model/deepseek4.py TorchOps.linears / grouped_linear, the CPU's
exact path), here beneath both ops classes: kernels/triton_ds4.py TritonOps takes them past its rows cap (prefill
chunks) or with engine.decode_gemv off (gemv_rows 0)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w) (x [T, K], w [N, K]), or the same matmul written into out [T, N] (a lane buffer's column range:
    the library's gemm writes it at its row stride, no copy)."""
    return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)


def linears(x, ws, outs=None, scales=None) -> list:
    """x [T, K] -> [x . w^T for w in ws] ([T, N_j] in x's dtype; scales[j] not None: that product as float32 times
    scales[j], the indexer's head weights). outs[j] not None: written there (linear's out)."""
    res = []
    for w, o, s in zip(ws, outs or (None,) * len(ws), scales or (None,) * len(ws)):
        if s is None:
            res.append(linear(x, w, o))
        else:
            y = F.linear(x, w).float()
            res.append(y * s if o is None else torch.mul(y, s, out=o))
    return res


def grouped_linear(x, w, out=None):
    """x [G, T, K] (any strides), w [G, N, K] -> [G, T, N] = x_g . w_g^T per group g (torch.bmm; out: written there,
    any strides: the library's strided batched gemm)."""
    return torch.bmm(x, w.transpose(1, 2), out=out)
