"""kernels/triton_moe.sort_rows: a decode routing's counts, stable sort by expert and offsets in one launch (issue 21:
the torch ops were ~8 launches a layer), the same integers as the torch ops MoEKernels.route runs for more rows
(torch.zeros().scatter_add_, argsort(stable=True), cumsum), under Triton's interpreter: random ids (decode's 1 x 6
and 8 x 6 rows of 256 experts, a partial 32-row block, SORT_ROWS_MAX), every row one expert (the ranks), one
expert in all. Bit for bit: integers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CODE = """
import torch
from betelgeuse.kernels import triton_moe as tm
g = torch.Generator().manual_seed(1)
bad = []
for n, E in ((6, 256), (48, 256), (1, 8), (100, 24), (33, 3), (64, 1), (tm.SORT_ROWS_MAX, 256)):
    for ids in (torch.randint(0, E, (n,), generator=g), torch.full((n,), E - 1, dtype=torch.int64)):
        counts, rows, off = tm.sort_rows(ids, E)
        c = torch.zeros(E, dtype=torch.int64).scatter_add_(0, ids, torch.ones_like(ids))
        o = torch.zeros(E + 1, dtype=torch.int32)
        o[1:] = torch.cumsum(c, 0)
        if not (torch.equal(counts, c) and torch.equal(rows, torch.argsort(ids, stable=True).to(torch.int32))
                and torch.equal(off, o)):
            bad.append((n, E))
print("bad", bad)
"""


def test_sort_rows_equals_the_torch_ops():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(__file__).parents[2])
    assert r.stdout.strip() == "bad []", (r.stdout, r.stderr[-2000:])
