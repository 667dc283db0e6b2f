"""The physical ceilings a pass is judged against, measured in the same run as the passes.

  disk     O_DIRECT read bandwidth of the model file with the store's own reader (ExpertReader,
           threads and request size from EngineConfig), reading whole experts (3 ranges each) into a
           memfd arena, as the store does, in both ways the store's loads read (measure_disk's patterns: random
           batches of experts waited for, as decode's few per layer; whole layers in file order with the queue kept
           full, as a prefill's): a virtio disk reads long neighbouring runs fed continuously faster than random
           batches with a barrier, so every disk bound uses the faster of the two (disk_rate: max(random, layer)),
           and no pass beats its bound by its access pattern. The device's disk is noisy (DESIGN.md §6), so the harness
           samples it right before AND right after every case, and a pass is bounded by the faster of the two or
           by the rate the pass's own reads ran at (its disk bytes x reader threads / the threads' summed time
           in preadv, from the store's stats: at least the rate the disk reached while the pass read), whichever
           is fastest (case_disk_rate): a bound must never be beaten.
  h2d      host->device bandwidth from a memfd arena registered with cudaHostRegister (the worker's
           real path); on the CPU, memcpy bandwidth out of the same kind of arena.
  compute  expert applications through the engine's own kernels (runner.kern), a bank of experts in one
           launch group at 1, 16 and 64 rows per expert, with the HBM bytes/s they reach, per expert type of
           the model (each gate-up/down type pair; the bound uses their mean over the layers).

A pass's bound is max(disk bytes / disk bandwidth, h2d bytes / copy bandwidth, expert compute):
the time the pass could not beat even with perfect overlap. achieved = bound / actual (<= ~1). An achieved fraction
above BOUND_WRONG is a bug in the bound, not a figure: the pass says bound_wrong and the report prints that instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.arena import Arena, register_pinned, unregister_pinned
from betelgeuse.store.reader import PAGE, ExpertReader
# case_disk_rate lives beside disk_rate (both suites' bounds use it; serve_meter imports no torch): C.case_disk_rate
from services.bench.serve_meter import BOUND_WRONG, DISK_PATTERNS, case_disk_rate, disk_rate  # noqa: F401

MiB = 1 << 20


@dataclass(slots=True)
class DiskSample:
    bytes: int          # device bytes read (4 KiB rounding included)
    seconds: float      # wall
    mode: str           # "direct" | "buffered" (O_DIRECT refused, e.g. tmpfs/overlay)
    at_s: float         # seconds since the run started
    pattern: str = "random"     # measure_disk's DISK_PATTERNS
    queue: int = 1      # experts in flight: random, one batch of them waited for; layer, reads kept outstanding
    busy_s: float = 0.0     # the reader threads' summed seconds inside preadv (ReaderStats.busy_seconds)
    active_s: float = 0.0   # wall seconds with >= 1 preadv in flight (ReaderStats.active_seconds)

    @property
    def bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def depth(self) -> float:
        """Mean preadv calls in flight while the disk was busy: busy_s / active_s (1.0: one at a time)."""
        return self.busy_s / self.active_s if self.active_s > 0 else 0.0

    def to_json(self) -> dict:
        return dict(asdict(self), bps=self.bps, depth=self.depth)


@dataclass(slots=True)
class Ceilings:
    h2d_bps: float = 0.0            # bytes/s host->device (CPU: memcpy)
    h2d_pinned: bool = False        # the arena was registered with CUDA
    deq_s: float = 0.0              # (dequantization is fused into the kernels: 0)
    mm_s: dict = field(default_factory=dict)   # rows -> seconds of one expert application to `rows` rows
    hbm_bps: dict = field(default_factory=dict)  # rows -> expert bytes/s those applications read
    # per expert type ("Q4_K/Q6_K": gate-up / down GGML types of a layer): {"layers", "backend", "mm_s", "hbm_bps"};
    # mm_s / hbm_bps above are their means weighted by the layers of each type
    by_type: dict = field(default_factory=dict)
    sub_batch: int = 16
    disk: list = field(default_factory=list)   # [DiskSample], in run order
    # the random pattern at fixed experts in flight (bench --disk-depths; measure_disk_depths): [DiskSample], by queue
    disk_depths: list = field(default_factory=list)

    @property
    def disk_bps(self) -> float:
        """The latest disk sample of each pattern (those interleaved with the passes that follow), the faster
        (disk_rate)."""
        return disk_rate({s.pattern: s.bps for s in self.disk})[0]

    def expert_s(self, rows: float) -> float:
        """Seconds of one expert application to `rows` rows: linear between the measured row counts
        (1, 16, 64), and beyond the last one linear in the rows at the last point's rate."""
        pts = sorted(self.mm_s.items())
        if not pts:
            return 0.0
        rows = max(float(rows), 1.0)
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        r1, t1 = pts[-1]
        return t1 * rows / r1

    def to_json(self) -> dict:
        d = asdict(self)
        d["mm_s"] = {str(k): v for k, v in self.mm_s.items()}
        d["hbm_bps"] = {str(k): v for k, v in self.hbm_bps.items()}
        d["by_type"] = {t: dict(v, mm_s={str(k): x for k, x in v["mm_s"].items()},
                                hbm_bps={str(k): x for k, x in v["hbm_bps"].items()}) for t, v in self.by_type.items()}
        d["disk"] = [s.to_json() for s in self.disk]
        d["disk_depths"] = [s.to_json() for s in self.disk_depths]
        d["disk_bps"] = self.disk_bps
        return d


def _slot_ranges(f: GGUFModelFile, layer: int, expert: int, dest: int) -> list[tuple[int, int, int]]:
    """One expert's (gate, up, down) ranges into an arena slot at `dest`, each part rounded out to 4 KiB as the store
    lays them."""
    ranges = []
    for p in f.expert_parts(layer, expert):
        ranges.append((p.offset, p.nbytes, dest))
        dest += -(-(p.offset % PAGE + p.nbytes) // PAGE) * PAGE
    return ranges


def measure_disk(f: GGUFModelFile, threads: int, request_bytes: int, max_bytes: int, max_seconds: float,
                 seed: int, t0: float, arena_bytes: int = 256 * MiB, pattern: str = "random",
                 queue: int | None = None) -> DiskSample:
    """Read whole experts of `f` into a memfd arena with the store's reader until max_bytes or max_seconds, in one of
    the two ways the store's loads read (DISK_PATTERNS):

      random  batches of random whole experts (layer and expert drawn at random), each batch one read waited for
              before the next: a decode step's few missing experts per layer
      layer   whole layers, layer after layer from a random first layer (wrapping, each layer once at most), each
              layer's experts in file order, one read per expert (as the store issues a load), the queue kept full:
              the next expert is submitted as soon as any read completes, up to the arena's slots outstanding
              (256 MiB: ~50 experts of the bench geometry, several per reader thread; at least 2), as many layers'
              loads feed the reader in a prefill. A GGUF holds a layer's experts contiguous per tensor (gate, up,
              down each [E, ...]), so this reads three long runs per layer; a virtio disk reads them faster than
              random batches (gpu-run30-serve: a 512-token prefill read 2.16 GB/s against 1.64 sampled random).

    queue (random only): exactly this many experts per batch instead of the arena's slots (the depth curve,
    measure_disk_depths). The reader is O_DIRECT where the filesystem honours it (`mode`), and each sample draws its
    own experts or first layer from `seed`, so neither the page cache nor an earlier sample's bytes help."""
    assert pattern in DISK_PATTERNS and (queue is None or (pattern == "random" and queue >= 1)), (pattern, queue)
    c = f.config
    rng = np.random.default_rng(seed)
    slot = -(-(max(f.expert_nbytes(layer) for layer in range(c.n_layer)) + 3 * 2 * PAGE) // PAGE) * PAGE
    if pattern == "random":         # experts per batch
        per_batch = queue or max(1, min(arena_bytes // slot, max(1, max_bytes // slot)))
    else:   # reads kept outstanding: the arena's slots (at least 2), at most the experts the budget covers
        per_batch = max(2, min(arena_bytes // slot, -(-max_bytes // min(map(f.expert_nbytes, range(c.n_layer))))))
    arena = Arena.create(per_batch * slot, name="betelgeuse-bench-disk")
    reader = ExpertReader(f.path, arena, threads=threads, request_bytes=request_bytes)
    try:
        start = time.perf_counter()
        if pattern == "random":
            while True:
                ranges = []
                for b in range(per_batch):
                    layer, expert = int(rng.integers(c.n_layer)), int(rng.integers(c.n_expert))
                    ranges += _slot_ranges(f, layer, expert, b * slot)
                reader.read(ranges, priority=0).result()
                dt = time.perf_counter() - start
                if reader.stats.bytes_read >= max_bytes or dt >= max_seconds:
                    break
        else:
            first = int(rng.integers(c.n_layer))        # each layer once at most: no byte is read twice
            order = (((first + i) % c.n_layer, e) for i in range(c.n_layer) for e in range(c.n_expert))
            free, pending, asked, nxt = list(range(per_batch)), {}, 0, next(order, None)
            while True:
                # fill every free slot, then wait for the first read to land: the reader's queue never runs dry
                while free and nxt and asked < max_bytes and time.perf_counter() - start < max_seconds:
                    (layer, expert), nxt = nxt, None
                    nxt = next(order, None)
                    b = free.pop()
                    pending[reader.read(_slot_ranges(f, layer, expert, b * slot), priority=0)] = b
                    asked += f.expert_nbytes(layer)
                if not pending:
                    break
                done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    fut.result()
                    free.append(pending.pop(fut))
            dt = time.perf_counter() - start
        return DiskSample(int(reader.stats.bytes_read), dt, reader.mode, start - t0, pattern, per_batch,
                          reader.stats.busy_seconds, reader.active_seconds())
    finally:
        reader.close()
        arena.close()


def measure_disk_rates(f: GGUFModelFile | str, threads: int, request_bytes: int, max_bytes: int, max_seconds: float,
                       seed: int, t0: float) -> dict:
    """Both patterns (measure_disk), one after the other, each with the whole byte / time budget: {"random": sample,
    "layer": sample} (each a DiskSample's fields with its bps) and the rate every bound uses, disk_rate's: "bps" (the
    faster), "pattern" (which), "mode", "bytes" / "seconds" (both samples together). f: an open model file, or the
    path of one (opened and closed here)."""
    if not isinstance(f, GGUFModelFile):
        g = GGUFModelFile.open(f)
        try:
            return measure_disk_rates(g, threads, request_bytes, max_bytes, max_seconds, seed, t0)
        finally:
            g.close()
    out = {}
    for i, pattern in enumerate(DISK_PATTERNS):
        s = measure_disk(f, threads, request_bytes, max_bytes, max_seconds, seed + 7919 * i, t0, pattern=pattern)
        out[pattern] = s.to_json()
    bps, pattern = disk_rate({p: out[p]["bps"] for p in DISK_PATTERNS})
    modes = {out[p]["mode"] for p in DISK_PATTERNS}
    return dict(out, bps=bps, pattern=pattern, mode=modes.pop() if len(modes) == 1 else "mixed",
                bytes=sum(out[p]["bytes"] for p in DISK_PATTERNS), seconds=sum(out[p]["seconds"] for p in DISK_PATTERNS))


def measure_disk_depths(f: GGUFModelFile, threads: int, request_bytes: int, max_bytes: int, max_seconds: float,
                        seed: int, t0: float, queues: tuple) -> list[DiskSample]:
    """The disk's depth curve: the random pattern (measure_disk) at exactly N experts in flight, for each N of queues,
    each with the whole byte / time budget and a seed of its own -> one DiskSample per N (bps, and depth: the preadv
    calls in flight while busy). No bound uses it: it shows the rate at a decode's own depth beside the bound's."""
    return [measure_disk(f, threads, request_bytes, max_bytes, max_seconds, seed + 104729 * i, t0, queue=n)
            for i, n in enumerate(queues)]


def disk_split(bound: dict, run: dict, sample: dict | None = None) -> dict | None:
    """A pass's or decode run's disk achieved (pass_bound's disk_s / the run's seconds: its achieved where disk is the
    limiter) split into factors that multiply back to it, from the store's reader counters over the run (store_delta):

      busy_share    store_disk_active_s / seconds: the share of the run with >= 1 preadv in flight
      busy_rate     (store_disk_bytes / store_disk_active_s) / disk_bps: the rate while busy over the bound's rate
      needed_share  disk_bytes / store_disk_bytes: the bytes the bound counts (the expert payload the run loaded from
                    disk) over the device bytes read (unused read-ahead, 4 KiB rounding, anything else read)

    and beside them depth = store_disk_busy_s / store_disk_active_s (preadv calls in flight while busy) and the
    sample's (`sample`: the DiskSample record, to_json, the bound's rate came from; None: the run's own reads).
    None where the run read nothing."""
    busy, active, read = run.get("store_disk_busy_s", 0.0), run.get("store_disk_active_s", 0.0), run.get(
        "store_disk_bytes", 0)
    secs, bps = run.get("seconds", 0.0), bound.get("disk_bps", 0.0)
    if not (active > 0 and read > 0 and secs > 0 and bps > 0):
        return None
    out = {"disk_achieved": bound["disk_s"] / secs, "busy_share": active / secs, "busy_rate": read / active / bps,
           "needed_share": run["disk_bytes"] / read, "depth": busy / active}
    if sample:
        out.update(sample_depth=sample["depth"], sample_pattern=sample["pattern"],
                   sample_busy_share=sample["active_s"] / sample["seconds"] if sample["seconds"] > 0 else 0.0)
    return out


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


def measure_compute(runner, reps: int, rounds: int = 5, layer: int = 0,
                    rows_list: tuple = (1, 16, 64)) -> tuple[dict, dict]:
    """({rows: seconds per expert application}, {rows: HBM bytes/s of the expert bytes}) through the engine's
    own expert kernels (runner.kern: triton on the GPU, the torch reference on the CPU): n experts of one
    layer placed in ring bank 0 exactly as slots hold them, each applied to `rows` rows in one launch group,
    as a warm layer-major pass does. Seconds per application = one group's time / n."""
    from betelgeuse.kernels.moe import Group
    cache, f, kern = runner.cache, runner.file, runner.kern
    device, dtype = cache.device, cache.dtype
    c = f.config
    n = min(cache.bank_size, c.n_expert)
    experts = list(range(n))
    for i, e in enumerate(experts):
        slot = cache.ring[i]
        for part, meta in zip(f.expert_parts(layer, e), cache.parts[layer][e]):
            raw = np.fromfile(f.path, dtype=np.uint8, count=part.nbytes, offset=part.offset)
            slot[meta.start: meta.start + meta.nbytes].copy_(torch.from_numpy(raw))
    offs = [cache.ring_offset + i * cache.slot_bytes for i in range(n)]
    host, dev = cache.table(experts, offs)
    g = Group(np.asarray(experts), host.copy(), dev)
    k, H = c.n_expert_used, c.n_embd
    gen = torch.Generator().manual_seed(0)
    secs, bps = {}, {}
    nbytes = sum(p.nbytes for p in f.expert_parts(layer, 0))
    for rows in rows_list:
        T = max(1, -(-rows * n // k))                        # T tokens x k ranks = rows per expert x n experts
        ids = (torch.arange(T * k) % n).reshape(T, k)
        ids = ids[:, torch.argsort(torch.rand(k, generator=gen))] if k > 1 else ids
        h = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
        w = torch.full((T, k), 1.0 / k, dtype=dtype)
        ids, w = ids.to(device), w.to(device)

        def one():
            r = kern.route(h, ids, w)
            kern.apply(r, layer, cache.pool, g, cache.slot_bytes)
            kern.combine(r)
        t = _best(one, device, reps, rounds)
        secs[rows] = t / n
        bps[rows] = n * nbytes / t
    return secs, bps


def measure_compute_by_type(runner, reps: int, rounds: int = 5, rows_list: tuple = (1, 16, 64)) -> dict:
    """{"gate-up/down types": {"layers": n, "backend": ..., "mm_s": {rows: s}, "hbm_bps": {rows: B/s}}}: one
    measure_compute on the first layer of each expert type pair of the model (a Q4_K_M-like file mixes them)."""
    from betelgeuse.gguf.qtypes import qtype_name
    by: dict = {}
    for layer, (a, b) in enumerate(runner.cache.qtypes):
        label = f"{qtype_name(a)}/{qtype_name(b)}"
        if label in by:
            by[label]["layers"] += 1
            continue
        secs, bps = measure_compute(runner, reps, rounds, layer=layer, rows_list=rows_list)
        by[label] = {"layers": 1, "backend": runner.kern.backend, "mm_s": secs, "hbm_bps": bps}
    return by


def layer_mean(by_type: dict, key: str) -> dict:
    """{rows: mean of by_type[*][key][rows] weighted by each type's layers}."""
    n = sum(v["layers"] for v in by_type.values())
    rows = set.intersection(*(set(v[key]) for v in by_type.values())) if by_type else set()
    return {r: sum(v[key][r] * v["layers"] for v in by_type.values()) / n for r in sorted(rows)}


def pass_bound(ceil: Ceilings, disk_bps: float, n_tokens: int, loads: int, disk_bytes: int, h2d_bytes: int,
               n_layer: int, k: int, seconds: float) -> dict:
    """The pass's physical bound (seconds) and which resource sets it. disk_bps: the disk rate beside the pass
    (case_disk_rate). Compute is a lower bound: `loads` expert loads share
    n_tokens * k * n_layer rows, each load at least one (sub-)batch."""
    disk_s = disk_bytes / disk_bps if disk_bps > 0 else 0.0
    h2d_s = h2d_bytes / ceil.h2d_bps if ceil.h2d_bps > 0 else 0.0
    compute_s = loads * ceil.expert_s(n_tokens * k * n_layer / loads) if loads else 0.0
    parts = {"disk": disk_s, "h2d": h2d_s, "compute": compute_s}
    limiter = max(parts, key=parts.get)
    bound = parts[limiter]
    achieved = bound / seconds if seconds > 0 else 0.0
    return {"disk_s": disk_s, "h2d_s": h2d_s, "compute_s": compute_s, "bound_s": bound, "limiter": limiter,
            "achieved": achieved, "bound_wrong": achieved > BOUND_WRONG, "disk_bps": disk_bps, "h2d_bps": ceil.h2d_bps}
