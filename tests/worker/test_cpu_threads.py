"""The CPU path pins torch to one intra-op thread (worker/runner.py): its bit claims (DESIGN.md §2: the same logits
whatever the batch, chunking or prefix around a row) need it, because torch's CPU GEMM with several threads splits
the rows by M -- at 2 threads a [330, 64] x [64, 256] product's rows 328-329 differ from the same rows computed as
320 + 10 (~1e-6), at 1 thread they are equal (what the tests' conftest sets under xdist, and what a CPU `serve` got
at torch's default threads before)."""

from __future__ import annotations

import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth


def test_a_cpu_runner_runs_one_torch_thread_and_keeps_chunked_bits(tmp_path):
    path = write_synth(tmp_path / "m.gguf", **ENGINE_SPEC)
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner, store = in_process_runner(path, 4, 8)
        try:
            assert torch.get_num_threads() == 1
            # the claim the pin keeps: a row's product does not depend on the rows beside it
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(256, 64, generator=g), torch.randn(330, 64, generator=g)
            assert torch.equal(x @ w.T, torch.cat([x[:320] @ w.T, x[320:] @ w.T]))
            ids = prompt(24, ENGINE_SPEC["n_vocab"], seed=3)
            a, _ = runner.forward(ids, runner.new_cache(64), all_logits=True)
            assert torch.isfinite(a).all()
        finally:
            close_runner(runner, store)
    finally:
        torch.set_num_threads(was)
