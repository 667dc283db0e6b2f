"""Bytes in flight an SM of the Gluon Q8_0 expert kernels (issue 23, docs/benchmarks/cpu-inflight61), statically.

Little's law: a loop whose loads are its only wait reads (bytes in flight) / (memory latency) -- at the H100's 3.35
TB/s and a loaded latency of 0.6-1 us that asks for 2.0-3.4 MB in flight, 15-25 KB an SM of 132. gluon_mmq's K loop
loads the weights straight into wgmma's A registers, so what it keeps in flight is bounded by registers:

    in flight an SM = resident CTAs x (bytes a K step) x (K steps in flight)
    resident CTAs   = min(CTAs an SM by registers and shared memory, programs with work / 132)
    bytes a K step  = rows of A (BN 64; FUSE: gate's and up's, 128) x KB 2 blocks x 34 bytes (Q8_0)
    steps in flight = GP (1: the next step's loads carried across the back edge; 2: two steps')

at the bench geometry (H 2048, F 768, BN 64, KB 2, KCB 16, a bank of 16 experts with 1 or 16 rows each: 16 row
blocks with work; the 1-row bucket splits K into chunks of 16 blocks over programs, the 16-row bucket walks them).
Each kernel is compiled for sm_90 (gluon_mmq.compile_kernel: the registers, shared memory, spills from the cubin)
and set beside gpu-run63's GB/s of the same form (H100 80GB HBM3, deploy/device/check_gluon_mmq.py, kernels alone;
MEASURED below: gpu-run63 ran before Q8_0's FUSE 1 shipped, so its `gluon GP1` / `gluon GP2` were unfused), giving
the latency the measured rate implies: (in flight an SM x 132) / GB/s. Where that is far above a memory latency,
something other than bytes in flight sets the rate.

    PYTHONPATH=$PWD python tests/scripts/inflight_account.py [--json]    # any Triton with Gluon (3.6: the device's)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

SMS = 132                           # H100 SXM: SMs
REGS_SM, SMEM_SM, THREADS_SM, CTAS_SM = 65536, 233472, 2048, 32     # per SM: registers, shared bytes (228 KiB),
#                                     threads, CTAs
H, F, BN, KB, KCB, BANK = 2048, 768, 64, 2, 16, 16
Q8_BLOCK = 34                       # bytes of a Q8_0 block (32 int8 + f16 d)
# gpu-run63 (H100 80GB HBM3, Triton 3.6), GB/s of (gate_up, down) at 1 and 16 rows an expert: form -> rows -> pair.
# Forms: (FUSE, GP); down has no FUSE (its row is gate_up's unfused form's)
MEASURED = {(1, 1): {1: (1031, 1067), 16: (885, 968)}, (0, 1): {1: (812, 1067), 16: (594, 966)},
            (0, 2): {1: (936, 968), 16: (795, 985)}, (0, 0): {1: (993, 1030), 16: (607, 881)}}


def ctas_an_sm(regs: int, warps: int, shared: int) -> int:
    """CTAs an sm_90 SM holds at once: registers allocated per warp in units of 256 (regs x 32 rounded up), shared
    memory with 1 KiB reserved a CTA, 2,048 threads and 32 CTAs."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(REGS_SM // (per_warp * warps), SMEM_SM // (shared + 1024), THREADS_SM // (32 * warps), CTAS_SM)


def launch(which: str, bucket: int, fuse: bool) -> dict:
    """The launch's programs with work and K steps a program (gate_up unfused: gate's walk then up's, both counted)."""
    K = H if which == "gate_up" else F
    grid_n = (F if which == "gate_up" else H) // BN
    nblk = K // 32
    split = bucket == 1 and nblk > KCB
    chunks = -(-nblk // KCB) if split else 1
    blocks = min(KCB, nblk) if split else nblk          # a program's blocks (split: its first chunk, the longest)
    parts = 2 if which == "gate_up" and not fuse else 1
    return {"programs": grid_n * BANK * chunks, "steps": parts * blocks // KB, "chunks": chunks}


def account(which: str, bucket: int, fuse: bool, gp: int, regs: int, shared: int, warps: int = 4) -> dict:
    """The static account of one compiled form (module doc) and, where gpu-run63 measured it, the implied latency."""
    la = launch(which, bucket, fuse)
    ctas = ctas_an_sm(regs, warps, shared)
    resident = min(ctas, la["programs"] / SMS)
    step = (2 if fuse else 1) * BN * KB * Q8_BLOCK
    flight = resident * step * max(gp, 1)               # GP 0: one step's loads issued ahead, waited for in it
    row = {"kernel": which, "rows": bucket, "fuse": int(fuse), "gp": gp, "regs": regs, "shared": shared,
           "ctas_an_sm": ctas, "programs": la["programs"], "programs_an_sm": round(la["programs"] / SMS, 2),
           "resident": round(resident, 2), "steps_a_program": la["steps"], "step_bytes": step,
           "kb_in_flight_sm": round(flight / 1024, 1), "mb_in_flight": round(flight * SMS / 1e6, 2),
           "little_tbps_at_1us": round(flight * SMS / 1e-6 / 1e12, 2)}
    m = MEASURED.get((int(fuse) if which == "gate_up" else 0, gp), {}).get(bucket)
    if m is not None:
        gbps = m[0 if which == "gate_up" else 1]
        row.update(measured_gbps=gbps, implied_latency_us=round(flight * SMS / (gbps * 1e9) * 1e6, 2))
    return row


FORMS = [(w, b, fuse, gp) for b in (1, 16) for w, fuse, gp in
         (("gate_up", True, 1), ("gate_up", False, 1), ("gate_up", False, 2), ("gate_up", True, 2), ("down", False, 1),
          ("down", False, 2))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    import sass_profile as sp
    from betelgeuse.kernels import gluon_mmq as gm
    import triton
    rows = []
    for w, b, fuse, gp in FORMS:
        k, _ = gm.compile_kernel(w, b, qt=0, fuse=fuse, gp=gp)
        _, res = sp.sass_of(k.asm["cubin"])
        assert int(re.search(r"LOCAL:(\d+)", res).group(1)) == 0, (w, b, fuse, gp, "spills")
        rows.append(account(w, b, fuse, gp, int(re.search(r"REG:(\d+)", res).group(1)), int(k.metadata.shared)))
    if a.json:
        print(json.dumps({"triton": triton.__version__, "rows": rows}))
        return 0
    print(f"Triton {triton.__version__}\n")
    print("| kernel | rows | FUSE | GP | regs | CTA/SM | programs (a SM) | resident | steps a program | B a step "
          "| KB in flight a SM | MB in flight | Little @ 1 us TB/s | measured GB/s | implied latency us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['rows']} | {r['fuse']} | {r['gp']} | {r['regs']} | {r['ctas_an_sm']} "
              f"| {r['programs']} ({r['programs_an_sm']}) | {r['resident']} | {r['steps_a_program']} "
              f"| {r['step_bytes']} | {r['kb_in_flight_sm']} | {r['mb_in_flight']} | {r['little_tbps_at_1us']} "
              f"| {r.get('measured_gbps', '-')} | {r.get('implied_latency_us', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
