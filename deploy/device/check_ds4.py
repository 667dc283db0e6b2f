#!/usr/bin/env python3
"""deepseek4's MXFP4 Triton expert path on CUDA, quickly (step 2 of bench_ds4.sh; no pytest on the device).

    python3 deploy/device/check_ds4.py [--out DIR]      # device cuda; writes DIR/check_ds4.{md,json}
    TRITON_INTERPRET=1 python3 deploy/device/check_ds4.py --device cpu --hidden 256 --ff 128   # a CPU dry run

1. kernel: MoEKernels("triton") against the torch path (quants.dequantize, F.linear, the clamped SwiGLU) on
   random MXFP4 experts of V4-Flash's expert shape (H 4096, F 2048; every E2M1 code, E8M0 scales 117..121),
   float32 (IEEE dots: within summation-order noise) and bfloat16 (the engine's CUDA dtype: within bf16 rounding),
   with V4's limit 10 and a binding limit; a row alone bit-identical to the same row in a full launch; two groups
   splitting the experts bit-identical to one group; µs per expert application, triton vs torch, decode-shaped.
2. engine: ds4-tiny (`--preset ds41-tiny`: deepseek41, Engram rows through the store) (MXFP4 experts, 150-token
   prompt crossing its windows) through the runner on the device,
   kernels "auto" must pick triton; logits bit-identical across slot configurations 0/0, 2/3 (with and without the
   flex cache) and 8/0 (cold, warm, consolidated, and 4 decode steps), and to the reference model on the same device and dtype;
   vs the CPU float32 reference: max-abs diff and greedy agreement (reported).
2b. prefix: the snapshot prefix cache (ds4-tiny; `--preset ds41-tiny`: deepseek41, its Engram history in the
   snapshot): a checkpoint restored and the rest prefilled == the unbroken prefill, the decode step after it too,
   whole-chunk pieces == one pass (chunks of 16); the same at the architecture's default chunk (`prefill_chunk` auto:
   256) on a 600-token prompt resumed at 512 and a 300-token one at 256 (a 44-row tail: with CHECK_DECODE_GEMV=1
   _gemv_kernel's, the full chunk the library's gemm); prefill wall by chunk size, one pass, 16, 64, 128, the default
   and 512 (reported).
3. ops: the fused per-row kernels (kernels/triton_ds4.py TritonOps) against TorchOps method by method, float32 and
   bfloat16, at tiny and V4-Flash shapes (tests/scripts/ds4_kernel_check.py; a row alone == in its launch).
3b. guess: the decode guess of layers l+1..l+3 in one pass (TritonOps.guess_route) picks the ids each layer's own
   moe_input + route pick (TorchOps layer by layer), ds4-tiny and ds41-tiny, from every layer at depths 1-3.
4. decode: ds4-tiny (`--preset ds41-tiny`: deepseek41, its Engram rows staged before each step) all in VRAM, a
   122-token prompt and 8 greedy steps (across the 128-token HCA window): eager
   (cuda_graphs off) == graph capture / replay bit for bit, solo (runner.forward) and lanes (decode_batch), in exact
   routing and in pool routing (2 VRAM + 3 host slots, settled after the prompt); solo
   decode == the reference's one-token passes (same device/dtype); the model with TritonOps vs TorchOps on the device
   (float32: within noise, same greedy tokens; bfloat16 reported); then check_cuda's batch step on ds4-tiny (3
   sequences over the lanes, one sitting out, == each alone; graphs replayed); and check_cuda's recycle step on
   ds4-tiny (2 + 3 slots: a second sequence on the first one's recycled state captures no decode graph, == fresh).
5. launches: kernels per layer of one decode step from torch.profiler, eager (the kernels a step runs) and replayed
   (what the profiler sees of the graphs), lanes and solo; PASS when the eager lanes step is <= 60 per layer.
6. vram: the worker's VRAM outside the expert slots, measured, against the slot plan's terms (store/plan.py
   vram_fixed_bytes): a runner with no VRAM slots over --vram-model (bench_ds4.sh passes ds4-flash; default
   ds4-tiny) and max_running 2, a 64-token prompt, then two sequences decoding 8 steps in the lanes with graphs and
   one alone (the graph pools): dense weights, graph pools, the non-torch part of the device (context, Triton
   modules) and the device-wide peak beside each plan term; PASS when the peak stays within the plan's total.

--adversarial-timing SEED:MS: the engine step under the store's test-only jitter (as check_cuda.py).
CHECK_ACT_QUANT, CHECK_PACK_EXPERTS (check_cuda.runner_for's): every engine check's engine.act_quant, and
engine.pack_experts on (the VRAM slots' MXFP4 experts in mma_pack's layout, read by gluon_mmq's PK 2: cpu-mxpk63; the
tiny model's experts then 64 wide); CHECK_DS4_FF=N: the tiny model's experts N wide (64: packing's model, unpacked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import _common  # first: puts this checkout on sys.path
import torch

from check_cuda import (RESULTS, check_batch, check_pool_decode, check_recycle, close, finish_checks, greedy_decode,
                        ids_for, parse_checks, row, run_steps, runner_for, slot_passes, sync)

from betelgeuse.gguf.quants import dequantize
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts
from betelgeuse.model import reference_model

MX = 39          # GGML MXFP4
LAUNCH_TARGET = 60           # kernels per layer of a decode step (issue 21)
sys.path.insert(0, str(_common.REPO / "tests" / "scripts"))


def _mx_raw(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Random MXFP4 bytes of a [rows, cols] matrix: uniform codes, exponents 117..121 (weights ~0.01..0.2)."""
    b = torch.randint(0, 256, (rows * cols // 32, 17), generator=g, dtype=torch.uint8)
    b[:, 0] = torch.randint(117, 122, (b.shape[0],), generator=g, dtype=torch.uint8)
    return b.reshape(-1)


def _timed(fn, n: int, device: str) -> float:
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t) / n


def check_kernel(device: str, E: int = 8, H: int = 4096, F: int = 2048, T: int = 37, K: int = 6):
    g = torch.Generator().manual_seed(39)
    raw = [[_mx_raw(g, F, H), _mx_raw(g, F, H), _mx_raw(g, H, F)] for _ in range(E)]
    shapes = ((F, H), (F, H), (H, F))
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, device)
    starts = starts[None]
    full = Group(None, base, torch.from_numpy(base).to(device))
    b1, b2 = base.copy(), base.copy()
    b1[::2], b2[1::2] = -1, -1
    split = [Group(None, b, torch.from_numpy(b).to(device)) for b in (b2, b1)]
    h32 = torch.randn(T, H, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    res = {}

    def run(kern, hh, ii, ww, groups):
        r = kern.route(hh, ii, ww)
        for grp in groups:
            kern.apply(r, 0, pool, grp, slot)
        return kern.combine(r)

    st_host = starts[0].cpu().tolist()

    def weights(dtype):
        def fn(buf, layer, e):           # as the engine's ExpertCache.weights: dequantize the slot's parts
            return tuple(dequantize(buf[st_host[e][i]: st_host[e][i] + raw[e][i].numel()], MX, shapes[i], dtype)
                         for i in range(3))
        return fn

    want32 = {}
    for lim in (10.0, 0.05):
        ref = MoEKernels("torch", E, F, starts, [(MX, MX)], 16, weights_fn=weights(torch.float32), act_limit=lim)
        want32[lim] = run(ref, h32, ids, w, [full])
    bind = float((want32[10.0] - want32[0.05]).abs().max() / want32[10.0].abs().max())
    cuda = device.startswith("cuda")
    # (Triton's CPU interpreter has no bfloat16: a CPU dry run checks float32 only and skips the timings)
    for dtype, tol in ((torch.float32, 2e-6 * (H + F) ** 0.5),) + (((torch.bfloat16, 3e-2),) if cuda else ()):
        h = h32.to(dtype)
        for lim in (10.0, 0.05):
            tk = MoEKernels("triton", E, F, starts, [(MX, MX)], 16, act_limit=lim)
            got = run(tk, h, ids, w, [full])
            alone = run(tk, h[5:6], ids[5:6], w[5:6], [full])
            sp = run(tk, h, ids, w, split)
            scale = float(want32[lim].abs().max())
            err = float((got.float() - want32[lim]).abs().max())
            key = f"{str(dtype).split('.')[-1]} limit {lim:g}"
            res[key] = {"max_abs": err, "scale": scale, "row_invariant": bool(torch.equal(alone[0], got[5])),
                        "split_equal": bool(torch.equal(sp, got))}
            ok = err <= tol * scale and res[key]["row_invariant"] and res[key]["split_equal"]
            row(f"kernel MXFP4 {key}", ok, f"max|triton - torch f32| {err:.3e} (scale {scale:.3g}, tol {tol * scale:.3e}); "
                f"row alone == in launch: {res[key]['row_invariant']}; 2 groups == 1: {res[key]['split_equal']}")
    row("kernel MXFP4 clamp binds", bind > 0.05, f"limit 0.05 vs 10 changes the output by {bind:.2f} of its scale")
    # µs per expert application, decode-shaped (1 token x top-6) and a 64-token prefill block
    for n_tok in (1, 64) if cuda else ():
        hh = torch.randn(n_tok, H, generator=g).to(device).to(torch.bfloat16)
        ii = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n_tok)]).to(device)
        ww = torch.rand(n_tok, K, generator=g).to(device)
        tk = MoEKernels("triton", E, F, starts, [(MX, MX)], 16, act_limit=10.0)
        tr = MoEKernels("torch", E, F, starts, [(MX, MX)], 16, weights_fn=weights(hh.dtype), act_limit=10.0)
        apps = int(torch.unique(ii).numel())
        t_tk = _timed(lambda: run(tk, hh, ii, ww, [full]), 20, device) / apps * 1e6
        t_tr = _timed(lambda: run(tr, hh, ii, ww, [full]), 5, device) / apps * 1e6
        gbs = sum(r.numel() for r in raw[0]) / (t_tk * 1e-6) / 1e9
        res[f"us_per_application_{n_tok}tok"] = {"triton": t_tk, "torch": t_tr, "triton_GBps": gbs}
        row(f"kernel MXFP4 speed {n_tok} tok", None, f"{apps} experts: triton {t_tk:.1f} µs / application "
            f"({gbs:.0f} GB/s of expert bytes), torch {t_tr:.1f} µs ({t_tr / t_tk:.1f}x)")
    RESULTS["kernel"] = res


def _tiny(tmp: Path, preset: str = "ds4-tiny"):
    """(path, spec) of the tiny model (ds4-tiny, or --preset's) the engine checks share (written once).
    CHECK_DS4_FF=N: its experts N wide; by default 64 under CHECK_PACK_EXPERTS=1 (check_cuda's runner_for:
    engine.pack_experts, with CHECK_ACT_QUANT=bf16 or auto; cpu-mxpk63: its 32 is not a whole tile of mma_pack's,
    startup would refuse), so CHECK_DS4_FF=64 alone is the same model unpacked (the baseline)."""
    spec = replace(spec_from_preset(preset), seed=2)
    ff = int(os.environ.get("CHECK_DS4_FF", "64" if os.environ.get("CHECK_PACK_EXPERTS") == "1" else "0"))
    if ff:
        spec = replace(spec, n_ff_exp=ff)
    path = tmp / f"check-{preset}-s2{f'-ff{ff}' if ff else ''}.gguf"
    if not path.exists():
        write_model(path, spec, progress=False)
    return path, spec


def check_engine(device: str, tmp: Path, preset: str = "ds4-tiny"):
    path, spec = _tiny(tmp, preset)
    tag = preset.split("-")[0]
    E = spec.n_expert
    import numpy as np
    ids = [int(x) for x in np.random.default_rng(4).integers(0, spec.n_vocab, 150)]
    got, dec, backends = {}, {}, set()
    # 2/3 without the flex cache: the decode steps' miss layers bank MXFP4 host experts beside disk ones (one group on
    # the fast path: MoEStep._hand_misses), where the flex cache would hold the disk experts after a step
    for vram, host, kw in ((0, 0, {}), (2, 3, {}), (2, 3, dict(flex_cache=False)), (E, 0, {})):
        runner, store = runner_for(path, device, vram, host, **kw)
        try:
            backends.add(runner.kern.backend)
            slot_passes(runner, ids, f"{vram}/{host}" + ("" if not kw else "-noflex"), got, dec)
            dtype = runner.dtype
        finally:
            close(runner, store)
    want = "triton" if device.startswith("cuda") else "torch"
    row(f"{tag} engine backend", backends == {want}, f"kernels auto picked {sorted(backends)} (want {want})")
    keys = list(got)
    first = got[keys[0]]
    same = all(torch.equal(first, got[k]) for k in keys)
    dsame = all(torch.equal(dec[keys[0].split()[0]], d) for d in dec.values())
    row(f"{tag} engine invariance", same and dsame, f"{len(keys)} prefill passes over 4 slot configs bit-identical: {same}; "
        f"4 decode steps bit-identical: {dsame}; reads {[k.split(' ', 2)[2] for k in keys[-3:]]}")
    with torch.no_grad():
        ref = reference_model(path, device=device, dtype=dtype)
        r_dev = ref.forward(torch.tensor(ids, device=device), ref.new_cache(len(ids) + 8)).float().cpu()
        ref32 = reference_model(path)
        r_cpu = ref32.forward(torch.tensor(ids), ref32.new_cache(len(ids) + 8)).float()
    row(f"{tag} engine = its reference model (same device/dtype)", bool(torch.equal(first.float(), r_dev)),
        f"max |diff| {(first.float() - r_dev).abs().max().item():.3e} ({dtype})")
    d = (first.float() - r_cpu).abs().max().item()
    greedy = float((first.float().argmax(-1) == r_cpu.argmax(-1)).float().mean())
    row(f"{tag} engine vs CPU float32 reference", None, f"max |diff| {d:.3e} (max |logit| {r_cpu.abs().max().item():.2f}), "
        f"greedy agreement {greedy:.1%} over {len(ids)} positions")
    RESULTS["engine"] = {"passes": keys, "bit_identical": same, "decode_bit_identical": dsame, "backends": sorted(backends),
                         "max_abs_vs_cpu_f32": d, "greedy_agreement": greedy}


def check_prefix(device: str, tmp: Path, chunk: int = 16, preset: str = "ds4-tiny"):
    """The snapshot prefix cache on the device (worker/snapshot_cache.py): ds4-tiny (or --preset's), a 150-token
    prompt in chunks of `chunk`; the checkpoint its pass keeps at 96 (state.mark), restored into a fresh state, and
    the rest prefilled: bit-identical to the unbroken prefill, and so is the decode step after it; a prompt in
    whole-chunk pieces too. Then at the architecture's default chunk (its class's prefill_chunk, what `prefill_chunk`
    auto runs: 256) a 600-token prompt's checkpoint at 512 likewise. Then the chunked prefill's wall against one
    chunk (chunk=None: what deepseek4 ran before chunking), a 150- and a 600-token prompt, reported."""
    import numpy as np
    from betelgeuse.worker.snapshot_cache import SnapshotCache
    path, spec = _tiny(tmp, preset)
    tag = preset.split("-")[0]
    ids = [int(x) for x in np.random.default_rng(4).integers(0, spec.n_vocab, 150)]
    runner, store = runner_for(path, device, spec.n_expert, 0, prefill_chunk=chunk)
    try:
        def resumed(prompt: list[int], cut: int, n_ctx: int):
            """-> (the rest after the checkpoint at `cut`, restored, == the unbroken prefill, and so is the decode
            step after it; their max |diff|; the snapshot's bytes; the unbroken prefill's logits)."""
            kv = runner.new_cache(n_ctx)
            kv.mark(cut)
            whole, _ = runner.forward(prompt, kv, all_logits=True)
            step, _ = runner.forward([int(whole[-1].argmax())], kv)
            snap = kv.take_mark()
            kv2 = runner.new_cache(n_ctx)
            runner.model.restore(kv2, snap)
            rest, _ = runner.forward(prompt[cut:], kv2, all_logits=True)
            step2, _ = runner.forward([int(whole[-1].argmax())], kv2)
            ok = torch.equal(rest.cpu(), whole[cut:].cpu()) and torch.equal(step.cpu(), step2.cpu())
            return ok, (rest.float() - whole[cut:].float()).abs().max().item(), snap.nbytes, whole

        ok, diff, snap_bytes, whole = resumed(ids, 96, 256)
        nbytes = {96: snap_bytes}
        row(f"{tag} prefix: checkpoint restore + rest == miss", ok,
            f"snapshot {snap_bytes} B at 96 of 150 tokens; max |diff| {diff:.3e}")
        kv3, a = runner.new_cache(256), 0
        for piece in (32, 16, 48, 54):
            out, _ = runner.forward(ids[a:a + piece], kv3, all_logits=True)
            a += piece
        row(f"{tag} prefix: pieces == one pass", torch.equal(out.cpu(), whole[-54:].cpu()), "pieces 32, 16, 48, 54")
        sc = SnapshotCache(runner.model, chunk, 1 << 30)
        held = sc.insert_tail(kv3, ids, [], out[-1])
        row(f"{tag} prefix: whole-prompt entry", sc.covered(sc.lookup(ids)) == len(ids) and held != [],
            f"{sc.bytes_used} B")
        default = replace(runner.cfg, prefill_chunk="auto").chunk_for(type(runner.model).prefill_chunk)
        long = [int(x) for x in np.random.default_rng(5).integers(0, spec.n_vocab, 600)]
        runner.chunk = default
        cut = 600 // default * default
        ok_d, diff, nbytes[cut], _ = resumed(long, cut, 608)
        row(f"{tag} prefix: default chunk {default}: checkpoint restore + rest == miss", ok_d,
            f"snapshot {nbytes[cut]} B at {cut} of 600 tokens; max |diff| {diff:.3e}")
        # a tail of <= GEMV_ROWS rows after a full chunk: with engine.decode_gemv on (CHECK_DECODE_GEMV=1) the tail
        # takes _gemv_kernel and the full chunk the library's gemm, fresh and resumed alike (inv60)
        tail = default + 44
        ok_t, diff, nbytes[default], _ = resumed(long[:tail], default, tail + 8)
        ok_d = ok_d and ok_t
        row(f"{tag} prefix: default chunk {default}, a 44-row tail: checkpoint restore + rest == miss", ok_t,
            f"snapshot at {default} of {tail} tokens; max |diff| {diff:.3e}")
        walls = {}
        sizes = [None] + sorted({chunk, 64, 128, default, 512})
        for n in (150, 600):
            prompt = long[:n]
            for c in sizes:
                runner.chunk = c
                runner.forward(prompt, runner.new_cache(n + 8))          # warm
                sync(device)
                t0 = time.perf_counter()
                runner.forward(prompt, runner.new_cache(n + 8))
                sync(device)
                walls[f"{n} tokens, chunk {c}"] = round((time.perf_counter() - t0) * 1e3, 1)
        runner.chunk = chunk
        gain = walls["600 tokens, chunk 64"] / walls[f"600 tokens, chunk {default}"]
        row(f"{tag} prefix: prefill wall ms by chunk", None, ", ".join(f"{k}: {v}" for k, v in walls.items())
            + f"; 600 tokens at the default {default}: {gain:.2f}x faster than at 64")
        RESULTS[f"prefix {preset}"] = {"exact": ok, "exact_default_chunk": ok_d, "default_chunk": default,
                                       "snapshot_bytes": nbytes, "prefill_ms": walls}
    finally:
        close(runner, store)


def check_ops(device: str):
    import os
    from ds4_kernel_check import FLASH, TINY, compare, failures, _widen_interpreter_bf16_dot
    if os.environ.get("TRITON_INTERPRET") == "1":
        _widen_interpreter_bf16_dot()
    res = {}
    for name, dims in (("tiny", TINY), ("flash", FLASH)) if device.startswith("cuda") else (("tiny", TINY),):
        r = compare(device, dims)
        bad = failures(r)
        worst = max(r, key=lambda k: r[k]["max_abs"] / max(r[k]["scale"], 1e-30))
        row(f"ds4 ops {name} shapes", not bad,
            f"{len(r)} cases, TritonOps vs TorchOps (f32 + bf16; ids, copied state rows and rows alone bit-exact); "
            f"failing {bad[:8]}; worst {worst}: max|diff| {r[worst]['max_abs']:.3e} of {r[worst]['scale']:.3g}")
        res[name] = r
    RESULTS["ops"] = res


def check_guess(device: str, tmp: Path):
    """The decode guess of layers l+1..l+3 in one pass (TritonOps.guess_route) picks the ids of each layer's own
    moe_input + route (TorchOps, layer by layer), ds4-tiny (hash layers) and ds41-tiny (lagged mHC), float32."""
    from ds4_kernel_check import compare_guess
    for preset in ("ds4-tiny", "ds41-tiny"):
        r = compare_guess(str(_tiny(tmp, preset)[0]), device=device)
        row(f"{preset.split('-')[0]} fused guess ids == per-layer", not r["bad"],
            f"{r['cases']} cases (every layer, depth 1-3, {r['n_hash']} hash layers of {r['n_layer']}); differing "
            f"(layer, depth): {r['bad'][:8]}")
        RESULTS[f"guess {preset}"] = r


def check_decode(device: str, tmp: Path, steps: int = 8, preset: str = "ds4-tiny"):
    from betelgeuse.kernels.triton_ds4 import TritonOps
    from betelgeuse.model.deepseek4 import TorchOps
    path, spec = _tiny(tmp, preset)
    tag = preset.split("-")[0]
    import numpy as np
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, spec.n_vocab, 122)]
    got, toks, replayed = {}, {}, {}
    for graphs in (False, True):
        runner, store = runner_for(path, device, spec.n_expert, 0, cuda_graphs=graphs)
        try:
            static = runner.decodes_in_lanes
            for how in ("solo", "lanes"):
                got[graphs, how], toks[graphs, how], replayed[graphs, how] = greedy_decode(runner, prompt, steps, how)
            dtype = runner.dtype
        finally:
            close(runner, store)
    cuda = device.startswith("cuda")
    for how in ("solo", "lanes"):
        same = bool(torch.equal(got[False, how], got[True, how]))
        row(f"{tag} decode {how}: eager == graphs", same and (replayed[True, how] or not cuda),
            f"{steps} steps from a {len(prompt)}-token prompt bit-identical: {same}; graphs replayed: {replayed[True, how]}; "
            f"static form: {static}; max |diff| {(got[False, how] - got[True, how]).abs().max().item():.3e}")
    # pool routing in the graphs (check_cuda.check_pool_decode): 2 VRAM + 3 host slots per layer of ds4-tiny's 8
    q = max(1, spec.n_expert // 4)
    replayed.update(check_pool_decode(path, device, prompt, q, q + 1, f"{tag} decode", exact=got, steps=steps))
    # the reference's one-token passes on the same tokens (same device, dtype and kernels)
    with torch.no_grad():
        ref = reference_model(path, device=device, dtype=dtype)
        ref.forward(torch.tensor(prompt, device=device), cache := ref.new_cache(len(prompt) + steps + 8))
        r = [ref.forward(torch.tensor([t], device=device), cache).float().cpu() for t in toks[False, "solo"]]
    rl = torch.cat(r)
    row(f"{tag} decode solo == {type(ref).__name__}", bool(torch.equal(rl, got[False, "solo"])),
        f"{steps} one-token passes, max |diff| {(rl - got[False, 'solo']).abs().max().item():.3e} ({dtype})")
    # the whole model with the fused kernels vs TorchOps on the device, teacher-forced on the same tokens
    res = {}
    for dt in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        outs = {}
        for name in ("triton", "torch"):
            with torch.no_grad():
                m = reference_model(path, device=device, dtype=dt)
                if name == "torch":
                    m.ops = TorchOps()
                elif not isinstance(m.ops, TritonOps):      # a CPU dry run: the kernels in Triton's interpreter
                    m.ops = TritonOps()
                    m.ops.prepare(m.w, m.cfg.n_layer)
                c = m.new_cache(len(prompt) + steps + 8)
                lg = [m.forward(torch.tensor(prompt, device=device), c).float().cpu()]
                lg += [m.forward(torch.tensor([t], device=device), c).float().cpu() for t in toks[False, "solo"]]
            outs[name] = torch.cat(lg)
            del m
        a, b = outs["triton"], outs["torch"]
        d, sc = (a - b).abs().max().item(), b.abs().max().item()
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        key = str(dt).split(".")[-1]
        res[key] = {"max_abs": d, "scale": sc, "greedy_agreement": agree}
        row(f"{tag} model TritonOps vs TorchOps {key}", (d <= 1e-3 * sc and agree == 1.0) if dt == torch.float32 else None,
            f"{len(prompt)}-token prefill + {steps} decode passes: max |diff| {d:.3e} (max |logit| {sc:.2f}), "
            f"greedy agreement {agree:.1%}")
    RESULTS["decode"] = {"ops_model": res, "replayed": {f"{g} {h}": v for (g, h), v in replayed.items()}}
    if cuda:
        check_batch(path, device)
    # a second sequence on the first one's recycled state replays from its first step, == a fresh runner's (issue 21)
    check_recycle(path, device, f"{tag} decode", q, q + 1)


def _profiled_step(step, n_layer: int, device: str) -> dict:
    """A decode step run eagerly, captured and replayed, then once timed and once profiled (torch.profiler)."""
    from services.bench.profile import profile_pass
    for _ in range(3):                              # eager, capture, replay
        step()
    sync(device)
    t = time.perf_counter()
    step()
    sync(device)
    wall = time.perf_counter() - t
    return dict(profile_pass(step, n_layer, wall, torch.device(device)), step_ms=wall * 1e3)


def check_launches(device: str, tmp: Path, preset: str = "ds4-tiny"):
    """Kernels per layer of one decode step (torch.profiler), ds4-tiny (or --preset's) all in VRAM. The target
    holds deepseek4; deepseek41's is reported (its lagged mHC, compressor and indexer steps are torch ops)."""
    tag = preset.split("-")[0]
    if not device.startswith("cuda"):
        row(f"{tag} launches per layer", None, "CUDA only (torch.profiler kernel events)")
        return
    path, spec = _tiny(tmp, preset)
    prompt = list(range(3, 125))
    res = {}
    for graphs in (False, True):
        runner, store = runner_for(path, device, spec.n_expert, 0, cuda_graphs=graphs)
        try:
            for how in ("lanes", "solo"):
                kv = runner.new_cache(len(prompt) + 16)
                runner.forward(prompt, kv)

                def step():
                    return (runner.decode_batch([7], [kv]) if how == "lanes"
                            else runner.forward([7], kv, consolidate=False))
                res[f"{how} {'replayed' if graphs else 'eager'}"] = _profiled_step(step, spec.n_layer, device)
                runner.release(kv)
                runner.consolidate()
        finally:
            close(runner, store)
    eager = res["lanes eager"]["launches_per_layer"]
    row(f"{tag} launches per layer (decode)", eager <= LAUNCH_TARGET if tag == "ds4" else None,
        f"lanes eager {eager:.1f} (target <= {LAUNCH_TARGET}); " + "; ".join(
            f"{k} {v['launches_per_layer']:.1f}/layer, {v['memcpys']} copies, {v['step_ms']:.2f} ms/step"
            for k, v in res.items() if k != "lanes eager"))
    # pool routing against exact on the same slots, each layer partly resident (E-2 VRAM + 1 host: one expert on
    # disk): the graphs hold one selection per layer (MoEStep.static_variant), so pool launches no more than exact
    # (it was exact + its own selection + the pick between them: ~20 more per layer)
    E = spec.n_expert
    modes = {}
    for routing in ("exact", "pool"):
        runner, store = runner_for(path, device, E - 2, 1, cuda_graphs=True, routing=routing)
        try:
            kv = runner.new_cache(len(prompt) + 16)
            runner.forward(prompt, kv)
            runner.settle()

            modes[routing] = _profiled_step(lambda: runner.decode_batch([7], [kv]), spec.n_layer, device)
            runner.release(kv)
        finally:
            close(runner, store)
    ex, po = (modes[k]["launches_per_layer"] for k in ("exact", "pool"))
    row(f"{tag} launches per layer, pool vs exact (lanes replayed, {E - 2}+1 slots)", po <= ex + 1.0,
        f"pool {po:.1f}/layer ({modes['pool']['step_ms']:.2f} ms/step), exact {ex:.1f}/layer "
        f"({modes['exact']['step_ms']:.2f} ms/step)")
    res["pool vs exact"] = modes
    RESULTS["launches"] = res


def check_vram(device: str, tmp: Path, model: str | None):
    if not device.startswith("cuda"):
        row("ds4 vram vs plan", None, "CUDA only")
        return
    from betelgeuse.config import GiB, MiB
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.model.registry import arch_of
    from betelgeuse.store import plan as P
    path = Path(model) if model and Path(model).exists() else _tiny(tmp)[0]
    dev = torch.device(device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0, total = torch.cuda.mem_get_info()
    alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runner, store = runner_for(path, device, 0, 0, max_running=2, vram_budget=100 * GiB)
    try:
        cfg, f = runner.cfg, runner.file
        c = f.config
        a, dt = arch_of(c), P.compute_dtype_bytes(cfg)
        plan = runner.plan
        slot = plan.slot.slot_bytes
        terms = {"dense": P.dense_bytes(f, dt), "state x max_running": cfg.max_running * a.state_bytes(c, cfg.max_context, dt),
                 "ring": cfg.ring_slots * slot, "activations + scratch": a.activation_bytes(c, cfg.prefill_pass_tokens, dt)
                 + a.scratch_bytes(c, cfg.max_context), "graphs": cfg.max_running * P.GRAPHS_BYTES_PER_SEQ,
                 "context": P.CUDA_CONTEXT_BYTES}
        torch.cuda.synchronize()
        dense = torch.cuda.memory_allocated() - alloc0 - cfg.ring_slots * slot
        prompts = [ids_for(path, 64, seed) for seed in (11, 12)]
        kvs = [runner.new_cache(len(p) + 16) for p in prompts]
        last = []
        for p, kv in zip(prompts, kvs):
            lg, _ = runner.forward(p, kv)
            last.append(int(lg[-1].argmax()))
        torch.cuda.synchronize()
        res_before = torch.cuda.memory_reserved()
        for _ in range(8):
            lg, _ = runner.decode_batch(last, kvs)
            last = [int(x.argmax()) for x in lg]
        kv3 = runner.new_cache(len(prompts[0]) + 16)
        lg, _ = runner.forward(prompts[0], kv3)
        for _ in range(4):
            lg, _ = runner.forward([int(lg[-1].argmax())], kv3, consolidate=False)
        torch.cuda.synchronize()
        graphs = torch.cuda.memory_reserved() - res_before
        free1, _ = torch.cuda.mem_get_info()
        used = (total - free1) - (total - free0)
        non_torch = used - (torch.cuda.memory_reserved() - res0)
        peak = non_torch + torch.cuda.max_memory_reserved() - res0       # device-wide peak, approximately
        fixed = plan.vram_fixed
        meas = {"dense": dense, "graphs (reserved growth over decode)": graphs, "non-torch (context, modules)": non_torch,
                "torch max allocated": torch.cuda.max_memory_allocated() - alloc0,
                "torch max reserved": torch.cuda.max_memory_reserved() - res0, "device peak": peak}
        for kv in kvs + [kv3]:
            runner.release(kv)
        warmed = runner.warmed          # attach's steps: device-wide / torch-reserved MiB each (worker/attach_steps.py)
    finally:
        close(runner, store)
    from services.bench.report import attach_vram
    row("ds4 vram vs plan", peak <= fixed,
        f"{path.name}, 0 VRAM slots: device peak {peak / MiB:,.0f} MiB vs plan fixed {fixed / MiB:,.0f} MiB; "
        + "; ".join(f"{k} {v / MiB:,.1f}" for k, v in meas.items()) + " || plan: "
        + "; ".join(f"{k} {v / MiB:,.1f}" for k, v in terms.items())
        + f" || attach by step, MiB device-wide / torch reserved: {attach_vram(warmed)}")
    RESULTS["vram"] = {"model": str(path), "measured": meas, "plan_terms": terms, "plan_fixed": fixed,
                       "attach": warmed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tmp", default="/tmp/bg-check")
    p.add_argument("--out", help="directory for check_ds4.md / check_ds4.json")
    p.add_argument("--only", default="kernel,engine,prefix,ops,guess,decode,launches,vram",
                   help="comma-separated steps to run")
    p.add_argument("--vram-model", help="the model of the vram step (bench_ds4.sh: ds4-flash; default ds4-tiny)")
    p.add_argument("--hidden", type=int, default=4096, help="kernel check: expert input width H (V4-Flash: 4096)")
    p.add_argument("--ff", type=int, default=2048, help="kernel check: expert width F (V4-Flash: 2048)")
    p.add_argument("--preset", default="ds4-tiny", help="engine, prefix, decode and launches checks' model: ds4-tiny, or "
                                                        "ds41-tiny (deepseek41 with its Engram rows read by the store)")
    a = parse_checks(p, "check_ds4")
    if a is None:
        return 2
    tmp = Path(a.tmp)
    run_steps((("kernel", lambda: check_kernel(a.device, H=a.hidden, F=a.ff)),
               ("engine", lambda: check_engine(a.device, tmp, a.preset)),
               ("prefix", lambda: check_prefix(a.device, tmp, preset=a.preset)),
               ("ops", lambda: check_ops(a.device)),
               ("guess", lambda: check_guess(a.device, tmp)),
               ("decode", lambda: check_decode(a.device, tmp, preset=a.preset)),
               ("launches", lambda: check_launches(a.device, tmp, a.preset)),
               ("vram", lambda: check_vram(a.device, tmp, a.vram_model))), a.only)
    return finish_checks("check_ds4", Path(a.out) if a.out else None)


if __name__ == "__main__":
    raise SystemExit(main())
