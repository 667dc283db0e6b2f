"""Decode's device-side gate (worker/gate.py): two 1-program kernels per decode layer, graph-capturable.

  publish   after the layer's at-hand group: its rows per expert [E] and the next layers' guessed ids [G] written
            to a host buffer (pinned, device-mapped: addressed as `anchor + off`, the way the at-hand table addresses
            the arena), then the misses counted (routed experts whose at-hand offset is -1) and flag = (misses == 0);
            the row is written through to system memory and fenced there (membar.sys) before the kernel ends
  gate      the layer's marker (the step's tag) written to the host buffer (after publish's writes: a kernel boundary
            and publish's fence order them), fenced to system memory so the host sees it while this kernel still
            runs; then, only when the step is armed (`arm`: launched ahead) and the layer missed an expert, a spin
            until the HOST writes the step's tag into the layer's open word (volatile loads of the mapped host
            buffer); a bounded spin: after max_iter loads the layer's error flag is set and the gate opens (the host
            raises; a bug cannot hang the GPU). The loads spun are stored per layer (`spins`). Last, the layer's miss
            table (the host's [E] byte offsets of the missed experts' slots: -1 for the others) is copied from the host
            buffer into device memory, where the misses' group after the gate reads it; all -1 when nothing was
            missed (the host writes no row then).

Nothing but the host opens a gate: the misses' bytes are read in place by the group after the gate, on the same
stream, so no kernel of another stream has to run beside a spinning one (streams beyond the device's hardware queues
share them: a gate waiting for another stream's kernel could wait behind itself, gpu-run38's replay failure).

Why the fences: a store to device-mapped host memory may sit in the GPU's caches while the storing kernel runs on;
`st.wt` writes through the L2 to system memory and `membar.sys` (CUDA's __threadfence_system) waits until the
thread's earlier writes are performed at system scope, the pattern a GPU -> host-proxy queue uses (NCCL). The host's
writes (the miss table, then the open word) reach the GPU in program order (x86 stores are not reordered), and the
volatile loads read system memory, not a cached line of an earlier step. The integer offsets are not specialized
(do_not_specialize): every layer's launch is one compiled kernel, so no layer of a step launched ahead compiles and
loads a module while an earlier gate spins. TRITON_INTERPRET (the tests) has no inline PTX: the fence is left out
there (FENCE=False), where memory is the host's own anyway.
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


@triton.jit(do_not_specialize=["mark_off", "open_off", "tab_off", "max_iter", "E"])
def _gate_kernel(flag_ptr, err_ptr, spin_ptr, arm_ptr, anchor_ptr, mark_off, open_off, tab_off, miss_ptr, tag_ptr,
                 max_iter, E, EP: tl.constexpr, FENCE: tl.constexpr):
    tag = tl.load(tag_ptr)
    tl.store(anchor_ptr + mark_off, tag, cache_modifier=".wt")
    armed = tl.load(arm_ptr)
    if FENCE:
        armed = _fence_sys(armed)
    hit = tl.load(flag_ptr)                     # publish's flag (this stream, an earlier kernel): nothing missed
    v = tl.load(anchor_ptr + open_off, volatile=True)
    i = 0
    while (armed != 0) & (hit == 0) & (v != tag) & (i < max_iter):
        v = tl.load(anchor_ptr + open_off, volatile=True)
        i += 1
    if FENCE:                                   # the table is read after the open word (an acquire at system scope)
        i = _fence_sys(i)
    tl.store(spin_ptr, i)
    if (armed != 0) & (hit == 0) & (v != tag):
        tl.store(err_ptr, 1)
    e = tl.arange(0, EP)
    me = e < E
    row = tl.load(anchor_ptr + tab_off + e, mask=me, other=-1, volatile=True)
    tl.store(miss_ptr + e, tl.where(hit != 0, -1, row), mask=me)


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


def gate(flag, err, spins, arm, anchor, mark_off: int, open_off: int, tab_off: int, miss, tag, max_iter: int):
    """flag, err, spins: the layer's int32 elements (flag: publish's); arm: int32 [1] (0: write the marker and pass,
    the host drains first; 1: spin while something was missed until the host buffer's open word at `open_off` holds
    the tag); anchor + tab_off: the layer's host miss table [E] int64, copied into miss [E] (the device's); tag:
    int64 [1], the step's marker."""
    E = miss.numel()
    _gate_kernel[(1,)](flag, err, spins, arm, anchor, mark_off, open_off, tab_off, miss, tag, max_iter, E,
                       EP=triton.next_power_of_2(E), FENCE=_fence())
