"""kernels/triton_mmq.py (act_quant q8_1, Triton interpreter): the q8_1 quantizer against a numpy port of llama.cpp's
quantize_row_q8_1_ref (ggml/src/ggml-quants.c), the Q8_0 int8-MMA experts against a numpy reference of the same
numerics on gguf-py's Q8_0 bytes (llama.cpp ggml-cuda/vecdotq.cuh vec_dot_q8_0_q8_1: d8_0 * d8_1 * sumi per
32-element block), against the float torch path within the int8 rounding's budget, a row's bits alone and in 5
and 16 rows of its expert, K steps and split-K, and the engine's location invariance with q8_1. The references are
mmq_helpers'; the decode schedule is test_mmq_decode's, the word loads test_mmq_word_loads', the sm_90 compiles
test_mmq_sm90's (split by theme so that CI's --dist loadfile balances)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from mmq_helpers import DIMS, E, experts, moe_ref, ref_q8_1, run  # noqa: E402

from betelgeuse.kernels import triton_mmq as mq  # noqa: E402


def test_quantize_q8_1_matches_llama_cpp_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.float32([[0.01], [1], [30], [1e-3], [5]])
    x[1, 32:64] = 0                                       # an all-zero block: d = 0, q = 0
    x[2, 0] = 127 * 0.25                                  # d = 0.25, id = 4: x * id = k + 1/2 exactly
    x[2, 1:32] = np.float32(0.25) * (np.arange(31) - 15) + np.float32(0.125)
    x[4, 0], x[4, 1] = 127, np.nextafter(np.float32(0.5), np.float32(0))   # d = id = 1: floor(x + 0.5) gives 1
    q, d, s = mq.quantize_q8_1(torch.from_numpy(x))
    rq, rd, rs = ref_q8_1(x)
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd) and np.array_equal(s.numpy(), rs)
    # roundf: half away from zero (-14.5 -> -15, 0.5 -> 1; numpy's round, half to even, gives -14 and 0)
    assert rd[2, 0] == np.float32(0.25) and rq[2, 1] == -15 and rq[2, 16] == 1 and rq[4, 1] == 0
    assert np.array_equal(rq[2, 1:32], np.arange(31) - 15 + (np.arange(31) >= 15) * 1)


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_mmq_matches_numpy_reference_and_blocks_are_32(qt):
    raw = experts(qt)
    H = DIMS[qt][0]
    rng = np.random.default_rng(2)
    T, k = 7, 2
    h = rng.standard_normal((T, H)).astype(np.float32) * np.float32(0.1)
    h[:, 32:64] *= 4
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    got = run(qt, raw, h, ids, w)
    want = moe_ref(qt, raw, h, ids, w)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-6, err                          # the same float ops (the interpreter: numpy's, in order)
    wrong = moe_ref(qt, raw, h, ids, w, per=64)      # one block's scales for 64 elements
    assert np.abs(wrong - want).max() / np.abs(want).max() > 1e-2


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_q8_1_within_the_int8_budget_of_the_float_path(qt):
    """|y_q8_1 - y_float| / max|y_float| < 3%: each activation rounds by up to amax/254 of its block (twice: h and
    the down input); the float path is the torch reference (exact). Experts split over two groups (tiers) give the
    bits of one group (location invariance: h quantized once, each row of the down input on its own)."""
    raw = experts(qt, 3)
    rng = np.random.default_rng(4)
    T, k = 6, 2
    h = rng.standard_normal((T, DIMS[qt][0])).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    ref = run(qt, raw, h, ids, w, "torch")
    got = run(qt, raw, h, ids, w)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert 1e-4 < rel < 3e-2, rel                      # approximate, but by the rounding only
    if qt == 8:                                        # off: the float schedules, unchanged
        off = run(qt, raw, h, ids, w, "off")
        assert np.abs(off - ref).max() / np.abs(ref).max() < 1e-5
    assert np.array_equal(run(qt, raw, h, ids, w, groups=[[1], [0, 2]]), got)


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_a_rows_bits_do_not_depend_on_its_block(qt):
    """Token 0 routed to expert 0 alone (1 row), with 4 others (5 rows) and with 15 (16 rows, a full BM block), and
    at BM 32 / BN 32: its output the same bits each time."""
    raw = experts(qt, 5)
    rng = np.random.default_rng(6)
    h = rng.standard_normal((16, DIMS[qt][0])).astype(np.float32)
    outs = []
    for n in (1, 5, 16):
        ids = np.zeros((n, 1), np.int64)
        outs.append(run(qt, raw, h[:n], ids, np.ones((n, 1), np.float32))[0])
    with pytest.MonkeyPatch.context() as mp:            # another schedule: 32 rows a block, 32 outputs a program
        mp.setitem(mq.CONFIG, "BM", 32)
        mp.setitem(mq.CONFIG, "BN", 32)
        outs.append(run(qt, raw, h[:5], np.zeros((5, 1), np.int64), np.ones((5, 1), np.float32))[0])
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("qt", [8, 39, 12], ids=["Q8_0", "MXFP4", "Q4_K"])
def test_k_steps_give_the_one_block_bits_and_split_k_the_walked_bits(qt):
    """H = F = 256 (8 quant blocks). K steps of KB = 2 / 4 / 8 blocks (one MMA on block-diagonal activations, the
    block partials scaled and added in ascending order), and gate_up's gate and up rows in one MMA (FUSE), give the
    bits of the one-block-a-step kernel (KB = 1, the schedule before K steps) for 16 rows; with chunks of KCB = 2
    blocks a token's row alone (the 1-row bucket: one program per chunk, the tile's last sums the chunks) equals the
    same row among 16 (chunks walked) and the numpy reference of the chunked sums, and differs from the unchunked
    bits (so the chunks are real)."""
    rng = np.random.default_rng(7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DIMS, qt, (256, 256))
        raw = experts(qt, 8)
        h = rng.standard_normal((16, 256)).astype(np.float32)
        h[:, 32:64] *= 4
        ids, w = np.zeros((16, 1), np.int64), np.ones((16, 1), np.float32)
        code = {8: 0, 39: 4, 12: 5}[qt]

        def with_cfg(n, **cfg):
            mp.setitem(mq.TYPE_CONFIG, code, cfg)
            return run(qt, raw, h[:n], ids[:n], w[:n])
        old = with_cfg(16, KB=1, KCB=0)
        assert np.abs(old - moe_ref(qt, raw, h, ids, w)).max() / np.abs(old).max() <= 1e-6
        for kb in (2, 4, 8):
            assert np.array_equal(with_cfg(16, KB=kb, KCB=0), old), kb
        assert np.array_equal(with_cfg(16, KB=2, KCB=0, FUSE=1), old)           # gate and up rows in one MMA
        assert np.array_equal(with_cfg(1, KB=4, KCB=0)[0], old[0])
        chunked = with_cfg(16, KB=2, KCB=2)
        # split over programs == walked (KCB 2 is no multiple of MXFP4's and Q4_K's MV word group: the MMA runs, at
        # the MMA's BN 64 rather than their one-row MV's 16, a quarter of the interpreted programs; its bits do not
        # depend on BN: test_a_rows_bits_do_not_depend_on_its_block)
        assert np.array_equal(with_cfg(1, KB=2, KCB=2, BN=64)[0], chunked[0])
        assert np.array_equal(with_cfg(1, KB=1, KCB=2, FUSE=1, BN=64)[0], chunked[0])
        want = moe_ref(qt, raw, h[:1], ids[:1], w[:1], kcb=2)[0]
        assert np.abs(chunked[0] - want).max() / np.abs(want).max() <= 1e-6
        assert not np.array_equal(chunked, old)


def test_act_quant_setting_and_flag():
    import argparse
    from betelgeuse.config import EngineConfig
    from betelgeuse.errors import BetelgeuseError
    from betelgeuse.settings import add_flags, flag_values, resolve_settings
    assert EngineConfig(model_path="m.gguf").act_quant == "off"
    assert EngineConfig(model_path="m.gguf", act_quant="q8_1").act_quant == "q8_1"
    with pytest.raises(BetelgeuseError, match="act_quant"):
        EngineConfig(model_path="m.gguf", act_quant="q4")
    p = argparse.ArgumentParser()
    add_flags(p, sections=["engine"])
    with pytest.raises(BetelgeuseError, match=r"--act-quant.*expected one of"):
        resolve_settings(None, env={}, flags=flag_values(p.parse_args(["--act-quant", "int4"])))


@pytest.mark.slow
def test_engine_with_q8_1_is_location_invariant(tmp_path):
    """The engine (qwen3moe, Q8_0 experts, kernels "triton", act_quant "q8_1" through EngineConfig): logits
    bit-identical across slot configurations (VRAM, host and disk tiers; all in VRAM), cold / warm /
    after consolidation and over decode steps; really quantized (not the torch engine's logits) and within the
    q8_1 budget of them, with the same greedy tokens (tests/scripts/triton_engine_check.py --act-quant q8_1)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", BETELGEUSE_TRITON_TUNING="off",
               PYTHONPATH=str(here.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = here / "scripts" / "triton_engine_check.py"
    p = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", str(script), "--act-quant", "q8_1",
                        str(tmp_path / "engine.gguf")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])["configs"]
    assert len(res) == 2
    for key, r in res.items():
        assert r["bit_identical"], key
        assert 1e-4 * r["max_logit"] < r["max_abs_vs_torch"] <= 0.05 * r["max_logit"], (key, r)
        assert r["greedy_equal_torch"], key
    assert res["3v8h"]["reads"][2]["host"] > 0 and res["3v8h"]["reads"][2]["vram"] > 0
