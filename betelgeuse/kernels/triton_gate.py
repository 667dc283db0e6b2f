"""Decode's device-side gate (worker/gate.py): two 1-program kernels per decode layer, graph-capturable.

  publish   after the layer's at-hand group: its rows per expert [E] and the next layers' guessed ids [G] written
            to a host buffer (pinned, device-mapped: addressed as `anchor + off`, the way the at-hand table addresses
            the arena), then the misses counted (routed experts whose at-hand offset is -1) and flag = (misses == 0)
  gate      the layer's marker (the step's tag) written to the host buffer, after publish's writes (a kernel
            boundary orders them), then a spin on the flag (volatile loads) until the device (no miss) or the host's
            side stream (after the misses' group) set it; a bounded spin: after max_iter loads the error flag is set
            and the gate opens (the host raises; a bug cannot hang the GPU)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _publish_kernel(counts_ptr, at_ptr, guess_ptr, flag_ptr, anchor_ptr, out_off, E, G,
                    EP: tl.constexpr, GP: tl.constexpr):
    e = tl.arange(0, EP)
    me = e < E
    c = tl.load(counts_ptr + e, mask=me, other=0)
    at = tl.load(at_ptr + e, mask=me, other=0)
    miss = tl.sum(((c > 0) & (at == -1)).to(tl.int32), 0)
    out = anchor_ptr + out_off
    tl.store(out + e, c, mask=me)
    g = tl.arange(0, GP)
    mg = g < G
    tl.store(out + E + g, tl.load(guess_ptr + g, mask=mg, other=0), mask=mg)
    tl.store(out + E + G, miss.to(tl.int64))
    tl.store(flag_ptr, (miss == 0).to(tl.int32))


@triton.jit
def _gate_kernel(flag_ptr, err_ptr, anchor_ptr, mark_off, tag_ptr, max_iter):
    tl.store(anchor_ptr + mark_off, tl.load(tag_ptr))
    v = tl.load(flag_ptr, volatile=True)
    i = 0
    while (v == 0) & (i < max_iter):
        v = tl.load(flag_ptr, volatile=True)
        i += 1
    if v == 0:
        tl.store(err_ptr, 1)


def publish(counts, at_row, guess, flag, anchor, out_off: int, n_guess: int):
    """counts [E] int64, at_row [E] int64 (the layer's at-hand table), guess [>= n_guess] int64 (any tensor when
    n_guess = 0), flag: the layer's int32 element; anchor: int64 device tensor, out_off its element offset to the
    layer's host row [E + n_guess + 1]."""
    E = counts.numel()
    _publish_kernel[(1,)](counts, at_row, guess, flag, anchor, out_off, E, n_guess,
                          EP=triton.next_power_of_2(E), GP=triton.next_power_of_2(max(n_guess, 1)))


def gate(flag, err, anchor, mark_off: int, tag, max_iter: int):
    _gate_kernel[(1,)](flag, err, anchor, mark_off, tag, max_iter)
