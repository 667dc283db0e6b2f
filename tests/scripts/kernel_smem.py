"""The shared memory each expert kernel needs on sm_90 (H200), compiled ahead of time: no GPU needed.

Triton compiles the gate_up and down kernels of every weight type the kernels read for a CUDA target (capability
90, warp 32) with the specializations of a real launch (bf16 activations, the bench geometry's H 2048 / F 768 /
128 experts, 16-byte aligned pointers and ints divisible by 16 marked as Triton's JIT marks them) and reads the
compiled kernel's `metadata.shared` (bytes per block: the pipeliner's staging buffers + layout scratch). A block on
sm_90 gets at most 227 KiB (232448 bytes); a kernel over it fails every launch with OutOfResources.

    kernel_smem.py [--types IQ2_XS,Q4_K] [--configs default|roofline] [--jobs N]

Prints one JSON line {"skipped": reason} when this Triton cannot compile for CUDA here, else
{"limit": 232448, "kernels": [{"type", "config", "gate_up", "down"}, ...]}; a markdown table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LIMIT = 232448                     # sm_90 max dynamic shared memory per block (227 KiB)
TYPES = ["Q8_0", "MXFP4", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ2_XS",
         "IQ2_XXS", "F16", "BF16", "F32"]
H, F, E, K_TOP = 2048, 768, 128, 8  # the bench geometry (deploy/device/kernel_roofline.py GEOMS["bench"])


def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def compile_sm90(fn, sig: dict, ints: dict, cst: dict, cfg: dict):
    """fn compiled for sm_90 -> Triton's CompiledKernel: sig = the runtime arguments' types in order (pointers
    '*...'), ints = the int arguments' values (specialized 'divisible by 16' as the JIT does), cst = the constexprs
    (an int argument the JIT specialized to 1 is one of them), cfg = num_warps / num_stages. A tuple argument
    (a tuple of types) gets no divisibility mark."""
    import triton
    from triton.compiler import ASTSource
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if isinstance(sig[n], str) and (sig[n].startswith("*") or (n in ints and ints[n] % 16 == 0))}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in cst}}, cst, attrs)
    return triton.compile(src, target=_target(), options={"num_warps": cfg["num_warps"],
                                                          "num_stages": cfg["num_stages"]})


def _compile(fn, sig: dict, ints: dict, cst: dict, cfg: dict) -> int:
    """metadata.shared of fn compiled for sm_90 (compile_sm90's arguments)."""
    return int(compile_sm90(fn, sig, ints, cst, cfg).metadata.shared)


def probe() -> str | None:
    """None if Triton compiles for sm_90 here, else why not (no CUDA backend, no ptxas, ...)."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(x, y, BS: tl.constexpr):
            i = tl.arange(0, BS)
            tl.store(y + i, tl.load(x + i))

        _compile(_copy, {"x": "*fp32", "y": "*fp32"}, {}, {"BS": 128}, {"num_warps": 4, "num_stages": 1})
        return None
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot check on this machine"
        return f"{type(e).__name__}: {str(e)[:300]}"


def shared(task: tuple[str, str, dict]) -> int:
    """Bytes of shared memory of (type name, 'gate_up' | 'down', config overrides) at the bench geometry."""
    return _compile(*expert_spec(*task))


def expert_spec(name: str, which: str, over: dict, geom: tuple = (H, F, E, K_TOP), bucket: int = 16,
                has_limit: bool = False) -> tuple:
    """compile_sm90's arguments (fn, sig, ints, cst, cfg) of the expert kernel `which` ('gate_up' | 'down') of type
    `name` with config overrides `over` for a launch in rows bucket `bucket` (triton_moe.config) at geometry (H, F,
    experts, k) (the bench's by default); has_limit: gate_up's clamped SwiGLU (ds4)."""
    import torch
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.gguf.qtypes import row_nbytes
    from betelgeuse.kernels import triton_moe
    from betelgeuse.kernels import triton_quants
    from betelgeuse.kernels.triton_quants import QT_CODES
    H, F, E, K_TOP = geom
    gtype = int(GT[name])
    qt = QT_CODES[gtype]
    if over:
        triton_moe.TYPE_CONFIG[qt] = dict(over)
    cfg = triton_moe.config(qt, bucket)
    bk = triton_moe.block_k(qt, H, F)
    tab = {torch.uint8: "*u8", torch.float16: "*fp16", torch.float32: "*fp32"}[triton_quants.tables("cpu").dtype]
    ptrs = {"pool": "*u8", "tab": tab, "base_ptr": "*i64", "starts_ptr": "*i64", "rows_ptr": "*i32",
            "off_ptr": "*i32"}
    ws = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    K = H if which == "gate_up" else F
    kc = triton_moe.chunk(qt, K, bk)
    split = bool(cfg["SPLIT"]) and kc < K
    rb = row_nbytes(gtype, K)
    if cfg["MV"] and triton_moe.mv_ok(qt, K, rb, True, cfg["KC"]):     # the decode schedule (triton_mmvq)
        base = {**ptrs, "rows_ptr": "*i32", "off_ptr": "*i32"}
        del base["tab"]
        mkc = cfg["KC"] if 0 < cfg["KC"] < K else 0          # K chunks (split over programs in a SPLIT bucket)
        cst = {"QT": qt, "RA": triton_moe._row_align(rb), "BM": cfg["BM_MV"], **triton_moe._mv_dims(qt),
               "EP": E, "CHUNKS": mkc > 0, "SPLIT": mkc > 0 and bool(cfg["SPLIT"])}
        if which == "gate_up":
            ints = {"H": H, "F": F, "row_bytes": rb, "n_exp": E, "k_top": K_TOP}
            sig = {"h_ptr": "*bf16", **base, "inter_ptr": "*bf16", **ws, **{k: "i32" for k in ints}, "limit": "fp32",
                   "KC": "i32"}
            return (triton_moe._gate_up_mv_kernel, sig, {**ints, "KC": mkc},
                    {**cst, "HAS_LIMIT": has_limit, "BN": cfg["BN_GATE_UP"]}, cfg)
        ints = {"H": H, "F": F, "row_bytes": rb, "n_exp": E}
        sig = {"inter_ptr": "*bf16", **base, "y_ptr": "*bf16", **ws, **{k: "i32" for k in ints}, "KC": "i32"}
        return triton_moe._down_mv_kernel, sig, {**ints, "KC": mkc}, {**cst, "BN": cfg["BN"]}, cfg
    if which == "gate_up":
        ints = {"H": H, "F": F, "row_bytes": rb, "n_exp": E, "k_top": K_TOP}
        sig = {"h_ptr": "*bf16", **ptrs, "inter_ptr": "*bf16", **ws, **{k: "i32" for k in ints}, "limit": "fp32",
               "KC": "i32"}
        cst = {"QT": qt, "HAS_LIMIT": has_limit, "IEEE": False, "ALIGNED": True, "RA": triton_moe._row_align(rb),
               "SPLIT": split, "BM": cfg["BM"], "BN": cfg["BN_GATE_UP"], "BK": bk, "EP": E, "TB": 0, "RAT": 1}
        return triton_moe._gate_up_kernel, sig, {**ints, "KC": kc}, cst, cfg
    ints = {"H": H, "F": F, "row_bytes": rb, "n_exp": E}
    sig = {"inter_ptr": "*bf16", **ptrs, "y_ptr": "*bf16", **ws, **{k: "i32" for k in ints}, "KC": "i32"}
    cst = {"QT": qt, "IEEE": False, "ALIGNED": True, "RA": triton_moe._row_align(rb), "SPLIT": split,
           "BM": cfg["BM"], "BN": cfg["BN"], "BK": bk, "EP": E, "TB": 0, "RAT": 1}   # TB 0: no tile-layout experts
    return triton_moe._down_kernel, sig, {**ints, "KC": kc}, cst, cfg


def _mv_type(name: str) -> bool:
    """Whether the decode schedule (triton_mmvq) has type `name` (its configs are candidates for those only)."""
    from gguf.constants import GGMLQuantizationType as GT

    from betelgeuse.kernels.triton_mmvq import STEP
    from betelgeuse.kernels.triton_quants import QT_CODES
    return QT_CODES[int(GT[name])] in STEP


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--configs", choices=("default", "roofline"), default="default",
                   help="default: each type's triton_moe.config; roofline: also every kernel_roofline.CONFIGS entry")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    a = p.parse_args()
    why = probe()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    configs: list[dict] = [{}]
    if a.configs == "roofline":
        import importlib.util
        spec = importlib.util.spec_from_file_location("kernel_roofline", Path(__file__).resolve().parents[2]
                                                      / "deploy" / "device" / "kernel_roofline.py")
        roofline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(roofline)                # its import needs torch and gguf, no GPU
        configs += roofline.CONFIGS
    tasks = [(t, which, c) for t in a.types.split(",") for c in configs for which in ("gate_up", "down")
             if not c.get("MV") or _mv_type(t)]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        got = list(ex.map(shared, tasks))
    rows = []
    for i in range(0, len(tasks), 2):
        name, _, c = tasks[i]
        rows.append({"type": name, "config": c or "default", "gate_up": got[i], "down": got[i + 1]})
    print("| type | config | gate_up bytes | down bytes |\n|---|---|---|---|", file=sys.stderr)
    for r in rows:
        flag = "" if max(r["gate_up"], r["down"]) <= LIMIT else " (over)"
        print(f"| {r['type']} | {r['config']} | {r['gate_up']} | {r['down']}{flag} |", file=sys.stderr)
    print(json.dumps({"limit": LIMIT, "kernels": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
