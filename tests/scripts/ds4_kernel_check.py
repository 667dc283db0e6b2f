"""kernels/triton_ds4.py's TritonOps against model/deepseek4.py's TorchOps (the CPU path, exact against
transformers), method by method, in float32 and bfloat16.

    TRITON_INTERPRET=1 python tests/scripts/ds4_kernel_check.py [DS4.gguf]   # tests/kernels/test_ds4_kernels.py
    compare("cuda", FLASH)                                          # deploy/device/check_ds4.py: V4-Flash shapes

Prints (returns) per case ("method/dtype/variant") the max |diff| against TorchOps and the scale of the reference
(max |ref|), plus the bit-for-bit facts: `exact` (index outputs: ids, the state rows a step copies, the fused
shared-expert weights' views), `row_invariant` (each row of a launch computed alone equals the same row in the full
launch: batch invariance). The tiny shapes keep the partial blocks: D not a power of two, 20 heads (a partial
16-head block), K = 3 (a partial top-k block), hc_pre's split-K over two column blocks. `failures` applies the
tolerances: float32 summation-order noise, bfloat16 a few ulps.
"""

import json
import os
import sys

import numpy as np
import torch

from betelgeuse.kernels import triton_ds4
from betelgeuse.kernels.triton_ds4 import TritonOps
from betelgeuse.model.deepseek4 import InterleavedRope, TorchOps
from betelgeuse.routing_approx import Residency

# D_pre: hc_pre's stream width; hd / r / H: head dim, rope dims, heads; d: the compressor's entry width; nh / ihd /
# N / k: the indexer's heads, head dim, entries, top-k; W / NE: window, compressed entries; E / K: experts, top-k;
# Hs / Fs: the shared expert
TINY = dict(D_pre=320, D_post=48, rms_D=48, hd=64, r=16, H=20, d=32, nh=16, ihd=32, N=70, k=4, W=16, NE=9,
            E=24, K=3, Hs=32, Fs=1100)
FLASH = dict(D_pre=4096, D_post=4096, rms_D=1024, hd=512, r=64, H=64, d=512, nh=64, ihd=128, N=1024, k=512, W=128,
             NE=1024, E=256, K=6, Hs=4096, Fs=2048)
REL_TOL = {"float32": 2e-6, "bfloat16": 1 / 32}   # of max |ref|; one bf16 ulp at |x| is <= |x| / 128


def failures(res: dict) -> list[str]:
    """The cases outside tolerance or not bit-exact / batch-invariant where they must be."""
    bad = []
    for name, r in res.items():
        rel = REL_TOL[name.split("/")[1]]
        # a float32 dense product (f64 given): its error against float64, within twice a K-term float32 sum's
        # random-walk noise, u sqrt(K) of the scale (flash's K = 4,096: 7.6e-6; _gemv_kernel's ieee dot is one
        # sequential fma chain a row: 2.2-3.8e-6 on the H100, gpu-run63, where cuBLAS's split-K sums read 2-6x less)
        err = r.get("max_abs_f64", r["max_abs"])
        rel = max(rel, 2 * 2.0 ** -24 * r["k"] ** 0.5) if "max_abs_f64" in r else rel
        if err > rel * r["scale"] or not r["exact"] or not r.get("row_invariant", True):
            bad.append(name)
    return bad


def _widen_interpreter_bf16_dot():
    """The interpreter multiplies bfloat16 operands as their raw uint16 bits; a bf16 x bf16 product is exact in
    float32, so widening them first is what the GPU's tensor cores compute (up to summation order)."""
    import triton.language as tl
    from triton.runtime import interpreter
    dot = interpreter.InterpreterBuilder.create_dot

    def widened(self, a, b, d, *args):
        def widen(h):
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return dot(self, widen(a), widen(b), d, *args)
    interpreter.InterpreterBuilder.create_dot = widened


def compare(device: str = "cpu", dims: dict = TINY, dtypes=(torch.float32, torch.bfloat16)) -> dict:
    g = torch.Generator().manual_seed(21)
    ref, tri = TorchOps(), TritonOps()
    TritonOps.gemv_rows = triton_ds4.GEMV_ROWS       # engine.decode_gemv on (the runner's per-process setting)
    out: dict[str, dict] = {}
    dev = torch.device(device)
    D_pre, D_post, rms_D, hd, r, H, d = (dims[x] for x in ("D_pre", "D_post", "rms_D", "hd", "r", "H", "d"))
    nh, ihd, N, k, W, NE, E, K, Hs, Fs = (dims[x] for x in ("nh", "ihd", "N", "k", "W", "NE", "E", "K", "Hs", "Fs"))

    def rnd(*shape, dtype=torch.float32, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device=dev, dtype=dtype)

    def tensor(x):
        return torch.tensor(x, device=dev)

    def diff(a, b) -> float:
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    def scale(a) -> float:
        return float(a.float().abs().max()) if a.numel() else 0.0

    def case(name, pairs, exact=(), row_inv=None, f64=None, k=0):
        """pairs: [(triton, torch)] tensors compared within noise; exact: pairs that must be equal bit for bit;
        f64: float64 results of the same products (given for float32: judged against them), one a pair, of k-term
        sums."""
        out[name] = {"max_abs": max((diff(a, b) for a, b in pairs), default=0.0),
                     "scale": max((scale(b) for _, b in pairs), default=1.0),
                     "exact": all(torch.equal(a, b) for a, b in exact)}
        if row_inv is not None:
            out[name]["row_invariant"] = row_inv
        if f64 is not None:
            out[name]["max_abs_f64"] = max(diff(a, r) for (a, _), r in zip(pairs, f64))
            out[name]["ref_err_f64"] = max(diff(b, r) for (_, b), r in zip(pairs, f64))   # the library's, for scale
            out[name]["k"] = k

    def rows_alone(fn, full, *args, n):
        """fn(*row i of each batched arg) == row i of full (a tuple of outputs) for every i, bit for bit."""
        for i in range(n):
            one = fn(*(a[i:i + 1] if isinstance(a, torch.Tensor) else a for a in args))
            one = one if isinstance(one, tuple) else (one,)
            if not all(torch.equal(o, f[i:i + 1]) for o, f in zip(one, full)):
                return False
        return True

    T, HC = 3, 4
    for dt in dtypes:
        dn = str(dt).split(".")[1]
        f32 = dt == torch.float32           # the dense products judged against float64 (failures)
        eps, hc_eps = 1e-6, 1e-6

        # hc_pre (tiny: D = 320 -> K = hc*D = 1280, two split-K column blocks of HC_SPLIT_K = 1024)
        D = D_pre
        assert dims is not TINY or HC * D > triton_ds4.HC_SPLIT_K
        X = rnd(T, HC, D, dtype=dt)
        fn, base, sc, norm = rnd((2 + HC) * HC, HC * D, s=0.05), rnd((2 + HC) * HC), rnd(3).abs(), 1 + rnd(D, s=0.1)
        a = tri.hc_pre(X, fn, base, sc, norm, 20, hc_eps, eps)
        b = ref.hc_pre(X, fn, base, sc, norm, 20, hc_eps, eps)
        case(f"hc_pre/{dn}", list(zip(a, b)),
             row_inv=rows_alone(lambda x: tri.hc_pre(x, fn, base, sc, norm, 20, hc_eps, eps), a, X, n=T))
        lag = torch.rand(T, HC, generator=g).to(dev)        # deepseek41: collapsed by the previous sublayer's pre
        a = tri.hc_pre_lagged(X, lag, fn, base, sc, norm, 20, hc_eps, eps)
        b = ref.hc_pre_lagged(X, lag, fn, base, sc, norm, 20, hc_eps, eps)
        case(f"hc_pre_lagged/{dn}", list(zip(a, b)),
             row_inv=rows_alone(lambda x, c: tri.hc_pre_lagged(x, c, fn, base, sc, norm, 20, hc_eps, eps), a, X, lag,
                                n=T))

        # hc_post, with and without the shared expert's output added
        D = D_post
        X, o, e = rnd(T, HC, D, dtype=dt), rnd(T, D, dtype=dt), rnd(T, D, dtype=dt)
        post, comb = (torch.rand(T, HC, generator=g) * 2).to(dev), torch.rand(T, HC, HC, generator=g).to(dev)
        for var, ex in (("plain", None), ("extra", e)):
            a = tri.hc_post(X, o, post, comb, ex)
            b = ref.hc_post(X, o, post, comb, ex)
            args = (X, o, post, comb) + ((ex,) if ex is not None else ())
            case(f"hc_post/{dn}/{var}", [(a, b)], row_inv=rows_alone(tri.hc_post, (a,), *args, n=T))

        # the norms + interleaved RoPE: per-head unweighted (q), weighted (kv), none (the indexer's q, de-rotation)
        rope = InterleavedRope.plain(r, 10000.0, dev)
        cos, sin = rope.cos_sin(tensor([0, 7, 300]))
        q, kv, w = rnd(T, H, hd, dtype=dt, s=3), rnd(T, hd, dtype=dt, s=3), 1 + rnd(hd, s=0.1)
        a = tri.rms_rope(q, None, cos, sin, eps)
        case(f"rms_rope/{dn}/unweighted", [(a, ref.rms_rope(q, None, cos, sin, eps))],
             row_inv=rows_alone(lambda x, c, s: tri.rms_rope(x, None, c, s, eps), (a,), q, cos, sin, n=T))
        a = tri.rms_rope(kv, w, cos, sin, eps)
        case(f"rms_rope/{dn}/weighted", [(a, ref.rms_rope(kv, w, cos, sin, eps))],
             row_inv=rows_alone(lambda x, c, s: tri.rms_rope(x, w, c, s, eps), (a,), kv, cos, sin, n=T))
        a = tri.rope(q, cos, sin)
        case(f"rope/{dn}", [(a, ref.rope(q, cos, sin))], row_inv=rows_alone(tri.rope, (a,), q, cos, sin, n=T))
        x2 = rnd(T, rms_D, dtype=dt, s=3)
        w2 = 1 + rnd(rms_D, s=0.1)
        a = tri.rms(x2, w2, eps)
        case(f"rms/{dn}", [(a, ref.rms(x2, w2, eps))], row_inv=rows_alone(lambda x: tri.rms(x, w2, eps), (a,), x2, n=T))

        # the compressor's decode step, token by token from position 0: the open window's rows, the entries
        # (ratio 4: overlapping windows, window 0's missing half gated -inf; ratio 128: positions across a window end)
        for ratio, positions in ((4, range(0, 13)), (128, [0, 1, 2, 126, 127, 128, 129])):
            R, C = (8, 2 * d) if ratio == 4 else (128, d)
            crope = InterleavedRope.yarn(r, 160000.0, 4.0, 64, 32.0, 1.0, dev)
            ape, cnorm = rnd(ratio, C, s=0.5), 1 + rnd(d, s=0.1)
            states = {s: tuple(torch.zeros(n, c, dtype=dt, device=dev)
                              for n, c in ((R, C), (R, C), (max(positions) // ratio + 1, d))) for s in ("tri", "ref")}
            worst, exact = [], True
            for p in positions:
                ckv, cg = rnd(1, C, dtype=dt), rnd(1, C, dtype=dt)
                pos = tensor([p])
                tri.compress_step(*states["tri"], ckv, cg, ape, cnorm, crope, pos, ratio, eps)
                ref.compress_step(*states["ref"], ckv, cg, ape, cnorm, crope, pos, ratio, eps)
                (ka, ga, ea), (kb, gb, eb) = states["tri"], states["ref"]
                exact &= torch.equal(ka, kb) and torch.equal(ga, gb)
                w0 = p // ratio
                worst.append((ea[w0], eb[w0]))
            case(f"compress_step/{dn}/ratio{ratio}", worst)
            out[f"compress_step/{dn}/ratio{ratio}"]["exact"] = exact

        # the lightning indexer's scores -> top-k (more entries visible than k, so no -inf ties)
        keys, iq, iw = rnd(N, ihd, dtype=dt), rnd(1, nh, ihd, dtype=dt), rnd(1, nh)
        for p in (4 * (k + 1), 4 * N + 3):        # k + 1 and all N entries visible
            pos = tensor([p])
            a, b = tri.index_topk(iq, iw, keys, pos, k), ref.index_topk(iq, iw, keys, pos, k)
            case(f"index_topk/{dn}/pos{p}", [], exact=[(a.sort().values, b.sort().values)])

        # one decode query over the window ring (partly filled, then wrapped) and the compressed entries
        sinks = rnd(H)
        q1, kv1 = rnd(1, H, hd, dtype=dt), rnd(1, hd, dtype=dt)
        ents = rnd(NE, hd, dtype=dt)
        top = torch.randperm(NE, generator=g)[:min(k, NE)].to(dev)   # some not visible at the early positions
        for var, e_, t_, ratio in (("window", None, None, 0), ("hca", ents, None, 128), ("csa", ents, top, 4)):
            for p in (5, W + 5, 128 * (NE - 1) + 60):    # ring partly filled; wrapped; all but one HCA entry
                pos = tensor([p])
                c1, s1 = rope.cos_sin(pos)
                ring0 = rnd(W, hd, dtype=dt)
                ra, rb = ring0.clone(), ring0.clone()
                a = tri.decode_attend(q1, kv1, ra, e_, t_, pos, ratio, sinks, c1, s1)
                b = ref.decode_attend(q1, kv1, rb, e_, t_, pos, ratio, sinks, c1, s1)
                # the head dim in 4 chunks (ds4-flash's 512 in chunks of ATTN_KB = 128; here 64 would be one)
                kb, triton_ds4.ATTN_KB = triton_ds4.ATTN_KB, hd // 4
                try:
                    a4 = tri.decode_attend(q1, kv1, ring0.clone(), e_, t_, pos, ratio, sinks, c1, s1)
                finally:
                    triton_ds4.ATTN_KB = kb
                # written into out (a lane's row of the lanes' attention buffer): the same bits, in place
                lane = torch.full((3, H * hd), float("nan"), dtype=dt, device=dev)
                o2 = tri.decode_attend(q1, kv1, ra.clone(), e_, t_, pos, ratio, sinks, c1, s1,
                                       lane[1:2].view(1, H, hd))
                case(f"decode_attend/{dn}/{var}/pos{p}", [(a, b), (a4, b)],
                     exact=[(ra, rb), (lane[1].view(1, H, hd), a), (o2, a), (lane[0].isnan(), torch.ones_like(lane[0], dtype=torch.bool))])

        # routing: sqrt(softplus) scores, top-k of scores + bias (or the hash table), renormalised weights
        V = 10
        logits, bias = rnd(5, E, s=3), rnd(E, s=0.5)
        tid2eid, toks = torch.randint(0, E, (V, K), generator=g).to(dev), tensor([3, 9, 0, 3, 5])
        for nrm in (True, False):
            a = tri.route_topk(logits, bias, K, nrm, 1.5, dt)
            b = ref.route_topk(logits, bias, K, nrm, 1.5, dt)
            case(f"route_topk/{dn}/norm{int(nrm)}", [(a[1], b[1])], exact=[(a[0], b[0])],
                 row_inv=rows_alone(lambda lg: tri.route_topk(lg, bias, K, nrm, 1.5, dt), a, logits, n=5))
            a = tri.route_hash(logits, tid2eid, toks, nrm, 1.5, dt)
            b = ref.route_hash(logits, tid2eid, toks, nrm, 1.5, dt)
            case(f"route_hash/{dn}/norm{int(nrm)}", [(a[1], b[1])], exact=[(a[0], b[0])],
                 row_inv=rows_alone(lambda lg, tk: tri.route_hash(lg, tid2eid, tk, nrm, 1.5, dt), a, logits, toks, n=5))
        # the approximate modes (routing_approx.py) in one launch: the same ids bit for bit over resident sets that
        # leave some ranks to non-resident experts (2 resident < K), fill every rank (E // 2), none and all; scores
        # with ties (the lower id first); a hash table of distinct experts per row (pool only)
        tied, tied_b = logits.clone(), bias.clone()
        tied[:, 1::2], tied_b[1::2] = tied[:, 0::2], tied_b[0::2]
        table = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]).to(dev)
        masks = {"few": torch.arange(E) % (E // 2) == 1, "half": torch.arange(E) % 2 == 0,
                 "none": torch.zeros(E, dtype=torch.bool), "all": torch.ones(E, dtype=torch.bool)}
        for (mn, mask), mode, lg in ((m, mo, lg) for m in masks.items() for mo in ("pool", "resident")
                                     for lg in (logits, tied)):
            res = Residency(mode, mask.to(dev))
            args = [(tied_b if lg is tied else bias, None, None)] + ([(None, table, toks)] if mode == "pool" else [])
            for bi, tb, tk in args:
                a = tri.route_approx(lg, bi, tb, tk, K, res, True, 1.5, dt)
                b = ref.route_approx(lg, bi, tb, tk, K, res, True, 1.5, dt)
                kind = "hash" if tb is not None else "topk"
                case(f"route_approx/{dn}/{mode}-{kind}-{mn}-{'tied' if lg is tied else 'plain'}", [(a[1], b[1])],
                     exact=[(a[0], b[0])],
                     row_inv=rows_alone(lambda x: tri.route_approx(x, bi, tb, tk, K, res, True, 1.5, dt), a, lg, n=1))

        # the shared expert: clamped SwiGLU (limit 2: binding) between the two matmuls (tiny: F = 1100, two blocks)
        h = rnd(T, Hs, dtype=dt)
        gate, up, down = rnd(Fs, Hs, dtype=dt, s=0.5), rnd(Fs, Hs, dtype=dt, s=0.5), rnd(Hs, Fs, dtype=dt, s=0.05)
        w = {"blk.0.ffn_gate_shexp.weight": gate.clone(), "blk.0.ffn_up_shexp.weight": up.clone()}
        tri.prepare(w, 1)                   # gate | up fused once, the separate names views of it
        gu_w = w["blk.0.ffn_gate_up_shexp.weight"]
        a = tri.shared_ffn(h, gu_w, w["blk.0.ffn_gate_shexp.weight"], w["blk.0.ffn_up_shexp.weight"], down, 2.0)
        b = ref.shared_ffn(h, None, gate, up, down, 2.0)
        views = (w["blk.0.ffn_up_shexp.weight"].data_ptr() == gu_w.data_ptr() + Fs * Hs * gu_w.element_size()
                 and torch.equal(w["blk.0.ffn_gate_shexp.weight"], gate) and torch.equal(w["blk.0.ffn_up_shexp.weight"], up))
        gu = torch.nn.functional.linear(h, torch.cat([gate, up]))
        act = torch.empty(T, Fs, dtype=dt, device=dev)
        nb = -(-Fs // 1024)
        triton_ds4._swiglu_kernel[(T, nb)](gu, act, Fs, 2.0, BF=1024)
        inv = True
        for i in range(T):
            one = torch.empty(1, Fs, dtype=dt, device=dev)
            triton_ds4._swiglu_kernel[(1, nb)](gu[i:i + 1].contiguous(), one, Fs, 2.0, BF=1024)
            inv &= torch.equal(one, act[i:i + 1])
        # the whole expert too (its two matmuls: TritonOps.linears' one launch each at decode's rows)
        inv &= rows_alone(lambda x: tri.shared_ffn(x, gu_w, None, None, down, 2.0), (a,), h, n=T)
        f64 = [ref.shared_ffn(h.double(), None, gate.double(), up.double(), down.double(), 2.0)] if f32 else None
        case(f"shared_ffn/{dn}", [(a, b)], row_inv=inv, f64=f64, k=max(Hs, Fs))
        out[f"shared_ffn/{dn}"]["exact"] = views


        # the dense projections of decode's few rows (linears / grouped_linear: one _gemv_kernel launch for every
        # product of a call): a ratio-4 layer's projections of u (flash: q_a 1024, kv 512, the compressor's 1024 x 2,
        # the indexer's head weights 64 (float32, scaled), its compressor's 256 x 2; K = D_pre: tiny 320, a partial
        # K step), two of them into column ranges of a flat lane buffer; the grouped output projection written through
        # its [g, T, N] view; past GEMV_ROWS rows the library's gemm (TorchOps' bits)
        u = rnd(T, D_pre, dtype=dt)
        ns = (rms_D, hd, 2 * d, 2 * d, nh, 2 * ihd, 2 * ihd)
        ws = [rnd(n, D_pre, dtype=dt, s=D_pre ** -0.5) for n in ns]
        scales = [None, None, None, None, nh ** -0.5, None, None]
        flats = [torch.full((T, 4 * d + 7), float("nan"), dtype=dt, device=dev) for _ in range(2)]
        outs = [[None, None, f[:, :2 * d], f[:, 2 * d:4 * d], None, None, None] for f in flats]
        a = tri.linears(u, ws, outs[0], scales)
        b = ref.linears(u, ws, outs[1], scales)
        case(f"linears/{dn}", list(zip(a, b)),
             exact=[(a[2], flats[0][:, :2 * d]), (flats[0][:, 4 * d:].isnan(), torch.ones(T, 7, dtype=torch.bool,
                                                                                           device=dev))],
             row_inv=rows_alone(lambda x: tuple(tri.linears(x, ws, None, scales)), tuple(a), u, n=T),
             f64=ref.linears(u.double(), [w.double() for w in ws], None, scales) if f32 else None, k=D_pre)
        many = rnd(triton_ds4.GEMV_ROWS + 1, D_pre, dtype=dt)
        out[f"linears/{dn}"]["exact"] &= all(torch.equal(x, y) for x, y in zip(tri.linears(many, ws[:2]),
                                                                                ref.linears(many, ws[:2])))
        G = 4 if dims is TINY else 8
        og, wa = rnd(T, H * hd, dtype=dt), rnd(G, rms_D, H * hd // G, dtype=dt, s=(H * hd // G) ** -0.5)
        ys = [torch.empty(T, G, rms_D, dtype=dt, device=dev) for _ in range(2)]
        tri.grouped_linear(og.reshape(T, G, -1).transpose(0, 1), wa, out=ys[0].transpose(0, 1))
        ref.grouped_linear(og.reshape(T, G, -1).transpose(0, 1), wa, out=ys[1].transpose(0, 1))
        y64 = None
        if f32:
            y64 = [torch.empty(T, G, rms_D, dtype=torch.float64, device=dev)]
            ref.grouped_linear(og.double().reshape(T, G, -1).transpose(0, 1), wa.double(), out=y64[0].transpose(0, 1))
        case(f"grouped_linear/{dn}", [(ys[0], ys[1])], f64=y64, k=H * hd // G,
             row_inv=rows_alone(lambda x: tri.grouped_linear(x.reshape(1, G, -1).transpose(0, 1), wa).transpose(0, 1),
                                (ys[0],), og, n=T))

    return out


def compare_model(path: str, prompt_len: int = 22, decode: tuple = (5, 9, 11)) -> dict:
    """The whole deepseek4 (or deepseek41) reference model of `path` (float32, CPU) with TritonOps against TorchOps: a prefill of
    prompt_len tokens, then one-token passes (the static decode form) -> max |diff| of the logits, their scale and
    whether the greedy tokens agree. ds4-tiny's window (16) and its ratio-4 windows close inside these passes."""
    from betelgeuse.model.registry import reference_model
    outs = {}
    for name in ("triton", "torch"):
        m = reference_model(path)
        if name == "triton":
            m.ops = TritonOps()
            m.ops.prepare(m.w, m.cfg.n_layer)
        cache = m.new_cache(prompt_len + len(decode) + 8)
        with torch.no_grad():
            lg = [m.forward(torch.arange(3, 3 + prompt_len), cache)]
            lg += [m.forward(torch.tensor([t]), cache) for t in decode]
        outs[name] = torch.cat(lg)
    a, b = outs["triton"], outs["torch"]
    return {"max_abs": float((a - b).abs().max()), "scale": float(b.abs().max()),
            "greedy_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1))), "rows": a.shape[0]}


def compare_guess(path: str, T: int = 3, device: str = "cpu") -> dict:
    """The decode guess (model.guess_ids: TritonOps.guess_route, every guessed layer in one pass each of mHC, router
    and top-k) against the per-layer reference (worker.guess.guess_per_layer: TorchOps' moe_input and route, layer
    by layer) on the streams of T rows, from every layer at depths 1..3 (fewer where fewer layers remain) -> the
    cases compared and those whose ids differ (the hash layers' rows included)."""
    from betelgeuse.model.registry import reference_model
    from betelgeuse.worker.guess import guess_per_layer
    from betelgeuse.model.deepseek4 import TorchOps
    ref, m = reference_model(path, device), reference_model(path, device)
    ref.ops, m.ops = TorchOps(), TritonOps()
    m.ops.prepare(m.w, m.cfg.n_layer)
    g = torch.Generator().manual_seed(7)
    p, L = m.p, m.cfg.n_layer
    # each layer's mix made far from uniform and its own (the same in both models: their per-layer names are views
    # of the stacks), else a layer's mHC mixed up with another's would hardly move h after the RMSNorm
    for st in (ref.guess_stack, m.guess_stack):
        g.manual_seed(8)
        st.base.copy_(torch.randn(st.base.shape, generator=g) * 4)
        st.scale.copy_(torch.rand(st.scale.shape, generator=g) * 0.5)
        st.fn.copy_(torch.randn(st.fn.shape, generator=g) * 4)
    X = torch.randn(T, p.hc_mult, m.cfg.n_embd, generator=g)
    x = X if not hasattr(m, "_pack") else m._pack(X, torch.rand(T, p.hc_mult, generator=g) + 0.1)
    x, tok = x.to(device), torch.tensor([5, 77, 300][:T], device=device)
    cases, bad = 0, []
    with torch.no_grad():
        for layer in range(L - 1):
            for depth in (1, 2, 3):
                n = min(depth, L - 1 - layer)
                a, b = m.guess_ids(layer, x, tok, n), guess_per_layer(ref, layer, x, tok, n)
                cases += 1
                if a.shape != b.shape or not torch.equal(a, b):
                    bad.append([layer, depth])
    return {"cases": cases, "bad": bad, "n_layer": L, "n_hash": p.n_hash_layers}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
    _widen_interpreter_bf16_dot()
    out = {"ops": compare()}
    if len(sys.argv) > 1:                   # a deepseek4 GGUF: the whole model too
        out["model"] = compare_model(sys.argv[1])
        out["guess"] = compare_guess(sys.argv[1])
    if len(sys.argv) > 2:                   # a deepseek41 GGUF: its static decode from position 3 on, so the
        # indexer's top-k has fewer visible entries than k (the spare row reaches decode_attend's kernel)
        out["model41"] = compare_model(sys.argv[2], prompt_len=3, decode=(5, 9, 11, 7, 2, 30, 8))
        out["guess41"] = compare_guess(sys.argv[2])
    json.dump(out, sys.stdout)
    print()
