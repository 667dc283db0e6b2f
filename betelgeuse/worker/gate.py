"""Decode with no per-layer host sync (decode_gate): the host launches the whole step ahead, each layer gated on the device.

Per decode layer that is not wholly in VRAM, inside the step's graphs, after routing (kernels/triton_gate.py):

    at-hand group     every routed row whose expert is at hand (worker/at_hand.py)
    publish           rows per expert + the next layers' guessed ids to this layer's pinned host row; misses counted
                      on the device; flag[l] = 1 when there is none
    gate              this layer's marker (the step's tag) to the host; when armed, spins until flag[l] is set (bounded)

Ahead only where nothing else needs the host: a step's launches run ahead of its drain only while they are graph
REPLAYS (the host enqueues graph launches and nothing else). A gate that spins while the host blocks on the device
deadlocks until the spin gives up, and the first steps of a graph key block the host in many ways: eager launches
compile and load Triton and CUDA modules (loading a module may wait for the device to idle: the CUDA guide's lazy
loading hazards), allocate and copy from pageable memory, and a capture instantiates graphs. So:
  - armed (a replayed part, `set_ahead(True)`): the gate spins; the host drains the layers in order once the step is
    launched (MoEStep.gate_drain), or earlier, before any launch that is not a replay (the lanes call it first);
  - disarmed (an eager or captured part: `set_ahead(False)`, written to `arm` on the main stream before the part): the
    gate writes its marker and passes; the host drains the layer right there and the main stream waits for the side
    stream (wait_stream) instead of the flag: nothing on the device waits for the host.
The drain polls layer l's marker, reads its row (the same counts and guesses the per-layer sync brought), and runs the
partial path for the misses ON A SIDE STREAM (loads, staging banks, their group), then sets flag[l] there (armed) or
makes the main stream wait for it (disarmed); a layer with no miss costs the host its tier counts and read-ahead only.
Rows are computed by the same kernels and written once whichever group computes them: the bits are the per-layer
sync's (invariant 1).
An armed drain itself must not block on the whole device either: its waits are on the side and copy streams and the
store (none on the main stream); what could still wait for an idle device there (a Triton kernel compiled and loaded
for the first time, a flex cache chunk allocated) is counted per armed drain by deploy/device/check_gate.py.

Ordering: the side stream's work for layer l is enqueued after the host saw l's marker, which the gate writes after
the layer's route, at-hand group and publish completed (fenced to system memory: kernels/triton_gate.py); the main
stream's next work (the combine) waits behind the gate for the flag the side stream sets after the misses' group (and
after any at-hand table rewrite a flex eviction needed: later layers' groups read it after their own gates); nothing
the drain enqueues waits for the main stream. Flags, error flags and spin counts are zeroed at the step's start on
the main stream. A bug cannot hang the GPU: a gate opens after MAX_ITER loads and sets its layer's error flag, which
the step checks at its end (BetelgeuseError naming the layers, the host's drain position and the device's words:
`report()`); a host failure mid-drain opens every gate (abort) before it raises.

On the CPU (the tests' path) nothing runs ahead: each gated layer is drained where its gate stands (the same drain code).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from betelgeuse.errors import BetelgeuseError
from betelgeuse.store.arena import host_device_address
from betelgeuse.worker.guess import Marks


class DecodeGate:
    MAX_ITER = 1 << 26          # volatile loads before a gate gives up (~10-20 s on the device: ~0.3 µs per L2 load)
    HOST_TIMEOUT_S = 60.0       # the host's wait for a marker

    def __init__(self, n_layer: int, n_expert: int, max_guess: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.L, self.E, self.G = n_layer, n_expert, max_guess
        self.flags = torch.zeros(n_layer, dtype=torch.int32, device=device)
        self.err = torch.zeros(n_layer, dtype=torch.int32, device=device)      # 1: layer l's gate gave up
        self.spins = torch.zeros(n_layer, dtype=torch.int32, device=device)    # loads layer l's gate spun
        self.arm = torch.zeros(1, dtype=torch.int32, device=device)            # 1: gates spin (launched ahead)
        self.tag_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.tag = 0
        self.width = n_expert + max_guess + 1                   # counts [E], guesses [<= G], misses
        # per layer: its row, then the marker at [L * width + l]; device-mapped pinned memory on CUDA
        self.host = torch.full((n_layer * self.width + n_layer,), -1, dtype=torch.int64, pin_memory=self.cuda)
        self._np = self.host.numpy()
        self.anchor = torch.zeros(1, dtype=torch.int64, device=device)
        addr = host_device_address(self.host.data_ptr()) if self.cuda else self.host.data_ptr()
        if addr is None:
            raise BetelgeuseError("decode_gate: the driver gives no device address for pinned host memory")
        d = addr - self.anchor.data_ptr()
        assert d % 8 == 0, d
        self.base_off = d // 8                                 # anchor + base_off = the host buffer (int64 elements)
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self._ahead = None                      # the arm word's value last enqueued this step (None: not yet)
        # the host's drain position this step (report()): layers launched armed / disarmed, the last marker seen,
        # the last layer whose misses were enqueued, the seconds waited for markers
        self.pos = _Pos()

    # ---- in the step's launches (graph-capturable) --------------------------------------------------------
    def begin(self):
        """Before a step's launches: a new tag, the flags, error flags and spin counts closed, disarmed (main stream,
        eager), after whatever the side stream still holds (an aborted step's opening fills must not land on this
        step's flags)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)
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
        """Layer l's publish and gate (after its at-hand group)."""
        n = 0 if guess is None else guess.numel()
        assert n <= self.G, (n, self.G)
        g = counts if guess is None else guess.reshape(-1)
        if not self.cuda:                                      # the drain runs right here (module doc)
            row = self._np[l * self.width: (l + 1) * self.width]
            row[:self.E] = counts.numpy()
            row[self.E:self.E + n] = g.numpy()[:n]
            row[self.E + n] = int(((counts > 0) & (at_row == -1)).sum())
            self._np[self.L * self.width + l] = self.tag
            return
        from betelgeuse.kernels import triton_gate
        triton_gate.publish(counts, at_row, g, self.flags[l:l + 1], self.anchor, self.base_off + l * self.width, n)
        triton_gate.gate(self.flags[l:l + 1], self.err[l:l + 1], self.spins[l:l + 1], self.arm, self.anchor,
                         self.base_off + self.L * self.width + l, self.tag_dev, self.MAX_ITER)

    # ---- the host's drain --------------------------------------------------------------------------------
    def wait(self, l: int, shape: tuple | None) -> tuple[np.ndarray, Marks | None, int]:
        """Layer l's marker polled -> (rows per expert [E], the guesses' Marks (worker/guess.py) or None, misses);
        shape: the published guess's (T, D, k) or None."""
        mark = self.L * self.width + l
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
        n = 0 if shape is None else int(np.prod(shape))
        counts, misses = row[:self.E].copy(), int(row[self.E + n])
        if shape is None:
            return counts, None, misses
        return counts, Marks.from_ids(row[self.E:self.E + n].reshape(shape), self.E), misses

    def stream(self):
        """The side stream the misses' work runs on (a no-op context on the CPU)."""
        return torch.cuda.stream(self.side) if self.cuda else _Null()

    def open(self, l: int, armed: bool, misses: int):
        """Layer l's misses are enqueued on the side stream: an armed gate opens after them (its flag; with no miss
        publish opened it), a disarmed one passed already and the main stream waits for the side stream instead."""
        self.pos.opened = l
        self.pos.opened_at[l] = round(time.perf_counter() - self.pos.t0, 4)
        if not self.cuda:
            return
        if not armed:
            torch.cuda.current_stream().wait_stream(self.side)
        elif misses:
            with torch.cuda.stream(self.side):
                self.flags[l:l + 1].fill_(1)

    def abort(self):
        """A failure mid-drain: every gate opens (the step's output is discarded), so the device finishes."""
        if self.cuda:
            with torch.cuda.stream(self.side):
                self.flags.fill_(1)

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
        marks = self._np[self.L * self.width:].tolist()
        txt = (f"tag {self.tag}; armed layers {p.armed}, disarmed {p.disarmed}; host: last marker seen "
               f"{p.seen}, last layer opened {p.opened}, waited {p.waited_s:.3f} s for markers (by layer: "
               f"{p.waits}), opened at (s after begin, by layer: {p.opened_at}); markers "
               f"{[m == self.tag for m in marks]}")
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
        # layer -> when its misses were enqueued and its gate opened, seconds after the step's begin: a gate that gave
        # up although the host opened it long before (a spin lasts ~seconds) points at the side stream's work not
        # running beside the spinning gate (its stream sharing the main stream's hardware queue), a late one at a
        # host that was blocked
        self.opened_at: dict = {}
        self.t0 = time.perf_counter()
        self.seen = self.opened = -1
        self.waited_s = 0.0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
