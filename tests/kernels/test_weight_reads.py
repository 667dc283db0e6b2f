"""MoEKernels.weight_reads: the bytes a launch reads per in-place expert, its list path (decode's few experts, summed
in Python) against the definition (module doc of kernels/moe.py): the triton kernels read an expert once per row
block of BM rows, ceil(rows / BM); the torch kernels once per expert with rows. Fails with the list path's sums
changed (a row block rounded down, an expert of no rows counted)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from betelgeuse.kernels.moe import MoEKernels

Q8_0 = 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weight_reads_lists_are_the_definition(backend):
    E, L = 16, 2
    starts = torch.zeros((L, E, 3), dtype=torch.int64)
    kern = MoEKernels(backend, E, 64, starts, [(Q8_0, Q8_0)] * L, sub_batch=8)
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(200):
        n_rows = int(rng.integers(1, 80))
        rows = [int(x) for x in rng.integers(0, 40, int(rng.integers(0, 6)))]
        for layer in range(L):
            if backend == "triton":
                from betelgeuse.kernels import triton_moe as tm
                c = tm.config(tm.QT_CODES[Q8_0], tm.bucket_of(n_rows, E))
                bm = c["BM_MV"] if c["MV"] else c["BM"]
                seen.add(bm)
                want = sum(math.ceil(x / bm) for x in rows)
            else:
                want = sum(1 for x in rows if x)
            got = kern.weight_reads(layer, rows, n_rows)
            assert type(got) is int and got == want, (backend, rows, n_rows, got, want)
            assert kern.weight_reads(layer, np.array(rows, dtype=np.int64), n_rows) == want
    assert backend == "torch" or any(b > 1 for b in seen), seen          # a row block of several rows was summed
