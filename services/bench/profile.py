"""Kernel launches per layer and GPU busy time of one pass, from torch.profiler (CUDA only).

The profiled pass is an extra one (the profiler slows the host), never the timed pass: launches per layer
are a count, which the profiler does not change; GPU busy = the union of kernel intervals of the profiled
pass divided by the wall time of the timed pass of the same kind (kernel durations are not inflated by the
profiler), so it says how much of the timed pass the GPU spent computing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import torch


def _union_us(intervals) -> float:
    total, end = 0.0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + ((end - start) if end is not None else 0.0)


def by_name(kernels: list[dict], n_layer: int, top: int = 12) -> dict[str, float]:
    """Launches per layer by kernel name, the `top` most launched first (which kernels a fused one would save):
    {name (cut to 80 chars): launches / n_layer}."""
    names = Counter(str(k.get("name", "?"))[:80] for k in kernels)
    return {n: round(c / max(n_layer, 1), 2) for n, c in names.most_common(top)}


def copy_kernels_after(kernels: list[dict], n_layer: int) -> dict[str, dict[str, float]]:
    """The driver's copy kernels (names starting "memcpy": a memcpy node of a CUDA graph the driver runs on the SMs,
    e.g. `memcpy32_post`), each by the kernel that ran before it on its stream: {copy name: {"after <kernel>": per
    layer}}. Inside a graph replay the profiler names no torch op, so the kernel before says which captured copy it is
    (gpu-run61: 3 a decode layer appeared with recycled states and 23 memcpys a token went)."""
    last: dict = {}
    out: dict[str, Counter] = {}
    for k in sorted(kernels, key=lambda e: float(e["ts"])):
        name, stream = str(k.get("name", "?"))[:80], k.get("args", {}).get("stream", k.get("tid"))
        if name.startswith("memcpy"):
            out.setdefault(name, Counter())["after " + last.get(stream, "(the pass's start)")] += 1
        last[stream] = name
    return {n: {a: round(c / max(n_layer, 1), 2) for a, c in cs.most_common(6)} for n, cs in out.items()}


def profile_pass(fn, n_layer: int, timed_wall_s: float, device: torch.device) -> dict | None:
    """Run fn() once under the profiler; {launches, launches_per_layer, memcpys, kernel_ms, gpu_busy,
    launches_by_name, copy_kernels_after}."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    finally:
        os.unlink(path)
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy"]
    busy_us = _union_us((float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels)
    return {"launches": len(kernels), "launches_per_layer": len(kernels) / max(n_layer, 1), "memcpys": len(copies),
            "kernel_ms": busy_us / 1e3, "gpu_busy": (busy_us / 1e6) / timed_wall_s if timed_wall_s > 0 else None,
            "launches_by_name": by_name(kernels, n_layer), "copy_kernels_after": copy_kernels_after(kernels, n_layer)}


class DecodeCProfile:
    """cProfile of the bench's timed decode tokens where the environment names a file (BENCH_DECODE_CPROFILE=path;
    off otherwise: a no-op). Python's profiler adds ~1 µs to every call, so a run with it on measures where the host
    time of a decode token goes (the functions' own and cumulative seconds, the largest first), not its speed: its
    TG and host µs are not the bench's figures. Which threads it sees is Python's: the calling (main) thread alone up
    to 3.11, every thread from 3.12 (sys.monitoring), so there the waits of the session reader thread and the bench's
    monitor thread are in the tables too. The file: pstats' tables by own time and by cumulative time, each headed by
    the tokens profiled, so that per-token figures are the table's seconds / tokens."""

    ENV = "BENCH_DECODE_CPROFILE"
    TOP = 60

    def __init__(self):
        self.path = os.environ.get(self.ENV) or None
        self.prof = None

    def start(self):
        if self.path:
            import cProfile
            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def finish(self, tokens: int):
        """Stop profiling and write the tables (tokens: how many decode tokens ran under it)."""
        if self.prof is None:
            return
        import io
        import pstats
        self.prof.disable()
        buf = io.StringIO()
        for key in ("tottime", "cumulative"):
            buf.write(f"# {tokens} decode tokens profiled; sorted by {key}\n")
            pstats.Stats(self.prof, stream=buf).sort_stats(key).print_stats(self.TOP)
        with open(self.path, "w") as fh:
            fh.write(buf.getvalue())
        self.prof = None
