"""deepseek4 decode's dense projections at ds4-flash's shapes: TritonOps.linears / grouped_linear (_gemv_kernel, one
launch for every product of a call) against the library's (cuBLAS: F.linear / torch.bmm, split-K at few rows: a
partial GEMM and a reduce each), at T = 1, 4, 8, 16 rows. Each call is timed as a CUDA graph of REPS calls replayed
(no host in the figure), over enough copies of the weights (ROT) that they are not read from the L2; GB/s = the
weights' bytes / time. Also each row of the T-row launch against the same row launched alone, bit for bit (invariant
6), and the max |diff| against the library's. Prints a markdown table; writes $OUT/gemv_bench.md if OUT is set.
--sweep: then the launch constants (triton_ds4.GEMV_BK, GEMV_BN, GEMV_STAGES) over the calls with the fewest
programs, at T = 1 and 8: µs each, and whether each gives the default's bits (BN and the stages cannot change them;
BK, whether the MMA chain's order over K follows the step or not, is what this shows).

    PYTHONPATH=$PWD python3 deploy/device/gemv_bench.py [--sweep]   # ~1-2 min on an H100 (TRITON_INTERPRET=1 ... cpu)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from betelgeuse.kernels import triton_ds4
from betelgeuse.kernels.triton_ds4 import TritonOps

TritonOps.gemv_rows = triton_ds4.GEMV_ROWS      # engine.decode_gemv on (off: every call would be the library's)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
SWEEP = "--sweep" in sys.argv
dev = args[0] if args else "cuda"
CUDA = dev == "cuda"
dt = torch.bfloat16 if CUDA else torch.float32
D, QL, HD, NH, IHD, G, OL = 4096, 1024, 512, 64, 128, 8, 1024        # ds4-flash (gguf/synth_ds4.py "ds4-flash")
REPS, ROT = (20, 8) if CUDA else (1, 1)
ROWS = (1, 4, 8, 16) if CUDA else (1, 4)
g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dev, dt)


# name -> (K, the output widths of one call), grouped: G products over column groups of x
CALLS = {
    "u: q_a kv comp kv/gate idx proj/kv/gate (ratio 4)": (D, [QL, HD, 2 * HD, 2 * HD, NH, 2 * IHD, 2 * IHD]),
    "u: q_a kv (ratio 0)": (D, [QL, HD]),
    "qr: q_b + idx q_b": (QL, [64 * HD, NH * IHD]),
    "attn_output_b": (G * OL, [D]),
    "router": (D, [256]),
    "shared gate_up": (D, [4096]),
    "shared down": (2048, [D]),
}


def timed(fn) -> float:
    """Seconds per call: a graph of REPS calls (each on the next weight copy), replayed."""
    if not CUDA:
        fn(0)
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for r in range(ROT):
            fn(r)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            fn(i % ROT)
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / (10 * REPS)


lines = ["| call | T | weights MB | gemv µs | GB/s | library µs | GB/s | library ÷ gemv | max abs diff | rows alone |",
         "|---|---|---|---|---|---|---|---|---|---|"]
for name, (K, ns) in list(CALLS.items()) + [("attn_output_a (grouped, 8 x 1024 of 4096)", (HD * 64 // G, None))]:
    grouped = ns is None
    if grouped:
        ws = [rnd(G, OL, K) for _ in range(ROT)]
        nbytes = ws[0].numel() * ws[0].element_size()
    else:
        ws = [[rnd(n, K) for n in ns] for _ in range(ROT)]
        nbytes = sum(w.numel() * w.element_size() for w in ws[0])
    for T in ROWS:
        x = rnd(T, G * K) if grouped else rnd(T, K)
        if grouped:
            xg = x.view(T, G, K).transpose(0, 1)
            ours = lambda r: TritonOps.grouped_linear(xg, ws[r])                               # noqa: E731
            lib = lambda r: torch.bmm(xg, ws[r].transpose(1, 2))                                # noqa: E731
            a, b = ours(0), lib(0)
            diff = float((a.float() - b.float()).abs().max())
            alone = all(torch.equal(TritonOps.grouped_linear(xg[:, i:i + 1], ws[0]), a[:, i:i + 1]) for i in range(T))
        else:
            ours = lambda r: TritonOps.linears(x, ws[r])                                        # noqa: E731
            lib = lambda r: [F.linear(x, w) for w in ws[r]]                                     # noqa: E731
            a, b = ours(0), lib(0)
            diff = max(float((u.float() - v.float()).abs().max()) for u, v in zip(a, b))
            alone = all(torch.equal(u, v[i:i + 1]) for i in range(T)
                        for u, v in zip(TritonOps.linears(x[i:i + 1], ws[0]), a))
        t_ours, t_lib = timed(ours), timed(lib)
        lines.append(f"| {name} | {T} | {nbytes / 1e6:.1f} | {t_ours * 1e6:.1f} | {nbytes / t_ours / 1e9:.0f} | "
                     f"{t_lib * 1e6:.1f} | {nbytes / t_lib / 1e9:.0f} | {t_lib / t_ours:.2f} | {diff:.3g} | "
                     f"{'yes' if alone else 'NO'} |")
        print(lines[-1], flush=True)
if SWEEP:
    lines += ["", "| call | T | BK | BN | stages | µs | GB/s | default's bits |", "|---|---|---|---|---|---|---|---|"]
    consts = ("GEMV_BK", "GEMV_BN", "GEMV_STAGES")
    default = tuple(getattr(triton_ds4, c) for c in consts)
    for name in ("u: q_a kv (ratio 0)", "router", "attn_output_b", "u: q_a kv comp kv/gate idx proj/kv/gate (ratio 4)"):
        K, ns = CALLS[name]
        ws = [[rnd(n, K) for n in ns] for _ in range(ROT)]
        nbytes = sum(w.numel() * w.element_size() for w in ws[0])
        for T in ROWS[::2]:
            x = rnd(T, K)
            ref = TritonOps.linears(x, ws[0])
            for cfg in ((256, 0, 3), (256, 0, 4), (256, 16, 2), (128, 16, 4), (512, 16, 3), (512, 32, 3), (1024, 16, 2)):
                for c, v in zip(consts, cfg):
                    setattr(triton_ds4, c, v)
                try:
                    same = all(torch.equal(a, b) for a, b in zip(TritonOps.linears(x, ws[0]), ref))
                    t = timed(lambda r: TritonOps.linears(x, ws[r]))                                 # noqa: B023
                    lines.append(f"| {name} | {T} | {cfg[0]} | {cfg[1] or 'auto'} | {cfg[2]} | {t * 1e6:.1f} | "
                                 f"{nbytes / t / 1e9:.0f} | {'yes' if same else 'no'} |")
                except Exception as e:          # a config past the shared memory: named, not fatal
                    lines.append(f"| {name} | {T} | {cfg[0]} | {cfg[1] or 'auto'} | {cfg[2]} | {type(e).__name__} | | |")
                finally:
                    for c, v in zip(consts, default):
                        setattr(triton_ds4, c, v)
                print(lines[-1], flush=True)
text = "\n".join(lines)
print(text)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gemv_bench.md"), "w") as f:
        f.write(text + "\n")
