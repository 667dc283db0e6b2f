"""Where wgmma's A operand (the weights) comes from, compiled for sm_90 without a GPU (cpu-mma55, issue 23).

The same [64, 64] Q8_0 weight tile (32-byte quant runs at byte 2 of 34-byte blocks, int8 -> bf16) against a
[64, 32] bf16 B tile in shared memory, one m64 n32 k16 wgmma per k16, a K loop of 2 blocks a step:
  triton  plain tl.dot(w.to(bf16), x): Triton 3.9 lowers A as local_alloc (registers -> shared memory, STS) and
          local_load into the dot-operand layout (LDSM), then HGMMA with A in registers: a round trip per K step
          and the barriers around it (OptimizeDotOperands' MMAV3UseRegOperand skips it only when A comes out of
          another MMA's accumulator layout);
  gluon   the same tile loaded straight into the dot-operand layout (ttgl.DotOperandLayout k_width 2 of the
          NVMMA v3 layout) and given to hopper.warpgroup_mma as a register tensor: no STS / LDSM for A.
Prints the K loop's counts (tests/scripts/sass_profile.py's classes) for both. Run from the repository root:
    .venv/bin/python docs/benchmarks/cpu-mma55/a_operand_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia import hopper  # noqa: E402

import sass_profile as sp  # noqa: E402

ROW = tl.constexpr(16 * 34)        # bytes a weight row (16 Q8_0 blocks)


@triton.jit
def tri(w_ptr, x_ptr, y_ptr, kb_n):
    r = tl.arange(0, 64)
    c = tl.arange(0, 64)
    m = tl.arange(0, 32)
    acc = tl.zeros((64, 32), tl.float32)
    for kb0 in range(0, kb_n, 2):
        kb = kb0 + c // 32
        w = tl.load(w_ptr + r[:, None] * ROW + (kb * 34 + 2 + c % 32)[None, :]).to(tl.int8, bitcast=True)
        x = tl.load(x_ptr + (kb0 * 32 + c)[:, None] * 32 + m[None, :])
        acc = tl.dot(w.to(tl.bfloat16), x, acc, out_dtype=tl.float32)
    tl.store(y_ptr + r[:, None] * 32 + m[None, :], acc)


MMA = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
AL = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
BL = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
SH = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2, transposed=True)


@gluon.jit
def glu(w_ptr, x_ptr, y_ptr, kb_n):
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, AL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, AL))
    kx = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    mx = gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
    acc = gl.zeros([64, 32], gl.float32, MMA)
    for kb0 in range(0, kb_n, 2):
        kb = kb0 + c // 32
        w = gl.load(w_ptr + r[:, None] * ROW + (kb * 34 + 2 + c % 32)[None, :])
        x = gl.load(x_ptr + (kb0 * 32 + kx)[:, None] * 32 + mx[None, :])
        xs = gl.allocate_shared_memory(gl.bfloat16, [64, 32], SH, x)
        hopper.fence_async_shared()
        acc = hopper.warpgroup_mma(w.to(gl.int8, bitcast=True).to(gl.bfloat16), xs, acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    mo = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    gl.store(y_ptr + ro[:, None] * 32 + mo[None, :], acc)


def main() -> int:
    sig = {"w_ptr": "*u8", "x_ptr": "*bf16", "y_ptr": "*fp32", "kb_n": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    for name, src in (("triton", ASTSource(tri, sig, {}, attrs)), ("gluon", GluonASTSource(glu, sig, {}, attrs))):
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
        sass, res = sp.sass_of(k.asm["cubin"])
        body = sp.k_loop(sp.instructions(sass), mma=True)
        cl = sp.mix(body)["classes"]
        ops = {}
        for _, op, rest in body:
            if op in ("STS", "STSM", "LDS", "LDSM", "BAR", "HGMMA"):
                key = op + (rest.split()[0] if rest.startswith(".") and op != "HGMMA" else "")
                ops[key] = ops.get(key, 0) + 1
        print(f"{name}: A {sp.a_operand(body)}, K loop {cl['total']} instructions, shared memory ops {ops}, "
              f"ttgir local_alloc {k.asm['ttgir'].count('local_alloc')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
