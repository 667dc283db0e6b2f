"""Decode's device-side gate (worker/gate.py): two 1-program kernels per decode layer, graph-capturable.

  publish   after the layer's at-hand group: its rows per expert [E] and the next layers' guessed ids [G] written
            to a host buffer (pinned, device-mapped: addressed as `anchor + off`, the way the at-hand table addresses
            the arena), then the misses counted (routed experts whose at-hand offset is -1) and flag = (misses == 0);
            the row is written through to system memory and fenced there (membar.sys) before the kernel ends
  gate      the layer's marker (the step's tag) written to the host buffer (after publish's writes: a kernel boundary
            and publish's fence order them), fenced to system memory so the host sees it while this kernel still
            runs; then, only when the step is armed (`arm`: launched ahead), a spin on the flag (volatile loads) until
            the device (no miss) or the host's side stream (after the misses' group) set it; a bounded spin: after
            max_iter loads the layer's error flag is set and the gate opens (the host raises; a bug cannot hang the
            GPU). The loads spun are stored per layer (`spins`: how long the layer waited for the host)

Why the fences: a store to device-mapped host memory may sit in the GPU's caches while the storing kernel runs on;
`st.wt` writes through the L2 to system memory and `membar.sys` (CUDA's __threadfence_system) waits until the
thread's earlier writes are performed at system scope, the pattern a GPU -> host-proxy queue uses (NCCL). The integer
offsets are not specialized (do_not_specialize): every layer's launch is one compiled kernel, so no layer of a step
launched ahead compiles and loads a module while an earlier gate spins. TRITON_INTERPRET (the tests) has no inline
PTX: the fence is left out there (FENCE=False), where memory is the host's own anyway.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def _fence_sys(x):
    """membar.sys (= fence.sc.sys) after this thread's writes; returns x (the asm needs an operand)."""
    return tl.inline_asm_elementwise("membar.sys;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["out_off", "E", "G"])
def _publish_kernel(counts_ptr, at_ptr, guess_ptr, flag_ptr, anchor_ptr, out_off, E, G,
                    EP: tl.constexpr, GP: tl.constexpr, FENCE: tl.constexpr):
    e = tl.arange(0, EP)
    me = e < E
    c = tl.load(counts_ptr + e, mask=me, other=0)
    at = tl.load(at_ptr + e, mask=me, other=0)
    miss = tl.sum(((c > 0) & (at == -1)).to(tl.int32), 0)
    out = anchor_ptr + out_off
    tl.store(out + e, c, mask=me, cache_modifier=".wt")
    g = tl.arange(0, GP)
    mg = g < G
    tl.store(out + E + g, tl.load(guess_ptr + g, mask=mg, other=0), mask=mg, cache_modifier=".wt")
    tl.store(out + E + G, miss.to(tl.int64), cache_modifier=".wt")
    if FENCE:
        miss = _fence_sys(miss)
    tl.store(flag_ptr, (miss == 0).to(tl.int32))


@triton.jit(do_not_specialize=["mark_off", "max_iter"])
def _gate_kernel(flag_ptr, err_ptr, spin_ptr, arm_ptr, anchor_ptr, mark_off, tag_ptr, max_iter,
                 FENCE: tl.constexpr):
    tag = tl.load(tag_ptr)
    tl.store(anchor_ptr + mark_off, tag, cache_modifier=".wt")
    armed = tl.load(arm_ptr)
    if FENCE:
        armed = _fence_sys(armed)
    v = tl.load(flag_ptr, volatile=True)
    i = 0
    while (armed != 0) & (v == 0) & (i < max_iter):
        v = tl.load(flag_ptr, volatile=True)
        i += 1
    tl.store(spin_ptr, i)
    if (armed != 0) & (v == 0):
        tl.store(err_ptr, 1)


def _fence() -> bool:
    """The system fences, except under TRITON_INTERPRET (no inline PTX) or BETELGEUSE_GATE_FENCE=0 (the device check's
    A/B of the fences: deploy/device/check_gate.py --settings ...,gate-nofence)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("BETELGEUSE_GATE_FENCE", "1") != "0"


def publish(counts, at_row, guess, flag, anchor, out_off: int, n_guess: int):
    """counts [E] int64, at_row [E] int64 (the layer's at-hand table), guess [>= n_guess] int64 (any tensor when
    n_guess = 0), flag: the layer's int32 element; anchor: int64 device tensor, out_off its element offset to the
    layer's host row [E + n_guess + 1]."""
    E = counts.numel()
    _publish_kernel[(1,)](counts, at_row, guess, flag, anchor, out_off, E, n_guess,
                          EP=triton.next_power_of_2(E), GP=triton.next_power_of_2(max(n_guess, 1)), FENCE=_fence())


def gate(flag, err, spins, arm, anchor, mark_off: int, tag, max_iter: int):
    """flag, err, spins: the layer's int32 elements; arm: int32 [1] (0: write the marker and pass, the host drains
    first; 1: spin until the flag is set); tag: int64 [1], the step's marker."""
    _gate_kernel[(1,)](flag, err, spins, arm, anchor, mark_off, tag, max_iter, FENCE=_fence())
