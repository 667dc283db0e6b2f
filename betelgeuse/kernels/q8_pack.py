"""A Q8_0 weight matrix in the packed layout of gluon_mmq's PK 1 form (issue 23, docs/benchmarks/cpu-pack62): each
K step's bytes placed in the order the kernel's threads hold them, so a warp's weight load is 512 contiguous bytes,
16 bytes a thread (GGUF order: 8 rows x 8 bytes a warp load, 8 sectors in 8 lines).

A permutation of the matrix's bytes (the same size: a slot holds either). GGUF order: rows of K / 32 blocks of 34
bytes (f16 d, 32 int8). Packed: tiles of TR = 64 rows (gluon_mmq's BN), each K / 64 steps of KB 2 blocks, a step
STEP_B = 4,352 bytes (64 rows x 68), tile-major ([tile][step]: a tile's bytes stay where GGUF had them, the tile's
64 rows x row_bytes):

  bytes 0 .. 4095     the quants: [warp w 4][half h 2][lane l 32][word a 4][4 bytes] -- row 16 w + 8 h + l // 4
                      of the tile, word a = the int8 pairs p = 8 a + l % 4 (low 16 bits) and p + 4 (high), pair p
                      = the step's quants 2 p, 2 p + 1 (block p // 16, bytes 2 + 2 (p % 16), + 1 of it): lane l's
                      16 bytes are wgmma's A k pairs of its rows (gluon_mmq.PL: thread t holds pairs t % 4 + 4 j
                      of rows t / 4 and t / 4 + 8 of its warp's 16);
  bytes 4096 .. 4351  the scales: row i of the tile a 32-bit word, f16 d of the step's first block (low 16 bits),
                      then the second's.

The index is a permutation of one tile's bytes, applied to every tile: numpy indexing here, a torch gather on
the GPU (permute_tiles)."""

from __future__ import annotations

import numpy as np

TR = 64                     # rows a tile (gluon_mmq.SHAPE's BN)
BLK = 34                    # bytes of a Q8_0 block of 32 weights
STEP_B = TR * 2 * BLK       # bytes of a tile's K step (KB 2 blocks of 64 rows)
QUANT_B = TR * 64           # ... of which the quants (the scales after them)


def usable(rows: int, K: int) -> bool:
    """Whether a matrix of `rows` rows of K weights packs: whole tiles and whole K steps."""
    return rows > 0 and rows % TR == 0 and K > 0 and K % 64 == 0


def tile_index(K: int) -> np.ndarray:
    """int64 [TR x row_bytes]: packed tile byte i = GGUF tile byte index[i] (a permutation of one tile's bytes)."""
    assert usable(TR, K), K
    rb = K // 32 * BLK
    s = np.arange(K // 64)[:, None]                                     # [steps, 1]
    w, h, n8, b, a, by = np.ix_(range(4), range(2), range(8), range(4), range(4), range(4))
    p = 8 * a + b + 4 * (by // 2)                                       # the pair a byte belongs to
    row = 16 * w + 8 * h + n8
    q = (row * rb + (p // 16) * BLK + 2 + 2 * (p % 16) + by % 2).reshape(1, QUANT_B)
    i, j, by2 = np.ix_(range(TR), range(2), range(2))
    d = ((i * rb + j * BLK + by2).reshape(1, STEP_B - QUANT_B))
    return np.concatenate([q + s * 2 * BLK, d + s * 2 * BLK], axis=1).reshape(-1)


def permute_tiles(a, index: np.ndarray):
    """Each tile of uint8 bytes `a` (a numpy array, or a torch tensor on any device: a gather there) permuted by
    `index` (one tile's: out tile byte i = in tile byte index[i]): a flat array of a's kind, the same size."""
    n = index.size
    if hasattr(a, "device"):                # torch (not imported here: the index goes to a's device)
        import torch
        return a.reshape(-1, n)[:, torch.as_tensor(index, device=a.device)].reshape(-1)
    return a.reshape(-1, n)[:, index].reshape(-1)


def _bytes(data, rows: int, K: int):
    a = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    assert usable(rows, K) and str(a.dtype) in ("uint8", "torch.uint8"), (rows, K, a.dtype)
    assert a.reshape(-1).shape[0] == rows * K // 32 * BLK, (rows, K, a.shape)
    return a


def pack_q8_0(data, rows: int, K: int):
    """GGUF-ordered Q8_0 bytes of a [rows, K] matrix (bytes, a uint8 numpy array or torch tensor) -> its packed bytes
    (a flat uint8 numpy array, or a torch tensor on data's device; the same size)."""
    return permute_tiles(_bytes(data, rows, K), tile_index(K))


def unpack_q8_0(data, rows: int, K: int):
    """pack_q8_0's inverse: packed bytes -> GGUF order."""
    return permute_tiles(_bytes(data, rows, K), np.argsort(tile_index(K)))
