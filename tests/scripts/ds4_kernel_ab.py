"""Two versions of kernels/triton_ds4.py bit for bit: an older file (--old) against this tree's, on the same inputs.

For a kernel change meant to change no bit (a tile split that keeps every sum's order: kernels/triton_ds4.py
_decode_attn_kernel's head-dim chunks). The ops whose kernels a change touched (decode_attend, compress_step) run at
ds4-flash's geometry (64 heads of 512, window 128, indexer top-k 512) and at a small one, every mode (window only,
HCA ratio 128, CSA ratio 4 with its top-k), positions in the ring's first fill, wrapped, and with entries not yet
visible, in bfloat16 and float32; each output must equal the old version's (torch.equal, NaNs included).

On CUDA it checks what the GPU computes (the MMA / FMA steps' order); under TRITON_INTERPRET=1 on the CPU a dot is
one numpy matmul whose summation order follows the operands' shapes, so there a chunked float32 dot may differ from
the whole one in the last bits (~1e-6: reported, exit 0; bfloat16 came out equal).

    ds4_kernel_ab.py --old OLD_triton_ds4.py [--device cuda] [--small-only]

Prints one JSON line {"device", "cases": n, "differ": [{"case", "max_abs"}...]}; exit 1 if any differs (on CUDA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FLASH = dict(H=64, hd=512, W=128, topk=512, rope=64)     # ds4-flash's attention (kernel_lmem.py's variants)
SMALL = dict(H=4, hd=64, W=16, topk=8, rope=16)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("triton_ds4_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases(old, new, dev, dt, geom: dict, seed: int = 0):
    """(name, old outputs, new outputs) over decode_attend's modes and compress_step's ratios at `geom`."""
    import torch
    from betelgeuse.model.deepseek4 import InterleavedRope
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * s).to(dtype).to(dev)

    H, hd, W, topk, r = geom["H"], geom["hd"], geom["W"], geom["topk"], geom["rope"]
    sinks = rnd(H)
    q, kv = rnd(1, H, hd, dtype=dt), rnd(1, hd, dtype=dt)
    cos, sin = rnd(1, r), rnd(1, r)
    for var, ratio, n_ent in (("window", 0, 0), ("hca", 128, 16), ("csa", 4, 4 * topk // 4 + 3)):
        ents = rnd(max(n_ent, 1), hd, dtype=dt) if ratio else None
        top = None
        if ratio == 4:
            top = torch.randperm(n_ent, generator=g)[:min(topk, n_ent)].to(dev)
        for p in (5, W + 5, ratio * (n_ent - 1) + 60 if ratio else 3 * W + 1):
            pos = torch.tensor([p], dtype=torch.int64, device=dev)
            ring0 = rnd(W, hd, dtype=dt)
            outs = []
            for ops in (old.TritonOps, new.TritonOps):
                ring = ring0.clone()
                o = ops.decode_attend(q, kv, ring, ents, top, pos, ratio, sinks, cos, sin)
                outs.append((o, ring))
            yield f"decode_attend/{var}/pos{p}", outs[0], outs[1]
    for ratio, positions in ((4, (0, 1, 5, 12)), (128, (0, 1, 127, 128, 129))):
        d = hd
        R, C = (8, 2 * d) if ratio == 4 else (128, d)
        crope = InterleavedRope.yarn(r, 160000.0, 4.0, 64, 32.0, 1.0, dev)
        ape, cnorm = rnd(ratio, C, s=0.5), 1 + rnd(d, s=0.1)
        st0 = [torch.zeros(n, c, dtype=dt, device=dev) for n, c in ((R, C), (R, C), (max(positions) // ratio + 1, d))]
        sts = [[t.clone() for t in st0], [t.clone() for t in st0]]
        for p in positions:
            ckv, cg = rnd(1, C, dtype=dt), rnd(1, C, dtype=dt)
            pos = torch.tensor([p], dtype=torch.int64, device=dev)
            for ops, st in zip((old.TritonOps, new.TritonOps), sts):
                ops.compress_step(*st, ckv, cg, ape, cnorm, crope, pos, ratio, 1e-6)
            yield f"compress_step/ratio{ratio}/pos{p}", tuple(sts[0]), tuple(sts[1])


def main() -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the older kernels/triton_ds4.py (e.g. git show main:...)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small-only", action="store_true", help="only the small geometry (the interpreter: faster)")
    a = p.parse_args()
    if not Path(a.old).is_file():
        print(f"ds4_kernel_ab: error: no file {a.old}", file=sys.stderr)
        return 2
    from betelgeuse.kernels import triton_ds4 as new
    old = _load(Path(a.old))
    dev = torch.device(a.device)
    n, differ = 0, []
    geoms = [("small", SMALL)] + ([] if a.small_only else [("flash", FLASH)])
    for gname, geom in geoms:
        for dt in (torch.bfloat16, torch.float32):
            for name, x, y in cases(old, new, dev, dt, geom):
                n += 1
                for i, (u, v) in enumerate(zip(x, y)):
                    if not torch.equal(u, v) and not (u.isnan().equal(v.isnan()) and
                                                      torch.equal(u.nan_to_num(), v.nan_to_num())):
                        diff = (u.float() - v.float()).abs().max().item()
                        differ.append({"case": f"{gname}/{str(dt)[6:]}/{name}/out{i}", "max_abs": diff})
    print(json.dumps({"device": str(dev), "cases": n, "differ": differ}))
    return 1 if differ and dev.type == "cuda" else 0


if __name__ == "__main__":
    sys.exit(main())
