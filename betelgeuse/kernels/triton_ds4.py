"""Fused Triton kernels for deepseek4's per-row math on CUDA: a few launches per layer instead of hundreds.

`TritonOps` has the methods of model.deepseek4.TorchOps (the CPU path, the exact reference against
transformers) and must equal them within float noise (tests/kernels/test_ds4_kernels.py runs both under
TRITON_INTERPRET=1). What each replaces:

  hc_pre      mHC before a sublayer: unweighted RMS of the 4 streams, the [24, 4D] mix, sigmoid pre/post, the
              softmax + 20 Sinkhorn iterations of the 4x4 comb (~120 small torch ops), the collapse and the
              sublayer's RMSNorm -> 2 launches (a split-K partial product, then one program per row)
  hc_pre_lagged   the same with the streams collapsed by the previous sublayer's pre (deepseek41), the mix's own
              pre returned for the next sublayer -> 2 launches
  hc_post     post_k * (routed + shared) + comb^T X -> 1 launch
  rms_rope    RMSNorm (weighted, unweighted or none) then interleaved RoPE on the last dims, optionally also
              written into the window ring at the device position -> 1 launch (was ~12)
  compress_step   a decode token's row into the open window, the window's entry pooled (softmax gates over its
              slots), RMSNorm, RoPE at the window start, into the entries -> 1 launch (was ~25)
  index_topk  the lightning indexer's scores over every entry (relu(q.k) weighted over heads, invisible -inf)
              -> 1 launch + torch.topk
  decode_attend   one query over the window ring and the chosen / visible compressed entries, with the sinks
              (online softmax, the sink as the first element) -> 1 launch + the de-rotation (rms_rope, no norm)
  route_topk / route_hash   sqrt(softplus), bias, top-k by repeated argmax, renormalised weights -> 1 launch
  shared_ffn  the shared expert's clamped SwiGLU -> 1 launch between two matmuls (linears' one launch each)
  linears / grouped_linear   the dense projections of decode's few rows (T <= GEMV_ROWS): every product of a call
              (attention's 2-7 projections of u; q_b with the indexer's q_b; attn_output_a's 8 groups; the guess's
              routers) -> 1 launch of _gemv_kernel, where cuBLAS ran a split-K GEMM and its reduce per product (2
              launches each at one row: gpu-run61-h100); more rows (prefill chunks) keep the library's gemm

Every kernel runs one program per row (or per row and column block), with block sizes that never depend on the
number of rows, so a row's bits do not depend on the other rows of its launch (batch invariance, invariant 6);
eager and graph-replayed steps run the same kernels (invariant 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from betelgeuse.kernels import dense
from betelgeuse.kernels.triton_launch import launcher
from betelgeuse.routing_approx import Residency

HC_SPLIT_K = 1024          # columns of the [M, hc*D] mHC matrix per partial-product program
ATTN_KB = 128              # head-dim columns per chunk of _decode_attn_kernel (its doc; min(ATTN_KB, HD) a launch)
ATTN_STAGES = 1            # _decode_attn_kernel's num_stages (its doc: 3 would stage the chunks' loads, 181 KB)
# the dense projections (TritonOps.linears / grouped_linear): up to GEMV_ROWS rows (decode: 1 solo, max_running in the
# lanes; a prefill chunk's tail) in _gemv_kernel, ONE launch for all the products of a call, rows in tiles of GEMV_BT
# (the dot's M: the tensor cores' least, padded rows masked), K in steps of GEMV_BK; more rows (prefill chunks) take
# the library's gemm (TorchOps: cuBLAS split-K at few rows was two launches a product, a partial GEMM and a reduce)
GEMV_ROWS = 64
GEMV_BT = 16
GEMV_BK = 256
# BN (outputs a program; 0: 16, or 32 from 8192 outputs a call) and the K loop's pipeline depth: launch constants only
# (a row's K order is GEMV_BK's), which deploy/device/gemv_bench.py --sweep times
GEMV_BN = 0
GEMV_STAGES = 3


@triton.jit
def _hc_partial_kernel(x_ptr, fn_ptr, pm_ptr, pss_ptr, K, S,
                       M: tl.constexpr, MP: tl.constexpr, KS: tl.constexpr, BK: tl.constexpr):
    """Program (t, s): columns [s*KS, (s+1)*KS) of row t: pm[t, s, :M] = fn[:, cols] . x[cols], pss[t, s] = sum x^2."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    r = tl.arange(0, MP)
    mr = r < M
    acc = tl.zeros((MP,), dtype=tl.float32)
    ss = tl.zeros((BK,), dtype=tl.float32)
    for kk in range(0, KS, BK):
        c = s * KS + kk + tl.arange(0, BK)
        mc = c < K
        x = tl.load(x_ptr + t * K + c, mask=mc, other=0).to(tl.float32)
        f = tl.load(fn_ptr + r[:, None] * K + c[None, :], mask=mr[:, None] & mc[None, :], other=0)
        acc += tl.sum(f * x[None, :], axis=1)
        ss += x * x
    tl.store(pm_ptr + (t * S + s) * MP + r, acc)
    tl.store(pss_ptr + t * S + s, tl.sum(ss, axis=0))


@triton.jit
def _hc_finish_kernel(x_ptr, pm_ptr, pss_ptr, base_ptr, scale_ptr, norm_ptr, post_ptr, comb_ptr, h_ptr,
                      pre_ptr, lag_ptr, D, K, S, iters, hc_eps, eps, T,
                      HC: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, LAG: tl.constexpr):
    """Program (t, l): row t's pre, post, comb of the mix; h = RMSNorm(sum_j c_j X_j) with c = pre, or (LAG:
    deepseek41's lagged mHC) c = lag[t] (the previous sublayer's pre), this mix's pre then stored in pre_ptr.
    l > 0 (the decode guess, several layers' mixes of the same rows): layer l's mix rows are pm's columns
    [l*M, (l+1)*M) (M = (2 + HC) * HC), its base / scale / norm rows l of stacked [*, M] / [*, 3] / [*, D], its
    outputs row l*T + t ([n, T, ...])."""
    t = tl.program_id(0).to(tl.int64)
    ly = tl.program_id(1).to(tl.int64)
    base_ptr += ly * (2 + HC) * HC
    scale_ptr += ly * 3
    norm_ptr += ly * D
    o = ly * T + t                                                              # the output row
    sp = tl.arange(0, SP)
    ms = sp < S
    j = tl.arange(0, HC)
    rinv = tl.rsqrt(tl.sum(tl.load(pss_ptr + t * S + sp, mask=ms, other=0), axis=0) / K + eps)
    prow = pm_ptr + (t * S + sp) * MP + ly * (2 + HC) * HC                       # [SP] partial rows
    pre_m = tl.sum(tl.load(prow[:, None] + j[None, :], mask=ms[:, None], other=0), axis=0) * rinv
    post_m = tl.sum(tl.load(prow[:, None] + HC + j[None, :], mask=ms[:, None], other=0), axis=0) * rinv
    jk = j[:, None] * HC + j[None, :]                                            # [HC, HC]
    comb_m = tl.sum(tl.load(prow[:, None, None] + 2 * HC + jk[None, :, :], mask=ms[:, None, None], other=0),
                    axis=0) * rinv
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_m * s0 + tl.load(base_ptr + j)) + hc_eps
    post = 2 * tl.sigmoid(post_m * s1 + tl.load(base_ptr + HC + j))
    c = comb_m * s2 + tl.load(base_ptr + 2 * HC + jk)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + hc_eps
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + o * HC + j, post)
    tl.store(comb_ptr + o * HC * HC + jk, c)
    if LAG:
        tl.store(pre_ptr + o * HC + j, pre)
        pre = tl.load(lag_ptr + t * HC + j)
    # u = sum_j pre_j X_j in X's dtype, then the sublayer's RMSNorm (u recomputed rather than re-read: no barrier)
    ssu = tl.zeros((BD,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        md = d < D
        xt = tl.load(x_ptr + t * HC * D + j[:, None] * D + d[None, :], mask=md[None, :], other=0).to(tl.float32)
        u = tl.sum(pre[:, None] * xt, axis=0).to(h_ptr.dtype.element_ty).to(tl.float32)
        ssu += u * u
    ru = tl.rsqrt(tl.sum(ssu, axis=0) / D + eps)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        md = d < D
        xt = tl.load(x_ptr + t * HC * D + j[:, None] * D + d[None, :], mask=md[None, :], other=0).to(tl.float32)
        u = tl.sum(pre[:, None] * xt, axis=0).to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(norm_ptr + d, mask=md, other=0)
        tl.store(h_ptr + o * D + d, (w * (u * ru)).to(h_ptr.dtype.element_ty), mask=md)


@triton.jit
def _hc_post_kernel(x_ptr, a_ptr, b_ptr, post_ptr, comb_ptr, out_ptr, D,
                    HAS_B: tl.constexpr, HC: tl.constexpr, BD: tl.constexpr):
    """out[t, k] = post_k * (a + b)[t] + sum_j comb[t, j, k] X[t, j] (post and comb rounded to X's dtype, as torch)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < D
    j = tl.arange(0, HC)
    dt = out_ptr.dtype.element_ty
    o = tl.load(a_ptr + t * D + d, mask=md, other=0)
    if HAS_B:
        o = (o.to(tl.float32) + tl.load(b_ptr + t * D + d, mask=md, other=0).to(tl.float32)).to(dt)
    o = o.to(tl.float32)
    post = tl.load(post_ptr + t * HC + j).to(dt).to(tl.float32)
    comb = tl.load(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :]).to(dt).to(tl.float32)   # [j, k]
    xt = tl.load(x_ptr + t * HC * D + j[:, None] * D + d[None, :], mask=md[None, :], other=0).to(tl.float32)
    mix = tl.sum(comb[:, :, None] * xt[:, None, :], axis=0)                                         # [k, BD]
    res = post[:, None] * o[None, :] + mix
    tl.store(out_ptr + t * HC * D + j[:, None] * D + d[None, :], res.to(dt), mask=md[None, :])


@triton.jit
def _rms_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, ring_ptr, pos_ptr, D, R, NH, W, OT, eps,
                     NORM: tl.constexpr, NEG_SIN: tl.constexpr, RING: tl.constexpr, BD: tl.constexpr):
    """Row `row` = token t * NH + head of x [rows, D]: NORM 0 none, 1 unweighted (in x's dtype, as V4's q norm),
    2 weighted (float32, as _rms); then RoPE on the last R dims (pairs (2i, 2i+1); cos/sin [T, R] float32).
    RING: the row also into ring[pos % W] (a decode token's K=V row into its window). out: token t's NH rows
    contiguous at out_ptr + t * OT (OT = NH * D, or a lane buffer's row stride)."""
    row = tl.program_id(0).to(tl.int64)
    t = row // NH
    c = tl.arange(0, BD)
    mc = c < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + c, mask=mc, other=0).to(tl.float32)
    xp = tl.load(x_ptr + row * D + (c ^ 1), mask=mc, other=0).to(tl.float32)     # the RoPE pair partner
    if NORM == 1:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps).to(dt).to(tl.float32)
        x = (x * r).to(dt).to(tl.float32)
        xp = (xp * r).to(dt).to(tl.float32)
    elif NORM == 2:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = (tl.load(w_ptr + c, mask=mc, other=0) * (x * r)).to(dt).to(tl.float32)
        xp = (tl.load(w_ptr + (c ^ 1), mask=mc, other=0) * (xp * r)).to(dt).to(tl.float32)
    rc = c - (D - R)
    inr = (rc >= 0) & mc
    cs = tl.load(cos_ptr + t * R + rc, mask=inr, other=1.0)
    sn = tl.load(sin_ptr + t * R + rc, mask=inr, other=0.0)
    if NEG_SIN:
        sn = -sn
    rot = tl.where((c % 2) == 0, -xp, xp)
    y = tl.where(inr, x * cs + rot * sn, x).to(dt)
    tl.store(out_ptr + t * OT + (row - t * NH) * D + c, y, mask=mc)
    if RING:
        p = tl.load(pos_ptr)
        tl.store(ring_ptr + (p % W) * D + c, y, mask=mc)


@triton.jit
def _compress_step_kernel(kvb_ptr, gb_ptr, ent_ptr, kv_ptr, g_ptr, ape_ptr, norm_ptr, inv_ptr, pos_ptr, eps,
                          D, C, R_ROPE,
                          RATIO: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr, BD: tl.constexpr):
    """One decode token at pos: its compressor row (kv, gate [C]) into the buffers at row pos % ROWS; entry
    w = pos // RATIO pooled over its SLOTS slots (RATIO 4: the previous window's first half, channels [0, D),
    and this window's second half, channels [D, 2D); window 0's missing half gated -inf; RATIO 128: this window),
    RMSNorm, RoPE at position w * RATIO on the last R_ROPE dims, into ent[w]."""
    dt = ent_ptr.dtype.element_ty
    pos = tl.load(pos_ptr)
    w = pos // RATIO
    row_new = pos % ROWS
    for c0 in range(0, C, BD):                      # the new row into the buffers
        c = c0 + tl.arange(0, BD)
        mc = c < C
        tl.store(kvb_ptr + row_new * C + c, tl.load(kv_ptr + c, mask=mc, other=0), mask=mc)
        tl.store(gb_ptr + row_new * C + c, tl.load(g_ptr + c, mask=mc, other=0), mask=mc)
    s = tl.arange(0, SLOTS)
    if RATIO == 4:
        half = s // 4                               # 0: previous window (first half), 1: this one (second half)
        row = tl.where(half == 0, ((w + 1) % 2) * 4 + s, (w % 2) * 4 + (s - 4))
        choff = half * D
        dead = (half == 0) & (w == 0)
    else:
        row = s
        choff = s * 0
        dead = s < 0
    arow = s % RATIO
    ss = tl.zeros((BD,), dtype=tl.float32)
    for d0 in range(0, D, BD):                      # pooled (rounded to the dtype, as torch's) into ent[w]
        d = d0 + tl.arange(0, BD)
        md = d < D
        ch = choff[:, None] + d[None, :]
        m2 = md[None, :] & (s >= 0)[:, None]
        new = row[:, None] == row_new
        # the new row's channels as [BD] vectors (both halves' for ratio 4) broadcast over the slots, not a second
        # [SLOTS, BD] load: the same values, fewer live tiles (ratio 128's [128, 128] tiles spilled: kernel_lmem.py)
        kn = tl.load(kv_ptr + d, mask=md, other=0)
        gn = tl.load(g_ptr + d, mask=md, other=0)
        if RATIO == 4:
            kn = tl.where(half[:, None] == 0, kn[None, :], tl.load(kv_ptr + D + d, mask=md, other=0)[None, :])
            gn = tl.where(half[:, None] == 0, gn[None, :], tl.load(g_ptr + D + d, mask=md, other=0)[None, :])
        else:
            kn = kn[None, :]
            gn = gn[None, :]
        g = tl.where(new, gn, tl.load(gb_ptr + row[:, None] * C + ch, mask=m2, other=0)).to(tl.float32)
        g = g + tl.load(ape_ptr + arow[:, None] * C + ch, mask=m2, other=0)
        g = tl.where(dead[:, None], float("-inf"), g)
        e = tl.exp(g - tl.max(g, axis=0)[None, :])
        sm = (e / tl.sum(e, axis=0)[None, :]).to(dt).to(tl.float32)
        k = tl.where(new, kn, tl.load(kvb_ptr + row[:, None] * C + ch, mask=m2, other=0)).to(tl.float32)  # after
        pooled = tl.sum((k * sm).to(dt).to(tl.float32), axis=0).to(dt)
        tl.store(ent_ptr + w * D + d, pooled, mask=md)
        pf = pooled.to(tl.float32)
        ss += tl.where(md, pf * pf, 0)
    tl.debug_barrier()
    rinv = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
    angle0 = (w * RATIO).to(tl.float32)
    for d0 in range(0, D, BD):                      # RMSNorm and RoPE in place (pairs stay inside a block)
        d = d0 + tl.arange(0, BD)
        md = d < D
        x = tl.load(ent_ptr + w * D + d, mask=md, other=0).to(tl.float32)
        xp = tl.load(ent_ptr + w * D + (d ^ 1), mask=md, other=0).to(tl.float32)
        x = (tl.load(norm_ptr + d, mask=md, other=0) * (x * rinv)).to(dt).to(tl.float32)
        xp = (tl.load(norm_ptr + (d ^ 1), mask=md, other=0) * (xp * rinv)).to(dt).to(tl.float32)
        rc = d - (D - R_ROPE)
        inr = (rc >= 0) & md
        ang = angle0 * tl.load(inv_ptr + rc // 2, mask=inr, other=0)
        rot = tl.where((d % 2) == 0, -xp, xp)
        y = tl.where(inr, x * tl.cos(ang) + rot * tl.sin(ang), x).to(dt)
        tl.debug_barrier()
        tl.store(ent_ptr + w * D + d, y, mask=md)


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, N, wscale, kscale, RATIO,
                         NH: tl.constexpr, IHD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """out[n] = sum_h w[h] * wscale * relu(q[h] . K[n]) * kscale for the visible entries n < (pos+1) // RATIO,
    else -inf."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = n < N
    h = tl.arange(0, NH)
    dd = tl.arange(0, IHD)
    q = tl.load(q_ptr + h[:, None] * IHD + dd[None, :])
    k = tl.load(k_ptr + n.to(tl.int64)[:, None] * IHD + dd[None, :], mask=mn[:, None], other=0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    wts = tl.load(w_ptr + h).to(tl.float32) * wscale
    sc = tl.sum(tl.maximum(s, 0) * kscale * wts[:, None], axis=0)
    vis = mn & (n < (tl.load(pos_ptr) + 1) // RATIO)
    tl.store(out_ptr + n, tl.where(vis, sc, float("-inf")), mask=mn)


@triton.jit
def _attn_keys(ring_ptr, ent_ptr, rows, ring, valid, own, kv_ptr, c0, HD: tl.constexpr, KB: tl.constexpr):
    """Columns [c0, c0 + KB) of a key block [BS, KB] (K = V): ring rows (the token's own row from kv: not yet
    visible in memory to the other programs), entry rows, invisible rows 0."""
    dd = c0 + tl.arange(0, KB)
    kr = tl.load(ring_ptr + rows[:, None] * HD + dd[None, :], mask=(ring & valid & (rows != own))[:, None], other=0)
    # masked by valid too: a block's rows past n_keys (row j - W >= NE; MODE 0: ent_ptr is the ring) lie past the
    # tensor's end (an illegal address on CUDA where nothing is mapped there: gpu-run47; tests/scripts/ds4_attend_guard)
    k = tl.load(ent_ptr + rows[:, None] * HD + dd[None, :], mask=(~ring & valid)[:, None], other=0)
    k = tl.where(ring[:, None], kr, k)
    k = tl.where((ring & (rows == own))[:, None], tl.load(kv_ptr + dd)[None, :], k)
    return tl.where(valid[:, None], k, 0)


@triton.jit
def _decode_attn_kernel(q_ptr, kv_ptr, ring_ptr, ent_ptr, top_ptr, pos_ptr, sinks_ptr, out_ptr, H, W, NE, RATIO, scale,
                        MODE: tl.constexpr, HD: tl.constexpr, HB: tl.constexpr, BS: tl.constexpr,
                        IEEE: tl.constexpr, KB: tl.constexpr):
    """Heads [HB*pid, ..) of one query over keys j in [0, W + NE): ring rows (visible: the position the row holds
    is >= 0; row pos % W is the token's own K=V row kv, which program 0 also stores there) then entries (MODE 1:
    rows top[j - W]; 2: row j - W; visible: row < (pos+1) // RATIO). Online softmax started at the head's sink (it
    only enlarges the denominator); K = V.

    The head dim in KB-column chunks (HD // KB, in order), so that no [HB, HD] / [BS, HD] operand is held whole
    (q whole, replicated over the warps as the MMA's A operand, spilled ~0.7 KB a thread: the driver's local-memory
    reservation, x 270,336 threads on an H100; tests/scripts/kernel_lmem.py): s = q . k^T as chained dots over the
    chunks (the accumulator carried: the same MMA / FMA steps in the same K order as one dot over HD), acc by column
    chunks (each output column its own sums): the same bits as unchunked. Launched with num_stages 1: the software
    pipeliner would stage the chunks' key loads (~180 KB of shared memory a block); the unchunked kernel's loads were
    not pipelined either (50 KB)."""
    NK: tl.constexpr = HD // KB
    hb = tl.program_id(0) * HB + tl.arange(0, HB)
    mh = hb < H
    pos = tl.load(pos_ptr)
    own = pos % W
    if tl.program_id(0) == 0:
        dd = tl.arange(0, HD)
        tl.store(ring_ptr + own * HD + dd, tl.load(kv_ptr + dd))
    m_i = tl.load(sinks_ptr + hb, mask=mh, other=0).to(tl.float32)
    l_i = tl.full((HB,), 1.0, tl.float32)
    accs = ()
    qs = ()
    for c in tl.static_range(NK):
        accs = accs + (tl.zeros((HB, KB), dtype=tl.float32),)
        dq = c * KB + tl.arange(0, KB)
        qs = qs + (tl.load(q_ptr + hb[:, None] * HD + dq[None, :], mask=mh[:, None], other=0),)
    n_keys = W + NE if MODE > 0 else W
    for j0 in range(0, n_keys, BS):
        j = j0 + tl.arange(0, BS)
        ring = j < W
        held = pos - ((pos - j) % W + W) % W                       # the position ring row j holds
        e = j - W
        if MODE == 1:
            er = tl.load(top_ptr + e, mask=(~ring) & (e < NE), other=0)
        else:
            er = e
        valid = tl.where(ring, held >= 0, (e < NE) & (er < (pos + 1) // RATIO)) & (j < n_keys)
        rows = tl.where(ring, j, er).to(tl.int64)
        s = tl.zeros((HB, BS), dtype=tl.float32)
        ks = ()
        for c in tl.static_range(NK):                               # s = q . k^T, K in chunk order
            q = qs[c]
            k = _attn_keys(ring_ptr, ent_ptr, rows, ring, valid, own, kv_ptr, c * KB, HD, KB)
            ks = ks + (k,)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), s, input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k), s)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        accs2 = ()
        for c in tl.static_range(NK):                               # acc's column chunks
            k = ks[c]
            if IEEE:
                a = accs[c] * alpha[:, None] + tl.dot(p, k.to(tl.float32), input_precision="ieee")
            else:
                a = accs[c] * alpha[:, None] + tl.dot(p.to(k.dtype), k)
            accs2 = accs2 + (a,)
        accs = accs2
        m_i = m_new
    for c in tl.static_range(NK):
        dd = c * KB + tl.arange(0, KB)
        tl.store(out_ptr + hb[:, None] * HD + dd[None, :], (accs[c] / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mh[:, None])


@triton.jit
def _route_approx_kernel(logits_ptr, bias_ptr, tid_ptr, tok_ptr, mask_ptr, ids_ptr, w_ptr, E, scale,
                         K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr,
                         HASH: tl.constexpr, RANK0: tl.constexpr):
    """An approximate routing mode's choice (routing_approx.py), row t, by repeated argmax over the experts left:
    each rank from the resident ones left (mask) while any is left, else from all left; RANK0 (`resident`): rank 0
    from all (the exact first choice). A top-k layer picks the best s + bias, a hash layer (HASH, `pool`) the
    table's experts first in table order, then the best s. Ties go to the lower id (tl.argmax's first maximum),
    as the stable sort of approx_topk / approx_hash does. Weights as _route_kernel's."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    me = e < E
    x = tl.load(logits_ptr + t * E + e, mask=me, other=0).to(tl.float32)
    s = tl.sqrt(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))
    res = (tl.load(mask_ptr + e, mask=me, other=0) != 0) & me
    kr = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    vals = tl.zeros((KP,), dtype=tl.float32)
    if HASH:
        tok = tl.load(tok_ptr + t)
        tab = tl.load(tid_ptr + tok * K + kr, mask=kr < K, other=-1).to(tl.int64)
        # each expert's place in the token's table row (KP: not in it)
        tpos = tl.min(tl.where(tab[:, None] == e[None, :], kr[:, None], KP), axis=0)
        key = tl.where(me, s, float("-inf"))
    else:
        tpos = tl.full((EP,), KP, dtype=tl.int32)
        key = tl.where(me, s + tl.load(bias_ptr + e, mask=me, other=0), float("-inf"))
    left = me
    for i in range(K):
        lr = left & res
        cand = tl.where(tl.sum(lr.to(tl.int32), axis=0) > 0, lr, left)
        if RANK0:
            if i == 0:
                cand = left
        tab_c = cand & (tpos < KP)
        by_tab = tl.argmin(tl.where(tab_c, tpos, KP), axis=0)
        by_key = tl.argmax(tl.where(cand & (tpos >= KP), key, float("-inf")), axis=0)
        idx = tl.where(tl.sum(tab_c.to(tl.int32), axis=0) > 0, by_tab, by_key)
        ids = tl.where(kr == i, idx.to(tl.int64), ids)
        vals = tl.where(kr == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), vals)
        left = left & (e != idx)
    if NORM:
        vals = vals / (tl.sum(tl.where(kr < K, vals, 0.0), axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids, mask=kr < K)
    tl.store(w_ptr + t * K + kr, (vals * scale).to(w_ptr.dtype.element_ty), mask=kr < K)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, E, scale, TB, NB, NH, TS,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr, HASH: tl.constexpr):
    """Row r: s = sqrt(softplus(logits)); ids = tid2eid[token] (HASH) or the top-K of s + bias (repeated argmax);
    w = s[ids] (/ their sum + 1e-20 when NORM) x scale. Rows r of logits [NB*TB, E] (the decode guess: NB layers'
    logits of TB rows each) are layer r // TB's: bias row r // TB of [NB, E], token r % TB, ids / w written to row
    (r % TB) * NB + r // TB (a [TB, NB, K] layout), and the first NH layers hash-routed (their tables [V, K] TS
    elements apart); one layer: NB = 1, TB = the rows, NH = 0."""
    r = tl.program_id(0).to(tl.int64)
    lay = r // TB
    bias_ptr += lay * E
    t = (r % TB) * NB + lay                                                      # the output row
    e = tl.arange(0, EP)
    me = e < E
    x = tl.load(logits_ptr + r * E + e, mask=me, other=0).to(tl.float32)
    s = tl.sqrt(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))
    kr = tl.arange(0, KP)
    if HASH:
        ids, vals = _hash_pick(tid_ptr, tok_ptr + r % TB, s, e, kr, K, KP)
    elif lay < NH:
        ids, vals = _hash_pick(tid_ptr + lay * TS, tok_ptr + r % TB, s, e, kr, K, KP)
    else:
        ids = tl.zeros((KP,), dtype=tl.int64)
        vals = tl.zeros((KP,), dtype=tl.float32)
        sel = tl.where(me, s + tl.load(bias_ptr + e, mask=me, other=0), float("-inf"))
        for i in range(K):
            idx = tl.argmax(sel, axis=0)
            ids = tl.where(kr == i, idx.to(tl.int64), ids)
            vals = tl.where(kr == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), vals)
            sel = tl.where(e == idx, float("-inf"), sel)
    if NORM:
        vals = vals / (tl.sum(tl.where(kr < K, vals, 0.0), axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids, mask=kr < K)
    tl.store(w_ptr + t * K + kr, (vals * scale).to(w_ptr.dtype.element_ty), mask=kr < K)


@triton.jit
def _hash_pick(tid_ptr, tok_ptr, s, e, kr, K: tl.constexpr, KP: tl.constexpr):
    """A hash-routed row: ids = the token's row of the table tid_ptr [V, K], vals = s[ids] ([KP] each)."""
    tok = tl.load(tok_ptr)
    ids = tl.load(tid_ptr + tok * K + kr, mask=kr < K, other=0).to(tl.int64)
    vals = tl.zeros((KP,), dtype=tl.float32)
    for i in range(K):
        idx = tl.sum(tl.where(kr == i, ids, 0), axis=0)
        vals = tl.where(kr == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), vals)
    return ids, vals


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, Fw, limit, BF: tl.constexpr):
    """gu [T, 2F] (gate | up) -> out [T, F] = silu(min(g, limit)) * clamp(u, -limit, limit), rounded per torch op."""
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    mf = f < Fw
    dt = out_ptr.dtype.element_ty
    g = tl.minimum(tl.load(gu_ptr + t * 2 * Fw + f, mask=mf, other=0).to(tl.float32), limit)
    u = tl.load(gu_ptr + t * 2 * Fw + Fw + f, mask=mf, other=0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * Fw + f, (act * u).to(dt), mask=mf)


@triton.jit
def _copy_rows_kernel(idx_ptr, srcs, dsts, s_stride, d_stride, widths, N: tl.constexpr, GATHER: tl.constexpr,
                      BN: tl.constexpr):
    """Row r of each of N byte matrices: dsts[j][r] = srcs[j][idx[r]] (GATHER) or srcs[j][r], widths[j] bytes (row
    strides in bytes): any dtypes, the bytes moved as they are."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.load(idx_ptr + r).to(tl.int64) if GATHER else r
    for j in tl.static_range(N):
        m = c < widths[j]
        tl.store(dsts[j] + r * d_stride[j] + c, tl.load(srcs[j] + s * s_stride[j] + c, mask=m), mask=m)


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(xs, ws, outs, ns, ks, x_rs, w_rs, o_rs, scales, starts, T,
                 NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """Program (r, c): rows [r*BT, (r+1)*BT) of column block c of NS matrix products out_j = x_j . w_j^T laid end to
    end (product j: column blocks [starts[j], starts[j+1])): its BN outputs over all of the product's K in ascending
    BK steps (no split-K, no second launch), fp32 accumulation. The product's operands are picked before the K loop
    (one loop whatever NS: the software pipeliner stages its loads), its output's dtype at the store."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    mt = t < T
    c = tl.program_id(1)
    x_ptr, w_ptr, N, K, xr, wr, c0 = xs[0], ws[0], ns[0], ks[0], x_rs[0], w_rs[0], starts[0]
    for j in tl.static_range(1, NS):
        sel = c >= starts[j]
        x_ptr = tl.where(sel, xs[j], x_ptr)
        w_ptr = tl.where(sel, ws[j], w_ptr)
        N = tl.where(sel, ns[j], N)
        K = tl.where(sel, ks[j], K)
        xr = tl.where(sel, x_rs[j], xr)
        wr = tl.where(sel, w_rs[j], wr)
        c0 = tl.where(sel, starts[j], c0)
    n = (c - c0) * BN + tl.arange(0, BN)
    mn = n < N
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):                      # K in ascending BK steps: the same order for every row
        k = k0 + tl.arange(0, BK)
        mk = k < K
        x = tl.load(x_ptr + t.to(tl.int64)[:, None] * xr + k[None, :], mask=mt[:, None] & mk[None, :], other=0)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * wr + k[None, :], mask=mn[:, None] & mk[None, :], other=0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    # rounded to x's dtype as F.linear's output, then (a float32 output: the indexer's head weights) scaled in float32
    y = acc.to(xs[0].dtype.element_ty).to(tl.float32)
    m = mt[:, None] & mn[None, :]
    for j in tl.static_range(NS):
        if (c >= starts[j]) & (c < starts[j + 1]):
            tl.store(outs[j] + t.to(tl.int64)[:, None] * o_rs[j] + n[None, :],
                     (y * scales[j]).to(outs[j].dtype.element_ty), mask=m)


def _ieee(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


# the launches, counted per kernel (kernels/triton_launch.py)
(_hc_partial_kernel, _hc_finish_kernel, _hc_post_kernel, _rms_rope_kernel, _compress_step_kernel, _index_scores_kernel,
 _decode_attn_kernel, _route_approx_kernel, _route_kernel, _swiglu_kernel, _copy_rows_kernel, _gemv_kernel) = map(launcher, (
    _hc_partial_kernel, _hc_finish_kernel, _hc_post_kernel, _rms_rope_kernel, _compress_step_kernel,
    _index_scores_kernel, _decode_attn_kernel, _route_approx_kernel, _route_kernel, _swiglu_kernel, _copy_rows_kernel,
    _gemv_kernel))


class TritonOps:
    """model.deepseek4.TorchOps' methods (the same signatures) as fused Triton launches (module doc)."""

    # rows up to which linears / grouped_linear run _gemv_kernel (one launch a call); 0: every product the library's
    # gemm (TorchOps). Set per process from engine.decode_gemv at the model's load (worker/runner.py: on since its
    # device check, gpu-run63); GEMV_ROWS when on
    gemv_rows = 0

    @staticmethod
    def prepare(w: dict, n_layer: int) -> None:
        """The shared expert's gate and up rows in one [2F, H] matrix (one matmul per call, no concatenation in
        the decode step), the separate names kept as views of it: the same bytes as before."""
        for l in range(n_layer):
            b = f"blk.{l}."
            gu = torch.cat([w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"]])
            F_ = gu.shape[0] // 2
            w[b + "ffn_gate_up_shexp.weight"] = gu
            w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"] = gu[:F_], gu[F_:]

    @staticmethod
    def _gemv(xs, ws, outs, scales) -> None:
        """outs[j] [T, N_j] = xs[j] [T, K_j] . ws[j] [N_j, K_j]^T (rounded to x's dtype; scales[j] not None: then
        x scales[j] in float32) in one _gemv_kernel launch. Any row strides; the last dims contiguous. A row's bits
        depend on its K and GEMV_BK only (never T, the other rows or products, BN): one program walks a row tile's
        whole K in ascending GEMV_BK steps, fp32 accumulation (batch invariance, invariant 6)."""
        T = xs[0].shape[0]
        for x, w, o in zip(xs, ws, outs):
            assert x.shape[0] == T and o.shape == (T, w.shape[0]) and x.shape[1] == w.shape[1], (x.shape, w.shape,
                                                                                                  o.shape)
            assert x.stride(1) == w.stride(1) == o.stride(1) == 1, (x.stride(), w.stride(), o.stride())
        ns, ks = [w.shape[0] for w in ws], [w.shape[1] for w in ws]
        BN = GEMV_BN or (32 if sum(ns) >= 8192 else 16)     # enough programs for the SMs at one row tile
        starts = [0]
        for n in ns:
            starts.append(starts[-1] + triton.cdiv(n, BN))
        _gemv_kernel[(triton.cdiv(T, GEMV_BT), starts[-1])](
            tuple(xs), tuple(ws), tuple(outs), tuple(ns), tuple(ks), tuple(x.stride(0) for x in xs),
            tuple(w.stride(0) for w in ws), tuple(o.stride(0) for o in outs),
            tuple(1.0 if s is None else float(s) for s in scales), tuple(starts), T,
            NS=len(ws), BT=GEMV_BT, BN=BN, BK=min(GEMV_BK, triton.next_power_of_2(min(ks))), IEEE=_ieee(xs[0]),
            num_stages=GEMV_STAGES)

    @classmethod
    def linears(cls, x, ws, outs=None, scales=None) -> list:
        """TorchOps.linears: up to gemv_rows rows in one launch for every w (_gemv), more the library's gemm."""
        if x.shape[0] > cls.gemv_rows:
            return dense.linears(x, ws, outs, scales)
        scales = scales or (None,) * len(ws)
        outs = [o if o is not None else
                torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype if s is None else torch.float32, device=x.device)
                for o, w, s in zip(outs or (None,) * len(ws), ws, scales)]
        cls._gemv([x] * len(ws), ws, outs, scales)
        return outs

    @classmethod
    def grouped_linear(cls, x, w, out=None):
        """TorchOps.grouped_linear: up to gemv_rows rows in one launch for every group (_gemv), more the library's."""
        G, T, _ = x.shape
        if T > cls.gemv_rows:
            return dense.grouped_linear(x, w, out)
        if out is None:
            out = torch.empty((G, T, w.shape[1]), dtype=x.dtype, device=x.device)
        cls._gemv(list(x.unbind(0)), list(w.unbind(0)), list(out.unbind(0)), (None,) * G)
        return out

    @classmethod
    def hc_pre(cls, X, fn, base, scale, norm, iters: int, hc_eps: float, eps: float):
        return cls._hc_pre(X, None, fn, base, scale, norm, iters, hc_eps, eps)[1:]

    @classmethod
    def hc_pre_lagged(cls, X, lag, fn, base, scale, norm, iters: int, hc_eps: float, eps: float):
        return cls._hc_pre(X, lag.contiguous(), fn, base, scale, norm, iters, hc_eps, eps)

    @staticmethod
    def _hc_pre(X, lag, fn, base, scale, norm, iters: int, hc_eps: float, eps: float):
        T, HC, D = X.shape
        K, M = HC * D, fn.shape[0]
        assert M == (2 + HC) * HC and fn.shape[1] == K, (fn.shape, X.shape)
        X = X.contiguous()
        MP = triton.next_power_of_2(M)
        KS = min(HC_SPLIT_K, triton.next_power_of_2(K))
        S = triton.cdiv(K, KS)
        pm = torch.empty((T, S, MP), dtype=torch.float32, device=X.device)
        pss = torch.empty((T, S), dtype=torch.float32, device=X.device)
        _hc_partial_kernel[(T, S)](X, fn, pm, pss, K, S, M=M, MP=MP, KS=KS, BK=min(256, KS))
        post = torch.empty((T, HC), dtype=torch.float32, device=X.device)
        comb = torch.empty((T, HC, HC), dtype=torch.float32, device=X.device)
        h = torch.empty((T, D), dtype=X.dtype, device=X.device)
        pre = torch.empty((T, HC), dtype=torch.float32, device=X.device) if lag is not None else None
        _hc_finish_kernel[(T,)](X, pm, pss, base, scale, norm, post, comb, h, pre if lag is not None else post,
                                lag if lag is not None else post, D, K, S, iters, hc_eps, eps, T,
                                HC=HC, MP=MP, SP=triton.next_power_of_2(S), BD=min(1024, triton.next_power_of_2(D)),
                                LAG=lag is not None)
        return pre, post, comb, h

    @staticmethod
    def _copy_rows(srcs, dsts, idx=None) -> None:
        """TorchOps.copy_rows (idx [R]: dsts[j] = srcs[j]'s rows idx) in ONE launch, whatever the number and dtypes of
        the tensors: their rows moved as bytes (each row's elements contiguous; row strides any)."""
        S = [s.reshape(s.shape[0], -1).view(torch.uint8) for s in srcs]
        D = [d.view(d.shape[0], -1).view(torch.uint8) for d in dsts]
        assert all(s.shape[1] == d.shape[1] and s.stride(1) == d.stride(1) == 1 for s, d in zip(S, D)), \
            [(s.shape, d.shape) for s, d in zip(S, D)]
        W = max(s.shape[1] for s in S)
        _copy_rows_kernel[(D[0].shape[0], triton.cdiv(W, 1024))](
            idx if idx is not None else S[0], tuple(S), tuple(D), tuple(s.stride(0) for s in S),
            tuple(d.stride(0) for d in D), tuple(s.shape[1] for s in S), N=len(S), GATHER=idx is not None, BN=1024)

    @classmethod
    def copy_rows(cls, srcs, dsts) -> None:
        cls._copy_rows(srcs, dsts)

    @classmethod
    def gather_rows(cls, idx, ts) -> list:
        out = [torch.empty((idx.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device) for t in ts]
        cls._copy_rows(ts, out, idx)
        return out

    @staticmethod
    def hc_post(X, out, post, comb, extra=None):
        T, HC, D = X.shape
        res = torch.empty_like(X)
        X, out = X.contiguous(), out.contiguous()
        b = out if extra is None else extra.contiguous()
        BD = min(256, triton.next_power_of_2(D))
        _hc_post_kernel[(T, triton.cdiv(D, BD))](X, out, b, post, comb, res, D, HAS_B=extra is not None, HC=HC, BD=BD)
        return res

    @staticmethod
    def _rms_rope(x, w, cos, sin, eps, norm: int, neg_sin: bool = False, ring=None, pos=None, out=None):
        D = x.shape[-1]
        xc = x.contiguous()
        rows = xc.numel() // D
        T = cos.shape[0]
        if out is None:
            out = torch.empty_like(xc)
        # out: any token stride (the batched decode lanes' buffers: column ranges of one flat buffer), each token's
        # rows contiguous
        assert out.shape == xc.shape and out.dtype == xc.dtype and out[0].is_contiguous(), (out.shape, xc.shape)
        if out.shape[0] != T:       # rows of several tokens per leading index: no token stride but the packed one
            assert out.is_contiguous(), (out.shape, out.stride())
        OT = out.stride(0) if out.shape[0] == T else rows // T * D
        _rms_rope_kernel[(rows,)](xc, w if w is not None else xc, cos, sin, out,
                                  ring if ring is not None else out, pos if pos is not None else cos,
                                  D, cos.shape[1], rows // T, ring.shape[0] if ring is not None else 1,
                                  OT, float(eps),
                                  NORM=norm, NEG_SIN=neg_sin, RING=ring is not None,
                                  BD=triton.next_power_of_2(D))
        return out

    @classmethod
    def rms_rope(cls, x, w, cos, sin, eps: float, out=None):
        return cls._rms_rope(x, w, cos, sin, eps, 1 if w is None else 2, out=out)

    @classmethod
    def rope(cls, x, cos, sin, out=None):
        return cls._rms_rope(x, None, cos, sin, 0.0, 0, out=out)

    @staticmethod
    def rms(x, w, eps: float):
        from betelgeuse.kernels.triton_norm import rms_norm
        return rms_norm(x, w, eps)

    @staticmethod
    def compress_step(kv_buf, gate_buf, entries, kv, gate, ape, norm, rope, pos, ratio: int, eps: float):
        rows, C = kv_buf.shape
        D = entries.shape[1]
        _compress_step_kernel[(1,)](kv_buf, gate_buf, entries, kv.contiguous(), gate.contiguous(), ape, norm,
                                    rope.inv_freq, pos, float(eps), D, C, 2 * rope.inv_freq.numel(),
                                    RATIO=ratio, ROWS=rows, SLOTS=2 * ratio if ratio == 4 else ratio,
                                    BD=min(128, triton.next_power_of_2(D)))

    @staticmethod
    def index_topk(iq, iw, keys, pos, k: int):
        N, IHD = keys.shape
        NH = iq.shape[1]
        score = torch.empty((1, N), dtype=torch.float32, device=keys.device)
        BN = 64
        _index_scores_kernel[(triton.cdiv(N, BN),)](iq.contiguous(), iw.contiguous(), keys, pos, score, N,
                                                    NH ** -0.5, IHD ** -0.5, 4, NH=NH, IHD=IHD, BN=BN,
                                                    IEEE=_ieee(keys))
        return score.topk(k, dim=-1).indices[0]

    @classmethod
    def decode_attend(cls, q, kv, ring, entries, top, pos, ratio: int, sinks, cos, sin, out=None):
        _, H, HD = q.shape
        W = ring.shape[0]
        mode = 0 if entries is None else (1 if top is not None else 2)
        NE = 0 if entries is None else (top.numel() if top is not None else entries.shape[0])
        o = torch.empty_like(q)
        HB = 16
        _decode_attn_kernel[(triton.cdiv(H, HB),)](q.contiguous(), kv.contiguous(), ring, entries if entries is not None else ring,
                                                   top if top is not None else pos, pos, sinks, o, H, W, NE,
                                                   max(ratio, 1), HD ** -0.5, MODE=mode, HD=HD, HB=HB, BS=32,
                                                   IEEE=_ieee(q), KB=min(ATTN_KB, HD),
                                                   num_stages=ATTN_STAGES)
        return cls._rms_rope(o, None, cos, sin, 0.0, 0, neg_sin=True, out=out)   # out: the de-rotation writes there

    @staticmethod
    def _route(logits, bias, tid2eid, token_ids, k, norm, scale, dtype, hashed: bool):
        T, E = logits.shape
        ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
        w = torch.empty((T, k), dtype=dtype, device=logits.device)
        lg = logits.contiguous()
        _route_kernel[(T,)](lg, bias if bias is not None else lg, tid2eid if tid2eid is not None else ids,
                            token_ids if token_ids is not None else ids, ids, w, E, float(scale), T, 1, 0, 0,
                            K=k, KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(E), NORM=bool(norm),
                            HASH=hashed)
        return ids, w

    @classmethod
    def route_topk(cls, logits, bias, k: int, norm: bool, scale: float, dtype):
        return cls._route(logits, bias, None, None, k, norm, scale, dtype, False)

    @classmethod
    def route_hash(cls, logits, tid2eid, token_ids, norm: bool, scale: float, dtype):
        return cls._route(logits, None, tid2eid.contiguous(), token_ids.contiguous(), tid2eid.shape[1], norm, scale,
                          dtype, True)

    @staticmethod
    def guess_route(X, lag, g, first: int, n: int, token_ids, k: int, iters: int, hc_eps: float, eps: float):
        """TorchOps.guess_route for all n layers at once: their mHC mix rows in one partial pass over the stacked
        hc_ffn_fn rows (layers first .. first+n-1 are contiguous in GuessStack), their finishes (h [n, T, D]) in one
        launch, their routers in one batched matmul, their top-ks in one launch writing [T, n, k] (hash layers in range: the
        token's table row, as route_hash)."""
        T, HC, D = X.shape
        fn = g.fn[first:first + n]                                                  # [n, M, K], contiguous
        M, K = fn.shape[1], fn.shape[2]
        assert M == (2 + HC) * HC and K == HC * D, (fn.shape, X.shape)
        X = X.contiguous()
        MP = triton.next_power_of_2(n * M)
        KS = min(HC_SPLIT_K, triton.next_power_of_2(K))
        S = triton.cdiv(K, KS)
        pm = torch.empty((T, S, MP), dtype=torch.float32, device=X.device)
        pss = torch.empty((T, S), dtype=torch.float32, device=X.device)
        # the partial tile [MP, BK] kept at the one-layer size (MP 32 x 256): n layers' rows in narrower column steps
        _hc_partial_kernel[(T, S)](X, fn, pm, pss, K, S, M=n * M, MP=MP, KS=KS, BK=min(256, KS, max(16, 8192 // MP)))
        post = torch.empty((n, T, HC), dtype=torch.float32, device=X.device)
        comb = torch.empty((n, T, HC, HC), dtype=torch.float32, device=X.device)
        h = torch.empty((n, T, D), dtype=X.dtype, device=X.device)
        pre = torch.empty((n, T, HC), dtype=torch.float32, device=X.device) if lag is not None else post
        _hc_finish_kernel[(T, n)](X, pm, pss, g.base[first], g.scale[first], g.norm[first], post, comb, h, pre,
                                  lag.contiguous() if lag is not None else post, D, K, S, iters, hc_eps, eps, T,
                                  HC=HC, MP=MP, SP=triton.next_power_of_2(S),
                                  BD=min(1024, triton.next_power_of_2(D)), LAG=lag is not None)
        logits = TritonOps.grouped_linear(h, g.router[first:first + n])           # [n, T, E]
        E = logits.shape[2]
        ids = torch.empty((T, n, k), dtype=torch.int64, device=X.device)
        w = torch.empty((T, n, k), dtype=torch.float32, device=X.device)
        nh = max(0, min(n, g.tid2eid.shape[0] - first))                          # hash layers in range
        tid = g.tid2eid[first] if nh else ids
        _route_kernel[(n * T,)](logits, g.bias[first], tid, token_ids.contiguous(), ids, w, E, 1.0, T, n, nh,
                                tid[0].numel() if nh else 0, K=k, KP=triton.next_power_of_2(k),
                                EP=triton.next_power_of_2(E), NORM=False, HASH=False)
        return ids

    @staticmethod
    def route_approx(logits, bias, tid2eid, token_ids, k: int, resident: Residency, norm: bool, scale: float,
                     dtype):
        """TorchOps.route_approx in one launch (_route_approx_kernel)."""
        T, E = logits.shape
        hashed = tid2eid is not None
        assert not hashed or resident.mode == "pool", resident.mode
        ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
        w = torch.empty((T, k), dtype=dtype, device=logits.device)
        lg = logits.contiguous()
        _route_approx_kernel[(T,)](lg, bias if bias is not None else lg, tid2eid.contiguous() if hashed else ids,
                                   token_ids.contiguous() if hashed else ids, resident.mask.contiguous(), ids, w, E,
                                   float(scale), K=k, KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(E),
                                   NORM=bool(norm), HASH=hashed, RANK0=resident.mode == "resident")
        return ids, w

    @staticmethod
    def shared_ffn(h, gate_up, gate, up, down, limit: float):
        """h [T, H], gate_up [2F, H] (gate rows, then up: prepare; None: concatenated here), down [H, F] -> [T, H]:
        the clamped SwiGLU expert."""
        gu = TritonOps.linears(h, [gate_up if gate_up is not None else torch.cat([gate, up])])[0]
        T, Fw = gu.shape[0], gu.shape[1] // 2
        act = torch.empty((T, Fw), dtype=h.dtype, device=h.device)
        BF = 1024
        _swiglu_kernel[(T, triton.cdiv(Fw, BF))](gu, act, Fw, float(limit), BF=BF)
        return TritonOps.linears(act, [down])[0]
