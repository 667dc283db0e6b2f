"""TritonOps.decode_attend (kernels/triton_ds4._decode_attn_kernel) on tensors that each end at a PROT_NONE page,
under Triton's interpreter: a load the kernel does not mask that reaches past a tensor faults (SIGSEGV), as it
faulted on CUDA (an illegal address: gpu-run47, a block's last key rows past W + NE read the entries' next rows).
Every mode (window only, HCA: every entry, CSA: top rows), key counts that leave a block's last rows unused.
Prints "ok" and the checked cases; the caller (tests/kernels/test_ds4_kernels.py) wants exit 0."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402

from betelgeuse.kernels.triton_ds4 import TritonOps  # noqa: E402
from betelgeuse.model.deepseek4 import InterleavedRope, TorchOps  # noqa: E402

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_keep: list = []


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose last byte is the last before a PROT_NONE page."""
    nbytes = t.numel() * t.element_size()
    pages = -(-nbytes // PAGE) + 1
    m = mmap.mmap(-1, pages * PAGE)
    buf = (ctypes.c_char * (pages * PAGE)).from_buffer(m)
    guard = ctypes.addressof(buf) + (pages - 1) * PAGE
    assert _libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(PAGE), 0) == 0, ctypes.get_errno()
    g = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=(pages - 1) * PAGE - nbytes)
    g = g.view(t.dtype).view(t.shape)
    g.copy_(t)
    _keep.append((m, buf, g))
    return g


def main() -> int:
    gen = torch.Generator().manual_seed(5)
    H, hd, W, NE, k = 4, 64, 8, 5, 3           # W + NE = 13 keys: a 32-key block's rows 13..31 are past them

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    rope = InterleavedRope.plain(16, 10000.0, torch.device("cpu"))
    n = 0
    for name, ratio, has_ent, has_top in (("window", 0, False, False), ("hca", 4, True, False),
                                          ("csa", 4, True, True)):
        for p in (3, 2 * W + 1):
            pos = guarded(torch.tensor([p]))
            c, s = rope.cos_sin(pos)
            q, kv, sinks = guarded(rnd(1, H, hd)), guarded(rnd(1, hd)), guarded(rnd(H))
            ring0 = rnd(W, hd)
            ents = guarded(rnd(NE, hd)) if has_ent else None
            top = guarded(torch.randperm(NE, generator=gen)[:k]) if has_top else None
            a = TritonOps.decode_attend(q, kv, guarded(ring0), ents, top, pos, ratio, sinks, c, s)
            b = TorchOps.decode_attend(q, kv, ring0.clone(), ents, top, pos, ratio, sinks, c, s)
            assert torch.allclose(a, b, atol=1e-5), (name, p, float((a - b).abs().max()))
            n += 1
    print("ok", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
