"""betelgeuse/kernels/tile_layout (docs/benchmarks/cpu-tile62): the tile layout is a permutation of a matrix's bytes
(round trip, same size, numpy and torch alike), and the tiled bytes read at the kernels' tiled addresses (block j
of row n at tile(n) * 64 * row_bytes + j * 64 * bb + (n % 64) * bb) dequantize to gguf-py's dequantization of the
GGUF bytes, bit for bit, for types of 32-element blocks, super-blocks, an i-quant and a float type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from betelgeuse.gguf.quants_synth import random_blocks
from betelgeuse.kernels import tile_layout as tlay

TYPES = (GT.Q8_0, GT.MXFP4, GT.Q4_K, GT.Q6_K, GT.IQ4_XS, GT.IQ2_XXS, GT.F16)


def _gguf(qt: GT, rows: int, K: int, seed: int) -> np.ndarray:
    """A [rows, K] matrix's GGUF bytes: random valid blocks (every code, both signs of the scales)."""
    el, bb = tlay.unit(qt)
    rng = np.random.default_rng(seed)
    if qt == GT.F16:
        return rng.standard_normal(rows * K).astype(np.float16).view(np.uint8)
    return random_blocks(int(qt), rows * K // el, rng).reshape(-1)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_tiled_bytes_at_tiled_addresses_dequantize_as_gguf(qt):
    el, bb = tlay.unit(qt)
    rows, K = 128, 2 * 256 if el == 256 else 96          # 2 tiles; 3 or 2 blocks a row
    g = _gguf(qt, rows, K, int(qt))
    t = tlay.tile(g, rows, K, qt)
    assert t.shape == g.shape and not np.array_equal(t, g)
    # the kernels' reading: row n's blocks gathered at the tiled offsets, then gguf-py's dequantization of the row
    off = tlay.block_offsets(rows, K, qt, tiled=True)
    got = t[off[:, :, None] + np.arange(bb)].reshape(rows, -1)
    want = gq.dequantize(g.reshape(rows, -1), qt)
    np.testing.assert_array_equal(gq.dequantize(got, qt), want)      # NaNs equal too (bit patterns of random blocks)
    # GGUF offsets read the GGUF bytes (the kernels' other stride pair): the formula, not only the tiling, checked
    goff = tlay.block_offsets(rows, K, qt, tiled=False)
    assert np.array_equal(g[goff[:, :, None] + np.arange(bb)].reshape(-1), g)
    assert np.array_equal(tlay.untile(t, rows, K, qt), g)
    # torch: the same bytes (the GPU tiles a bank with it)
    tt = tlay.tile(torch.from_numpy(g.copy()), rows, K, qt)
    assert np.array_equal(tt.numpy(), t) and np.array_equal(tlay.untile(tt, rows, K, qt).numpy(), g)


def test_a_tile_keeps_its_bytes_and_a_k_step_is_one_run():
    """Tile t holds GGUF's bytes of its 64 rows (a slot's extent per tile is unchanged); block j of a tile's 64 rows
    is one run of 64 bb bytes."""
    qt, rows, K = GT.Q8_0, 192, 128
    g = _gguf(qt, rows, K, 3)
    t = tlay.tile(g, rows, K, qt)
    tb = 64 * K // 32 * 34
    for i in range(rows // 64):
        assert sorted(t[i * tb:(i + 1) * tb]) == sorted(g[i * tb:(i + 1) * tb])
    off = tlay.block_offsets(rows, K, qt, tiled=True)
    assert np.array_equal(np.diff(off[64:128, 2]), np.full(63, 34))


def test_usable():
    assert tlay.usable(64, 256, GT.Q4_K) and tlay.usable(128, 32, GT.Q8_0) and tlay.usable(64, 32, GT.BF16)
    assert not tlay.usable(96, 256, GT.Q4_K)              # a partial tile
    assert not tlay.usable(64, 128, GT.Q4_K)              # a partial super-block
    assert not tlay.usable(0, 32, GT.Q8_0)
    assert tlay.unit(GT.F32) == (32, 128) and tlay.unit(GT.Q4_K) == (256, 144)


def _bits_equal(res: dict, keys: tuple) -> None:
    for name, r in res.items():
        for k in keys:
            assert r[k]["eq_gu"] and r[k]["eq_dn"], (name, k, r)
        assert r["moved_gu"] or r["moved_dn"], (name, r)            # the check reads tiled bytes somewhere


def test_triton_kernels_read_a_mixed_bank_to_the_gguf_banks_bits():
    """triton_moe's float kernels (gate_up, down; both rows buckets, Q8_0 split-K in bucket 1) and triton_mmq's q8_1
    and bf16 MMA kernels on a bank of tiled and GGUF experts == the all-GGUF bank, bit for bit
    (tests/scripts/tile_kernel_check.py, the interpreter; ~15 s; IQ4_XS and `--mmq Q4_K`, ~45 s more, by hand:
    docs/benchmarks/cpu-tile62)."""
    pytest.importorskip("triton")
    from test_kernels import _run          # tests/kernels (rootdir-relative imports: pytest's prepend mode)
    res = _run("tile_kernel_check.py", "Q8_0", "MXFP4", "Q4_K", "F16", tuning="off")
    assert set(res) == {"Q8_0", "MXFP4", "Q4_K", "F16"}
    _bits_equal(res, ("1", "16"))
    assert all(res["Q8_0"][b]["eq_flag_on"] for b in ("1", "16"))
    assert all(res[n]["moved_gu"] and res[n]["moved_dn"] for n in ("Q8_0", "MXFP4", "F16"))
    res = _run("tile_kernel_check.py", "--mmq", "Q8_0", "MXFP4")
    assert set(res) == {"Q8_0", "MXFP4"}
    _bits_equal(res, tuple(f"{m}/{b}" for m in ("q8_1", "bf16") for b in ("1", "16")))

