"""The local memory (stack frame: spills, dynamically indexed arrays) per thread of each kernel variant the attach
warm-ups launch, compiled for sm_90 ahead of time, and the VRAM it makes the CUDA driver reserve: no GPU needed.

Why (issue 21, gpu-run45-ds4 / gpu-run45-serve): the driver sizes a context's local-memory reservation by the
largest per-thread local bytes of any kernel launched so far times every thread the GPU can hold resident (132 SMs x
2048 on an H100: 270,336), and keeps it for the context's life: VRAM outside torch's allocator. A variant that only
the warm-up launches (MoEStep.warm_kernels, worker/warm_decode.py) can grow it for good.

Each variant is compiled as its launch is (kernel_smem.compile_sm90: capability 90, warp 32, the launch's
constexprs, int arguments == 1 as constants, pointers 16-byte aligned) and Triton's own ptxas run reports it
(knobs.nvidia.dump_ptxas_log, in a fresh cache directory so that every variant really runs ptxas): registers,
"N bytes stack frame, N bytes spill stores"; the cubin's bytes are the module the first launch loads.

The variants: the dense decode kernels as a run records them (`name[K=v,...]`: constexprs and int arguments
specialized to 1; by default the list of gpu-run45-ds4's attach, deepseek4 ds4-flash, and qwen3moe's two norms),
their runtime arguments' types from DENSE below; the expert kernels (triton_moe gate_up / down, both rows buckets'
configs, Q8_0 at the bench geometry and MXFP4 at ds4-flash's; combine's two forms). A variant's own T (rows 1..8)
only changes int arguments' values, not its compile key beyond them.

    kernel_lmem.py [--variants bench.json|list.txt] [--only NAME,..] [--no-experts] [--buckets 1,16] [--jobs N]
                   [--sms 132] [--threads 2048] [--measure]

--measure (CUDA): a few ops (MEASURE) launched once each in a fresh process, the VRAM each adds outside torch's
allocator against the reservation its variant's local bytes predict: the formula checked on the GPU at hand.

Prints one JSON line {"skipped": reason} when this Triton cannot compile for CUDA here, else {"triton", "ptxas",
"threads", "kernels": [{"kernel", "constexprs", "warps", "regs", "stack", "spill_stores", "lmem_mib", "cubin",
"shared"}, ...], "measured"} (largest stack first); markdown tables go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_smem  # noqa: E402  (beside this script: compile_sm90, expert_spec, probe)

from betelgeuse.kernels.triton_ds4 import ATTN_STAGES  # noqa: E402  (decode_attend's launch, as the ops make it)
from betelgeuse.kernels.triton_moe import BUCKETS  # noqa: E402  (the expert schedules' rows buckets)

SMS, THREADS_PER_SM = 132, 2048           # an H100 SXM: resident threads = 270,336

# the dense decode kernels: module, and every runtime argument's type in order ("*dtype" pointer, "i32" int,
# "i32/16" an int whose launches pass multiples of 16 (the JIT marks them divisible), "fp32" a float; a tuple of
# them: a tuple argument). bf16 activations (the models' dtype on CUDA); float32 mix / RoPE / norm / routing tables
DENSE = {
    "_hc_partial_kernel": ("triton_ds4", dict(x_ptr="*bf16", fn_ptr="*fp32", pm_ptr="*fp32", pss_ptr="*fp32",
                                              K="i32/16", S="i32")),
    "_hc_finish_kernel": ("triton_ds4", dict(x_ptr="*bf16", pm_ptr="*fp32", pss_ptr="*fp32", base_ptr="*fp32",
                                             scale_ptr="*fp32", norm_ptr="*fp32", post_ptr="*fp32", comb_ptr="*fp32",
                                             h_ptr="*bf16", pre_ptr="*fp32", lag_ptr="*fp32", D="i32/16",
                                             K="i32/16", S="i32", iters="i32", hc_eps="fp32", eps="fp32", T="i32")),
    "_hc_post_kernel": ("triton_ds4", dict(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", post_ptr="*fp32",
                                           comb_ptr="*fp32", out_ptr="*bf16", D="i32/16")),
    "_rms_rope_kernel": ("triton_ds4", dict(x_ptr="*bf16", w_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32",
                                            out_ptr="*bf16", ring_ptr="*bf16", pos_ptr="*i64", D="i32/16",
                                            R="i32/16", NH="i32", W="i32/16", OT="i32/16", eps="fp32")),
    "_compress_step_kernel": ("triton_ds4", dict(kvb_ptr="*bf16", gb_ptr="*bf16", ent_ptr="*bf16", kv_ptr="*bf16",
                                                 g_ptr="*bf16", ape_ptr="*fp32", norm_ptr="*fp32", inv_ptr="*fp32",
                                                 pos_ptr="*i64", eps="fp32", D="i32/16", C="i32/16",
                                                 R_ROPE="i32/16")),
    "_index_scores_kernel": ("triton_ds4", dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*bf16", pos_ptr="*i64",
                                                out_ptr="*fp32", N="i32", wscale="fp32", kscale="fp32",
                                                RATIO="i32")),
    "_decode_attn_kernel": ("triton_ds4", dict(q_ptr="*bf16", kv_ptr="*bf16", ring_ptr="*bf16", ent_ptr="*bf16",
                                               top_ptr="*i64", pos_ptr="*i64", sinks_ptr="*fp32", out_ptr="*bf16",
                                               H="i32/16", W="i32/16", NE="i32", RATIO="i32", scale="fp32")),
    "_route_approx_kernel": ("triton_ds4", dict(logits_ptr="*fp32", bias_ptr="*fp32", tid_ptr="*i64",
                                                tok_ptr="*i64", mask_ptr="*u8", ids_ptr="*i64", w_ptr="*fp32",
                                                E="i32/16", scale="fp32")),
    "_route_kernel": ("triton_ds4", dict(logits_ptr="*fp32", bias_ptr="*fp32", tid_ptr="*i64", tok_ptr="*i64",
                                         ids_ptr="*i64", w_ptr="*fp32", E="i32/16", scale="fp32", TB="i32",
                                         NB="i32", NH="i32", TS="i32")),
    "_swiglu_kernel": ("triton_ds4", dict(gu_ptr="*bf16", out_ptr="*bf16", Fw="i32/16", limit="fp32")),
    "_copy_rows_kernel": ("triton_ds4", dict(idx_ptr="*i64", srcs="*u8", dsts="*u8", s_stride="i32/16",
                                             d_stride="i32/16", widths="i32/16")),     # tuples of N (below)
    "_rms_kernel": ("triton_norm", dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", D="i32/16", eps="fp32")),
    "_combine_kernel": ("triton_moe", dict(y_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", rows_ptr="*i64",
                                           H="i32/16", k_top="i32")),
}

LAUNCH = {"_decode_attn_kernel": {"num_stages": ATTN_STAGES}}   # launch options besides Triton's defaults (4 warps,
#                                                                 3 stages), as the ops launch them

# the variants of gpu-run45-ds4's attach (docs/benchmarks/gpu-run45-ds4/bench.json, cases[0]'s
# attach_triton_compiles: the first 32 of its 51; its copy_rows compiles were not listed: N 2..4 here), the other
# classes of the compressed-entry counts the warm-up's state lengths give (NE, N: neither, a multiple of 16; see
# worker/warm_decode.py) and qwen3moe's norms (H 2048, head 128)
DEFAULT_VARIANTS = """
_combine_kernel[BN=256,ROWS=False]
_combine_kernel[BN=256,ROWS=True]
_hc_partial_kernel[M=24,MP=32,KS=1024,BK=256]
_hc_finish_kernel[T=1,HC=4,MP=32,SP=16,BD=1024,LAG=False]
_rms_kernel[BD=1024]
_rms_rope_kernel[W=1,NORM=1,NEG_SIN=False,RING=False,BD=512]
_rms_rope_kernel[NH=1,W=1,NORM=2,NEG_SIN=False,RING=False,BD=512]
_decode_attn_kernel[RATIO=1,MODE=0,HD=512,HB=16,BS=32,IEEE=False]
_rms_rope_kernel[W=1,NORM=0,NEG_SIN=True,RING=False,BD=512]
_hc_post_kernel[HAS_B=False,HC=4,BD=256]
_route_kernel[TB=1,NB=1,K=6,KP=8,EP=256,NORM=True,HASH=True]
_hc_partial_kernel[M=72,MP=128,KS=1024,BK=64]
_hc_finish_kernel[T=1,HC=4,MP=128,SP=16,BD=1024,LAG=False]
_route_kernel[TB=1,K=6,KP=8,EP=256,NORM=False,HASH=False]
_swiglu_kernel[BF=1024]
_hc_post_kernel[HAS_B=True,HC=4,BD=256]
_route_kernel[TB=1,NH=1,K=6,KP=8,EP=256,NORM=False,HASH=False]
_rms_rope_kernel[W=1,NORM=0,NEG_SIN=False,RING=False,BD=128]
_compress_step_kernel[RATIO=4,ROWS=8,SLOTS=8,BD=128]
_index_scores_kernel[NH=64,IHD=128,BN=64,IEEE=False]
_decode_attn_kernel[MODE=1,HD=512,HB=16,BS=32,IEEE=False]
_compress_step_kernel[RATIO=128,ROWS=128,SLOTS=128,BD=128]
_decode_attn_kernel[NE=1,MODE=2,HD=512,HB=16,BS=32,IEEE=False]
_decode_attn_kernel[MODE=2,HD=512,HB=16,BS=32,IEEE=False]
_decode_attn_kernel[MODE=2,HD=512,HB=16,BS=32,IEEE=False] @div16=NE
_decode_attn_kernel[MODE=1,HD=512,HB=16,BS=32,IEEE=False] @div16=NE
_index_scores_kernel[NH=64,IHD=128,BN=64,IEEE=False] @div16=N
_route_kernel[TB=1,NB=1,K=6,KP=8,EP=256,NORM=True,HASH=False]
_hc_partial_kernel[M=48,MP=64,KS=1024,BK=128]
_hc_finish_kernel[T=1,HC=4,MP=64,SP=16,BD=1024,LAG=False]
_route_kernel[TB=1,NB=1,K=6,KP=8,EP=256,NORM=False,HASH=False]
_copy_rows_kernel[N=2,GATHER=True,BN=1024]
_copy_rows_kernel[N=3,GATHER=False,BN=1024]
_copy_rows_kernel[N=4,GATHER=True,BN=1024]
_rms_kernel[BD=2048]
_rms_kernel[BD=128]
"""

# the expert kernels warm_kernels launches: (type, geometry (H, F, experts, k), gate_up's clamp) per model
EXPERTS = [("Q8_0", (2048, 768, 128, 8), False), ("MXFP4", (4096, 2048, 256, 6), True)]

_VARIANT = re.compile(r"^\s*(\w+)\[([^\]]*)\](?:\s*@div16=([\w,]+))?")


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """`name[K=v,...]` lines (a run's attach_triton_compiles.variants; anything after the ']' is ignored, but for
    ` @div16=A,B`: int arguments A, B passed as multiples of 16, which a run's record does not name) ->
    [(kernel name, {K: value, "@div16": (A, B)})] (ints, booleans as Python's)."""
    out = []
    for line in text.splitlines():
        m = _VARIANT.match(line)
        if not m:
            continue
        cst = {"@div16": tuple(m.group(3).split(","))} if m.group(3) else {}
        for kv in filter(None, m.group(2).split(",")):
            k, v = kv.split("=", 1)
            cst[k.strip()] = {"True": True, "False": False}.get(v.strip()) if v.strip() in ("True", "False") \
                else int(v) if re.fullmatch(r"-?\d+", v.strip()) else float(v)
        out.append((m.group(1), cst))
    return out


def _fn(name: str):
    import importlib
    mod = importlib.import_module(f"betelgeuse.kernels.{DENSE[name][0]}")
    from betelgeuse.kernels.triton_launch import Launcher
    k = getattr(mod, name)
    return k.kernel if isinstance(k, Launcher) else k      # the @triton.jit function under a counted launcher


def dense_spec(name: str, cst: dict) -> tuple:
    """compile_sm90's arguments of a dense variant: its runtime arguments typed by DENSE, those the variant names
    (int arguments the JIT specialized to 1) as constants."""
    if name not in DENSE:
        raise ValueError(f"no argument types for {name!r} (DENSE in {Path(__file__).name})")
    fn = _fn(name)
    types = dict(DENSE[name][1])
    cst = dict(cst)
    for a in cst.pop("@div16", ()):
        if types.get(a) != "i32":
            raise ValueError(f"{name}: @div16 names {a!r}, not an int argument of class 'neither' in DENSE")
        types[a] = "i32/16"
    sig, ints = {}, {}
    n_tuple = cst.get("N") if name == "_copy_rows_kernel" else None
    for a in fn.arg_names:
        if a in cst or a not in types:
            continue
        t = types[a]
        if n_tuple and a in ("srcs", "dsts", "s_stride", "d_stride", "widths"):
            sig[a] = tuple([t.split("/")[0]] * n_tuple)
            continue
        if t.endswith("/16"):
            t = t[:-3]
            ints[a] = 16
        sig[a] = t
    for prm in fn.params:                   # a constexpr the launch leaves at its default (the JIT's value)
        if prm.is_constexpr and prm.name not in cst and prm.has_default:
            cst[prm.name] = prm.default
    if name == "_decode_attn_kernel" and "KB" in fn.arg_names and "KB" not in cst:
        from betelgeuse.kernels import triton_ds4   # TritonOps.decode_attend's chunk (a record from before it: none)
        cst["KB"] = min(triton_ds4.ATTN_KB, cst["HD"])
    missing = [a for a in fn.arg_names if a not in sig and a not in cst]
    if missing:
        raise ValueError(f"{name}: arguments {missing} are neither typed (DENSE) nor in the variant {cst}")
    return fn, sig, ints, cst, {"num_warps": 4, "num_stages": 3, **LAUNCH.get(name, {})}


def _ptxas_log(fn, sig, ints, cst, cfg) -> tuple[str, object]:
    """Compile (kernel_smem.compile_sm90) with Triton's ptxas log printed, -> (the log, the CompiledKernel)."""
    from triton import knobs
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True         # a variant found in the cache would run no ptxas, print no log
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = kernel_smem.compile_sm90(fn, sig, ints, cst, cfg)
    return buf.getvalue(), k


def _own_ptxas(ptx: str) -> str:
    """ptxas -v on the PTX (a Triton whose knobs cannot print its log): sm_90a, as Triton's make_cubin."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        r = subprocess.run([get_ptxas(90).path, "-lineinfo", "-v", "--gpu-name=sm_90a", str(p), "-o",
                            str(Path(d) / "k.o")], capture_output=True, text=True)
    return r.stderr


def measure(task: tuple) -> dict:
    """task (kind, name, constexprs | expert args) -> the variant's registers, stack, spills, cubin and shared bytes."""
    kind, label, spec = task
    if kind == "dense":
        fn, sig, ints, cst, cfg = dense_spec(label, spec)
    else:
        fn, sig, ints, cst, cfg = kernel_smem.expert_spec(*spec)
    log, k = _ptxas_log(fn, sig, ints, cst, cfg)
    src = "triton"
    if "bytes stack frame" not in log:
        log, src = _own_ptxas(k.asm["ptx"]), "own ptxas"
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    r = re.search(r"Used (\d+) registers", log)
    if not (m and r):
        raise RuntimeError(f"{label}: no ptxas resource line in {log[-500:]!r}")
    name = fn.__name__
    div = f" @div16={','.join(spec['@div16'])}" if kind == "dense" and "@div16" in spec else ""
    if kind == "expert":
        name = f"{name} ({label})"
    return {"kernel": name, "constexprs": ",".join(f"{k_}={v}" for k_, v in cst.items()) + div,
            "warps": cfg["num_warps"], "stages": cfg["num_stages"], "regs": int(r.group(1)),
            "stack": int(m.group(1)), "spill_stores": int(m.group(2)), "spill_loads": int(m.group(3)),
            "cubin": len(k.asm["cubin"]), "shared": int(k.metadata.shared), "log": src}


def tasks_for(variants: list[tuple[str, dict]], experts: bool, buckets=BUCKETS) -> list[tuple]:
    out = [("dense", n, c) for n, c in variants]
    if experts:
        for t, geom, lim in EXPERTS:
            for b in buckets:
                for which in ("gate_up", "down"):
                    out.append(("expert", f"{t} {which} rows{b}", (t, which, {}, geom, b, lim)))
    return out


# ops launched once each by --measure: ds4's (a no-spill control, the spilling kernels before the fix, a float32
# one), and the torch kernels the warm-ups reach that a short run may not: index_topk's torch.topk over 512 entries
# (a 2048-token state) against 20, qwen3moe's static attention (SDPA with a mask) over the scratch states' lengths
MEASURE = ("rms", "compress_step128", "decode_attend_csa", "decode_attend_window_f32", "topk:20:20",
           "topk:512:512", "sdpa:256", "sdpa:136", "sdpa:2048")


def measure_one(which: str) -> dict:
    """On CUDA, in a fresh process (the reservation only grows): one op of MEASURE launched once -> the device-wide
    bytes it added outside torch's allocator (module loads + the local-memory reservation) and, for a Triton op, its
    variant's local bytes per thread as the driver reports them (triton_launch.compiles_since)."""
    import torch

    from betelgeuse.kernels import triton_launch as TL
    from betelgeuse.kernels.triton_ds4 import TritonOps as ops
    from betelgeuse.model.deepseek4 import InterleavedRope
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)
    H, hd, W, r = 64, 512, 128, 64
    if which == "rms":                                   # a kernel without local memory: the module load alone
        x, w = rnd(4, 4096), rnd(4096)

        def run():
            ops.rms(x, w, 1e-6)
    elif which == "compress_step128":
        st = [torch.zeros(n, c, dtype=torch.bfloat16, device=dev) for n, c in ((128, hd), (128, hd), (17, hd))]
        ckv, cg, ape, cnorm = rnd(1, hd), rnd(1, hd), rnd(128, hd, dtype=torch.float32), rnd(hd, dtype=torch.float32)
        crope = InterleavedRope.yarn(r, 160000.0, 4.0, 64, 32.0, 1.0, dev)
        pos = torch.tensor([129], device=dev)

        def run():
            ops.compress_step(*st, ckv, cg, ape, cnorm, crope, pos, 128, 1e-6)
    elif which.startswith("decode_attend"):
        dt = torch.float32 if which.endswith("f32") else torch.bfloat16
        csa = "csa" in which
        q, kv, ring = rnd(1, H, hd, dtype=dt), rnd(1, hd, dtype=dt), rnd(W, hd, dtype=dt)
        ents = rnd(515, hd, dtype=dt) if csa else None
        top = torch.randperm(515, generator=g)[:512].to(dev) if csa else None
        pos = torch.tensor([2116], device=dev)
        sinks, cos, sin = (rnd(n, dtype=torch.float32) for n in (H, (1, r), (1, r)))

        def run():
            ops.decode_attend(q, kv, ring, ents, top, pos, 4 if csa else 0, sinks, cos, sin)
    elif which.startswith("topk:"):
        n, k = map(int, which.split(":")[1:])
        x = rnd(1, n, dtype=torch.float32)

        def run():
            x.topk(k, dim=-1)
    elif which.startswith("sdpa:"):                     # the bench geometry: 32 heads on 4 kv heads of 128
        from betelgeuse.model.layers import static_decode_attention
        S = int(which.split(":")[1])
        q, k, v = rnd(32, 1, 128), rnd(4, S, 128), rnd(4, S, 128)
        pos = torch.tensor([S // 2], device=dev)

        def run():
            static_decode_attention(q, k, v, pos)
    else:
        raise ValueError(f"unknown op {which!r} (one of {MEASURE})")
    TL.watch_compiles()
    mark = TL.compile_mark()
    torch.cuda.synchronize()
    free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    run()
    torch.cuda.synchronize()
    free1, res1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    c = TL.compiles_since(mark)
    return {"op": which, "non_torch_mib": round(((free0 - free1) - (res1 - res0)) / 2**20, 1),
            "max_local": c.get("max_local"), "variants": c.get("variants"),
            "threads": TL._resident_threads()}


def measure_all() -> list[dict]:
    """measure_one for each op of MEASURE, each in its own process."""
    import subprocess
    out = []
    for which in MEASURE:
        p = subprocess.run([sys.executable, __file__, "--measure-one", which], capture_output=True, text=True,
                           timeout=300)
        lines = p.stdout.strip().splitlines()
        out.append(json.loads(lines[-1]) if p.returncode == 0 and lines else
                   {"op": which, "error": p.stderr[-800:]})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", help="a bench.json (cases[*].attach_triton_compiles.variants) or a file of "
                                      "name[K=v,...] lines; default: DEFAULT_VARIANTS")
    p.add_argument("--only", help="kernel names (comma-separated) to compile, of the list")
    p.add_argument("--no-experts", action="store_true", help="the dense variants only")
    p.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                   help="the expert kernels' rows buckets (1: decode's, 16: prefill's)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--sms", type=int, default=SMS)
    p.add_argument("--threads", type=int, default=THREADS_PER_SM, help="resident threads per SM")
    p.add_argument("--measure", action="store_true",
                   help="on CUDA: also launch a few ops once each (fresh processes) and measure the VRAM each adds "
                        "outside torch: the reservation's formula checked on this GPU")
    p.add_argument("--measure-one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure_one:
        print(json.dumps(measure_one(a.measure_one)))
        return 0
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_lmem.")     # not the user's cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    why = kernel_smem.probe()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    text = DEFAULT_VARIANTS
    if a.variants:
        path = Path(a.variants)
        if not path.exists():
            print(f"kernel_lmem: error: no file {path}", file=sys.stderr)
            return 2
        text = path.read_text()
        if path.suffix == ".json":
            doc = json.loads(text)
            text = "\n".join(v for c in doc.get("cases", [doc]) for v in
                             (c.get("attach_triton_compiles") or {}).get("variants", []))
    variants = parse_variants(text)
    only = set(a.only.split(",")) if a.only else None
    seen, uniq = set(), []
    for n, c in variants:
        key = (n, tuple(sorted(c.items())))
        if key not in seen and (only is None or n in only):
            seen.add(key)
            uniq.append((n, c))
    bad = sorted({n for n, _ in uniq if n not in DENSE} - {"_gate_up_kernel", "_down_kernel", "_gate_up_mv_kernel",
                                                           "_down_mv_kernel"})
    uniq = [(n, c) for n, c in uniq if n in DENSE]
    experts = not a.no_experts and (only is None or only & {"_gate_up_kernel", "_down_kernel"})
    buckets = [int(b) for b in a.buckets.split(",")]
    if set(buckets) - set(BUCKETS):
        print(f"kernel_lmem: error: --buckets {a.buckets}: the buckets are {BUCKETS}", file=sys.stderr)
        return 2
    tasks = tasks_for(uniq, bool(experts), buckets)
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        rows = list(ex.map(measure, tasks))
    threads = a.sms * a.threads
    for r in rows:
        r["lmem_mib"] = round(r["stack"] * threads / 2**20, 1)
    rows.sort(key=lambda r: (-r["stack"], r["kernel"], r["constexprs"]))
    import triton
    from triton.backends.nvidia.compiler import get_ptxas
    print(f"triton {triton.__version__}, ptxas {get_ptxas(90).version}; LMEM = stack x {threads} resident "
          "threads\n\n| kernel | constexprs | warps/stages | regs | stack B/thread | spill st/ld B | LMEM MiB | "
          "cubin B | shared B |\n|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['kernel']} | {r['constexprs']} | {r['warps']}/{r['stages']} | {r['regs']} | {r['stack']} | "
              f"{r['spill_stores']}/{r['spill_loads']} | {r['lmem_mib']} | {r['cubin']} | {r['shared']} |",
              file=sys.stderr)
    print(f"\n{len(rows)} variants, cubins {sum(r['cubin'] for r in rows)} B in all", file=sys.stderr)
    if bad:
        print(f"not compiled (no argument types here): {bad}", file=sys.stderr)
    measured = None
    import torch
    if a.measure and not torch.cuda.is_available():
        print("kernel_lmem: --measure needs CUDA (this torch has none): the compile table only", file=sys.stderr)
    elif a.measure:
        measured = measure_all()
        print("\n| op (fresh process, one launch) | local B/thread (driver) | predicted MiB | measured MiB outside "
              "torch |\n|---|---|---|---|", file=sys.stderr)
        for m in measured:
            if "error" in m:
                print(f"| {m['op']} | error: {m['error'][-200:]!r} | | |", file=sys.stderr)
                continue
            loc = m.get("max_local") or 0
            pred = round(loc * (m.get("threads") or threads) / 2**20, 1)
            print(f"| {m['op']} | {loc} | {pred} | {m['non_torch_mib']} |", file=sys.stderr)
    print(json.dumps({"triton": triton.__version__, "ptxas": str(get_ptxas(90).version), "threads": threads,
                      "kernels": rows, "untyped": bad, "measured": measured}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
