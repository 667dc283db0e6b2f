"""Shared fixtures: tiny seeded qwen3moe GGUF files written once per test session.

The oracle geometry deliberately has n_ff_exp != 768 (transformers' Qwen3MoeConfig default), so the
transformers reference only agrees when `moe_intermediate_size` is passed explicitly (its GGUF
loader does not map expert_feed_forward_length); 2 kv heads for 4 query heads exercise GQA.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run only under Triton's interpreter, which is chosen when a kernel is decorated:
# set for the whole session, so a test that imports a kernel module in this process (test_mmq) does not depend on
# whether another test imported it first without the interpreter ("Cannot call @triton.jit'd outside of the scope
# of a kernel"). With CUDA (the device's -m gpu runs) the kernels compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one torch thread per test process and per process it starts: the CPU path's bit claims need it (torch's CPU GEMM
# with several threads splits rows by M, so a chunked or batched row differs by ~1e-6: tests/worker/test_cpu_threads.py;
# the runner pins it too), and under pytest-xdist (the README's `-n 2`: CI's two cores) two workers at the default
# two threads each would oversubscribe the two cores. A file run alone now gets what CI gets.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# small enough that the transformers reference loads in well under a second per file
ORACLE_OVERRIDES = dict(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=8,
                        n_expert_used=2, n_ff_exp=64, n_vocab=320, context_length=256, router_skew=0.5,
                        seed=7)
ORACLE_QTYPES = ("F32", "Q8_0")


def _write(dir_: Path, preset: str, **overrides) -> Path:
    from betelgeuse.gguf.synth import PRESETS, write_model
    spec = replace(PRESETS[preset], **overrides)
    path = dir_ / f"{preset}-{spec.qtype}-{spec.n_layer}L-s{spec.seed}.gguf"
    write_model(path, spec, progress=False)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def oracle_models(model_dir) -> dict[str, Path]:
    """{"F32": path, "Q8_0": path}: the same geometry and seed in two quant types, one directory."""
    return {q: _write(model_dir, "tiny", qtype=q, **ORACLE_OVERRIDES) for q in ORACLE_QTYPES}


@pytest.fixture(scope="session")
def tiny_model(oracle_models) -> Path:
    """The Q8_0 oracle model: the default small model for CLI and engine tests."""
    return oracle_models["Q8_0"]
