"""Decode with no per-layer host sync (decode_gate): the host launches the whole step ahead, each layer gated on the device.

Per decode layer that is not wholly in VRAM, inside the step's graphs, after routing (kernels/triton_gate.py):

    at-hand group     every routed row whose expert is at hand (worker/at_hand.py)
    publish           rows per expert + the next layers' guessed ids to this layer's pinned host row; misses counted
                      on the device; flag[l] = 1 when there is none
    gate              this layer's marker (the step's tag) to the host; when armed and something was missed, spins
                      until the HOST writes the tag into the layer's open word; then the layer's miss table (host
                      buffer -> device; all -1 when nothing was missed)
    misses' group     ONE gate_up + ONE down over the miss table: the missed experts' bytes read IN PLACE where the
                      host found them (a disk expert in its staging slot, a host expert not in the at-hand table in
                      its host slot: both in the store's arena, registered mapped), on the same stream

Only the host opens a gate, and an armed drain makes no CUDA call. The host drains the layers in order
(MoEStep.gate_drain): it polls layer l's marker, reads its row (the counts and guesses the per-layer sync brought),
sends the loads and reads ahead as the partial path does, waits for the disk experts to land in staging slots,
writes the slots' offsets into the layer's miss table in the host buffer, then the open word. Nothing on the device
waits for another stream (gpu-run38's replay failure: a gate waited for a side stream's kernels that queued behind it
in a shared hardware queue), and nothing the host does while a gate spins waits for the device (eager launches
compile and load modules, allocate and copy from pageable memory; module loading may wait for the device to idle:
the CUDA guide's lazy loading hazards). A layer's staging slots go back to the store once a later layer's marker is
seen (its misses' group ran before that gate, in stream order), the last layer's after the step.

Ahead only where nothing else needs the host: a step's launches run ahead of its drain only while they are graph
REPLAYS (the host enqueues graph launches and nothing else). So:
  - armed (a replayed part, `set_ahead(True)`): the gate spins when the layer missed something; the host drains the
    layers in order once the step is launched, or earlier, before any launch that is not a replay (the lanes call it
    first);
  - disarmed (an eager or captured part: `set_ahead(False)`, written to `arm` on the main stream before the part): the
    gate writes its marker and passes; the host drains the layer right there and copies the miss table into the
    device (stream-ordered before the misses' group, which is launched after the drain).
Rows are computed by the same kernels and written once whichever group computes them: the bits are the per-layer
sync's (invariant 1).

Flags, error flags and spin counts are zeroed at the step's start on the main stream; the open words hold the step's
tag, so they need no zeroing. A bug cannot hang the GPU: a gate opens after MAX_ITER loads and sets its layer's error
flag, which the step checks at its end (BetelgeuseError naming the layers, the host's drain position and the device's
words: `report()`); a host failure mid-drain opens every gate (abort: host writes only) before it raises.

On the CPU (the tests' path) nothing runs ahead: each gated layer is drained where its gate stands (the same drain
code), the misses' group reading the table the drain wrote.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from betelgeuse.errors import BetelgeuseError
from betelgeuse.store.arena import host_device_address
from betelgeuse.worker.guess import Marks


class DecodeGate:
    MAX_ITER = 1 << 25          # loads of the open word before a gate gives up (~10-30 s on the device: a volatile
                                # load of mapped host memory crosses PCIe, ~0.5-1 µs)
    HOST_TIMEOUT_S = 60.0       # the host's wait for a marker

    def __init__(self, n_layer: int, n_expert: int, max_guess: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.L, self.E, self.G = n_layer, n_expert, max_guess
        self.flags = torch.zeros(n_layer, dtype=torch.int32, device=device)     # publish's: 1 = nothing missed
        self.err = torch.zeros(n_layer, dtype=torch.int32, device=device)      # 1: layer l's gate gave up
        self.spins = torch.zeros(n_layer, dtype=torch.int32, device=device)    # loads layer l's gate spun
        self.arm = torch.zeros(1, dtype=torch.int32, device=device)            # 1: gates spin (launched ahead)
        self.tag_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.tag = 0
        self.width = n_expert + max_guess + 1                   # counts [E], guesses [<= G], misses
        # the host buffer (device-mapped pinned memory on CUDA), int64 elements:
        #   [0, L * width)           per layer its row (publish)
        #   [mark, mark + L)         per layer its marker (gate: the step's tag)
        #   [opens, opens + L)       per layer its open word (the host: the step's tag once the misses are in place)
        #   [table, table + L * E)   per layer its miss table (the host: byte offsets of the missed experts' slots
        #                            relative to the slot pool, -1 for the others; kernels.moe.Group)
        self.mark = n_layer * self.width
        self.opens = self.mark + n_layer
        self.table_at = self.opens + n_layer
        self.host = torch.full((self.table_at + n_layer * n_expert,), -1, dtype=torch.int64, pin_memory=self.cuda)
        self._np = self.host.numpy()
        self.table = self._np[self.table_at:].reshape(n_layer, n_expert)        # the host's miss tables [L, E]
        self._table_t = self.host[self.table_at:].view(n_layer, n_expert)
        self.miss = torch.full((n_layer, n_expert), -1, dtype=torch.int64, device=device)   # the device's copy
        # the torch kernels' sources of the missed experts (CPU): [L][E] (tensor, byte offset) or None
        self.srcs: list[list] = [[None] * n_expert for _ in range(n_layer)]
        self.anchor = torch.zeros(1, dtype=torch.int64, device=device)
        addr = host_device_address(self.host.data_ptr()) if self.cuda else self.host.data_ptr()
        if addr is None:
            raise BetelgeuseError("decode_gate: the driver gives no device address for pinned host memory")
        d = addr - self.anchor.data_ptr()
        assert d % 8 == 0, d
        self.base_off = d // 8                                 # anchor + base_off = the host buffer (int64 elements)
        self._ahead = None                      # the arm word's value last enqueued this step (None: not yet)
        # the host's drain position this step (report()): layers launched armed / disarmed, the last marker seen,
        # the last layer opened, the seconds waited for markers
        self.pos = _Pos()

    # ---- in the step's launches (graph-capturable) --------------------------------------------------------
    def begin(self):
        """Before a step's launches: a new tag, the flags, error flags and spin counts zeroed, disarmed (main stream,
        eager)."""
        self.tag += 1
        self.tag_dev.fill_(self.tag)
        self.flags.zero_()
        self.err.zero_()
        self.spins.zero_()
        self._ahead = None
        self.set_ahead(False)
        self.pos = _Pos()

    def set_ahead(self, ahead: bool):
        """The gates launched from here on spin (a replayed part: the host drains after the step's launches) or pass
        (an eager or captured part: the host drains each right after it). The arm word is written on the main stream
        where it changes, so each gate reads the value enqueued before it (module doc)."""
        if ahead != self._ahead:
            self.arm.fill_(int(ahead))
            self._ahead = ahead

    @property
    def ahead(self) -> bool:
        return bool(self._ahead)

    def publish_and_gate(self, l: int, counts: torch.Tensor, at_row: torch.Tensor, guess: torch.Tensor | None):
        """Layer l's publish and gate (after its at-hand group; the misses' group follows: MoEStep.gate_misses)."""
        n = 0 if guess is None else guess.numel()
        assert n <= self.G, (n, self.G)
        g = counts if guess is None else guess.reshape(-1)
        if not self.cuda:                                      # the drain runs right here (module doc)
            row = self._np[l * self.width: (l + 1) * self.width]
            row[:self.E] = counts.numpy()
            row[self.E:self.E + n] = g.numpy()[:n]
            row[self.E + n] = int(((counts > 0) & (at_row == -1)).sum())
            self._np[self.mark + l] = self.tag
            return
        from betelgeuse.kernels import triton_gate
        triton_gate.publish(counts, at_row, g, self.flags[l:l + 1], self.anchor, self.base_off + l * self.width, n)
        triton_gate.gate(self.flags[l:l + 1], self.err[l:l + 1], self.spins[l:l + 1], self.arm, self.anchor,
                         self.base_off + self.mark + l, self.base_off + self.opens + l,
                         self.base_off + self.table_at + l * self.E, self.miss[l], self.tag_dev, self.MAX_ITER)

    # ---- the host's drain (no CUDA call where armed) -------------------------------------------------------
    def wait(self, l: int, shape: tuple | None) -> tuple[np.ndarray, Marks | None, int]:
        """Layer l's marker polled -> (rows per expert [E], the guesses' Marks (worker/guess.py) or None, misses);
        shape: the published guess's (T, D, k) or None."""
        mark = self.mark + l
        if self._np[mark] != self.tag:
            t = time.perf_counter()
            while self._np[mark] != self.tag:
                if time.perf_counter() - t > self.HOST_TIMEOUT_S:
                    raise BetelgeuseError(f"decode gate: layer {l}'s routing did not arrive in "
                                          f"{self.HOST_TIMEOUT_S:.0f} s ({self.report(device=False)})")
                time.sleep(0)                               # the store's client threads need the GIL
            dt = time.perf_counter() - t
            self.pos.waited_s += dt
            self.pos.waits[l] = round(dt, 4)
        self.pos.seen = l
        row = self._np[l * self.width: (l + 1) * self.width]
        n = 0 if shape is None else math.prod(shape)
        counts, misses = row[:self.E].copy(), int(row[self.E + n])
        if shape is None:
            return counts, None, misses
        return counts, Marks.from_ids(row[self.E:self.E + n].reshape(shape), self.E), misses

    def open(self, l: int, armed: bool, misses: int):
        """Layer l's miss table is written (self.table[l], only where something was missed): an armed gate opens (its
        open word), a disarmed one passed already and the table is copied into the device here, stream-ordered
        before the misses' group."""
        self.pos.opened = l
        self.pos.opened_at[l] = round(time.perf_counter() - self.pos.t0, 4)
        if not misses:
            return
        if armed:
            self._np[self.opens + l] = self.tag                # after the table (x86 stores stay in order)
        else:
            self.miss[l].copy_(self._table_t[l], non_blocking=self.cuda)

    def abort(self):
        """A failure mid-drain: every gate opens (host writes only; the step's output is discarded), so the device
        finishes."""
        self._np[self.opens:self.opens + self.L] = self.tag

    def check(self):
        """After the step's launches and drain: a gate that gave up is an error (waits for the step)."""
        if self.cuda and int(self.err.amax().item()):
            msg = self.report()
            self.err.zero_()
            raise BetelgeuseError("decode gate: a layer's gate gave up waiting for its misses (a bug: the step's "
                                  f"output is wrong and was discarded; {msg})")

    def report(self, device: bool = True) -> str:
        """The host's drain position (and, after the step, the device's words: device=True waits for it), for an
        error."""
        p = self.pos
        marks = self._np[self.mark:self.mark + self.L].tolist()
        opens = self._np[self.opens:self.opens + self.L].tolist()
        txt = (f"tag {self.tag}; armed layers {p.armed}, disarmed {p.disarmed}; host: last marker seen "
               f"{p.seen}, last layer opened {p.opened}, waited {p.waited_s:.3f} s for markers (by layer: "
               f"{p.waits}), opened at (s after begin, by layer: {p.opened_at}); markers "
               f"{[m == self.tag for m in marks]}; open words {[o == self.tag for o in opens]}")
        if self.cuda and device:
            err = self.err.cpu().tolist()
            txt += (f"; gave up: layers {[l for l, e in enumerate(err) if e]}; flags {self.flags.cpu().tolist()}; "
                    f"spins {self.spins.cpu().tolist()}; arm {int(self.arm.cpu())}")
        return txt


class _Pos:
    """The host's drain position in a step (DecodeGate.report)."""

    __slots__ = ("armed", "disarmed", "seen", "opened", "waited_s", "waits", "opened_at", "t0")

    def __init__(self):
        self.armed, self.disarmed = [], []
        self.waits: dict = {}               # layer -> seconds the host polled for its marker (where it did)
        # layer -> when its misses were in place and its gate opened, seconds after the step's begin: a gate that
        # gave up although the host opened it long before (a spin lasts ~seconds) points at the open word not reaching
        # the device, a late one at a host that was blocked
        self.opened_at: dict = {}
        self.t0 = time.perf_counter()
        self.seen = self.opened = -1
        self.waited_s = 0.0
