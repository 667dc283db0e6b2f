#!/usr/bin/env python3
"""The expert kernels against the memory roofline, per GGML type, on the GPU (< 3 minutes on a bare H200).

    python3 deploy/device/kernel_roofline.py                 # every type, both geometries; OUT=/dir for the files
    python3 deploy/device/kernel_roofline.py --types Q4_K,Q8_0 --geoms bench --configs 0

For each expert type (Q8_0, MXFP4, the K-quants, the i-quants) and geometry (the bench's: hidden 2048, expert FFN
768, 128 experts; ds4-flash's: 4096, 2048, 256 experts, its clamped SwiGLU): a bank of 16 experts (one ring bank of
the engine) in a device pool laid out as slots (gate | up | down), applied through the engine's own kernels
(MoEKernels "triton": gate_up + down; routing prepared once) to 1, 16 and 64 rows per expert. Timed by CUDA-graph
replays of many launches that rotate over enough banks that the bytes are several times the L2 (random bytes: the
kernels' speed does not depend on the values). GB/s = expert bytes read / time; the launch pair and each kernel.

Each type runs the launch configurations of CONFIGS (block sizes, warps, pipeline depth: constants per type,
never the row count's) and keeps the fastest at 1 + 16 rows; the kept one is then checked on valid blocks against
the torch path (quants.dequantize -> bf16 -> SwiGLU experts; relative max error), for row invariance (one token's
rows alone == the same rows in the full launch, bit for bit) and for its in-kernel weights (triton_quants.dequantize
vs quants.dequantize, bf16). Compiles are done first by worker processes in parallel (the Triton cache).

Prints a markdown table (targets: 1 row >= 1500 GB/s, 16 rows >= 1200 GB/s) and the TYPE_CONFIG to keep; writes
$OUT/kernel_roofline.{md,json}. gguf is installed from .whl/ into /tmp/site where this Python lacks it
(`bash deploy/device/wheels.sh` here, then carry .whl). One device run that checks the kernels of every type, then
times them (check_cuda also needs services/pb/betelgeuse carried; ~5 minutes in all):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:$PWD python3 deploy/device/check_cuda.py --only kernels && \
      PYTHONPATH=/tmp/site:$PWD python3 deploy/device/kernel_roofline.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
T0 = time.perf_counter()


def _ensure_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        whl = sorted((REPO / ".whl").glob("gguf-*.whl"))
        if not whl:
            sys.exit("kernel_roofline: gguf is missing and .whl/ has no gguf wheel (run deploy/device/wheels.sh "
                     "here and carry .whl)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", "/tmp/site", *map(str, whl)], check=True)
        sys.path.insert(0, "/tmp/site")


_ensure_gguf()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

from betelgeuse.gguf.qtypes import row_nbytes  # noqa: E402

TYPES = ["Q8_0", "MXFP4", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ2_XS", "IQ2_XXS"]
# name: (hidden H, expert FFN F, experts per layer E, SwiGLU limit)
GEOMS = {"bench": (2048, 768, 128, None), "ds4-flash": (4096, 2048, 256, 10.0)}
BANK = 16                         # experts per launch group (a ring bank: EngineConfig.ring_slots / 2)
K_TOP = 8
ROWS = (1, 16, 64)
CONFIGS = [                       # candidate launch constants per type (triton_moe.CONFIG keys)
    {"BN": 64, "BN_GATE_UP": 64, "BK": 256, "num_warps": 4, "num_stages": 3},
    {"BN": 64, "BN_GATE_UP": 64, "BK": 128, "num_warps": 4, "num_stages": 3},
    {"BN": 128, "BN_GATE_UP": 128, "BK": 256, "num_warps": 8, "num_stages": 3},
    {"BN": 32, "BN_GATE_UP": 32, "BK": 256, "num_warps": 4, "num_stages": 3},
]
TARGET = {1: 1500.0, 16: 1200.0}
dev = torch.device("cuda")
DRY = False                       # --dry-run: the CPU under TRITON_INTERPRET=1, tiny geometries, no graphs
DTYPE = torch.bfloat16            # the engine's CUDA dtype (the dry run: float32, which the interpreter emulates)


def expert_nbytes(qt: int, H: int, F: int) -> int:
    return 2 * F * row_nbytes(qt, H) + H * row_nbytes(qt, F)


def part_sizes(qt: int, H: int, F: int) -> list[int]:
    return [F * row_nbytes(qt, H), F * row_nbytes(qt, H), H * row_nbytes(qt, F)]


def slot_layout(qt: int, H: int, F: int) -> tuple[list[int], int]:
    """(part starts in a slot, slot bytes): parts 64-byte aligned, slot a multiple of 4 KiB (as the worker's)."""
    starts, o = [], 0
    for n in part_sizes(qt, H, F):
        starts.append(o)
        o += -(-n // 64) * 64
    return starts, -(-o // 4096) * 4096


def kernels_for(qt: int, H: int, F: int, E: int, limit, weights_fn=None, backend="triton"):
    from betelgeuse.kernels.moe import MoEKernels
    starts, slot = slot_layout(qt, H, F)
    st = torch.tensor([starts] * E, dtype=torch.int64, device=dev)[None]
    return MoEKernels(backend, E, F, st, [(qt, qt)], 16, weights_fn=weights_fn, act_limit=limit), slot


def routing(n: int, rows: int, k: int, H: int, seed: int = 0):
    """T tokens x k ranks over experts 0..n-1, each expert exactly `rows` rows (distinct experts per token)."""
    T = n * rows // k
    ids = ((torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % n).to(dev)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dev, DTYPE)
    w = torch.rand(T, k, generator=g).to(dev, DTYPE)
    return h, ids, w


def base_table(E: int, first_slot: int, n: int, slot: int) -> torch.Tensor:
    b = torch.full((E,), -1, dtype=torch.int64)
    b[:n] = (first_slot + torch.arange(n)) * slot
    return b.to(dev)


def set_config(code: int, cfg: dict | None):
    from betelgeuse.kernels import triton_moe
    if cfg is None:
        triton_moe.TYPE_CONFIG.pop(code, None)
    else:
        triton_moe.TYPE_CONFIG[code] = dict(cfg)


# ---- compile workers ------------------------------------------------------------------------------------

def warm(tasks: list[tuple[str, str, int]]):
    """Compile the kernels of (geometry, type, config) tasks by launching them once on a tiny routing (the same
    specializations as the timed launches: same H, F, E, row bytes, dtypes, limit)."""
    from betelgeuse.kernels.moe import Group
    from betelgeuse.kernels.triton_quants import QT_CODES
    for gname, tname, ci in tasks:
        H, F, E, limit = GEOMS[gname]
        qt = int(GT[tname])
        set_config(QT_CODES[qt], CONFIGS[ci])
        kern, slot = kernels_for(qt, H, F, E, limit)
        pool = torch.zeros(2 * slot, dtype=torch.uint8, device=dev)
        h, ids, w = routing(2, 4, 2, H)
        r = kern.route(h, ids, w)
        kern.apply(r, 0, pool, Group(None, None, base_table(E, 0, 2, slot)), slot)
        kern.combine(r)
        if ci == 0:                                    # the check's in-kernel weights (triton_quants.dequantize)
            from betelgeuse.kernels import triton_quants
            for K in (H, F):
                raw = torch.zeros(64 * row_nbytes(qt, K), dtype=torch.uint8, device=dev)
                triton_quants.dequantize(raw, qt, (64, K), dtype=DTYPE)
    torch.cuda.synchronize()


def warm_parallel(tasks: list[tuple[str, str, int]], workers: int, timeout: float) -> float:
    import tempfile
    t = time.perf_counter()
    chunks = [tasks[i::workers] for i in range(workers) if tasks[i::workers]]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in chunks]
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", json.dumps(c)], stdout=subprocess.DEVNULL,
                              stderr=log) for c, log in zip(chunks, logs)]
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t)))
            if p.returncode:
                log.seek(0)
                err = log.read().strip().splitlines()
                print(f"  (a compile worker failed: {err[-1] if err else p.returncode})", flush=True)
        except subprocess.TimeoutExpired:
            p.kill()
            print("  (a compile worker ran out of time: the rest compiles in the main process)", flush=True)
        log.close()
    return time.perf_counter() - t


# ---- timing ---------------------------------------------------------------------------------------------

def graph_time(fn, reps: int) -> float:
    """Seconds per fn() call: a CUDA graph of `reps` calls (fn gets the call index), median of 5 replays."""
    if DRY:
        t = time.perf_counter()
        fn(0)
        return time.perf_counter() - t
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    del g
    return float(np.median(ts))


def measure(gname: str, tname: str, cfgs: list[int]) -> dict:
    """GB/s of the launch pair (and of gate_up, down) at ROWS for each config in cfgs, on rotating banks."""
    from betelgeuse.kernels import triton_moe as tk
    from betelgeuse.kernels.moe import Group
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    code = QT_CODES[qt]
    nbytes = expert_nbytes(qt, H, F)
    bank_bytes = BANK * nbytes
    n_banks = 2 if DRY else max(2, math.ceil(512e6 / bank_bytes))          # several times the 60 MB L2
    _, slot = slot_layout(qt, H, F)
    pool = torch.randint(0, 256, (n_banks * BANK * slot,), dtype=torch.uint8, device=dev)
    bases = [base_table(E, b * BANK, BANK, slot) for b in range(n_banks)]
    reps = max(n_banks, min(64, math.ceil(2e9 / bank_bytes)))
    out = {}
    for ci in cfgs:
        set_config(code, CONFIGS[ci])
        kern, _ = kernels_for(qt, H, F, E, limit)
        res = {}
        for rows in ROWS:
            h, ids, w = routing(BANK, rows, K_TOP, H)
            r = kern.route(h, ids, w)
            kern.apply(r, 0, pool, Group(None, None, bases[0]), slot)       # compile check outside the graph
            st = kern.starts[0]
            c = tk.config(code)
            aligned = kern._aligned

            def gu(i):
                tk.gate_up(r.h, pool, bases[i % n_banks], st, r.rows, r.off, r.inter, F, K_TOP, code, limit,
                           row_nbytes(qt, H), aligned)

            def dn(i):
                tk.down(r.inter, pool, bases[i % n_banks], st, r.rows, r.off, r.y, r.ids.shape[0], code,
                        row_nbytes(qt, F), aligned)
            t_gu, t_dn = graph_time(gu, reps), graph_time(dn, reps)
            gu_bytes, dn_bytes = BANK * 2 * F * row_nbytes(qt, H), BANK * H * row_nbytes(qt, F)
            res[rows] = {"us": (t_gu + t_dn) * 1e6, "gbps": bank_bytes / (t_gu + t_dn) / 1e9,
                         "gate_up_gbps": gu_bytes / t_gu / 1e9, "down_gbps": dn_bytes / t_dn / 1e9,
                         "gate_up_us": t_gu * 1e6, "down_us": t_dn * 1e6}
        out[ci] = {"config": {**c}, "rows": res}
    pool = None                   # the banks are freed before the next type
    torch.cuda.empty_cache()
    return {"expert_bytes": nbytes, "bpw": nbytes * 8 / (3 * H * F), "banks": n_banks, "reps": reps,
            "configs": out}


# ---- checks ---------------------------------------------------------------------------------------------

def check(gname: str, tname: str, ci: int) -> dict:
    """On valid blocks (2 experts): the kernels vs the torch path (bf16), row invariance, the in-kernel weights."""
    from betelgeuse.gguf.quants import dequantize
    from betelgeuse.gguf.quants_synth import quantize, random_blocks
    from betelgeuse.kernels import triton_quants
    from betelgeuse.kernels.moe import Group
    H, F, E, limit = GEOMS[gname]
    qt = int(GT[tname])
    set_config(triton_quants.QT_CODES[qt], CONFIGS[ci])
    rng = np.random.default_rng(qt)
    shapes = [(F, H), (F, H), (H, F)]
    starts, slot = slot_layout(qt, H, F)
    n = 2
    pool = torch.zeros(n * slot, dtype=torch.uint8)
    parts = []
    for e in range(n):
        ps = []
        for k, (shp, o) in enumerate(zip(shapes, starts)):
            std = 0.02 if k < 2 else 0.005
            if qt in (8, 39):                             # random valid blocks (gguf-py's quantizer is slow here)
                raw = random_blocks(qt, shp[0] * shp[1] // 32, rng, std / 74 if qt == 8 else std / 4)
            else:
                raw = quantize(None, qt, shp, rng, std)
            t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
            pool[e * slot + o: e * slot + o + t.numel()] = t
            ps.append(t.to(dev))
        parts.append(ps)
    pool = pool.to(dev)
    deq = [[dequantize(p, qt, s, DTYPE) for p, s in zip(ps, shapes)] for ps in parts]
    tri, _ = kernels_for(qt, H, F, E, limit)
    ref, _ = kernels_for(qt, H, F, E, limit, weights_fn=lambda b, l, e: deq[e], backend="torch")
    T = 16
    g = torch.Generator().manual_seed(1)
    h = torch.randn(T, H, generator=g).to(dev, DTYPE)
    ids = torch.tensor([[0, 1]] * T, device=dev)
    w = torch.rand(T, 2, generator=g).to(dev, DTYPE)
    base = base_table(E, 0, n, slot)
    grp = Group(np.arange(n), base.cpu().numpy(), base)

    def run(k, hh, ii, ww):
        r = k.route(hh, ii, ww)
        k.apply(r, 0, pool, grp, slot)
        return k.combine(r).float()
    o_t, o_r = run(tri, h, ids, w), run(ref, h, ids, w)
    alone = run(tri, h[5:6], ids[5:6], w[5:6])
    werr = max(float((triton_quants.dequantize(p, qt, s, dtype=DTYPE).to(DTYPE).float()
                      - d.float()).abs().max() / d.float().abs().max())
               for p, s, d in zip(parts[0], shapes, deq[0]))
    return {"rel_err": float((o_t - o_r).abs().max() / o_r.abs().max()), "finite": bool(torch.isfinite(o_t).all()),
            "row_invariant": bool(torch.equal(alone[0], o_t[5])), "weights_rel_err": werr}


# ---- main -----------------------------------------------------------------------------------------------

def table(results: dict, meta: dict) -> str:
    lines = [f"## Expert kernels vs the memory roofline on {meta['device']} (torch {meta['torch']}, triton "
             f"{meta['triton']})", "",
             f"Bank of {BANK} experts, bf16 activations, gate_up + down per launch pair; copy bandwidth "
             f"{meta['copy_gbps']:.0f} GB/s (read + write). Targets: 1 row >= {TARGET[1]:.0f} GB/s, 16 rows >= "
             f"{TARGET[16]:.0f} GB/s.", "",
             "| geometry | type | bpw | MB/expert | config (BN/BK/warps/stages) | 1 row GB/s | 16 rows | 64 rows | "
             "gate_up / down GB/s @1 | µs @1 | vs torch | weights | row-inv |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        gname, tname = key.split("/")
        if "best" not in r:
            lines.append(f"| {gname} | {tname} | | | | {r.get('error', 'not run')} | | | | | | | |")
            continue
        b = r["configs"][r["best"]]
        c, rw = b["config"], b["rows"]
        ck = r.get("check", {})

        def mark(rows):
            if rows not in rw:
                return "-"
            v = rw[rows]["gbps"]
            return f"{v:.0f}" + (" ✓" if rows in TARGET and v >= TARGET[rows] else "")
        lines.append(f"| {gname} | {tname} | {r['bpw']:.2f} | {r['expert_bytes'] / 1e6:.2f} | "
                     f"{c['BN']}/{c['BK']}/{c['num_warps']}/{c['num_stages']} | {mark(1)} | {mark(16)} | {mark(64)} | "
                     f"{rw[1]['gate_up_gbps']:.0f} / {rw[1]['down_gbps']:.0f} | {rw[1]['us']:.0f} | "
                     f"{ck.get('rel_err', float('nan')):.1e} | {ck.get('weights_rel_err', float('nan')):.1e} | "
                     f"{'yes' if ck.get('row_invariant') else 'NO' if ck else '?'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--geoms", default=",".join(GEOMS))
    p.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))), help="indices into CONFIGS")
    p.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 2))
    p.add_argument("--budget", type=float, default=160.0, help="seconds: later cases are skipped past it")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU under TRITON_INTERPRET=1 on tiny geometries (checks this script, not the GPU)")
    p.add_argument("--warm", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.warm:
        warm([tuple(t) for t in json.loads(a.warm)])
        return 0
    if a.dry_run:
        global DRY, dev, ROWS, BANK, DTYPE
        assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1"
        DRY, dev, ROWS, BANK, DTYPE, a.workers, a.budget = True, torch.device("cpu"), (1, 16), 2, torch.float32, 0, 1e9
        for g in list(GEOMS):
            GEOMS[g] = (256, 256, 32, GEOMS[g][3])
    elif not torch.cuda.is_available():
        print("kernel_roofline: error: CUDA is not available")
        return 2
    import triton
    types, geoms = a.types.split(","), a.geoms.split(",")
    cfgs = [int(i) for i in a.configs.split(",")]
    bad = [t for t in types if t not in TYPES] + [g for g in geoms if g not in GEOMS]
    if bad:
        print(f"kernel_roofline: error: unknown {bad} (types: {TYPES}; geometries: {list(GEOMS)})")
        return 2
    x = torch.empty(1 << (16 if DRY else 28), dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    copy_s = graph_time(lambda i: y.copy_(x), 8)
    meta = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": 2 * x.numel() * 4 / copy_s / 1e9, "configs": CONFIGS}
    x = y = None
    tasks = [(g, t, c) for g in geoms for t in types for c in cfgs]
    print(f"compiling {len(tasks) * 2} kernels in {a.workers} workers ...", flush=True)
    meta["compile_s"] = warm_parallel(tasks, a.workers, timeout=a.budget * 0.45) if a.workers > 0 else 0.0
    print(f"  done in {meta['compile_s']:.0f} s", flush=True)
    results = {}
    for g in geoms:
        for t in types:
            key = f"{g}/{t}"
            if time.perf_counter() - T0 > a.budget:
                results[key] = {"error": "skipped (time budget)"}
                continue
            try:
                r = measure(g, t, cfgs)
                r["best"] = min(r["configs"], key=lambda ci: r["configs"][ci]["rows"][ROWS[0]]["us"]
                                + r["configs"][ci]["rows"][ROWS[1]]["us"])
                r["check"] = check(g, t, r["best"])
                results[key] = r
                b = r["configs"][r["best"]]["rows"]
                print(f"{key:18s} best config {r['best']}: " + " / ".join(f"{b[n]['gbps']:.0f}" for n in ROWS)
                      + f" GB/s at {ROWS} rows; check {r['check']}  ({time.perf_counter() - T0:.0f} s)", flush=True)
            except Exception as e:                     # one table with every case
                import traceback
                traceback.print_exc()
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    md = table(results, meta)
    keep = {}
    from betelgeuse.kernels.triton_quants import QT_CODES
    for t in types:                                    # the faster config over the geometries measured
        rs = [results[f"{g}/{t}"] for g in geoms if "best" in results.get(f"{g}/{t}", {})]
        if rs:
            ci = min(cfgs, key=lambda c: sum(r["configs"][c]["rows"][n]["us"] / r["configs"][cfgs[0]]["rows"][n]["us"]
                                             for r in rs for n in ROWS[:2]))
            keep[QT_CODES[int(GT[t])]] = {k: v for k, v in CONFIGS[ci].items()}
    fails = [k for k, r in results.items()
             if ("check" in r and not (r["check"]["row_invariant"] and r["check"]["finite"] and r["check"]["rel_err"] < 3e-2))
             or ("error" in r and not r["error"].startswith("skipped"))]
    md += ("\n\nTYPE_CONFIG = " + json.dumps({str(k): v for k, v in keep.items()}) + "\n\nchecks: "
           + ("all pass" if not fails else "FAIL " + ", ".join(fails))
           + f"\n\n({time.perf_counter() - T0:.0f} s, compiles {meta['compile_s']:.0f} s)")
    print("\n" + md)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kernel_roofline.md").write_text(md + "\n")
        (Path(out) / "kernel_roofline.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                                                    default=str))
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
