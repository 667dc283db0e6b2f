#!/usr/bin/env python3
"""deepseek4's MXFP4 Triton expert path on CUDA, quickly (step 2 of bench_ds4.sh; no pytest on the device).

    python3 deploy/device/check_ds4.py [--out DIR]      # device cuda; writes DIR/check_ds4.{md,json}
    TRITON_INTERPRET=1 python3 deploy/device/check_ds4.py --device cpu --hidden 256 --ff 128   # a CPU dry run

1. kernel: MoEKernels("triton") against the torch path (quants.dequantize, F.linear, the clamped SwiGLU) on
   random MXFP4 experts of V4-Flash's expert shape (H 4096, F 2048; every E2M1 code, E8M0 scales 117..121),
   float32 (IEEE dots: within summation-order noise) and bfloat16 (the engine's CUDA dtype: within bf16 rounding),
   with V4's limit 10 and a binding limit; a row alone bit-identical to the same row in a full launch; two groups
   splitting the experts bit-identical to one group; µs per expert application, triton vs torch, decode-shaped.
2. engine: ds4-tiny (MXFP4 experts, 150-token prompt crossing its windows) through the runner on the device,
   kernels "auto" must pick triton; logits bit-identical across slot configurations 0/0, 2/3 and 8/0 (cold,
   warm, consolidated, and 4 decode steps), and to the deepseek4 Deepseek4Reference on the same device and dtype;
   vs the CPU float32 reference: max-abs diff and greedy agreement (reported).

--adversarial-timing SEED:MS: the engine step under the store's test-only jitter (as check_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from check_cuda import (RESULTS, ROWS, close, results_table, row, run_steps, runner_for, slot_passes,  # noqa: E402
                        sync, timing_flag, use_timing)

from betelgeuse.gguf.quants import dequantize  # noqa: E402
from betelgeuse.gguf.synth import spec_from_preset, write_model  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402
from betelgeuse.model import reference_model  # noqa: E402

MX = 39          # GGML MXFP4


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


def check_engine(device: str, tmp: Path):
    spec = replace(spec_from_preset("ds4-tiny"), seed=2)
    path = tmp / "check-ds4-tiny-s2.gguf"
    if not path.exists():
        write_model(path, spec, progress=False)
    E = spec.n_expert
    import numpy as np
    ids = [int(x) for x in np.random.default_rng(4).integers(0, spec.n_vocab, 150)]
    got, dec, backends = {}, {}, set()
    for vram, host in ((0, 0), (2, 3), (E, 0)):
        runner, store = runner_for(path, device, vram, host)
        try:
            backends.add(runner.kern.backend)
            slot_passes(runner, ids, f"{vram}/{host}", got, dec)
            dtype = runner.dtype
        finally:
            close(runner, store)
    want = "triton" if device.startswith("cuda") else "torch"
    row("ds4 engine backend", backends == {want}, f"kernels auto picked {sorted(backends)} (want {want})")
    keys = list(got)
    first = got[keys[0]]
    same = all(torch.equal(first, got[k]) for k in keys)
    dsame = all(torch.equal(dec[keys[0].split()[0]], d) for d in dec.values())
    row("ds4 engine invariance", same and dsame, f"{len(keys)} prefill passes over 3 slot configs bit-identical: {same}; "
        f"4 decode steps bit-identical: {dsame}; reads {[k.split(' ', 2)[2] for k in keys[-3:]]}")
    with torch.no_grad():
        ref = reference_model(path, device=device, dtype=dtype)
        r_dev = ref.forward(torch.tensor(ids, device=device), ref.new_cache(len(ids) + 8)).float().cpu()
        ref32 = reference_model(path)
        r_cpu = ref32.forward(torch.tensor(ids), ref32.new_cache(len(ids) + 8)).float()
    row("ds4 engine = Deepseek4Reference (same device/dtype)", bool(torch.equal(first.float(), r_dev)),
        f"max |diff| {(first.float() - r_dev).abs().max().item():.3e} ({dtype})")
    d = (first.float() - r_cpu).abs().max().item()
    greedy = float((first.float().argmax(-1) == r_cpu.argmax(-1)).float().mean())
    row("ds4 engine vs CPU float32 reference", None, f"max |diff| {d:.3e} (max |logit| {r_cpu.abs().max().item():.2f}), "
        f"greedy agreement {greedy:.1%} over {len(ids)} positions")
    RESULTS["engine"] = {"passes": keys, "bit_identical": same, "decode_bit_identical": dsame, "backends": sorted(backends),
                         "max_abs_vs_cpu_f32": d, "greedy_agreement": greedy}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tmp", default="/tmp/bg-check")
    p.add_argument("--out", help="directory for check_ds4.md / check_ds4.json")
    p.add_argument("--only", default="kernel,engine", help="comma-separated steps to run")
    p.add_argument("--hidden", type=int, default=4096, help="kernel check: expert input width H (V4-Flash: 4096)")
    p.add_argument("--ff", type=int, default=2048, help="kernel check: expert width F (V4-Flash: 2048)")
    timing_flag(p)
    a = p.parse_args()
    use_timing(a.adversarial_timing)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("check_ds4: error: CUDA is not available (use --device cpu to run the checks on the CPU)")
        return 2
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    RESULTS["torch"] = torch.__version__
    run_steps((("kernel", lambda: check_kernel(a.device, H=a.hidden, F=a.ff)),
               ("engine", lambda: check_engine(a.device, tmp))), a.only)
    md = results_table("check_ds4")
    print("\n" + md, flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "check_ds4.md").write_text(md + "\n")
        (out / "check_ds4.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 1 if any(r == "FAIL" for _, r, _ in ROWS) else 0


if __name__ == "__main__":
    raise SystemExit(main())
