"""The tensor-core expert schedules: llama.cpp's mmq route (activations quantized to q8_1, int8 MMA per block) and
its bf16 mode (the quants as bf16 integers against bf16 activations: within float noise; the section at the end).

Opt-in (`engine.act_quant = "q8_1"`): it changes the numerics. The float schedules (triton_moe, triton_mmvq) keep
the activations as the engine holds them and stay within float noise of the torch path; this one rounds every
activation to int8 per 32-element block first, as llama.cpp's CUDA mmq/mmvq do (ggml-cuda/quantize.cu,
mmq.cuh, vecdotq.cuh), for a relative error of about amax/254 per activation (~0.5% on a dot product of a
Gaussian row; tests/kernels/test_mmq.py holds it to a budget).

q8_1 (quantize_q8_1 below), per activation row and 32-element block b, following ggml-quants.c
quantize_row_q8_1_ref:
    d = max|x| / 127 (IEEE division);  id = 1 / d (0 where d = 0);  q = roundf(x * id) int8 (half away from 0);
    s = float(sum q) * d  (the int sum is exact).
d and s stay float32 (llama.cpp rounds them to the two halves of block_q8_1.ds: float32 is closer to the float
path and costs nothing here). A row's blocks depend on that row only, so batching never changes a row's bits.

Q8_0 x q8_1 (llama.cpp vec_dot_q8_0_q8_1: d8_0 * d8_1 * sumi), for output (n, m), K blocks kb = 0, 1, ... in order:
    dot   = sum_{j < 32} wq[n, 32 kb + j] * xq[m, 32 kb + j]         int8 x int8 -> int32 (tl.dot: exact, any order)
    acc   = fma(float(dot), dw[n, kb] * dx[m, kb], acc)            fp32, one block (32) per dot so its scales apply
K chunks (the reduction key KCB of TUNING, quant blocks a chunk; 0 = one chunk): each chunk c's acc p_c starts
from zero and walks its blocks as above, and the output is tot = 0 + p_0 + p_1 + ... in chunk order (one chunk:
tot = p_0, bit for bit). The 1-row bucket runs one program per chunk (split-K: the tile's last program to arrive
sums the stored partials in chunk order, as triton_moe's); the 16-row bucket walks the chunks in one program: the
same sums, so a row's bits do not depend on the rows beside it in a launch. KCB is per type, never per bucket.
The int32 dot is exact and the fp32 accumulation is per (n, m) in fixed K order, so an output's bits depend on
neither BM, BN, KB, SPLIT, nor the other rows of its block (DESIGN.md invariant 6); the fma is written out (tl.fma),
so the rounding is the source's, not the compiler's contraction (the same on the GPU and the interpreter, and in
triton_mmq_mv, the decode schedule without tensor cores that gives these bits: MV = 1, a schedule key).
The weight and activation tiles are read byte by byte, or (WL = 1, a schedule key) as int32 words unpacked in
registers: the same int8 tiles, so the same bits (the section "WL = 1" below).
The MMA of a K step of KB blocks (a schedule key) is [BN, KB*32] x [KB*32, KB*BM] -> [BN, KB*BM]: weights on the
M side; the rows (padded to BM = 16: a decode row costs the same weight traffic as 16) on the N side, the
activations block-diagonal (column i*BM + m holds row m's block i, zeros elsewhere), so its KB k32 MMAs issue back
to back under one commit and give the KB exact int32 block dots at once; each is then scaled and added in
ascending block order (KB = 1: one [BN, 32] x [32, BM] MMA a block).

MXFP4 x q8_1 (llama.cpp vec_dot_mxfp4_q8_1): as Q8_0 with wq = the doubled e2m1 values of the codes (kvalues_mxfp4:
0 1 2 3 4 6 8 12 and negatives, int8) and dw = 2^(e - 128) of the block's E8M0 byte (ggml_e8m0_to_fp32_half).

Q4_K x q8_1 (llama.cpp vec_dot_q4_K_q8_1: d sc sumi d8 - dmin m s8), sub-block j of a super-block (32 elements,
its 6-bit scale sc and min m, get_scale_min_k4), quants q in 0..15 as int8:
    acc   = acc + fma(float(dot), d sc * dx[m, kb], -(dmin m * sx[m, kb]))     sx = the q8_1 block sum s
Types with this schedule: MMQ_TYPES (kernel type codes, triton_quants.QT_CODES). The others take the float path.

The bf16 mode (`engine.act_quant = "bf16"`, BF: issue 23's exact tensor-core schedule; BF_TYPES: MMQ_TYPES and
Q5_K, whose quants are Q4_K's nibbles plus bit j of qh[e] as bit 4, 0..31, read byte by byte). Every quant above is a
small integer (Q8_0 int8, MXFP4's doubled e2m1 values, Q4_K 0..15, Q5_K 0..31), exactly a bf16, and a bf16 x bf16
product is exact in fp32, so the same tiles, as bf16, against the activations as bf16 (no q8_1: xb = x, the
engine's own bf16 on the GPU; a float32 x is rounded to bf16 once, prepare_bf16) give each block's dot in fp32 from
the MMA, then the same float ops in ascending block order with dx = 1:
    dot   = sum_{j < 32} wq[n, 32 kb + j] * xb[m, 32 kb + j]        bf16 x bf16 -> fp32 (the MMA's order, below)
    acc   = fma(dot, dw[n, kb], acc)                                Q8_0, MXFP4
    acc   = acc + fma(dot, d sc, -(dmin m * sx[m, kb]))             Q4_K, Q5_K; sx = the bf16 block's sum (prepare_bf16:
                                                                    one launch, fixed order, a row's own blocks)
Within float noise of the torch path (tests/kernels/test_mmq_bf16.py), so it may become the default where it is
faster: the device decides (deploy/device/kernel_roofline.py --act-quant bf16). Unlike the int32 dot, the fp32 dot
is rounded inside the MMA in the instruction's fixed order, which depends on the instruction shape (K per dot, the
N = KB * BM of the block-diagonal tile, BN and warps), so BF_TUNING fixes those per type for BOTH rows buckets (the
q8_1 MMA's KB and BM may differ per bucket: exact dots), the MV schedule (no MMA) is never taken, and MXFP4's
elements take the word loads' order within a block in the byte-load tiles too (_perm): then a row's bits depend on
neither the other rows of its launch, nor SPLIT, nor WL (DESIGN.md invariant 6; on the GPU kernel_roofline's
bf16_check and check_cuda verify it, the interpreter the float ops). The interpreter's dot cannot read bf16: there
each block dot is the same values' products summed in float64 and rounded once to fp32 (_INTERP; numpy's float32
matmul rounds in a blocking that varies with the tile's M and N, so BN, warps or FUSE changed bits there alone).
Why a value of act_quant rather than a new key: the setting already names how the expert kernels take their
activations (off: as held, float schedules; q8_1: int8 per 32), it keys the prefix cache's numerics (kv_manager,
prefix_host) and picks the MMA parts (MoEKernels.mmq_parts); bf16 is a third such form (the activations as bf16,
which rounds nothing on the GPU) and shares all of that plumbing. The types without this schedule stay on the float
path in every mode.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from betelgeuse.kernels import gluon_mmq as gm
from betelgeuse.kernels import triton_mmq_mv as mv
from betelgeuse.kernels import triton_moe as tm
from betelgeuse.kernels.triton_mmvq import _half as _f16, _join4
from betelgeuse.kernels.triton_quants import TILE_ROWS, k_scale_min_of
from betelgeuse.kernels.triton_launch import launcher

QK = 32                        # elements per q8_1 block (llama.cpp QK8_1)
MMQ_TYPES = frozenset({0, 4, 5})  # kernel type codes with an MMA schedule: Q8_0, MXFP4, Q4_K
BF_TYPES = MMQ_TYPES | {6}        # ... and with the bf16 mode: + Q5_K (byte loads: no word-load form yet)
CONFIG = {"BM": 16, "BN": 64, "FUSE": 0, "num_warps": 4, "num_stages": 3,   # schedule keys (every type and bucket)
          "MV": 0, "BM_MV": 1, "NS": 1, "DP4A": 0, "WL": 0, "PF": 0, "GL": 0, "GP": 0, "PK": 0, "NR": 0,
          "NRD": 0, "ST": 0}
# GL = 1 (bf16 MMA only): gluon_mmq's kernel, the same arithmetic with the weights loaded straight into the wgmma's A
# registers (no shared memory round trip), where gluon_mmq.usable says so (CUDA sm_90, Q8_0 / MXFP4 / Q4_K at
# BF_TUNING's shape, FUSE either way, aligned parts), else this module's kernel: a schedule key (the same bits:
# deploy/device/check_gluon_mmq.py). GP (with GL): how far ahead the Gluon K loop's loads are issued
# (gluon_mmq._acc_part: 0 converted in the step that issues them, 1 / 2 carried as loaded one / two steps; the same
# bits: cpu-gluon16r57; Q4_K's too, GGUF order and PK 1 / 2: cpu-gpk63). PK 1 (with GL, Q8_0, GP >= 1; off everywhere):
# the pool's weights are in kernels/mma_pack's layout (every part's 64-row tiles re-laid: 512 contiguous bytes a warp
# load), which only the Gluon form reads (the same values in the same MMA: the same bits, cpu-pack62); the caller packs
# the pool. PK 2: each expert's layout from bit 0 of its base offset (engine.pack_experts' packed VRAM slots beside GGUF
# ones: MoEKernels passes it per launch, gate_up / down's pk, which sets GL 1 too; cpu-vram62). Q4_K's Gluon forms (any
# GP) read mma_pack's Q4_K layout under PK 1 / 2 alike (its byte pairs 16 contiguous bytes a thread: cpu-packk62),
# MXFP4's every GP form its MXFP4 layout (a thread's nibble bytes 16 contiguous bytes, a row's 2 scales one 16-bit load:
# cpu-mxpk63)
# NR (with GL; 0: ptxas's choice): the Gluon kernels' register limit a thread (ptxas's maxnreg), NRD the down's where
# not 0: 168 fits 3 CTAs of 4 warps a SM, 128 4 -- register allocation alone, the same instructions' arithmetic, so
# the same bits (Q4_K's fused GP 1 gate_up: 219-247 registers, 2 CTAs, at 168 without spills; its down at 128: 4
# CTAs; cpu-gpk63)
# ST (with GL, PK, GP 1, MXFP4 / Q4_K; 0 off everywhere): the weight words of the next ST - 1 K steps in flight through
# a ring of shared memory (cp.async, gluon_mmq._acc_part), the step's other loads carried one step as GP 1's: the same
# words into the same decode, MMA and float ops, so the same bits (cpu-mxtma65); gluon_mmq.usable refuses ST outside
# 2 .. 8 or with another type or GP (then PK's launch raises: no other kernel reads packed weights)
# MV = 1: the decode schedule without tensor cores (triton_mmq_mv: the same bits; BM_MV rows a program, NS word
# groups a K step; DP4A 1: its block dots by PTX dp4a on the GPU, the same integers) where a launch
# can take it (triton_mmq_mv.mv_ok), else the MMA. WL = 1: the MMA's weight and activation tiles read as int32 words
# (unpacked to int8 in registers; the same tiles, the same bits) where the rows allow (wl_ok), else byte loads (WL 2:
# MXFP4's codes decoded by a byte-permute table, on the GPU: wl_mode); PF
# (with WL): 0 every word through Triton's cp.async pipeline where it takes them (the quants: num_stages - 1 steps
# ahead; the scale words are loaded in the step), 1 the next K step's words all loaded before this step's MMA
# (register double-buffering, no cp.async), 2 the quants as 0 and the scale words one step ahead in registers
# per type: KB quant blocks a K step (a schedule key: the same bits at every KB) and KCB quant blocks a K chunk (the
# reduction key, 0 = one chunk: an output is 0 + p_0 + p_1 + ... over its chunks in order, each p_c accumulated from
# zero; the same for both buckets, so a row's bits never depend on how many rows share its launch)
TUNING: dict[int, dict] = {qt: {"KCB": 16, "num_warps": 4} for qt in MMQ_TYPES}
# per rows bucket (triton_moe.bucket_of): SPLIT the chunks over programs (decode: a bank's output tiles alone leave
# SMs idle) or walk them in one program; KB quant blocks a K step; WL / PF the MMA's word loads -- schedule keys (the
# same sums, the same bits). WL 2 + PF 1 at KB 2 (MMQ_CONFIGS[26] of deploy/device/kernel_roofline.py) was the best or
# within 5% of the best MMA candidate for every type at 16 rows and for Q8_0 at one row (gpu-run44-ds4, H100, bank of
# 16 at the bench geometry, kernels alone, GB/s of expert bytes: Q8_0 1,052 / 843, Q4_K - / 401, MXFP4 - / 412,
# against the byte-loading KB 1 schedule's 966 / 670, - / 231, - / 187; every candidate's rows the same bits there).
# Earlier: KB 4 / 2 at 8 warps compiled to back-to-back IGMMAs at 238-255 registers (548 / 392 on the H100)
BUCKETS = {1: {"SPLIT": 1, "KB": 2, "WL": 2, "PF": 1}, 16: {"SPLIT": 0, "KB": 2, "WL": 2, "PF": 1}}
# per (type, rows bucket), over TUNING: the one-row bank of Q4_K and MXFP4 on the MV schedule (gpu-run43-exact, H100,
# bank of 16 at the bench geometry, kernels alone: Q4_K 723 GB/s against the MMA's 369, MXFP4 673 against 221; Q8_0's
# MV, 622, stays behind its MMA, 976). The same bits as the MMA (checked there: rows alone == in the launch, every
# candidate equal), so the 16-row bucket's MMA and this agree row for row. The constants are the measured candidate's
TYPE_BUCKET: dict[tuple[int, int], dict] = {(qt, 1): {"MV": 1, "BN": 16, "num_warps": 2, "num_stages": 1, "KB": 4}
                                           for qt in (4, 5)}       # MXFP4, Q4_K
TYPE_CONFIG: dict[int, dict] = {}     # kernel type code -> overrides (tests, the roofline)
_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")   # Triton's interpreter (CPU tests)
# act_quant "bf16" (the bf16 MMA of the integer quants, module doc): one schedule per type for BOTH rows buckets (the
# fp32 block dot's summation order is the MMA instruction's, so the instruction shape -- KB blocks a step, BM rows,
# BN outputs, warps -- stays fixed per type: a row's bits then never depend on its launch's rows). Over CONFIG,
# BUCKETS (SPLIT, and WL / PF: how the bytes are read, the same tiles), TUNING, never TYPE_BUCKET (the MV schedule
# has no bf16 form); TYPE_CONFIG's overrides apply last. Not measured yet: the q8_1 MMA's 16-row constants.
BF_TUNING: dict[int, dict] = {qt: {"MV": 0, "BN": 64, "num_warps": 4, "num_stages": 3, "KB": 2, "KCB": 16}
                              for qt in BF_TYPES}
# FUSE 1 (gate and up rows in one K loop: the same HGMMA on the same rows and columns, the same bits) for MXFP4 and
# Q4_K: gpu-run58-kernels (H100, bank of 16, kernels alone, GB/s at 1 / 16 rows, bits == the unfused launch's):
# MXFP4 499 / 444 against 473 / 379, Q4_K 494 / 409 against 488 / 371. Q8_0's Triton form loses fused at one row
# (777 / 932 against 917 / 812): it fuses for its Gluon form (below); Q5_K's fused kernel spills (255 registers)
for _qt in (4, 5):                                                          # MXFP4, Q4_K
    BF_TUNING[_qt]["FUSE"] = 1
# GL 1 where a Gluon form was faster in both rows buckets with the Triton kernel's bits (gpu-run63, H100,
# deploy/device/check_gluon_mmq.py: bank of 16 at the bench geometry, kernels alone, gate_up + down GB/s at 1 / 16
# rows): Q8_0 fused with GP 1 1,046 / 909 against Triton's unfused 912 / 826 (so Q8_0 fuses too: where Gluon cannot
# run, Triton's fused Q8_0 is the same bits, gpu-run58's 777 / 932), Q4_K (fused, GP 0: then its one form) 528 /
# 479 against 491 / 416. MXFP4 (GP 0, fused), once its nibbles were decoded by PTX (cpu-mxlut63): 588 / 476 against
# Triton's 497 / 441 (gpu-run65, H200) and 1.17-1.18x / 1.08x in two runs on an H100 (gpu-run66); before it every
# Gluon form read 0.61-0.95x
BF_TUNING[0].update(FUSE=1, GL=1, GP=1)                                     # Q8_0
for _qt in (4, 5):                                                          # MXFP4, Q4_K
    BF_TUNING[_qt]["GL"] = 1
# Q4_K GP 1 (cpu-gpk63: a step's loads carried to the step that uses them; the same bits): gpu-run66 (H100), pair GB/s
# at 1 / 16 rows 639 / 558 against GP 0's 526 / 480 and Triton's 490 / 412; check_cuda's engine rows (act_quant
# bf16, CHECK_QTYPE=Q4_K) pass with it
BF_TUNING[5]["GP"] = 1


@triton.jit
def _roundf(v):
    """C roundf (half away from zero) of float32 v, exactly: a - floor(a) is exact, so no x + 0.5 rounding."""
    a = tl.abs(v)
    t = tl.floor(a)
    r = t + tl.where(a - t >= 0.5, 1.0, 0.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, NB: tl.constexpr):
    """Row program_id(0), blocks program_id(1) * NB ..: x [T, K] (any float) -> q [T, K] int8, d, s [T, K / 32]."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    mb = b < K // 32
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]                    # [NB, 32]
    x = tl.load(x_ptr + row * K + cols, mask=mb[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)                                      # [NB]
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv = tl.where(d > 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0, d, 1.0)), 0.0)
    q = _roundf(x * inv[:, None]).to(tl.int32)
    s = tl.sum(q, axis=1).to(tl.float32) * d
    tl.store(q_ptr + row * K + cols, q.to(tl.int8), mask=mb[:, None])
    tl.store(d_ptr + row * (K // 32) + b, d, mask=mb)
    tl.store(s_ptr + row * (K // 32) + b, s, mask=mb)


_QUANTIZE = launcher(_quantize_kernel)


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of 32) -> (q [T, K] int8, d [T, K/32] float32, s [T, K/32] float32): module doc."""
    T, K = x.shape
    assert K % QK == 0 and x.is_contiguous(), (x.shape, x.is_contiguous())
    q = torch.empty(T, K, dtype=torch.int8, device=x.device)
    d = torch.empty(T, K // QK, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    nb = min(32, triton.next_power_of_2(K // QK))
    if T:
        _QUANTIZE[(T, triton.cdiv(K // QK, nb))](x, q, d, s, K, NB=nb, num_warps=4)
    return q, d, s


@triton.jit
def _sums_kernel(x_ptr, s_ptr, K, NB: tl.constexpr):
    """Row program_id(0), blocks program_id(1) * NB ..: x [T, K] bf16 -> s [T, K / 32] float32, the sum of each
    32-element block (fp32 adds in the order of tl.sum's tree, fixed for a fixed NB: one row's alone)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    mb = b < K // 32
    x = tl.load(x_ptr + row * K + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=mb[:, None], other=0.0)
    tl.store(s_ptr + row * (K // 32) + b, tl.sum(x.to(tl.float32), axis=1), mask=mb)


_SUMS = launcher(_sums_kernel)


def prepare_bf16(x: torch.Tensor, sums: bool = True) -> tuple[torch.Tensor, None, torch.Tensor]:
    """x [T, K] (K a multiple of 32) -> the bf16 MMA's activations (xb [T, K] bf16: x itself when it is bf16 and
    contiguous, else rounded to nearest even; None: no scales, dx = 1; s [T, K/32] float32: the block sums of xb,
    the K-quants' min term, where `sums`, else an empty tensor) -- gate_up / down's hq. s is NB = 32 blocks a program
    whatever T or K: a row's sums depend on that row alone."""
    T, K = x.shape
    assert K % QK == 0, x.shape
    xb = x.to(torch.bfloat16).contiguous()
    if not sums:
        return xb, None, torch.empty(1, dtype=torch.float32, device=x.device)
    s = torch.empty(T, K // QK, dtype=torch.float32, device=x.device)
    if T:
        _SUMS[(T, triton.cdiv(K // QK, 32))](xb, s, K, NB=32, num_warps=4)
    return xb, None, s


@triton.jit
def _q8_0_block(pool, ra, kb, mn, TL: tl.constexpr = 0):
    """Block kb of Q8_0 rows at byte addresses ra [BN]: (quants [BN, 32] int8, d [BN] float32). 34-byte blocks:
    f16 d, then 32 int8. TL: the weights' layout (triton_quants.wdot's: 1 = the tile layout, a block TILE_ROWS
    blocks from the row's next)."""
    b = ra + kb * (34 * (1 + (TILE_ROWS - 1) * TL))
    d = tl.load((pool + b).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
    w = tl.load(pool + b[:, None] + 2 + tl.arange(0, 32)[None, :], mask=mn[:, None], other=0)
    return w.to(tl.int8, bitcast=True), d


@triton.jit
def _mxfp4_block(pool, ra, kb, mn, TL: tl.constexpr = 0):
    """Block kb of MXFP4 rows at ra [BN]: (the doubled e2m1 values [BN, 32] int8, llama.cpp's kvalues_mxfp4
    0 1 2 3 4 6 8 12 and their negatives; d [BN] = 2^(e - 128), ggml_e8m0_to_fp32_half). 17-byte blocks: E8M0 e,
    qs[16] (elements 0..15 in the low nibbles, 16..31 in the high)."""
    b = ra + kb * (17 * (1 + (TILE_ROWS - 1) * TL))
    i = tl.arange(0, 32)
    c = tl.load(pool + b[:, None] + 1 + (i % 16)[None, :], mask=mn[:, None], other=0).to(tl.int32)
    c = (c >> ((i // 16) * 4)[None, :]) & 15
    e = (c >> 1) & 3
    mag = tl.where(e == 0, c & 1, (2 + (c & 1)) << tl.maximum(e - 1, 0))
    e8 = tl.load(pool + b, mask=mn, other=0).to(tl.int32)
    d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
    return tl.where(c >= 8, -mag, mag).to(tl.int8), d


@triton.jit
def _q4_k_scale(pool, b, mn, j, d, dmin):
    """Sub-block j of the super-blocks at b [BN]: (d sc, dmin m) float32 as get_scale_min_k4 (and _q4_k_block)."""
    lo = j < 4
    s_j = tl.load(pool + b + 4 + j, mask=mn, other=0).to(tl.int32)                      # scales[j]
    s_j4 = tl.load(pool + b + 8 + j, mask=mn, other=0).to(tl.int32)                     # scales[j + 4] (j < 8)
    s_jm4 = tl.load(pool + b + j, mask=mn, other=0).to(tl.int32)                        # scales[j - 4] (used: j >= 4)
    sc = tl.where(lo, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
    m = tl.where(lo, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    return d * sc.to(tl.float32), dmin * m.to(tl.float32)


@triton.jit
def _q4_k_block(pool, ra, kb, mn, TL: tl.constexpr = 0):
    """Block kb (sub-block j = kb % 8 of super-block kb // 8) of Q4_K rows at ra [BN]: (quants [BN, 32] int8 in
    0..15, d sc [BN], dmin m [BN]) float32, as ggml's get_scale_min_k4. 144-byte super-blocks: f16 d, f16 dmin,
    scales[12], qs[128] (32-byte group g: sub-block 2g in the low nibbles, 2g + 1 in the high)."""
    b = ra + (kb // 8) * (144 * (1 + (TILE_ROWS - 1) * TL))
    j = kb % 8
    d = tl.load((pool + b).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
    dmin = tl.load((pool + b + 2).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
    q = tl.load(pool + b[:, None] + 16 + (j // 2) * 32 + tl.arange(0, 32)[None, :], mask=mn[:, None], other=0)
    q = (q.to(tl.int32) >> (4 * (j % 2))) & 15
    dw, mw = _q4_k_scale(pool, b, mn, j, d, dmin)
    return q.to(tl.int8), dw, mw


@triton.jit
def _half(X, bit: tl.constexpr):
    """X [..., 2] -> X[..., bit] (a register move: tl.split)."""
    a, b = tl.split(X)
    if bit:
        r = b
    else:
        r = a
    return r


@triton.jit
def _part(P, i: tl.constexpr, KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """P [BN, BM, KB] -> P[:, :, i] [BN, BM] (KB 1, 2, 4 or 8; index i = 4a + 2b + c peeled from its low bit)."""
    if KB == 1:
        r = tl.reshape(P, (BN, BM))
    elif KB == 2:
        r = _half(P, i)
    elif KB == 4:
        r = _half(_half(tl.reshape(P, (BN, BM, 2, 2)), i % 2), i // 2)
    else:
        r = _half(_half(_half(tl.reshape(P, (BN, BM, 2, 2, 2)), i % 2), (i // 2) % 2), i // 4)
    return r


@triton.jit
def _w_tile(pool, ra, kb0, mn, QT: tl.constexpr, KB: tl.constexpr, BF: tl.constexpr = False, TL: tl.constexpr = 0):
    """The quants of blocks kb0 .. kb0 + KB of weight rows ra [BN] as one [BN, KB * 32] int8 tile (column c: block
    kb0 + c // 32, element c % 32; BF and MXFP4: element _perm(c) % 32, the word loads' order), in the values the
    block functions above give; TL their layout."""
    T: tl.constexpr = 1 + (TILE_ROWS - 1) * TL      # a block's stride: its bytes x T
    c = tl.arange(0, KB * 32)
    if BF and QT == 4:
        c = _perm(c)
    kb = kb0 + c // 32
    e = c % 32
    m2 = mn[:, None]
    if QT == 0:
        w = tl.load(pool + ra[:, None] + (kb * (34 * T) + 2 + e)[None, :], mask=m2, other=0).to(tl.int8,
                                                                                                bitcast=True)
    elif QT == 4:
        v = tl.load(pool + ra[:, None] + (kb * (17 * T) + 1 + e % 16)[None, :], mask=m2, other=0).to(tl.int32)
        v = (v >> ((e // 16) * 4)[None, :]) & 15
        x = (v >> 1) & 3
        mag = tl.where(x == 0, v & 1, (2 + (v & 1)) << tl.maximum(x - 1, 0))
        w = tl.where(v >= 8, -mag, mag).to(tl.int8)
    elif QT == 5:
        j = kb % 8
        q = tl.load(pool + ra[:, None] + ((kb // 8) * (144 * T) + 16 + (j // 2) * 32 + e)[None, :], mask=m2,
                    other=0)
        w = ((q.to(tl.int32) >> (4 * (j % 2))[None, :]) & 15).to(tl.int8)
    else:                           # Q5_K (BF only), 176-byte super-blocks: f16 d, f16 dmin, scales[12], qh[32],
        j = kb % 8                  # qs[128]: sub-block j's low 4 bits as Q4_K's (at byte 48), bit 4 = bit j of qh[e]
        o = (kb // 8) * (176 * T)
        q = tl.load(pool + ra[:, None] + (o + 48 + (j // 2) * 32 + e)[None, :], mask=m2, other=0).to(tl.int32)
        h = tl.load(pool + ra[:, None] + (o + 16 + e)[None, :], mask=m2, other=0).to(tl.int32)
        w = (((q >> (4 * (j % 2))[None, :]) & 15) | (((h >> j[None, :]) & 1) << 4)).to(tl.int8)
    return w


@triton.jit
def _w_scale(pool, ra, kb, mn, QT: tl.constexpr, TL: tl.constexpr = 0):
    """Block kb's weight scale d [BN] float32 (Q8_0: the f16 d; MXFP4: 2^(e - 128)), as the block functions."""
    T: tl.constexpr = 1 + (TILE_ROWS - 1) * TL
    if QT == 0:
        d = tl.load((pool + ra + kb * (34 * T)).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
    else:
        e8 = tl.load(pool + ra + kb * (17 * T), mask=mn, other=0).to(tl.int32)
        d = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
    return d


@triton.jit
def _perm(p):
    """MXFP4's order of a block's elements in the word-load MMA (WL): position 32 a + 8 w + 2 c + h holds element
    32 a + 16 h + 4 w + c. An int dot is exact in any order, a bf16 MMA's fp32 sum is not: BF takes this order in
    both the byte- and the word-load tiles, so WL stays a schedule key of the same bits."""
    r = p % 32
    return (p // 32) * 32 + (r % 2) * 16 + (r // 8) * 4 + (r % 8) // 2


@triton.jit
def _bd_dot(wq, xb, KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr):
    """wq [BN, KB*32] int8 and the block-diagonal activations xb [KB, BM, KB*32] (int8, or BF: bf16) -> the KB block
    dots [BN, BM, KB] of one MMA: int8 x int8 -> int32 (exact), or BF: the quants as bf16 (the same integers,
    exact) x bf16 -> fp32 (the products exact, their sum in the MMA's fixed order for a fixed KB and BM)."""
    return _bd_dot_t(wq, tl.trans(tl.reshape(xb, (KB * BM, KB * 32))), KB, BM, BN, BF)


@triton.jit
def _bd_dot_t(wq, xt, KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr):
    """_bd_dot of the MMA's B tile xt [KB*32, KB*BM] (xb reshaped and transposed: column i*BM + m holds row m's
    block i at rows 32 i .. 32 i + 31, zeros elsewhere)."""
    if BF and _INTERP:              # the same values; an output's KB*32 products [BN, KB*32, KB*BM] summed in
        p = wq.to(tl.float64)[:, :, None] * xt.to(tl.float64)[None, :, :]        # float64 (exact unless they span
        dot = tl.sum(p, axis=1).to(tl.float32)    # ~2^37), rounded once: no bit depends on the tile's M or N
    elif BF:
        dot = tl.dot(wq.to(tl.bfloat16), xt, out_dtype=tl.float32)
    else:
        dot = tl.dot(wq, xt, out_dtype=tl.int32)
    return tl.permute(tl.reshape(dot, (BN, KB, BM)), (0, 2, 1))


@triton.jit
def _bd_tile(xq_ptr, xoff, mr, kb0, QT: tl.constexpr, KB: tl.constexpr):
    """The bf16 MMA's B tile of blocks kb0 .. kb0 + KB, loaded as it is [KB*32, KB*BM] (BM = xoff's rows at element
    offsets xoff, mask mr): element (k, i*BM + m) = row m's element 32 (kb0 + i) + k % 32 where k // 32 = i
    (MXFP4: element _perm(k), the weights' order), else 0 -- the values of _bd_dot's xb, so the same MMA and bits.
    Its columns' runs of 32 contiguous elements load as 16-byte words (the zeros are masked off: no traffic) and
    store to shared memory as such: built in registers, xb's select, its transpose through shared memory and its
    2-byte stores (Triton's layouts) cost ~20 shared memory ops and 2 barriers a K step (cpu-mma55)."""
    R: tl.constexpr = xoff.shape[0]
    k = tl.arange(0, KB * 32)
    p = k
    if QT == 4:
        p = _perm(k)
    jo = tl.reshape(tl.broadcast_to(xoff[None, :], (KB, R)), (KB * R,))             # column j = i R + m: row m's
    jm = tl.reshape(tl.broadcast_to(mr[None, :], (KB, R)), (KB * R,))               # offset and mask, block i
    jb = tl.arange(0, KB * R) // R
    m2 = jm[None, :] & (jb[None, :] == (k // 32)[:, None])
    return tl.load(xq_ptr + jo[None, :] + kb0 * 32 + p[:, None], mask=m2, other=0.0)


@triton.jit
def _scale(dw, dx, BF: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """A block's scale of outputs [BN, BM]: dw [BN] x dx [BM] (q8_1), or BF: dw alone (dx = 1: no rounding)."""
    if BF:
        r = tl.broadcast_to(dw[:, None], (BN, BM))
    else:
        r = dw[:, None] * dx[None, :]
    return r


@triton.jit
def _mmq_step(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, kb0, QT: tl.constexpr, KB: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr = False, TL: tl.constexpr = 0):
    """acc + blocks kb0 .. kb0 + KB: ONE int8 MMA [BN, KB*32] x [KB*32, KB*BM] (the activations block-diagonal:
    column i*BM + m holds row m's block kb0 + i, zeros elsewhere) gives the KB exact int32 block dots of every
    (n, m) at once; then each block's scaling and fp32 add in ascending block order, the same float ops as a
    one-block step (module doc). Q4_K: a step lies in one super-block (KB | 8), whose d and dmin load once.
    BF: the bf16 MMA of the same integers against the bf16 activations (fp32 block dots; dx = 1, sx the x sums)."""
    c = tl.arange(0, KB * 32)
    wq = _w_tile(pool, ra, kb0, mn, QT, KB, BF, TL)                                              # [BN, KB*32]
    if BF:                          # the B tile loaded as it is (the same values as xb below, in the weights' order)
        P = _bd_dot_t(wq, _bd_tile(xq_ptr, xoff, mr, kb0, QT, KB), KB, BM, BN, BF)              # [BN, BM, KB]
    else:
        xq = tl.load(xq_ptr + xoff[:, None] + kb0 * 32 + c[None, :], mask=mr[:, None], other=0)   # [BM, KB*32]
        i3 = tl.arange(0, KB)[:, None, None]
        xb = tl.where(i3 == (c // 32)[None, None, :], xq[None, :, :], tl.zeros_like(xq)[None, :, :])  # [KB, BM, KB*32]
        P = _bd_dot(wq, xb, KB, BM, BN, BF)                                                  # [BN, BM, KB]
    if QT == 5 or QT == 6:          # Q4_K / Q5_K: the super-block's d and dmin once a step
        b = ra + (kb0 // 8) * ((144 if QT == 5 else 176) * (1 + (TILE_ROWS - 1) * TL))
        d = tl.load((pool + b).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
        dmin = tl.load((pool + b + 2).to(tl.pointer_type(tl.float16)), mask=mn, other=0).to(tl.float32)
    for i in tl.static_range(KB):                   # ascending blocks: the fp32 adds in K order
        di = _part(P, i, KB, BN, BM).to(tl.float32)
        if BF:                                      # dx = 1 (unused)
            dx = tl.zeros((BM,), tl.float32)
        else:
            dx = tl.load(xd_ptr + dxoff + kb0 + i, mask=mr, other=0.0)
        if QT == 5 or QT == 6:
            dw, mw = _q4_k_scale(pool, b, mn, (kb0 + i) % 8, d, dmin)
            sx = tl.load(xs_ptr + dxoff + kb0 + i, mask=mr, other=0.0)
            acc = acc + tl.fma(di, _scale(dw, dx, BF, BN, BM), -(mw[:, None] * sx[None, :]))
        else:
            dw = _w_scale(pool, ra, kb0 + i, mn, QT, TL)
            acc = tl.fma(di, _scale(dw, dx, BF, BN, BM), acc)
    return acc


# ---- WL = 1: the same tiles from int32 word loads (a schedule key: only how the bytes are read) ---------------------
# The byte-load tiles above cost a load instruction and a 32-bit register per byte, so a 4-warp program keeps one K
# step (BN x 34 B of Q8_0 at KB 1) in flight and waits on it before its MMA. Here every quant and scale byte comes from
# an aligned 32-bit word (rows at 4-byte multiples of 16-byte aligned parts: wl_ok), unpacked in registers: a block's
# quants that do not start on a word (Q8_0's even blocks at byte 2, MXFP4's at 1, 2, 3 mod 4) are funnel-shifted from
# the word pair (lo, hi); the activations are read as words too. A K step's words (_wl_fetch) are decoded into the
# int8 tiles of _w_tile and the float32 scales of the block functions (_wl_step): the same int8 values, the same
# float32 scales, so the same int32 dots and float ops, bit for bit. Within a block the dot's 32 positions may be
# permuted (MXFP4: position 8 w + 2 c + h holds element 16 h + 4 w + c, for weights and activations alike): the int32
# dot is exact in any order. PF (CONFIG's note): which words are fetched a step ahead and how; a byte-load step
# keeps one step of loads in flight a program, Triton's pipeline of word loads num_stages - 1 more.

@triton.jit
def _bytes_i8(v, R: tl.constexpr, NW: tl.constexpr):
    """int32 words v [R, NW] -> int8 [R, 4 NW]: position 4 i + c = the signed byte c of word i (little-endian)."""
    return tl.reshape(_join4(((v << 24) >> 24).to(tl.int8), ((v << 16) >> 24).to(tl.int8),
                             ((v << 8) >> 24).to(tl.int8), (v >> 24).to(tl.int8)), (R, 4 * NW))


@triton.jit
def _nib_i8(v, sh: tl.constexpr, R: tl.constexpr, NW: tl.constexpr):
    """int32 words v [R, NW] -> int32 [R, NW, 4]: position (i, c) = the 4-bit field at bit 8 c + sh of word i."""
    return _join4((v >> sh) & 15, (v >> (8 + sh)) & 15, (v >> (16 + sh)) & 15, (v >> (24 + sh)) & 15)


@triton.jit
def _funnel(lo, hi, s):
    """The 32 bits at bit offset s (0, 8, 16, 24) of the 64-bit little-endian pair (lo, hi) of int32 words."""
    t = tl.where(s == 0, 8, s)                      # (a shift by 32 is undefined: s = 0 takes lo as it is)
    return tl.where(s == 0, lo, ((lo >> t) & ((1 << (32 - t)) - 1)) | (hi << (32 - t)))


@triton.jit
def _wl_fetch(pool, ra, kb0, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, QT: tl.constexpr, KB: tl.constexpr,
              BF: tl.constexpr = False):
    """The raw int32 words of K step kb0 .. kb0 + KB of weight rows at byte addresses ra [BN] (mask mn) and q8_1
    rows at element offsets xoff [BM] (mask mr): (lo [BN, W KB]: the word holding each quant word's first byte
    (W = 8 quant words a block, MXFP4 4); hi: the word after it, loaded only where the quant word straddles two
    (else 0); sw: the scale words, [BN, KB] (Q8_0: the word holding d; MXFP4: the E8M0 byte's) or Q4_K's super-block
    header [BN, 4] (f16 d | f16 dmin, scales[0..3], [4..7], [8..11]); xw [BM, 8 KB]: the activations' quant words,
    block-major (MXFP4: word 8 a + 4 h + w at position 8 a + 2 w + h); xd, xs [BM, KB]: the activations' block scales
    and sums (Q4_K; else xd again)). BF: xw is the bf16 MMA's B tile [32 KB, KB BM] itself (_bd_tile), its positions
    as the weights' (MXFP4: position 32 a + 8 w + 2 c + h holds element 32 a + 16 h + 4 w + c), xd unused, xs the x
    sums."""
    m2 = mn[:, None]
    kk = kb0 + tl.arange(0, KB)
    wp = (pool + ra).to(tl.pointer_type(tl.int32))[:, None]         # word pointers of the rows (offsets in words:
    if QT == 0:                                     # the compiler sees runs of consecutive words, and Q4_K's 16-byte
        i = tl.arange(0, KB * 8)                    # alignment); 34-byte blocks: f16 d, 32 int8 at byte 2
        kb = kb0 + i // 8
        o = (kb * 34 + 2) // 4 + i % 8              # the word of quant word i's first byte; straddles: kb even
        st = (kb % 2) == 0
        sw = tl.load(wp + ((kk * 34) // 4)[None, :], mask=m2, other=0)
    elif QT == 4:                                   # 17-byte blocks: E8M0, 16 bytes of codes at byte 1
        i = tl.arange(0, KB * 4)
        kb = kb0 + i // 4
        o = (kb * 17 + 1) // 4 + i % 4              # straddles unless 17 kb + 1 = 0 mod 4
        st = ((kb * 17 + 1) % 4) != 0
        sw = tl.load(wp + ((kk * 17) // 4)[None, :], mask=m2, other=0)
    else:                                           # 144-byte super-blocks (36 words): block kb's nibbles in the
        i = tl.arange(0, KB * 8)                    # 8 words of group (kb % 8) // 2, at word 4 + 8 group
        kb = kb0 + i // 8
        o = (kb // 8) * 36 + 4 + ((kb % 8) // 2) * 8 + i % 8
        st = i < 0
        sw = tl.load(wp + ((kb0 // 8) * 36 + tl.arange(0, 4))[None, :], mask=m2, other=0)
    lo = tl.load(wp + o[None, :], mask=m2, other=0)
    if QT == 5:
        hi = lo
    else:
        hi = tl.load(wp + o[None, :] + 1, mask=m2 & st[None, :], other=0)
    xp = (xq_ptr + xoff).to(tl.pointer_type(tl.int32))[:, None] + kb0 * 8     # the q8_1 rows' words of block kb0
    if BF:                                          # bf16 elements, no words: the MMA's B tile itself (_bd_tile)
        xw = _bd_tile(xq_ptr, xoff, mr, kb0, QT, KB)
    elif QT == 4:                                     # block a's words w and 4 + w, interleaved (position 2 w + h)
        j = tl.arange(0, KB * 4)
        jw = (j // 4) * 8 + j % 4
        xw = tl.reshape(tl.join(tl.load(xp + jw[None, :], mask=mr[:, None], other=0),
                                tl.load(xp + jw[None, :] + 4, mask=mr[:, None], other=0)), (xoff.shape[0], KB * 8))
    else:
        xw = tl.load(xp + tl.arange(0, KB * 8)[None, :], mask=mr[:, None], other=0)
    if QT == 5:
        xs = tl.load(xs_ptr + dxoff[:, None] + kk[None, :], mask=mr[:, None], other=0.0)
    if BF:
        xd = tl.zeros((xoff.shape[0], KB), tl.float32)
    else:
        xd = tl.load(xd_ptr + dxoff[:, None] + kk[None, :], mask=mr[:, None], other=0.0)
    if QT != 5:
        xs = xd
    return lo, hi, sw, xw, xd, xs


@triton.jit
def _blk(P, i: tl.constexpr, KB: tl.constexpr, BN: tl.constexpr):
    """P [BN, KB] -> P[:, i] [BN] (register moves)."""
    if KB == 1:
        r = tl.reshape(P, (BN,))
    elif KB == 2:
        r = mv._pick(P, i, BN, 2, 1)
    elif KB == 4:
        r = mv._pick(P, i, BN, 4, 2)
    else:
        r = mv._pick(P, i, BN, 8, 3)
    return r


@triton.jit
def _wl_step(acc, lo, hi, sw, xw, xd, xs, kb0, QT: tl.constexpr, KB: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, PRMT: tl.constexpr = False, BF: tl.constexpr = False):
    """acc + blocks kb0 .. kb0 + KB from _wl_fetch's words: the int8 tiles of _w_tile (positions permuted within a
    block alike for weights and activations: MXFP4), the MMA of mmq_acc (KB 1) or _mmq_step (block-diagonal), then
    each block's float ops in ascending order with the block functions' float32 scales. BF: xw is the MMA's B tile
    (_wl_fetch: _bd_tile), the MMA bf16 with fp32 block dots (_bd_dot_t), dx = 1."""
    if QT == 0:                                     # even blocks' quants start at byte 2 of a word
        i = tl.arange(0, KB * 8)
        v = tl.where((((kb0 + i // 8) % 2) == 0)[None, :], ((lo >> 16) & 0xFFFF) | (hi << 16), lo)
        wq = _bytes_i8(v, BN, KB * 8)
        xq = xw if BF else _bytes_i8(xw, BM, KB * 8)
    elif QT == 4:                                   # codes at byte offset 17 kb + 1 + 4 w: funnel from (lo, hi)
        i = tl.arange(0, KB * 4)
        v = _funnel(lo, hi, ((((kb0 + i // 4) * 17 + 1) % 4) * 8)[None, :])
        xq = xw
        if PRMT:                                    # WL 2 (the GPU): the code table by byte permutes, 8 codes a word
            wl, wh = mv._mxfp4_int8(v)              # (elements 4 w + c, 16 + 4 w + c as int8 bytes c)
            wq = tl.reshape(tl.join(tl.reshape(_bytes_i8(wl, BN, KB * 4), (BN, KB * 4, 4)),
                                    tl.reshape(_bytes_i8(wh, BN, KB * 4), (BN, KB * 4, 4))), (BN, KB * 32))
        else:
            c = tl.reshape(tl.join(_nib_i8(v, 0, BN, KB * 4), _nib_i8(v, 4, BN, KB * 4)), (BN, KB * 32))
            x = (c >> 1) & 3
            mag = tl.where(x == 0, c & 1, (2 + (c & 1)) << tl.maximum(x - 1, 0))
            wq = tl.where(c >= 8, -mag, mag).to(tl.int8)
        if not BF:
            xl, xh = tl.split(tl.reshape(xw, (BM, KB * 4, 2)))
            xq = tl.reshape(tl.join(tl.reshape(_bytes_i8(xl, BM, KB * 4), (BM, KB * 4, 4)),
                                    tl.reshape(_bytes_i8(xh, BM, KB * 4), (BM, KB * 4, 4))), (BM, KB * 32))
    else:                                           # Q4_K: block kb's nibbles: low (kb even) or high of its group
        i = tl.arange(0, KB * 8)
        v = (lo >> ((((kb0 + i // 8) % 2) * 4)[None, :])) & 0x0F0F0F0F
        wq = _bytes_i8(v, BN, KB * 8)
        xq = xw if BF else _bytes_i8(xw, BM, KB * 8)
    if BF:                                          # the block-diagonal bf16 MMA (KB = 1: one block)
        P = _bd_dot_t(wq, xq, KB, BM, BN, BF)
    elif KB == 1:
        P = tl.reshape(tl.dot(wq, tl.trans(xq), out_dtype=tl.int32), (BN, BM, 1))
    else:
        c32 = tl.arange(0, KB * 32)
        i3 = tl.arange(0, KB)[:, None, None]
        xb = tl.where(i3 == (c32 // 32)[None, None, :], xq[None, :, :], tl.zeros_like(xq)[None, :, :])
        dot = tl.dot(wq, tl.trans(tl.reshape(xb, (KB * BM, KB * 32))), out_dtype=tl.int32)      # [BN, KB*BM]
        P = tl.permute(tl.reshape(dot, (BN, KB, BM)), (0, 2, 1))                                 # [BN, BM, KB]
    if QT == 5:                                     # the super-block's header: d, dmin and the 6-bit scales' bytes
        d = _f16(mv._pick(sw, 0, BN, 4, 2))
        dmin = _f16(mv._pick(sw, 0, BN, 4, 2) >> 16)
        s1 = mv._pick(sw, 1, BN, 4, 2)
        s2 = mv._pick(sw, 2, BN, 4, 2)
        s3 = mv._pick(sw, 3, BN, 4, 2)
    for i in tl.static_range(KB):                   # ascending blocks: the fp32 adds in K order (as _mmq_step)
        if KB == 1 and not BF:
            di = tl.reshape(P, (BN, BM)).to(tl.float32)
        elif KB == 1:
            di = tl.reshape(P, (BN, BM))
        else:
            di = _part(P, i, KB, BN, BM).to(tl.float32)
        dx = _blk(xd, i, KB, BM)
        if QT == 5:                                 # get_scale_min_k4 of sub-block j (as _q4_k_scale)
            j = (kb0 + i) % 8
            c1 = (s1 >> (8 * (j % 4))) & 255        # scales[j % 4], [4 + j % 4], [8 + j % 4]
            c2 = (s2 >> (8 * (j % 4))) & 255
            c3 = (s3 >> (8 * (j % 4))) & 255
            sc, m = k_scale_min_of(c1, c2, c3, j < 4)
            dw = d * sc.to(tl.float32)
            mw = dmin * m.to(tl.float32)
            sx = _blk(xs, i, KB, BM)
            acc = acc + tl.fma(di, _scale(dw, dx, BF, BN, BM), -(mw[:, None] * sx[None, :]))
        else:
            swi = _blk(sw, i, KB, BN)
            if QT == 0:                             # f16 d at byte 34 kb: the low half (kb even) or the high
                dw = _f16(swi >> (16 * ((kb0 + i) % 2)))
            else:                                   # E8M0 at byte 17 kb: byte kb % 4 of its word
                e8 = (swi >> (8 * ((kb0 + i) % 4))) & 255
                dw = tl.where(e8 < 2, (e8 + 1) * 0x00200000, (e8 - 1) << 23).to(tl.float32, bitcast=True)
            acc = tl.fma(di, _scale(dw, dx, BF, BN, BM), acc)
    return acc


@triton.jit
def wl_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT: tl.constexpr, KB: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, PF: tl.constexpr, PRMT: tl.constexpr = False, BF: tl.constexpr = False):
    """mmq_acc from word loads (WL = 1, module doc): the same tiles, dots and float ops, in the same order. PF 1: the
    next step's words fetched (masked past b1) before this step's decode and MMA; PF 2: its scale words only."""
    if PF == 2:                                     # the scale words one step ahead in registers, the quant words
        u0, u1, sw, u2, xd, xs = _wl_fetch(pool, ra, b0, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, QT, KB, BF)
        for kb0 in range(b0, b1, KB):               # in Triton's cp.async pipeline (loads left unused: dropped)
            nn = mn & (tl.zeros(mn.shape, tl.int32) + (kb0 + KB) < b1)
            nr = mr & (tl.zeros(mr.shape, tl.int32) + (kb0 + KB) < b1)
            v0, v1, sw2, v2, xd2, xs2 = _wl_fetch(pool, ra, kb0 + KB, nn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, nr,
                                                  QT, KB, BF)
            lo, hi, w0, xw, w1, w2 = _wl_fetch(pool, ra, kb0, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, QT, KB, BF)
            acc = _wl_step(acc, lo, hi, sw, xw, xd, xs, kb0, QT, KB, BM, BN, PRMT, BF)
            sw, xd, xs = sw2, xd2, xs2
    elif PF:
        lo, hi, sw, xw, xd, xs = _wl_fetch(pool, ra, b0, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, QT, KB, BF)
        for kb0 in range(b0, b1, KB):
            nn = mn & (tl.zeros(mn.shape, tl.int32) + (kb0 + KB) < b1)     # (as tensors: the interpreter's masks)
            nr = mr & (tl.zeros(mr.shape, tl.int32) + (kb0 + KB) < b1)
            lo2, hi2, sw2, xw2, xd2, xs2 = _wl_fetch(pool, ra, kb0 + KB, nn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, nr,
                                                     QT, KB, BF)
            acc = _wl_step(acc, lo, hi, sw, xw, xd, xs, kb0, QT, KB, BM, BN, PRMT, BF)
            lo, hi, sw, xw, xd, xs = lo2, hi2, sw2, xw2, xd2, xs2
    else:
        for kb0 in range(b0, b1, KB):
            lo, hi, sw, xw, xd, xs = _wl_fetch(pool, ra, kb0, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, QT, KB, BF)
            acc = _wl_step(acc, lo, hi, sw, xw, xd, xs, kb0, QT, KB, BM, BN, PRMT, BF)
    return acc


@triton.jit
def mmq_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT: tl.constexpr, KB: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr = False, TL: tl.constexpr = 0):
    """acc [BN, BM] + the rows' products over quant blocks b0 .. b1 (module doc): xq rows at element offsets xoff
    [BM], their block scales d (and sums s) at dxoff [BM] (mask mr). KB blocks a K step (_mmq_step; KB divides
    b1 - b0); KB = 1: one [BN, 32] x [32, BM] MMA a block. The same float ops, in the same order, for every KB.
    BF: the bf16 MMA (module doc; _mmq_step, KB = 1 too: one code path for the fp32 block dots)."""
    c = tl.arange(0, 32)
    if KB > 1 or BF:
        for kb0 in range(b0, b1, KB):
            acc = _mmq_step(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, kb0, QT, KB, BM, BN, BF, TL)
    else:
        for kb in range(b0, b1):
            xq = tl.load(xq_ptr + xoff[:, None] + kb * 32 + c[None, :], mask=mr[:, None], other=0)       # [BM, 32]
            dx = tl.load(xd_ptr + dxoff + kb, mask=mr, other=0.0)                                          # [BM]
            if QT == 0 or QT == 4:                      # Q8_0 / MXFP4: d_w d8_1 sumi
                if QT == 0:
                    wq, dw = _q8_0_block(pool, ra, kb, mn, TL)
                else:
                    wq, dw = _mxfp4_block(pool, ra, kb, mn, TL)
                dot = tl.dot(wq, tl.trans(xq), out_dtype=tl.int32)                                        # [BN, BM]
                acc = tl.fma(dot.to(tl.float32), dw[:, None] * dx[None, :], acc)
            else:                                       # Q4_K: d sc sumi d8 - dmin m s8 (s8 = d8 sum q8)
                wq, dw, mw = _q4_k_block(pool, ra, kb, mn, TL)
                sx = tl.load(xs_ptr + dxoff + kb, mask=mr, other=0.0)
                dot = tl.dot(wq, tl.trans(xq), out_dtype=tl.int32)
                acc = acc + tl.fma(dot.to(tl.float32), dw[:, None] * dx[None, :], -(mw[:, None] * sx[None, :]))
    return acc


@triton.jit
def _acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT: tl.constexpr, KB: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, MV: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
         NB: tl.constexpr, LOG2NB: tl.constexpr, DP4A: tl.constexpr, WL: tl.constexpr = 0,
         PF: tl.constexpr = 0, BF: tl.constexpr = False, TL: tl.constexpr = 0):
    """mmq_acc (int8 MMA; WL: its tiles from word loads, wl_acc), or with MV the same float ops without tensor cores
    (triton_mmq_mv.mv_acc; never with BF: _launch). TL 1 (the tile layout): mmq_acc's byte loads only (_launch)."""
    tl.static_assert(TL == 0 or (not MV and not WL), "the tile layout is read by mmq_acc's byte loads only")
    if MV:
        r = mv.mv_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT, BM, BN, D1, D2, D3, NB,
                      LOG2NB, DP4A)
    elif WL:
        r = wl_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT, KB, BM, BN, PF, WL == 2,
                   BF)
    else:
        r = mmq_acc(acc, pool, ra, mn, xq_ptr, xd_ptr, xs_ptr, xoff, dxoff, mr, b0, b1, QT, KB, BM, BN, BF, TL)
    return r


@triton.jit
def _gu_acc(pool, gra, ura, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, b0, b1, QT: tl.constexpr, KB: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, FUSE: tl.constexpr, MV: tl.constexpr, D1: tl.constexpr,
            D2: tl.constexpr, D3: tl.constexpr, NB: tl.constexpr, LOG2NB: tl.constexpr, DP4A: tl.constexpr,
            WL: tl.constexpr = 0, PF: tl.constexpr = 0, BF: tl.constexpr = False, TL: tl.constexpr = 0):
    """gate_up's partial over blocks b0 .. b1, from zero: [2 BN, BM], the gate rows gra then the up rows ura [BN].
    FUSE: both as one weight side of 2 BN rows (one MMA of M = 2 BN a step, a warpgroup each at 8 warps, the
    activations' tile built once); else gate's K walk, then up's. Either way each output's float ops are those of
    its own row (a schedule key)."""
    if FUSE:
        ra = tl.reshape(tl.permute(tl.join(gra, ura), (1, 0)), (2 * BN,))
        m2 = tl.reshape(tl.permute(tl.join(mn, mn), (1, 0)), (2 * BN,))
        acc = _acc(tl.zeros((2 * BN, BM), dtype=tl.float32), pool, ra, m2, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr,
                   b0, b1, QT, KB, BM, 2 * BN, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL, PF, BF, TL)
    else:
        z = tl.zeros((BN, BM), dtype=tl.float32)
        g = _acc(z, pool, gra, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, b0, b1, QT, KB, BM, BN, MV, D1, D2, D3, NB,
                 LOG2NB, DP4A, WL, PF, BF, TL)
        u = _acc(z, pool, ura, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, b0, b1, QT, KB, BM, BN, MV, D1, D2, D3, NB,
                 LOG2NB, DP4A, WL, PF, BF, TL)
        acc = tl.reshape(tl.permute(tl.join(g, u), (2, 0, 1)), (2 * BN, BM))
    return acc


@triton.jit
def _gate_up_mmq_kernel(xq_ptr, xd_ptr, xs_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr,
                        cnt_ptr, H, F, row_bytes, n_exp, k_top, limit, KCB, QT: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr,
                        ALIGNED: tl.constexpr = False, RA: tl.constexpr = 1, KB: tl.constexpr = 1,
                        SPLIT: tl.constexpr = False, FUSE: tl.constexpr = False, MV: tl.constexpr = False,
                        D1: tl.constexpr = 1, D2: tl.constexpr = 1, D3: tl.constexpr = 1, NB: tl.constexpr = 1,
                        LOG2NB: tl.constexpr = 0, DP4A: tl.constexpr = False, WL: tl.constexpr = 0,
                        PF: tl.constexpr = 0, BF: tl.constexpr = False, TB: tl.constexpr = 0, RAT: tl.constexpr = 1):
    """TB > 0: the bank may hold tile-layout experts (triton_moe._gate_up_kernel's TB and RAT: bit 0 of a base
    offset flags one; the byte-load MMA reads it, _launch); TB 0: the kernel as before."""
    e, mb, base = tm._find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    # -1: not in this group. Any other offset is an expert, a negative one too: decode's at-hand table names flex
    # chunks and host slots below the pool so (kernels.moe.Group); `base >= 0` skipped those experts, leaving
    # their rows of inter / y as torch.empty left them (issue 23's NaN)
    if base != -1:
        if TB == 0:
            _gate_up_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr,
                              H, F, row_bytes, k_top, limit, KCB, e, mb, base, QT, HAS_LIMIT, BM, BN, ALIGNED, RA, KB,
                              SPLIT, FUSE, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL, PF, BF, 0, 0)
        elif (base & 1) == 0:
            _gate_up_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr,
                              H, F, row_bytes, k_top, limit, KCB, e, mb, base, QT, HAS_LIMIT, BM, BN, ALIGNED, RA, KB,
                              SPLIT, FUSE, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL, PF, BF, 0, TB)
        else:
            _gate_up_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr,
                              H, F, row_bytes, k_top, limit, KCB, e, mb, base - 1, QT, HAS_LIMIT, BM, BN, ALIGNED, RAT,
                              KB, SPLIT, FUSE, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL, PF, BF, 1, TB)


@triton.jit
def _gate_up_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, inter_ptr, ws_ptr, cnt_ptr, H, F,
                      row_bytes, k_top, limit, KCB, e, mb, base, QT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, ALIGNED: tl.constexpr, RA: tl.constexpr, KB: tl.constexpr,
                      SPLIT: tl.constexpr, FUSE: tl.constexpr, MV: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                      D3: tl.constexpr, NB: tl.constexpr, LOG2NB: tl.constexpr, DP4A: tl.constexpr, WL: tl.constexpr,
                      PF: tl.constexpr, BF: tl.constexpr, TL: tl.constexpr, TB: tl.constexpr):
    """_gate_up_mmq_kernel's program for row block mb of expert e at pool offset base, its weights in layout TL."""
    rows, mr, flat = tm._rows_of(off_ptr, rows_ptr, e, mb, BM)
    tok = flat // k_top
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = n < F
    gra = tm._part_rows(base, starts_ptr, e, 0, n, row_bytes, ALIGNED, RA, TL, TB)
    ura = tm._part_rows(base, starts_ptr, e, 1, n, row_bytes, ALIGNED, RA, TL, TB)
    xo, dxo = tok * H, tok * (H // 32)
    NBLK = H // 32
    NCH = (NBLK + KCB - 1) // KCB
    z = tl.zeros((2 * BN, BM), dtype=tl.float32)
    tot = z
    if SPLIT:                   # this program: chunk program_id(2); the tile's last sums the chunks in order
        pc = tl.program_id(2)
        acc = _gu_acc(pool, gra, ura, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, pc * KCB,
                      tl.minimum(pc * KCB + KCB, NBLK), QT, KB, BM, BN, FUSE, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL,
                      PF, BF, TL)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.store(tm._partial_ptr(ws_ptr, tile, pc, NCH, 2 * BN * BM, 2 * BN, BM), acc)
        if tm._arrive(cnt_ptr, tile, NCH):
            for ch in range(0, NCH):        # 0 + p_0 + p_1 + ... in chunk order, as the walk below
                tot = tot + tl.load(tm._partial_ptr(ws_ptr, tile, ch, NCH, 2 * BN * BM, 2 * BN, BM),
                                    cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            accg, accu = tl.split(tl.permute(tl.reshape(tot, (2, BN, BM)), (1, 2, 0)))
            tm._gu_store(accg, accu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT)
    else:                       # the same chunk partials and sums, walked by one program
        for ch in range(0, NCH):
            tot = tot + _gu_acc(pool, gra, ura, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, ch * KCB,
                                tl.minimum(ch * KCB + KCB, NBLK), QT, KB, BM, BN, FUSE, MV, D1, D2, D3, NB,
                                LOG2NB, DP4A, WL, PF, BF, TL)
        accg, accu = tl.split(tl.permute(tl.reshape(tot, (2, BN, BM)), (1, 2, 0)))
        tm._gu_store(accg, accu, inter_ptr, rows, mr, n, mn, F, limit, HAS_LIMIT)


@triton.jit
def _down_mmq_kernel(xq_ptr, xd_ptr, xs_ptr, pool, base_ptr, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr,
                     H, F, row_bytes, n_exp, KCB, QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     EP: tl.constexpr, ALIGNED: tl.constexpr = False, RA: tl.constexpr = 1, KB: tl.constexpr = 1,
                     SPLIT: tl.constexpr = False, MV: tl.constexpr = False, D1: tl.constexpr = 1,
                     D2: tl.constexpr = 1, D3: tl.constexpr = 1, NB: tl.constexpr = 1, LOG2NB: tl.constexpr = 0,
                     DP4A: tl.constexpr = False, WL: tl.constexpr = 0, PF: tl.constexpr = 0,
                     BF: tl.constexpr = False, TB: tl.constexpr = 0, RAT: tl.constexpr = 1):
    """TB, RAT: as _gate_up_mmq_kernel's."""
    e, mb, base = tm._find_block(off_ptr, base_ptr, n_exp, tl.program_id(1), BM, EP)
    if base != -1:                  # as gate_up's: -1 alone means not in this group
        if TB == 0:
            _down_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                           row_bytes, KCB, e, mb, base, QT, BM, BN, ALIGNED, RA, KB, SPLIT, MV, D1, D2, D3, NB, LOG2NB,
                           DP4A, WL, PF, BF, 0, 0)
        elif (base & 1) == 0:
            _down_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                           row_bytes, KCB, e, mb, base, QT, BM, BN, ALIGNED, RA, KB, SPLIT, MV, D1, D2, D3, NB, LOG2NB,
                           DP4A, WL, PF, BF, 0, TB)
        else:
            _down_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                           row_bytes, KCB, e, mb, base - 1, QT, BM, BN, ALIGNED, RAT, KB, SPLIT, MV, D1, D2, D3, NB,
                           LOG2NB, DP4A, WL, PF, BF, 1, TB)


@triton.jit
def _down_mmq_body(xq_ptr, xd_ptr, xs_ptr, pool, starts_ptr, rows_ptr, off_ptr, y_ptr, ws_ptr, cnt_ptr, H, F,
                   row_bytes, KCB, e, mb, base, QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   ALIGNED: tl.constexpr, RA: tl.constexpr, KB: tl.constexpr, SPLIT: tl.constexpr, MV: tl.constexpr,
                   D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, NB: tl.constexpr, LOG2NB: tl.constexpr,
                   DP4A: tl.constexpr, WL: tl.constexpr, PF: tl.constexpr, BF: tl.constexpr, TL: tl.constexpr,
                   TB: tl.constexpr):
    """_down_mmq_kernel's program for row block mb of expert e at pool offset base, its weights in layout TL."""
    rows, mr, flat = tm._rows_of(off_ptr, rows_ptr, e, mb, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = n < H
    dra = tm._part_rows(base, starts_ptr, e, 2, n, row_bytes, ALIGNED, RA, TL, TB)
    r64 = rows.to(tl.int64)
    xo, dxo = r64 * F, r64 * (F // 32)
    NBLK = F // 32
    NCH = (NBLK + KCB - 1) // KCB
    ptr = y_ptr + flat[None, :] * H + n[:, None]
    z = tl.zeros((BN, BM), dtype=tl.float32)
    tot = z
    if SPLIT:
        pc = tl.program_id(2)
        acc = _acc(z, pool, dra, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, pc * KCB,
                   tl.minimum(pc * KCB + KCB, NBLK), QT, KB, BM, BN, MV, D1, D2, D3, NB, LOG2NB, DP4A, WL, PF,
                   BF, TL)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.store(tm._partial_ptr(ws_ptr, tile, pc, NCH, BN * BM, BN, BM), acc)
        if tm._arrive(cnt_ptr, tile, NCH):
            for ch in range(0, NCH):
                tot = tot + tl.load(tm._partial_ptr(ws_ptr, tile, ch, NCH, BN * BM, BN, BM), cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            tl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])
    else:
        for ch in range(0, NCH):
            tot = tot + _acc(z, pool, dra, mn, xq_ptr, xd_ptr, xs_ptr, xo, dxo, mr, ch * KCB,
                             tl.minimum(ch * KCB + KCB, NBLK), QT, KB, BM, BN, MV, D1, D2, D3, NB, LOG2NB, DP4A,
                             WL, PF, BF, TL)
        tl.store(ptr, tot.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mr[None, :])


_GATE_UP_MMQ, _DOWN_MMQ = map(launcher, (_gate_up_mmq_kernel, _down_mmq_kernel))


def mmq_ok(qt: int, K: int, bf: bool = False) -> bool:
    """Whether a launch of kernel type code qt over K columns has the MMA schedule (whole 32-element blocks; whole
    super-blocks for the K-quants), q8_1's or (bf) the bf16 mode's."""
    return qt in (BF_TYPES if bf else MMQ_TYPES) and K % (256 if qt in (5, 6) else QK) == 0


def wl_ok(qt: int, row_bytes: int, aligned: bool) -> bool:
    """Whether a launch can read its weight tiles as int32 words (WL): every row starts on a 4-byte boundary (16-byte
    aligned parts, row_bytes a multiple of 4). A launch that cannot reads bytes: the same tiles and bits."""
    return qt in MMQ_TYPES and aligned and row_bytes % 4 == 0


def wl_mode(qt: int, want: int) -> int:
    """The WL constant of a launch that reads words: 2 (MXFP4's codes by PTX byte permutes, llama.cpp's
    get_int_from_table_16: the same int8 values) where asked, the type is MXFP4 and the kernel is compiled for the
    GPU (the interpreter cannot run inline PTX), else 1."""
    return 2 if want == 2 and qt == 4 and os.environ.get("TRITON_INTERPRET", "0") != "1" else 1


def config(qt: int, bucket: int, bf: bool = False, pk: int = 0) -> dict:
    """The launch constants of kernel type code qt for a rows bucket (triton_moe.bucket_of): CONFIG, the bucket's
    (SPLIT, KB), the type's TUNING (KCB, warps), the pair's TYPE_BUCKET (bf: BF_TUNING instead), then TYPE_CONFIG's
    overrides; pk (not 0): PK over them all (engine.pack_experts' 2: the launch reads packed slots), with GL 1 (only
    gluon_mmq reads packed weights, cpu-mxpk63)."""
    per = BF_TUNING.get(qt, {}) if bf else TYPE_BUCKET.get((qt, bucket), {})
    c = {**CONFIG, **BUCKETS[bucket], **TUNING.get(qt, {}), **per, **TYPE_CONFIG.get(qt, {})}
    return {**c, "PK": pk, "GL": 1} if pk else c


def _chunk(c: dict, qt: int, K: int) -> tuple[int, int]:
    """(KB, KCB) of a launch over K columns: KB (a power of two <= 8) halved until it divides K / 32; KCB quant
    blocks a chunk (0: all of K in one), a multiple of KB."""
    nblk = K // QK
    kb = min(c["KB"], 8)
    while nblk % kb:
        kb //= 2
    kcb = c["KCB"] or nblk
    assert kcb % kb == 0, ("KCB: a multiple of KB", kcb, kb)
    return kb, kcb


def _launch(kernel, args: list, grid_n: int, R: int, E: int, K: int, qt: int, per: int, c: dict, consts: dict,
            device, row_bytes: int = 0, aligned: bool = False, bf: bool = False, tiled: bool = False):
    """Grid (output blocks, row blocks[, chunks]): the chunks as programs when the bucket says SPLIT, K has more
    than one and the partials fit triton_moe.WS_LIMIT (per: floats of a tile's partial), else walked: the same
    sums (0 + p_0 + p_1 + ... in chunk order) either way. bf: the bf16 MMA (BF; never the MV schedule). tiled: the
    bank may hold tile-layout experts (gate_up's): only the byte-load MMA reads them, so MV, WL and GL (schedule keys
    of the same bits) are off for the launch."""
    kb, kcb = _chunk(c, qt, K)
    nch = triton.cdiv(K // QK, kcb)
    if tiled:
        if c.get("PK"):
            raise ValueError(f"PK {c['PK']} (mma_pack's layout) and the tile layout in one launch: type {qt}")
        c = {**c, "MV": 0, "WL": 0, "GL": 0}
        consts = {**consts, **tm.tile_consts(qt)}
    use_mv = bool(c["MV"]) and not bf and mv.mv_ok(qt, K, kcb, c["NS"], row_bytes, aligned)
    if use_mv:                      # the decode schedule: BM_MV rows a block (per: floats of a tile's partial)
        per = per // c["BM"] * c["BM_MV"]
        c = {**c, "BM": c["BM_MV"]}
        consts = {**consts, "MV": True, **mv.dims(qt, c["NS"]), "DP4A": mv.dp4a_ok(qt, c["DP4A"])}
    else:                           # the MMA: its tiles from words where the rows allow (the same bits either way)
        wl = bool(c["WL"]) and wl_ok(qt, row_bytes, aligned)
        consts = {**consts, "WL": wl_mode(qt, c["WL"]) if wl else 0, "PF": int(c["PF"]) if wl else 0}
    nrb = tm._launch_rows(R, E, c["BM"])
    split = bool(c["SPLIT"]) and nch > 1 and grid_n * nrb * nch * per * 4 <= tm.WS_LIMIT
    ws, cnt = tm._workspace(device, grid_n * nrb * nch * per, grid_n * nrb) if split else tm._workspace(device, 1, 1)
    gl_ok = bf and c.get("GL") and gm.usable(qt, c, kb, device, aligned)
    if c.get("PK") and not gl_ok:   # packed weights: no other kernel reads them
        raise ValueError(f"PK {c['PK']} (mma_pack's layout) needs gluon_mmq's form, not usable here: type {qt}, "
                         f"config {c}")
    if gl_ok:                       # the Gluon form of the schedule (GL)
        which = "gate_up" if kernel is _GATE_UP_MMQ else "down"
        gm.launch(which, (grid_n, nrb, nch) if split else (grid_n, nrb),
                  [*args[:9], ws, cnt, *args[9:]], {**consts, "BM": c["BM"], "BN": c["BN"], "KB": kb, "SPLIT": split,
                                                    "EP": triton.next_power_of_2(E), "GP": c.get("GP", 0),
                                                    "PK": c.get("PK", 0), "ST": c.get("ST", 0),
                                                    "NR": which == "down" and c.get("NRD") or c.get("NR", 0)}, kcb)
        return
    kernel[(grid_n, nrb, nch) if split else (grid_n, nrb)](
        *args[:9], ws, cnt, *args[9:], kcb, **consts, BM=c["BM"], BN=c["BN"], EP=triton.next_power_of_2(E), KB=kb,
        SPLIT=split, BF=bf, num_warps=c["num_warps"], num_stages=c["num_stages"])


def gate_up(hq, pool, base, starts, rows, off, inter, n_ff: int, k_top: int, qt: int, limit: float | None,
            row_bytes: int, aligned: bool = False, pk: int = 0, tiled: bool = False):
    """triton_moe.gate_up with the activations as quantize_q8_1(h) = hq (q [T, H] int8, d [T, H/32], s), or as
    prepare_bf16(h) (xb [T, H] bf16, None, s: the bf16 MMA); aligned: every part starts 16-byte aligned (the rows'
    loads may then be wider, as triton_moe's); pk: the schedule key PK over the config (2: engine.pack_experts'
    per-expert layouts, bit 0 of base; 0: the config's); tiled: triton_moe.gate_up's (bit 0 of base flags a
    tile-layout expert; not with pk)."""
    q, d, sx = hq
    bf = d is None
    d = sx if bf else d
    E, R = base.numel(), rows.numel()
    c = config(qt, tm.bucket_of(R, E), bf, pk)
    _launch(_GATE_UP_MMQ, [q, d, sx, pool, base, starts, rows, off, inter, q.shape[1], n_ff, row_bytes, E, k_top,
                           float(limit) if limit is not None else 0.0],
            triton.cdiv(n_ff, c["BN"]), R, E, q.shape[1], qt, 2 * c["BN"] * c["BM"], c,
            dict(QT=qt, HAS_LIMIT=limit is not None, ALIGNED=aligned, RA=tm._row_align(row_bytes),
                 FUSE=bool(c["FUSE"])), q.device, row_bytes, aligned, bf, tiled)


def down(iq, pool, base, starts, rows, off, y, qt: int, row_bytes: int, aligned: bool = False, pk: int = 0,
         tiled: bool = False):
    """triton_moe.down with the activations as quantize_q8_1(inter) = iq (or prepare_bf16(inter): the bf16 MMA); pk
    and tiled as gate_up's."""
    q, d, sx = iq
    bf = d is None
    d = sx if bf else d
    H = y.shape[1]
    E, R = base.numel(), rows.numel()
    c = config(qt, tm.bucket_of(R, E), bf, pk)
    _launch(_DOWN_MMQ, [q, d, sx, pool, base, starts, rows, off, y, H, q.shape[1], row_bytes, E],
            triton.cdiv(H, c["BN"]), R, E, q.shape[1], qt, c["BN"] * c["BM"], c,
            dict(QT=qt, ALIGNED=aligned, RA=tm._row_align(row_bytes)), q.device, row_bytes, aligned, bf, tiled)


def compile_kernel(which: str = "gate_up", qt: int = 0, arch: int = 90, bm: int | None = None, bn: int | None = None,
                   num_warps: int | None = None, bucket: int = 16, kb: int | None = None,
                   kcb: int | None = None, fuse: int | None = None, over: dict | None = None,
                   hints: bool = False, bf: bool = False) -> tuple:
    """compile_report's kernel: (Triton's CompiledKernel for CUDA sm_`arch`, the launch config (KB, KCB, SPLIT as
    launched), the constexprs) of the same arguments (tests/scripts/sass_profile.py reads its cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    c = {**config(qt, bucket, bf), **({"BM": bm} if bm else {}), **({"BN": bn} if bn else {}),
         **({"num_warps": num_warps} if num_warps else {}), **({"KB": kb} if kb else {}),
         **({"KCB": kcb} if kcb is not None else {}), **({"FUSE": fuse} if fuse is not None else {}), **(over or {})}
    K = 2048 if which == "gate_up" else 768
    KB, KCB = _chunk(c, qt, K)
    split = bool(c["SPLIT"]) and K // QK > KCB
    ptr = {"xq_ptr": "*bf16" if bf else "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "pool": "*u8", "base_ptr": "*i64",
           "starts_ptr": "*i64", "rows_ptr": "*i32", "off_ptr": "*i32"}
    ws = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    if which == "gate_up":
        fn = _gate_up_mmq_kernel
        sig = {**ptr, "inter_ptr": "*bf16", **ws, "H": "i32", "F": "i32", "row_bytes": "i32", "n_exp": "i32",
               "k_top": "i32", "limit": "fp32", "KCB": "i32", "QT": "constexpr", "HAS_LIMIT": "constexpr",
               "FUSE": "constexpr"}
        const = {"QT": qt, "HAS_LIMIT": False, "FUSE": bool(c["FUSE"])}
    else:
        fn = _down_mmq_kernel
        sig = {**ptr, "y_ptr": "*bf16", **ws, "H": "i32", "F": "i32", "row_bytes": "i32", "n_exp": "i32",
               "KCB": "i32", "QT": "constexpr"}
        const = {"QT": qt}
    from betelgeuse.gguf.qtypes import row_nbytes
    gt = {code: t for t, code in tm.QT_CODES.items()}[qt]
    sig.update(BM="constexpr", BN="constexpr", EP="constexpr", ALIGNED="constexpr", RA="constexpr", KB="constexpr",
               SPLIT="constexpr")
    const.update(BM=c["BM"], BN=c["BN"], EP=256, ALIGNED=True,          # aligned rows of the bench geometry's K
                 RA=tm._row_align(row_nbytes(gt, K)), KB=KB, SPLIT=split)
    sig.update(MV="constexpr", D1="constexpr", D2="constexpr", D3="constexpr", NB="constexpr", LOG2NB="constexpr",
               DP4A="constexpr", WL="constexpr", PF="constexpr")
    sig.update(BF="constexpr", TB="constexpr", RAT="constexpr")
    const.update(BF=bf, TB=0, RAT=1)                 # TB 0: no tile-layout experts (the launch as the engine's)
    if c["MV"] and not bf and mv.mv_ok(qt, K, KCB, c["NS"], row_nbytes(gt, K), True):
        const.update(BM=c["BM_MV"], MV=True, **mv.dims(qt, c["NS"]), DP4A=bool(c["DP4A"]) and qt in mv.DP4A_TYPES,
                     WL=False, PF=False)
    else:
        wl = bool(c["WL"]) and wl_ok(qt, row_nbytes(gt, K), True)
        const.update(MV=False, D1=1, D2=1, D3=1, NB=1, LOG2NB=0, DP4A=False, WL=wl_mode(qt, c["WL"]) if wl else 0,
                     PF=int(c["PF"]) if wl else 0)
    attrs = {}
    if hints:                       # what triton.runtime.jit specializes for a launch of these values
        vals = {"H": 2048, "F": 768, "row_bytes": row_nbytes(gt, K), "n_exp": 128, "k_top": 8, "KCB": KCB}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in sig
                 and (sig[name].startswith("*") or vals.get(name, 1) % 16 == 0 and name in vals)}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
    return k, {**c, "KB": KB, "KCB": KCB, "SPLIT": split}, const


def compile_report(which: str = "gate_up", qt: int = 0, arch: int = 90, bm: int | None = None, bn: int | None = None,
                   num_warps: int | None = None, bucket: int = 16, kb: int | None = None,
                   kcb: int | None = None, fuse: int | None = None, over: dict | None = None,
                   hints: bool = False, bf: bool = False) -> dict:
    """Compile one mmq kernel for CUDA sm_`arch` without a GPU (Triton's compiler and the ptxas its wheel ships) at
    the bench geometry (H 2048, F 768: K = 2048 for gate_up, 768 for down) with the launch constants of `bucket`
    (config(); bm / bn / num_warps / kb / kcb / over's keys override: MV 1 the decode schedule) and report what the
    device will run: {"mma": tensor-core instructions in the PTX (mma / wgmma, by name and count), "loads": global
    loads in the PTX by width, "dp4a": dp4a instructions in the PTX, "imma": IMMA/HGMMA lines of the SASS (nvdisasm),
    "regs": registers per thread, "spill_bytes": ptxas's spill stores + loads, "smem": shared memory bytes,
    "ptxas": its -v line}. deploy/device/kernel_roofline.py --act-quant prints it beside the figures;
    tests/kernels/test_mmq.py checks the int8 MMA is there and nothing spills. hints: the alignment facts the JIT
    gives a device launch of the bench geometry (torch's 16-byte aligned pointers, the int arguments whose values
    are multiples of 16: H, F, row_bytes where it is, 128 experts, KCB), so loads may be as wide as there. bf: the
    bf16 MMA (act_quant bf16: bf16 activations, config(bf=True), BF)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    k, c, const = compile_kernel(which, qt, arch, bm, bn, num_warps, bucket, kb, kcb, fuse, over, hints, bf)
    ptx = k.asm["ptx"]
    mma = {}
    for m in re.findall(r"\b(w?gmma\.[\w.]+|mma\.sync\.[\w.]+)", ptx):
        mma[m] = mma.get(m, 0) + 1
    loads = {}                  # global loads by width (ld.global.b8 / .b16: byte loads; cp.async: staged into
    for m in re.findall(r"\b(ld\.global[\w.]*|cp\.async\.c[ag][\w.]*\s*\[[^]]*\],\s*\[[^]]*\],\s*\w+)", ptx):
        if m.startswith("cp."):     # shared memory, by its copy size in bytes: cp.async.ca.shared.global.4)
            m = m.split()[0] + "." + str(int(m.rsplit(",", 1)[1], 0))
        loads[m] = loads.get(m, 0) + 1
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = {"kernel": which, "qt": qt, "arch": f"sm_{arch}", "bucket": bucket, "bf": bf,
           "config": {**c, "WL": int(const["WL"]), "PF": int(const["PF"])},
           "hints": hints, "mma": mma, "loads": loads,
           "dp4a": ptx.count("dp4a."),
           "asm": sorted({m for m in ("prmt", "dp4a") if m + "." in ptx}), "imma": {}, "regs": None,
           "spill_bytes": None,
           "smem": k.metadata.shared, "ptxas": ""}
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"
        p.write_text(ptx)
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        for exe in ("ptxas-blackwell", "ptxas"):        # the newer one reads the PTX version Triton writes
            r = subprocess.run([str(bindir / exe), "-v", f"--gpu-name={sm}", str(p), "-o", str(Path(tmp) / "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
        log = r.stdout + r.stderr
        out["ptxas_err"] = log[-300:] if r.returncode else ""
        out["ptxas_rc"] = r.returncode
        out["ptxas"] = " ".join(line.strip() for line in log.splitlines() if "registers" in line or "spill" in line)
        if (m := re.search(r"Used (\d+) registers", log)):
            out["regs"] = int(m.group(1))
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        out["spill_bytes"] = sum(spills) if spills else None
        if r.returncode == 0:
            s = subprocess.run([str(bindir / "nvdisasm"), "-c", str(Path(tmp) / "k.o")], capture_output=True,
                               text=True).stdout
            for m in re.findall(r"\b((?:IMMA|HMMA|HGMMA|IGMMA)[\w.]*)", s):
                out["imma"][m] = out["imma"].get(m, 0) + 1
    return out


def _report_job(job: tuple, bucket: int) -> dict:
    """compile_report of (kernel, type code, overrides) with the alignment hints (the __main__ candidates' pool)."""
    w, code, over = job
    return compile_report(w, code, bucket=bucket, over=over, hints=True)


if __name__ == "__main__":       # python -m betelgeuse.kernels.triton_mmq: the compile check, no GPU needed
    import json
    import sys
    if len(sys.argv) > 1 and sys.argv[1].startswith("["):   # a JSON list of overrides (candidates): each at the
        from concurrent.futures import ProcessPoolExecutor  # 16-row bucket with a device launch's alignment facts,
        from functools import partial                       # compiled by 4 processes
        jobs = [(w, code, over) for over in json.loads(sys.argv[1]) for code in sorted(MMQ_TYPES)
                for w in ("gate_up", "down")]
        with ProcessPoolExecutor(4) as ex:
            for r in ex.map(partial(_report_job, bucket=16), jobs):
                print(json.dumps(r), flush=True)
        sys.exit(0)
    kbs = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [None]     # KB values (default: TUNING)
    for code in sorted(MMQ_TYPES):
        for w in ("gate_up", "down"):
            for kb in kbs:
                for bucket in (1, 16):
                    print(json.dumps(compile_report(w, code, bucket=bucket, kb=kb)))
