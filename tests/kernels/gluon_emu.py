"""Tests' numpy emulation of gluon_mmq's register code (no GPU here: the device checks the bits): an interpreter of the
PTX its inline asm runs, so a test executes the kernel source's own asm text rather than a transcription of it, and
MXFP4's register moves (the join / reshape / permute lines MX_LINES, which a test checks are in the source).
Registers are uint32 arrays (one element a thread's value); each instruction as the PTX ISA defines it, element-wise:

  mov.b32, and / or / xor.b32, shr.u32 / shr.b32 (logical), shl.b32, add.u32 / sub.u32 (mod 2^32), cvt.u32.u16;
  prmt.b32 d, a, b, c (default mode): byte i of d is byte c[4i+2:4i] of the 8 bytes {b, a} (a bytes 0-3), or with
      c[4i+3] set that byte's sign (bit 7) replicated over 8 bits; c's bits 16-31 unused;
  add.rn.bf16x2 / sub.rn.bf16x2: each 16-bit half a bf16, the float32 sum or difference of the halves rounded to bf16
      (round to nearest even: torch's float32 -> bf16). One rounding where float32 holds the exact result (the asm
      here: integers below 2^24), as the hardware's.

asm_of(fn) is the asm text of a @gluon.jit function's (first) inline_asm_elementwise; run(asm, n_out, *ins) its
outputs ($0 .. $n_out-1) on the inputs ($n_out ..)."""

from __future__ import annotations

import inspect
import re

import numpy as np
import torch

M32 = 0xFFFFFFFF


def asm_of(fn) -> str:
    """The asm text between the braces of the first triple-quoted `{ ... }` string in fn's source."""
    src = inspect.getsource(fn.fn if hasattr(fn, "fn") else fn)
    return re.search(r'"""\{(.*?)\}"""', src, re.S).group(1)


def _bf16(v: np.ndarray) -> np.ndarray:
    """uint32 with a bf16 in its low 16 bits -> float32 (exact)."""
    return ((v & 0xFFFF) << 16).astype(np.uint32).view(np.float32)


def _to_bf16(f: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even) as uint64."""
    b = torch.from_numpy(np.ascontiguousarray(f, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return b.astype(np.uint16).astype(np.uint64)


def _prmt(a, b, c):
    src = (b << 32) | a                                        # bytes 0-3: a, 4-7: b
    d = np.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = (src >> (8 * (sel & 7))) & 255
        byte = np.where(sel & 8, np.where(byte & 128, np.uint64(255), np.uint64(0)), byte)
        d |= byte << (8 * i)
    return d


def _bf16x2(a, b, sign):
    """Both halves: bf16(a_h + sign * b_h)."""
    out = 0
    for s in (0, 16):
        out = out | (_to_bf16(_bf16(a >> s) + np.float32(sign) * _bf16(b >> s)) << s)
    return out


OPS = {"mov.b32": lambda a: a, "cvt.u32.u16": lambda a: a & 0xFFFF,
       "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "xor.b32": lambda a, b: a ^ b,
       "shr.u32": lambda a, b: a >> b, "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & M32,
       "add.u32": lambda a, b: (a + b) & M32, "sub.u32": lambda a, b: (a - b) & M32,
       "prmt.b32": _prmt, "add.rn.bf16x2": lambda a, b: _bf16x2(a, b, 1),
       "sub.rn.bf16x2": lambda a, b: _bf16x2(a, b, -1)}


def run(asm: str, n_out: int, *ins) -> tuple:
    """Execute asm on the inputs (integer arrays of one shape, the low 32 bits of each): its outputs as uint32."""
    shape = np.broadcast_shapes(*(np.shape(x) for x in ins))
    regs = {f"${n_out + i}": np.broadcast_to(np.asarray(x).astype(np.int64) & M32, shape).astype(np.uint64)
            for i, x in enumerate(ins)}
    for line in asm.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *args = [o.strip() for o in rest.split(",")]
        vals = [regs[a] if a in regs else np.uint64(int(a, 0)) for a in args]
        regs[d] = np.broadcast_to(OPS[op](*vals), shape).astype(np.uint64)
    return tuple(regs[f"${i}"].astype(np.uint32) for i in range(n_out))


# ---- MXFP4 (gluon_mmq._mx_words, _mx_pk_words, _mx_a): gl.join = a stack on a new last axis, gl.split its inverse,
# reshape / permute numpy's (row-major); the lines emulated, as the source has them
MX_LINES = {
    "_mx_words": ("v = gl.reshape(gl.permute(gl.reshape(v, [R, 2, 4, 4]), [0, 3, 1, 2]), [R, 8, 2, 2])",
                  "v02, v13 = gl.split(v)", "b0, b2 = gl.split(v02)", "b1, b3 = gl.split(v13)",
                  '"=r,r,r,r,r", [b0, b1, b2, b3]'),
    "_mx_pk_words": ("return gl.reshape(gl.permute(gl.reshape(w, [R // 16, 8, 4, 2, 2]), [0, 3, 1, 2, 4]), [R, 8])",),
    "_mx_a": ("o0, o1, o2, o3 = _e2m1x8(w)", "v = gl.join(gl.join(o0, o2), gl.join(o1, o3))",
              "v = gl.permute(gl.reshape(v, [R, 4, 2, 4]), [0, 2, 3, 1])",
              "return gl.convert_layout(_bf16x2(gl.reshape(v, [R, 32]), R), AL)"),
    "_mx_x_load": ("e = gl.arange(0, KB * 32, layout=gl.SliceLayout(1, XE))", "(jb[None, :] == (e // 32)[:, None])",
                   "+ kb0 * 32 + e[:, None], mask=m2"),
    "_mx_x_words": ("(jb[:, None] == (u // 16)[None, :])",
                    "[:, None] + kb0 * 32) // 2 + u[None, :],"),
    "_conv_raw": ("xb = _mx_x_perm(gl.permute(_bf16x2(x, x.shape[0]), [1, 0]))",),
    "_mx_x_perm": ("x = gl.permute(gl.reshape(x, [R // 32, 2, 4, 4, C]), [0, 2, 3, 1, 4])",
                   "return gl.convert_layout(gl.reshape(x, [R, C]), BL)"),
    "_bf16x2": ("lo = (v & 0xFFFF)", "hi = (v >> 16)", "return gl.reshape(gl.join(lo, hi), [R, 2 * v.shape[1]])"),
}


def mx_source_lines(gm) -> None:
    """Assert gluon_mmq's MXFP4 functions hold the lines emulated here."""
    for name, lines in MX_LINES.items():
        f = getattr(gm, name)
        src = inspect.getsource(f.fn if hasattr(f, "fn") else f)
        for line in lines:
            assert line in src, (name, line)


def mx_words(gm, v: np.ndarray) -> np.ndarray:
    """_mx_words: nibble bytes [R, 32] (column p: step byte p) -> words [R, 8] (its PTX packs 4 bytes a word)."""
    R = v.shape[0]
    v = v.reshape(R, 2, 4, 4).transpose(0, 3, 1, 2).reshape(R, 8, 2, 2)
    v02, v13 = v[..., 0], v[..., 1]
    return run(asm_of(gm._mx_words), 1, v02[..., 0], v13[..., 0], v02[..., 1], v13[..., 1])[0]


def mx_pk_words(w: np.ndarray) -> np.ndarray:
    """_mx_pk_words: _mx_pk_load's words [R / 2, 16] -> [R, 8]."""
    R = 2 * w.shape[0]
    return w.reshape(R // 16, 8, 4, 2, 2).transpose(0, 3, 1, 2, 4).reshape(R, 8)


def mx_a(gm, w: np.ndarray) -> np.ndarray:
    """_mx_a: words [R, 8] -> the A operand [R, 64] as bf16 bits (uint16; column k of the step)."""
    R = w.shape[0]
    o0, o1, o2, o3 = run(asm_of(gm._e2m1x8), 4, w)
    v = np.stack([np.stack([o0, o2], -1), np.stack([o1, o3], -1)], -1)
    return bf16x2(v.reshape(R, 4, 2, 4).transpose(0, 2, 3, 1).reshape(R, 32)).astype(np.uint16)


def bf16x2(v: np.ndarray) -> np.ndarray:
    """_bf16x2: words [R, C] holding bf16 pairs -> [R, 2 C] (element 2 p + h: half h of word p)."""
    return np.stack([v & 0xFFFF, v >> 16], -1).reshape(v.shape[0], 2 * v.shape[1])


def mx_x_perm(x: np.ndarray) -> np.ndarray:
    """_mx_x_perm: the B tile [R, C] in element order (_mx_x_load's rows) -> _perm's positions."""
    R, C = x.shape
    return x.reshape(R // 32, 2, 4, 4, C).transpose(0, 2, 3, 1, 4).reshape(R, C)
