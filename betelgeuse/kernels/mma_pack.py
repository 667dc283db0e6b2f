"""A Q8_0, Q4_K or MXFP4 weight matrix in the packed layout of gluon_mmq's PK forms (issue 23, docs/benchmarks/
cpu-pack62, cpu-packk62 (where this module was q8_pack) and cpu-mxpk63): each K step's bytes placed in the order the
kernel's threads hold them, so a warp's weight load is 512 contiguous bytes, 16 bytes a thread (GGUF order: 8 rows x
8 bytes a warp load, 8 sectors in 8 lines).

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

Q4_K (type code 5, cpu-packk62): GGUF rows of K / 256 super-blocks of 144 bytes (f16 d, f16 dmin, 12 bytes of
6-bit scales / mins, 128 bytes of nibbles: group g = bytes 16 + 32 g .. + 31, sub-blocks 2 g (low nibbles) and 2 g + 1
(high)). Packed: the same 64-row tiles, each K / 256 super-blocks of SB_B = 9,216 bytes (64 x 144):

  bytes 0 .. 1023     the headers: row i of the tile its super-block's bytes 0 .. 15 at 16 i (one 128-bit load a
                      row, gluon_mmq.HL's; a warp load 8 rows = 128 contiguous bytes);
  1024 + 2048 g ..    group g (gluon_mmq's K step kb0 with (kb0 // 2) % 4 = g): [warp w 4][n8 8][lane-quad b 4][half h
                      2][j 4][2 bytes] -- row 16 w + 8 h + n8 of the tile, byte pair p = b + 4 j (bytes 2 p, 2 p + 1
                      of the group): lane l = 4 n8 + b's 16 bytes are the pairs gluon_mmq.QL gives thread l (rows
                      l / 4, + 8 of its warp's 16, pairs l % 4 + 4 j), one 128-bit load; a warp load 512 contiguous
                      bytes (GGUF order: 8 rows x 2 bytes a load instruction, 8 lines).

MXFP4 (type code 4, cpu-mxpk63): GGUF rows of K / 32 blocks of 17 bytes (the E8M0 scale byte, 16 bytes of nibbles:
element j < 16 the low nibble of byte 1 + j, j >= 16 the high nibble of byte 1 + j - 16). Packed: the same 64-row
tiles, each K / 64 steps of MX_STEP_B = 2,176 bytes (64 rows x 2 blocks x 17):

  bytes 0 .. 2047     the nibbles: [warp w 4][n8 8][lane-quad b 4][half h 2][j 8] -- row 16 w + 8 h + n8 of the tile,
                      the step's nibble byte p = b + 4 j (byte 1 + p % 16 of block p // 16): under triton_mmq._perm's
                      element order wgmma's A k pair (2 p', 2 p' + 1) is the two nibbles of the step's byte p', and
                      thread l holds pairs l % 4 + 4 j of rows l / 4 and l / 4 + 8 of its warp's 16 (gluon_mmq.AL),
                      so lane l = 4 n8 + b's 16 bytes are its bytes: one 128-bit load, a warp load 512 contiguous
                      bytes (GGUF order: a byte load a pair, 8 rows x 1 byte in 8 lines);
  bytes 2048 .. 2175  the scales: row i of the tile its two E8M0 bytes (blocks 2 s, 2 s + 1) at 2048 + 2 i (one
                      16-bit load a row; the tile's 128 contiguous).

The index is a permutation of one tile's bytes, applied to every tile: numpy indexing here, a torch gather on
the GPU (permute_tiles). The types' tile indices differ; the tiling, the gather and usable's rule are shared."""

from __future__ import annotations

import numpy as np

TR = 64                     # rows a tile (gluon_mmq.SHAPE's BN)
BLK = 34                    # bytes of a Q8_0 block of 32 weights
STEP_B = TR * 2 * BLK       # bytes of a tile's K step (KB 2 blocks of 64 rows)
QUANT_B = TR * 64           # ... of which the quants (the scales after them)
SB = 256                    # Q4_K: weights of a super-block
SB_BYTES = 144              # ... its bytes
HDR_B = TR * 16             # ... a tile's super-block: its headers' bytes (the 4 groups of 2,048 after them)
SB_B = TR * SB_BYTES        # ... and all of it
MX_BLK = 17                 # MXFP4: bytes of a block of 32 weights
MX_STEP_B = TR * 2 * MX_BLK  # ... a tile's K step (2 blocks of 64 rows)
MX_NIB_B = TR * 32          # ... of which the nibbles (the scales after them)
TYPES = {0: (64, 32, BLK), 4: (64, 32, MX_BLK), 5: (SB, SB, SB_BYTES)}  # kernel type code (gluon_mmq.TYPES) -> (K
#                                                     multiple, weights and bytes of a block): the types with a layout
GGML = {8: 0, 39: 4, 12: 5}  # their GGML types (Q8_0, MXFP4, Q4_K) -> type code (triton_quants.QT_CODES' values)


def usable(rows: int, K: int, qt: int = 0) -> bool:
    """Whether a matrix of `rows` rows of K weights of type code qt (TYPES) packs: whole tiles and whole K steps
    (64 weights; Q4_K: whole super-blocks)."""
    return qt in TYPES and rows > 0 and rows % TR == 0 and K > 0 and K % TYPES[qt][0] == 0


def row_bytes(K: int, qt: int = 0) -> int:
    """Bytes of a GGUF row of K weights of type code qt."""
    return K // TYPES[qt][1] * TYPES[qt][2]


def _index_q4_k(K: int) -> np.ndarray:
    """Q4_K's tile index (module doc): [K / 256 super-blocks x SB_B]."""
    rb = row_bytes(K, 5)
    s = np.arange(K // SB)[:, None] * SB_BYTES                          # [super-blocks, 1]: the GGUF offset in a row
    i, by = np.ix_(range(TR), range(16))
    hdr = (i * rb + by).reshape(1, HDR_B)
    g, w, n8, b, h, j, by2 = np.ix_(range(4), range(4), range(8), range(4), range(2), range(4), range(2))
    q = ((16 * w + 8 * h + n8) * rb + 16 + 32 * g + 2 * (b + 4 * j) + by2).reshape(1, SB_B - HDR_B)
    return np.concatenate([hdr + s, q + s], axis=1).reshape(-1)


def _index_mxfp4(K: int) -> np.ndarray:
    """MXFP4's tile index (module doc): [K / 64 steps x MX_STEP_B]."""
    rb = row_bytes(K, 4)
    s = np.arange(K // 64)[:, None] * 2 * MX_BLK                      # [steps, 1]: the GGUF offset in a row
    w, n8, b, h, j = np.ix_(range(4), range(8), range(4), range(2), range(8))
    p = b + 4 * j                                                       # the step's nibble byte
    q = ((16 * w + 8 * h + n8) * rb + (p // 16) * MX_BLK + 1 + p % 16).reshape(1, MX_NIB_B)
    i, a = np.ix_(range(TR), range(2))
    d = (i * rb + a * MX_BLK).reshape(1, MX_STEP_B - MX_NIB_B)
    return np.concatenate([q + s, d + s], axis=1).reshape(-1)


def tile_index(K: int, qt: int = 0) -> np.ndarray:
    """int64 [TR x row_bytes]: packed tile byte i = GGUF tile byte index[i] (a permutation of one tile's bytes) of
    type code qt."""
    assert usable(TR, K, qt), (K, qt)
    if qt == 5:
        return _index_q4_k(K)
    if qt == 4:
        return _index_mxfp4(K)
    rb = row_bytes(K)
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


def _bytes(data, rows: int, K: int, qt: int):
    a = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    assert usable(rows, K, qt) and str(a.dtype) in ("uint8", "torch.uint8"), (rows, K, qt, a.dtype)
    assert a.reshape(-1).shape[0] == rows * row_bytes(K, qt), (rows, K, a.shape)
    return a


def pack(data, rows: int, K: int, qt: int = 0):
    """GGUF-ordered bytes of a [rows, K] matrix of type code qt (bytes, a uint8 numpy array or torch tensor) -> its
    packed bytes (a flat uint8 numpy array, or a torch tensor on data's device; the same size)."""
    return permute_tiles(_bytes(data, rows, K, qt), tile_index(K, qt))


def unpack(data, rows: int, K: int, qt: int = 0):
    """pack's inverse: packed bytes -> GGUF order."""
    return permute_tiles(_bytes(data, rows, K, qt), np.argsort(tile_index(K, qt)))
