"""The physical ceilings a pass is judged against, measured in the same run as the passes.

  disk     O_DIRECT read bandwidth of the model file with the store's own reader (ExpertReader,
           threads and request size from EngineConfig), reading whole experts (3 ranges each) into a
           memfd arena, as the store does. The device's disk is noisy (DESIGN.md §6), so the harness
           samples it again before every case and bounds each pass with the latest sample.
  h2d      host->device bandwidth from a memfd arena registered with cudaHostRegister (the worker's
           real path); on the CPU, memcpy bandwidth out of the same kind of arena.
  compute  one expert's dequantize + SwiGLU matmuls on the compute device, through the engine's own
           ExpertCache.weights and layers.run_expert, at 1 row and at the sub-batch size.

A pass's bound is max(disk bytes / disk bandwidth, h2d bytes / copy bandwidth, expert compute):
the time the pass could not beat even with perfect overlap. achieved = bound / actual (<= ~1).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.model.layers import ExpertWork, run_expert
from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned
from betelgeuse.store.reader import PAGE, ExpertReader

MiB = 1 << 20


@dataclass(slots=True)
class DiskSample:
    bytes: int          # device bytes read (4 KiB rounding included)
    seconds: float      # wall
    mode: str           # "direct" | "buffered" (O_DIRECT refused, e.g. tmpfs/overlay)
    at_s: float         # seconds since the run started

    @property
    def bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Ceilings:
    h2d_bps: float = 0.0            # bytes/s host->device (CPU: memcpy)
    h2d_pinned: bool = False        # the arena was registered with CUDA
    deq_s: float = 0.0              # seconds to dequantize one expert (gate, up, down)
    mm_s: dict = field(default_factory=dict)   # rows -> seconds of one SwiGLU over `rows` tokens (weights ready)
    sub_batch: int = 16
    disk: list = field(default_factory=list)   # [DiskSample], in run order

    @property
    def disk_bps(self) -> float:
        """The latest disk sample (the one interleaved with the passes that follow it)."""
        return self.disk[-1].bps if self.disk else 0.0

    def expert_s(self, rows: float) -> float:
        """Seconds of one expert load applied to `rows` tokens: dequantize once, then ceil(rows/sb)
        sub-batches; a partial sub-batch is interpolated linearly between 1 row and sb rows."""
        sb = self.sub_batch
        t1, tsb = self.mm_s.get(1, 0.0), self.mm_s.get(sb, 0.0)
        full, rest = divmod(max(rows, 1.0), sb)
        part = 0.0 if rest == 0 else t1 + (tsb - t1) * (rest - 1) / max(sb - 1, 1)
        return self.deq_s + full * tsb + part

    def to_json(self) -> dict:
        d = asdict(self)
        d["mm_s"] = {str(k): v for k, v in self.mm_s.items()}
        d["disk"] = [dict(asdict(s), bps=s.bps) for s in self.disk]
        d["disk_bps"] = self.disk_bps
        return d


def measure_disk(f: GGUFModelFile, threads: int, request_bytes: int, max_bytes: int, max_seconds: float,
                 seed: int, t0: float, arena_bytes: int = 256 * MiB) -> DiskSample:
    """Read random whole experts of `f` into a memfd arena until max_bytes or max_seconds."""
    c = f.config
    rng = np.random.default_rng(seed)
    slot = -(-(sum(p.nbytes for p in f.expert_parts(0, 0)) + 3 * 2 * PAGE) // PAGE) * PAGE
    per_batch = max(1, min(arena_bytes // slot, max(1, max_bytes // slot)))
    arena = Arena.create(per_batch * slot, name="betelgeuse-bench-disk")
    reader = ExpertReader(f.path, arena, threads=threads, request_bytes=request_bytes)
    try:
        start = time.perf_counter()
        while True:
            ranges = []
            for b in range(per_batch):
                layer, expert = int(rng.integers(c.n_layer)), int(rng.integers(c.n_expert))
                dest = b * slot
                for p in f.expert_parts(layer, expert):     # each part rounded out to 4 KiB, as the store does
                    ranges.append((p.offset, p.nbytes, dest))
                    dest += -(-(p.offset % PAGE + p.nbytes) // PAGE) * PAGE
            reader.read(ranges, priority=0).result()
            dt = time.perf_counter() - start
            if reader.stats.bytes_read >= max_bytes or dt >= max_seconds:
                break
        return DiskSample(int(reader.stats.bytes_read), dt, reader.mode, start - t0)
    finally:
        reader.close()
        arena.close()


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_h2d(device: torch.device, nbytes: int, reps: int) -> tuple[float, bool]:
    """bytes/s of copying a memfd arena to `device` (registered as pinned on CUDA; CPU: memcpy)."""
    arena = Arena.create(nbytes, name="betelgeuse-bench-h2d")
    pinned = False
    try:
        src = arena.torch(0, arena.nbytes)
        if device.type == "cuda":
            pinned = register_pinned(arena)
        dst = torch.empty(arena.nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=pinned)                 # warm-up (first touch, TLBs)
        _sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=pinned)
        _sync(device)
        dt = time.perf_counter() - t
        del dst, src
        return reps * arena.nbytes / dt, pinned
    finally:
        if pinned:
            unregister_pinned(arena)
        arena.close()


def _best(fn, device: torch.device, reps: int, rounds: int) -> float:
    """Seconds per call: the best of `rounds` rounds of `reps` calls (one sync per round). A ceiling is
    the best rate the hardware gives; other processes' threads only ever make a round slower."""
    fn()                                                        # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def measure_compute(cache, f: GGUFModelFile, sub_batch: int, reps: int, rounds: int = 5,
                    layer: int = 0, expert: int = 0) -> tuple[float, dict]:
    """(dequantize seconds, {rows: SwiGLU seconds}) for one expert, on the cache's device and dtype.
    The expert's raw bytes are placed in ring buffer 0 exactly where a slot holds them."""
    device, dtype = cache.device, cache.dtype
    slot = cache.ring[0]
    for part, meta in zip(f.expert_parts(layer, expert), cache.parts[layer][expert]):
        raw = np.fromfile(f.path, dtype=np.uint8, count=part.nbytes, offset=part.offset)
        slot[meta.start: meta.start + meta.nbytes].copy_(torch.from_numpy(raw))
    k, H = f.config.n_expert_used, f.config.n_embd
    deq = _best(lambda: cache.weights(slot, layer, expert), device, reps, rounds)
    w = cache.weights(slot, layer, expert)
    mm = {}
    gen = torch.Generator().manual_seed(0)
    for rows in sorted({1, sub_batch}):
        h = torch.randn(rows, H, generator=gen).to(device=device, dtype=dtype)
        y = torch.zeros(rows, k, H, dtype=dtype, device=device)
        work = ExpertWork(expert, torch.arange(rows), torch.zeros(rows, dtype=torch.long))
        mm[rows] = _best(lambda: run_expert(h, y, work, w, sub_batch), device, reps, rounds)
    return deq, mm


def pass_bound(ceil: Ceilings, disk_bps: float, n_tokens: int, loads: int, disk_bytes: int, h2d_bytes: int,
               n_layer: int, k: int, seconds: float) -> dict:
    """The pass's physical bound (seconds) and which resource sets it. disk_bps: the disk sample taken
    just before the pass's case. Compute is a lower bound: `loads` expert loads share
    n_tokens * k * n_layer rows, each load at least one (sub-)batch."""
    disk_s = disk_bytes / disk_bps if disk_bps > 0 else 0.0
    h2d_s = h2d_bytes / ceil.h2d_bps if ceil.h2d_bps > 0 else 0.0
    compute_s = loads * ceil.expert_s(n_tokens * k * n_layer / loads) if loads else 0.0
    parts = {"disk": disk_s, "h2d": h2d_s, "compute": compute_s}
    limiter = max(parts, key=parts.get)
    bound = parts[limiter]
    return {"disk_s": disk_s, "h2d_s": h2d_s, "compute_s": compute_s, "bound_s": bound, "limiter": limiter,
            "achieved": bound / seconds if seconds > 0 else 0.0, "disk_bps": disk_bps, "h2d_bps": ceil.h2d_bps}
