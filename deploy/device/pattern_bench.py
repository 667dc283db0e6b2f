#!/usr/bin/env python3
"""Read-only GB/s of the Q8_0 Gluon kernel's weight access pattern, no MMA (issue 23, docs/benchmarks/cpu-inflight61):
is the ~1 TB/s plateau of every Q8_0 expert kernel (gpu-run63) the memory access pattern, or the kernel's step?

The shipped Gluon form (gluon_mmq, FUSE 1, GP 1) reads, a K step of 2 Q8_0 blocks, 68 bytes of each of 128 weight
rows (gate's 64 then up's) into wgmma's A layout: each thread 16-bit pairs of 8 rows at once (a warp's LDG.U16 = 8
rows x 8 bytes: 8 sectors in 8 lines) and the two f16 scales; the next step's loads carried across the back edge
(one step in flight a program). Here the same programs (a bank of 16 experts at the bench geometry: 24,576 rows of
2,176 bytes; 128-row tiles; the 1-row bucket's 4 chunks of 16 blocks, 8 steps a program: 768 programs, or the
16-row bucket's walk, 32 steps: 192 programs) read the same bytes and only XOR them (the kernel's step without the
conversion, the B tile, the MMA and the fmas), by MODE:

  pairs   the kernel's loads exactly (gluon_mmq.PL2 / ACC layouts, gluon_mmq._ld_u16: 40 LDG.U16 a thread a step);
  words   the same 68 bytes a row a step as 32-bit words, a warp's lanes along one row (17 of 32 lanes; coalesced:
          a warp load = one row's 3 sectors), NS steps' runs at once (NS x 68 bytes a row: longer runs a request);
  flat    the same programs and steps reading a contiguous region (16-byte loads): the device's streaming roofline
          at this grid;
  ring    words' loads as cp.async copies global -> shared in NS stages (NS - 1 steps in flight, no registers
          spent), each step read back from shared memory between two CTA barriers: the brief's ring, without the MMA;
  tiled   pairs' loads on the bank re-laid tile-major (cpu-pack62): tiles of NS (64 or 128) rows, [tile][step][row in
          tile][68 bytes], so a warp's 8 rows x 8 bytes fall in 8 x 68 contiguous bytes (NS 64: the program's 128
          rows two tiles, as a fused gate_up reads gate's tile and up's);
  packed  the bank re-laid as betelgeuse/kernels/mma_pack (64-row tiles, a step's quants in the order of the
          threads' A registers): 4 LDG.128 a thread a step (a warp load 512 contiguous bytes) and its rows' scale
          words, what a kernel reading that layout issues (gluon_mmq.PW2).

CTAS caps the resident programs an SM (a shared memory reservation: the kernel's 3 at one row, 2 at 16; 0 = the
registers' own). Each case's bytes are checked: the XOR of the programs' results == numpy's of the bytes read (the
layout cases: each program's, over the GGUF bytes of its rows and steps, read from the bank re-laid by a gather on
the GPU; their timing reads the rotating random banks as they are, random bytes in any layout).
Reading it (cpu-inflight61 section 3): pairs ~1 TB/s with flat far above -- the pattern is the limit (words ~ pairs:
the 68-byte runs; words above pairs: the scattered lanes); pairs well above 1.5 TB/s -- the kernel's step is.
cpu-pack62: packed (and tiled) against pairs -- what a packed layout would buy the kernel's reads.

    PYTHONPATH=$PWD python3 deploy/device/pattern_bench.py [--reps 32] [--cases NAMES]    # H100 / H200, ~1 minute
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))     # kernel_roofline's graph_time

from betelgeuse.kernels import gluon_mmq as gm  # noqa: E402
from betelgeuse.kernels.triton_launch import launcher  # noqa: E402

ROWS, ROW_B, BR, BLK = 16 * 2 * 768, 2176, 128, 34   # a bank's gate and up rows (16 experts), their bytes, a tile
STEP_B = 2 * BLK                                      # a K step's bytes of a row (KB 2 blocks)
SMEM_SM = 233472                                      # sm_90 shared memory an SM (1 KiB of it reserved a CTA)
MODES = {"pairs": 0, "words": 1, "flat": 2, "ring": 3, "tiled": 4, "packed": 5}
LAYOUTS = ("tiled", "packed")                         # modes reading the bank re-laid (layout_index)
# name -> (MODE, NS (words: steps a load; ring: stages; tiled: rows a tile), walked (16-row bucket) or split
# into 4 chunks (1-row), CTAS)
# (words4: 222 registers on Triton 3.6, 2 CTAs an SM by registers, four steps' runs in flight: capped at 2)
CASES = {"pairs": ("pairs", 1, False, 3), "words": ("words", 1, False, 3), "words4": ("words", 4, False, 2),
         "flat": ("flat", 1, False, 3), "pairs free": ("pairs", 1, False, 0), "words free": ("words", 1, False, 0),
         "pairs r16": ("pairs", 1, True, 2), "words r16": ("words", 1, True, 2), "flat r16": ("flat", 1, True, 2),
         "ring2": ("ring", 2, False, 3), "ring4": ("ring", 4, False, 3), "ring4 r16": ("ring", 4, True, 2),
         "tiled": ("tiled", 64, False, 3), "tiled128": ("tiled", 128, False, 3), "tiled r16": ("tiled", 64, True, 2),
         "packed": ("packed", 1, False, 3), "packed free": ("packed", 1, False, 0),
         "packed r16": ("packed", 1, True, 2)}

if gm.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    # cp.async global -> shared: async_load on Triton 3.9, async_copy_global_to_shared on 3.6 (the device's)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    WL = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))     # words: a warp along one row
    FL = gl.constexpr(gl.BlockedLayout([4], [32], [4], [0]))                  # flat: 16 bytes a thread
    SL = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))                # the reservation's 4 KiB rows, ring
    RL = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0]))        # ... and its first row's store

    @gluon.jit
    def _pattern_kernel(pool, out, steps, MODE: gl.constexpr, NS: gl.constexpr, RES: gl.constexpr,
                        RES2: gl.constexpr):
        """Program (tile, chunk): rows tile*BR .. + BR, bytes chunk*steps*68 .. + steps*68 of each (flat: the
        program's own contiguous steps x 8 KiB); XOR of everything read -> out[program]. The literals 128, 2176 and
        68 are BR, ROW_B and STEP_B (a Gluon kernel reads no module globals that are not constexprs)."""
        # the reservation that caps the CTAs an SM: two buffers (power-of-2 shapes), each a 4 KiB row stored first and
        # read back last (both live throughout: the allocator would otherwise overlap them)
        res = gl.allocate_shared_memory(gl.int32, [max(RES // 4096, 1), 1024], SL)
        res2 = gl.allocate_shared_memory(gl.int32, [max(RES2 // 4096, 1), 1024], SL)
        if RES > 0:
            res.slice(0, 1).store(gl.zeros([1, 1024], gl.int32, RL))
        if RES2 > 0:
            res2.slice(0, 1).store(gl.zeros([1, 1024], gl.int32, RL))
        tile = gl.program_id(0)
        ch = gl.program_id(1)
        pid = tile * gl.num_programs(1) + ch
        row0 = tile.to(gl.int64) * 128 * 2176 + ch * steps * 68          # the tile's first row, the chunk's byte
        if MODE == 0 or MODE == 4:      # pairs: GGUF rows; tiled: tiles of NS rows, [tile][step][row][68 bytes]
            T: gl.constexpr = 128 if MODE == 0 else NS          # rows a tile (pairs: the program's 128, no tiles)
            RS: gl.constexpr = 2176 if MODE == 0 else 68        # bytes from a tile's row to the next
            SS: gl.constexpr = 68 if MODE == 0 else NS * 68     # ... from a K step to the next
            t0 = tile.to(gl.int64) * 128 * 2176 + ch * steps * SS
            pp = gl.arange(0, 32, layout=gl.SliceLayout(0, gm.PL2))
            r = gl.arange(0, 128, layout=gl.SliceLayout(1, gm.PL2))
            rp = t0 + ((r // T) * (T * 2176) + (r % T) * RS).to(gl.int64)
            o = rp[:, None] + ((pp // 16) * 34 + 2 + (pp % 16) * 2)[None, :]
            r = gl.arange(0, 128, layout=gl.SliceLayout(1, gm.ACC))
            rc = t0 + ((r // T) * (T * 2176) + (r % T) * RS).to(gl.int64)
            on = gl.full([128, 32], 1, gl.int32, gm.PL2)
            oc = gl.full([128], 1, gl.int32, gl.SliceLayout(1, gm.ACC))
            w = gm._ld_u16(pool + o, on)
            r0 = gm._ld_u16(pool + rc, oc)
            r1 = gm._ld_u16(pool + rc + 34, oc)
            acc = gl.zeros([128, 32], gl.int32, gm.PL2)
            accr = gl.zeros([128], gl.int32, gl.SliceLayout(1, gm.ACC))
            for s in range(0, steps):       # consume step s, then issue s + 1 (masked off past the last): GP 1
                acc = acc ^ w
                accr = accr ^ r0 ^ r1
                m = (s + 1 < steps).to(gl.int32)
                w = gm._ld_u16(pool + o + (s + 1) * SS, on * m)
                r0 = gm._ld_u16(pool + rc + (s + 1) * SS, oc * m)
                r1 = gm._ld_u16(pool + rc + (s + 1) * SS + 34, oc * m)
            tot = gl.xor_sum(gl.xor_sum(acc, 1), 0) ^ gl.xor_sum(accr, 0)
        elif MODE == 5:                 # packed: mma_pack's layout, the program's two 64-row tiles (gate's, up's)
            t0 = tile.to(gl.int64) * 128 * 2176 + ch * steps * 4352        # 4352: mma_pack.STEP_B
            n = gl.arange(0, 128, layout=gl.SliceLayout(1, gm.PW2))
            c = gl.arange(0, 16, layout=gl.SliceLayout(0, gm.PW2))
            g = (n // 64) * (64 * 2176) + ((n % 64) // 16) * 1024 + ((n // 8) % 2) * 512 + (n % 8) * 64
            pw = (pool + t0 + gl.multiple_of(g, 16)).to(gl.pointer_type(gl.int32))[:, None] + c[None, :]
            n = gl.arange(0, 128, layout=gl.SliceLayout(1, gm.ACC))       # the scale words after the quants
            ps = (pool + t0 + (n // 64) * (64 * 2176) + 4096 + (n % 64) * 4).to(gl.pointer_type(gl.int32))
            on = gl.full([128, 16], 1, gl.int1, gm.PW2)
            oc = gl.full([128], 1, gl.int1, gl.SliceLayout(1, gm.ACC))
            w = gl.load(pw)
            r0 = gl.load(ps)
            acc = gl.zeros([128, 16], gl.int32, gm.PW2)
            accr = gl.zeros([128], gl.int32, gl.SliceLayout(1, gm.ACC))
            for s in range(0, steps):       # 1088 = 4352 / 4: a step in words
                acc = acc ^ w
                accr = accr ^ r0
                w = gl.load(pw + (s + 1) * 1088, mask=on & (s + 1 < steps), other=0)
                r0 = gl.load(ps + (s + 1) * 1088, mask=oc & (s + 1 < steps), other=0)
            tot = gl.xor_sum(gl.xor_sum(acc, 1), 0) ^ gl.xor_sum(accr, 0)
        elif MODE == 1:
            W: gl.constexpr = 32 if NS == 1 else 128 if NS <= 7 else 256          # a row's 17 NS words, padded
            wd = gl.arange(0, W, layout=gl.SliceLayout(0, WL))
            rw = gl.arange(0, 128, layout=gl.SliceLayout(1, WL)) * (2176 // 4)
            ow = rw[:, None] + wd[None, :]                                  # int32 offsets from the tile's word
            mw = gl.broadcast(rw[:, None] >= 0, (wd < 17 * NS)[None, :])
            mw = mw[0] & mw[1]
            pw = (pool + row0).to(gl.pointer_type(gl.int32))
            w = gl.load(pw + ow, mask=mw, other=0)
            acc = gl.zeros([128, W], gl.int32, WL)
            for s in range(0, steps, NS):
                acc = acc ^ w
                w = gl.load(pw + ow + (s + NS) * 17, mask=mw & (s + NS < steps), other=0)
            tot = gl.xor_sum(gl.xor_sum(acc, 1), 0)
        elif MODE == 3:                 # words' copies global -> shared by cp.async, NS stages (NS - 1 steps ahead)
            wd = gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
            rw = gl.arange(0, 128, layout=gl.SliceLayout(1, WL)) * (2176 // 4)
            ow = rw[:, None] + wd[None, :]
            mw = gl.broadcast(rw[:, None] >= 0, (wd < 17)[None, :])
            mw = mw[0] & mw[1]
            pw = (pool + row0).to(gl.pointer_type(gl.int32))
            ring = gl.allocate_shared_memory(gl.int32, [NS, 128, 32], SL)     # NS stages of [128, 32] words
            for i in gl.static_range(NS - 1):
                _cp_async(ring.index(i), pw + ow + i * 17, mask=mw & (i < steps))
                async_copy.commit_group()
            acc = gl.zeros([128, 32], gl.int32, WL)
            for s in range(0, steps):
                j = s + NS - 1              # into the stage step s - 1 was read from (the barrier below: read out)
                _cp_async(ring.index(j % NS), pw + ow + j * 17, mask=mw & (j < steps))
                async_copy.commit_group()
                async_copy.wait_group(NS - 1)                           # step s's copies landed
                gm._barrier()
                acc = acc ^ ring.index(s % NS).load(WL)
                gm._barrier()
            tot = gl.xor_sum(gl.xor_sum(acc, 1), 0)
        else:
            f = gl.arange(0, 2048, layout=FL)
            fb = pid.to(gl.int64) * steps * 2048                               # words a program: steps x 8 KiB
            pw = pool.to(gl.pointer_type(gl.int32))
            w = gl.load(pw + fb + f)
            acc = gl.zeros([2048], gl.int32, FL)
            for s in range(0, steps):
                acc = acc ^ w
                w = gl.load(pw + fb + (s + 1) * 2048 + f, mask=(f >= 0) & (s + 1 < steps), other=0)
            tot = gl.xor_sum(acc, 0)
        if RES > 0:                     # (zeros: the XOR unchanged)
            tot = tot ^ gl.xor_sum(gl.xor_sum(res.slice(0, 1).load(RL), 1), 0)
        if RES2 > 0:
            tot = tot ^ gl.xor_sum(gl.xor_sum(res2.slice(0, 1).load(RL), 1), 0)
        gl.store(out + pid, tot)

    LAUNCH = launcher(_pattern_kernel)


def reservation(ctas: int, own: int = 0) -> dict:
    """Shared bytes a CTA reserves so that an SM holds at most `ctas` (0: none) beside the kernel's `own` (the ring's
    stages): two power-of-2 buffers (Gluon's shapes), RES + RES2 the most that `ctas` CTAs fit (with 1 KiB reserved
    and 1 KiB of the kernel's scratch a CTA)."""
    if ctas == 0:
        return {"RES": 0, "RES2": 0}
    top = SMEM_SM // ctas - 2048 - own
    a = 1 << (top.bit_length() - 1)
    return {"RES": a, "RES2": 1 << ((top - a).bit_length() - 1) if top - a >= 4096 else 0}


def consts(name: str) -> dict:
    """The case's constexprs (the ring's own shared memory: NS stages of [128, 32] int32, 16 KiB each)."""
    mode, ns, walked, ctas = CASES[name]
    return {"MODE": MODES[mode], "NS": ns, **reservation(ctas, ns * 16384 if mode == "ring" else 0)}


def launch(pool_view, out, name: str):
    """One launch of case `name` over a bank (pool_view: its bytes): grid (ROWS / BR tiles, chunks)."""
    steps = 32 if CASES[name][2] else 8
    LAUNCH[(ROWS // BR, 64 // (2 * steps))](pool_view, out, steps, **consts(name), num_warps=4, num_stages=1)


def compile_case(name: str, arch: int = 90):
    """The case's kernel compiled for CUDA sm_`arch` without a GPU (Triton alone, as gluon_mmq.compile_kernel): the
    CompiledKernel (tests/kernels/test_pattern_bench.py reads its SASS)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    const = consts(name)
    sig = {"pool": "*u8", "out": "*i32", "steps": "i32", **{k: "constexpr" for k in const}}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    return triton.compile(GluonASTSource(_pattern_kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "num_stages": 1})


def layout_index(mode: str, ns: int):
    """A layout case's permutation of one tile's bytes (int64 [tile rows x ROW_B]: laid byte i = GGUF byte index[i],
    each tile of the bank alike): tiled's [step][row][68 bytes] of NS rows, packed's betelgeuse/kernels/mma_pack."""
    import numpy as np
    from betelgeuse.kernels import mma_pack
    if mode == "packed":
        return mma_pack.tile_index(ROW_B // BLK * 32)
    s, r, b = np.ix_(range(ROW_B // STEP_B), range(ns), range(STEP_B))
    return (r * ROW_B + s * STEP_B + b).reshape(-1)


def relaid(bank, mode: str, ns: int):
    """The bank's bytes in a layout case's order (a gather on the bank's device)."""
    from betelgeuse.kernels import mma_pack
    return mma_pack.permute_tiles(bank, layout_index(mode, ns))


def expected_programs(bank, walked: bool):
    """numpy's XOR a program of the GGUF bytes its rows and steps hold, as 16-bit values (what a layout case's
    programs must read from the bank re-laid): [programs] in pid order."""
    import numpy as np
    steps = 32 if walked else 8
    a = bank.cpu().numpy()[:ROWS * ROW_B].reshape(ROWS // BR, BR, 64 // (2 * steps), steps * STEP_B)
    return np.bitwise_xor.reduce(np.bitwise_xor.reduce(a.view(np.uint16), axis=3), axis=1).reshape(-1)


def fold16(x):
    """int32 XORs -> the XOR of their 16-bit halves (a layout case's words: the same 16-bit pairs, packed by two)."""
    import numpy as np
    u = x.view(np.uint32)
    return ((u & 0xFFFF) ^ (u >> 16)).astype(np.uint16)


def expected(bank, mode: str, walked: bool):
    """numpy's XOR of the bytes the case reads of a bank (pairs: as 16-bit values, folded from the words)."""
    import numpy as np
    a = bank.cpu().numpy()
    steps = 32 if walked else 8
    if mode == "flat":
        n = ROWS // BR * (64 // (2 * steps)) * steps * 8192
        return int(np.bitwise_xor.reduce(a[:n].view(np.int32)))
    x = int(np.bitwise_xor.reduce(a[:ROWS * ROW_B].view(np.int32)))
    return x if mode in ("words", "ring") else (x & 0xFFFF) ^ ((x >> 16) & 0xFFFF)


def main() -> int:
    import numpy as np
    import torch
    from kernel_roofline import graph_time
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--cases", default="", help="comma-separated CASES names (default: all)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    bank_b = ROWS * ROW_B
    n_banks = max(2, math.ceil(512e6 / bank_b))                       # rotating beyond the L2
    pool = torch.randint(0, 256, (n_banks * bank_b,), dtype=torch.uint8, device=dev)
    print(f"device {torch.cuda.get_device_name()}; bank {bank_b / 1e6:.1f} MB x {n_banks}")
    print("| case | mode | NS | steps a program | programs | CTAs an SM cap | XOR == numpy | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for name in (a.cases.split(",") if a.cases else CASES):
        mode, ns, walked, ctas = CASES[name]
        steps = 32 if walked else 8
        progs = ROWS // BR * (64 // (2 * steps))
        out = torch.zeros(progs, dtype=torch.int32, device=dev)
        if mode in LAYOUTS:             # each program's XOR: the bytes of its rows and steps, wherever laid
            launch(relaid(pool[:bank_b], mode, ns), out, name)
            ok = np.array_equal(fold16(out.cpu().numpy()), expected_programs(pool[:bank_b], walked))
        else:
            launch(pool[:bank_b], out, name)
            got = int(np.bitwise_xor.reduce(out.cpu().numpy()))
            ok = (got & (0xFFFF if mode == "pairs" else -1)) == expected(pool[:bank_b], mode, walked)
        bad += not ok
        t = graph_time(lambda i: launch(pool[(i % n_banks) * bank_b:], out, name), a.reps)
        nbytes = progs * steps * (8192 if mode == "flat" else BR * STEP_B)
        print(f"| {name} | {mode} | {ns} | {steps} | {progs} | {ctas or '-'} | {'PASS' if ok else 'FAIL'} "
              f"| {nbytes / t / 1e9:.0f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
