"""What a pass reports (PassStats, one LayerStats per layer) and the clock that measures it (PassClock).

The host's time in a pass splits into work and waiting: `blocked` counts the waits (routing syncs, disk reads,
bank copies, the end-of-pass sync), so host_s = seconds - blocked_s is what the Python side itself cost. The host
time splits further into the store messages (`store_rpc`: per kind, messages sent and the seconds the host spent
sending them and waiting for their replies, replies that wait on no disk), the per-layer expert step's own host
time (`moe_host_s`: MoEStep.partial's Python, copies and launches) and the rest (`other_host_s`: the dense part,
graph replays, pass bookkeeping). A wait for expert bytes the store is still reading from disk (a Load stream's next
message) is blocked time, counted apart as `store_wait_s`. So is the wait for the reply of a pass-boundary message
(BeginPass / EndPass, `store_reply_wait_s`): the store applies or plans a consolidation before it answers (EndPass's
plan_moves was ~6 ms at ds4-flash's shapes, issue 21) while the worker's thread sleeps in the call; only the
thread's own CPU time in the call (building the request, the client's bookkeeping) is the message's host time. Per-layer
compute and copy times are CUDA events when the bench turns `timing` on (read once, after the pass's end sync), CPU
wall times otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from betelgeuse.kernels.streams import current_stream
from betelgeuse.worker.engram_feed import EngramStats

@dataclass(slots=True)
class LayerStats:
    attn_s: float = 0.0         # attention + routing, wall (host enqueue time; the GPU may still be busy)
    moe_s: float = 0.0          # wall from routing to the last expert group enqueued
    disk_wait_s: float = 0.0    # blocked waiting for the store to land an expert
    copy_ms: float = 0.0        # host->device copy time (CUDA events on the copy stream; CPU: memcpy wall)
    compute_ms: float = 0.0     # MoE compute time of the layer (CUDA events when timing; CPU: wall)
    copy_events: list = field(default_factory=list, repr=False)   # per bank copy: (start, end) CUDA events or CPU ms
    vram: int = 0
    host: int = 0
    disk: int = 0
    synced: bool = True         # the layer needed the host sync (not wholly VRAM-resident)
    groups: int = 0             # expert launch groups


@dataclass(slots=True)
class PassStats:
    kind: str                   # "prefill" | "decode"
    schedule: str
    n_tokens: int
    seconds: float = 0.0
    reads: dict = field(default_factory=lambda: {"vram": 0, "host": 0, "disk": 0})
    disk_bytes: int = 0         # bytes read from disk for experts this pass used (expert payload bytes)
    disk_wait_s: float = 0.0
    h2d_bytes: int = 0          # bytes the copy engine moved host -> device (ring banks, VRAM fills, flex copies)
    in_place_bytes: int = 0     # host-tier expert bytes the kernels read in place over PCIe (slot bytes x the times
                                # a launch reads them: MoEKernels.weight_reads; worker/at_hand.py)
    flex_hits: int = 0          # of reads["vram"]: experts computed from a flex cache copy (worker/flex_cache.py)
    prefetched: int = 0         # experts whose disk read was issued ahead, before they were asked for
    # decode's guesses of the next layer's experts (worker/guess.py): guessed experts on disk, those the layer then
    # used, the disk experts of the guessed layers, bytes of the reads started for guesses, and of those not used
    guessed: int = 0
    guess_hits: int = 0
    guess_disk: int = 0
    guess_bytes: int = 0
    guess_wasted_bytes: int = 0
    guess_held: int = 0         # guessed disk experts not read ahead: their depth's hit rate below the budget
    # decode's copies ahead (prefetch_host, worker/moe_step.py): the next layer's guessed host-tier experts the step
    # banks, copied into a ring bank at layer l; of them those layer l+1 then used (found on the GPU, not copied
    # after its routing); the bytes copied ahead (part of h2d_bytes; those not used are the guesses' waste)
    host_guessed: int = 0
    host_guess_hits: int = 0
    host_guess_bytes: int = 0
    # decode's reads of the step's hash-routed layers' disk experts (deepseek4: chosen by token id), asked at the
    # step's start, before layer 0's attention (MoEStep.hash_ahead): experts asked, reads the store started (its
    # read-ahead share of the staging slots), their bytes, and of those asked the ones the layer then used
    hash_ahead: int = 0
    hash_ahead_started: int = 0
    hash_ahead_bytes: int = 0
    hash_ahead_hits: int = 0
    # (time.monotonic() s, layer) of each decode message that asks the store for disk reads, as it is sent: a layer's
    # load or read ahead of guesses (MoEStep._send_loads), -1 the step's hash ahead. The bench lays them over the
    # store's idle gaps: the message that ended a gap names what the disk waited for (services/bench/disk_idle.py)
    sends: list = field(default_factory=list)
    # the chain before such a message (issue 21: the disk idles from a layer's last read to the next layer's load),
    # on the same clock: (time, layer) of each layer's routing on the host (after its sync; MoEStep._partial) and of
    # each layer's last disk expert handed to the worker (MoEStep._disk_groups / _disk_table)
    routed: list = field(default_factory=list)
    landed: list = field(default_factory=list)
    # the `gpu` link of that chain cut at the device's steps (issue 21), only when the bench turns PassClock.marks on:
    # (time.monotonic() s, layer, name) per mark, name "copy0" / "copy" (a disk batch's ring-bank or flex copy starts
    # / ends on the copy stream), "group" (its expert group ends), "attn" (the layer's attention ends: the dense part
    # up to the MoE input), "route" (its routing and the copies of the routing's counts to the host end, before the
    # host's sync). CUDA: events read after the pass's end sync, put on the host clock by one anchor event recorded
    # on the idle device (PassClock.finish); CPU: host stamps (the CPU runs each op as it is called)
    gpu_marks: list = field(default_factory=list)
    # decode's disk batches copied and grouped because the next disk expert had not landed yet (engine.disk_flush_early,
    # MoEStep._disk_groups): each one a group more than batching to the layer's last would have run
    disk_flushes: int = 0
    # decode's landed disk experts' copies issued before the layer's last landed (engine.disk_copy_early, MoEStep.
    # _copy_ahead): each one a _foreach_copy_ (or bank copy) more, no group more
    disk_copies_early: int = 0
    vram_filled: int = 0        # experts copied into VRAM hot slots at the start of the pass
    fill_disk: int = 0          # of those, read from disk (no host backing copy): fills, not uses (reads counts uses)
    open_s: float = 0.0         # opening the store pass: BeginPass (it waits for a pending consolidation) + VRAM fills
    host_s: float = 0.0         # wall minus the time the host was blocked (syncs on the GPU, the disk)
    blocked_s: float = 0.0      # host blocked: routing syncs, waits for disk reads and copies, the end sync
    store_calls: int = 0        # messages to the store during this pass (round trips and one-way sends)
    store_rpc: dict = field(default_factory=dict)   # message kind -> [messages, host seconds in them] (module doc)
    store_wait_s: float = 0.0   # blocked waiting for the store to deliver expert bytes (part of blocked_s)
    # of those waits and the pass-boundary replies: how many there were, and in how many the thread slept (was off
    # its CPU >= PassClock.SLEPT_S of the wait): each sleep is a wake after it (issue 21: is a decode's host time, which
    # grows with its waits at the same work, a core woken cold?). The spin reader's waits stay on the CPU: no sleeps
    store_waits: int = 0
    store_sleeps: int = 0
    store_reply_wait_s: float = 0.0   # blocked waiting for a pass-boundary message's reply (part of blocked_s;
                                      # PassClock.reply: the store's work on it, a consolidation applied or planned)
    moe_host_s: float = 0.0     # host time in the layers' expert steps, outside store messages and blocked waits
    layers: list = field(default_factory=list)
    engram: EngramStats | None = None   # deepseek41: Engram rows of this pass (worker/engram_feed.py)

    @property
    def tok_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def store_s(self) -> float:
        """Host seconds in store messages (not blocked: sends, and replies that wait on no disk)."""
        return sum(s for _, s in self.store_rpc.values())

    @property
    def other_host_s(self) -> float:
        """Host time that is neither a store message nor the layers' expert steps (the dense part, graphs, ...)."""
        return max(0.0, self.host_s - self.store_s - self.moe_host_s)

    @property
    def disk_share(self) -> float:
        n = sum(self.reads.values())
        return self.reads["disk"] / n if n else 0.0

    @property
    def applications(self) -> int:
        """Expert applications (one expert applied to its rows of one layer)."""
        return sum(self.reads.values())


class PassClock:
    """One pass's blocked time and per-layer compute timing (begin() starts a pass, finish() fills its stats)."""

    __slots__ = ("device", "is_cuda", "timing", "marks", "blocked", "store_wait", "reply_wait", "store", "store_s",
                 "waits", "sleeps", "_events", "_marks", "_t0")

    SLEPT_S = 100e-6                    # a wait off the CPU this long or longer counts as a sleep (PassStats.store_sleeps)

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.timing = False             # per-layer CUDA events (the bench turns it on)
        self.marks = False              # PassStats.gpu_marks (the bench turns it on; callers test it: nil cost off)
        self.blocked = 0.0              # seconds the host waited in this pass
        self.store_wait = 0.0           # of them: waits for the store to deliver expert bytes
        self.reply_wait = 0.0           # of them: waits for a pass-boundary message's reply (reply())
        self.store: dict = {}           # store message kind -> [messages, host seconds] in this pass
        self.store_s = 0.0              # their seconds summed (MoEStep takes differences of it)
        self.waits = self.sleeps = 0    # waits for the store's bytes and replies; those the thread slept in
        self._events: list = []         # (LayerStats, start, end) CUDA events of this pass
        self._marks: list = []          # (CUDA event or monotonic s, layer, name) of this pass (PassStats.gpu_marks)
        self._t0 = 0.0

    def begin(self):
        self.blocked = self.store_wait = self.reply_wait = self.store_s = 0.0
        self.waits = self.sleeps = 0
        self.store = {}
        self._events = []
        self._marks = []
        self._t0 = time.perf_counter()

    def wait(self, fn, *args):
        """fn(*args), the time it took counted as blocked (a sync, a wait for the disk or a copy)."""
        t = time.perf_counter()
        out = fn(*args)
        self.blocked += time.perf_counter() - t
        return out

    def wait_store(self, fn, *args):
        """fn(*args), a wait for expert bytes the store is delivering: blocked (wait), and counted as store_wait."""
        t, c = time.perf_counter(), time.thread_time()  # wait's body, inline (a landed expert's: issue 21)
        out = fn(*args)
        dt = time.perf_counter() - t
        self.blocked += dt
        self.store_wait += dt
        self.waits += 1
        if dt - (time.thread_time() - c) >= self.SLEPT_S:
            self.sleeps += 1
        return out

    def message(self, kind: str, fn, *args):
        """fn(*args), one message to the store of this kind: counted, its host time summed (host, not blocked)."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add_message(kind, time.perf_counter() - t, 1)

    def reply(self, kind: str, fn, *args):
        """fn(*args), one message to the store whose reply waits on the store's own work (BeginPass applies a landed
        consolidation, EndPass plans the next one: milliseconds, issue 21): counted as a message of this kind with
        the calling thread's CPU time in it as its host time; the rest of its wall, the thread asleep until the store
        answers, is blocked (reply_wait), as a wait for the store's expert bytes is (wait_store). On CUDA a wait for
        the GIL inside the call (the session stream's threads) counts as blocked too; the main thread holds no GIL
        while it waits for the reply, so that is the others' work, not this call's."""
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            wall = time.perf_counter() - t
            cpu = min(wall, time.thread_time() - c)     # two clocks: the CPU time may read a hair over the wall
            self.blocked += wall - cpu
            self.reply_wait += wall - cpu
            self.waits += 1
            self.sleeps += wall - cpu >= self.SLEPT_S
            self.add_message(kind, cpu, 1)

    def add_message(self, kind: str, seconds: float, n: int = 0):
        rec = self.store.setdefault(kind, [0, 0.0])
        rec[0] += n
        rec[1] += seconds
        self.store_s += seconds

    def sync(self):
        """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def copy_timing(self, ls: LayerStats) -> list | None:
        """Where bank copies record their timing: the layer's copy_events (CPU always; CUDA when timing), or None."""
        return ls.copy_events if self.timing or self.marks or not self.is_cuda else None

    # ---- PassStats.gpu_marks (only while `marks`: callers test it first) ---------------------------------
    def mark(self, name: str, layer: int):
        """A point of the device's work as enqueued so far on the current stream (CUDA: an event; not inside a graph
        capture, where an event records no time) or now (CPU: the op ran when called)."""
        if not self.is_cuda:
            self._marks.append((time.monotonic(), layer, name))
        elif not torch.cuda.is_current_stream_capturing():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(current_stream(None))
            self._marks.append((ev, layer, name))

    def mark_copy(self, layer: int, timing: list | None, t0: float):
        """A disk batch's copy as a mark pair: CUDA its (start, end) events (the last of `timing`, bank_copy's), the
        CPU the copy's wall (t0: monotonic s before it, now its end)."""
        if not self.is_cuda:
            self._marks += [(t0, layer, "copy0"), (time.monotonic(), layer, "copy")]
        elif timing and not isinstance(timing[-1], float):
            self._marks += [(timing[-1][0], layer, "copy0"), (timing[-1][1], layer, "copy")]

    # ---- the MoE compute of a layer ------------------------------------------------------------------
    def layer_start(self):
        if not self.timing:
            return time.perf_counter() if not self.is_cuda else None
        if self.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(current_stream(None))            # = record(): the current stream (kernels/streams.py)
            return ev
        return time.perf_counter()

    def layer_end(self, ev, ls: LayerStats):
        if ev is None:
            return
        if isinstance(ev, float):
            ls.compute_ms += (time.perf_counter() - ev) * 1e3
            return
        ev1 = torch.cuda.Event(enable_timing=True)
        ev1.record(current_stream(None))
        self._events.append((ls, ev, ev1))

    def abandon(self):
        self._events = []
        self._marks = []

    def finish(self, stats: PassStats):
        """After the pass's end sync: its wall and blocked time, the layers' compute and copy times."""
        stats.seconds = time.perf_counter() - self._t0
        stats.blocked_s = self.blocked
        stats.host_s = max(0.0, stats.seconds - self.blocked)
        stats.store_wait_s = self.store_wait
        stats.store_reply_wait_s = self.reply_wait
        stats.store_waits, stats.store_sleeps = self.waits, self.sleeps
        stats.store_rpc = {k: list(v) for k, v in self.store.items()}
        for ls, ev0, ev1 in self._events:
            ls.compute_ms += ev0.elapsed_time(ev1)
        self._events = []
        if self._marks:
            stats.gpu_marks = self._host_marks()
            self._marks = []
        for ls in stats.layers:
            if ls.copy_events and not isinstance(ls.copy_events[0], float):
                ls.copy_ms = sum(ev0.elapsed_time(ev1) for ev0, ev1 in ls.copy_events)
            else:
                ls.copy_ms = sum(ls.copy_events)
            ls.copy_events = []

    def _host_marks(self) -> list:
        """This pass's marks on the host clock (monotonic s). CUDA: the device is synced (the pass's end sync; once
        more here, only with marks on), so an anchor event recorded now runs as it is enqueued: its host time is the
        middle of the record call, and each mark's is that less the event time between them (>= 0: marks come first)."""
        if not self.is_cuda:
            return list(self._marks)
        self.sync()
        anchor = torch.cuda.Event(enable_timing=True)
        t0 = time.monotonic()
        anchor.record(current_stream(None))
        t_a = (t0 + time.monotonic()) / 2
        anchor.synchronize()
        return [(t_a - ev.elapsed_time(anchor) * 1e-3, layer, name) for ev, layer, name in self._marks]
