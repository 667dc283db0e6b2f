"""Python's cyclic collector as the engine loop sees it: each collection's pause (seconds, by generation), and the
freeze that keeps start-up's objects out of later collections.

A full (generation 2) collection walks every object the collector tracks. After the model load and the first decode
graphs a worker holds a great many (torch modules and tensor wrappers, the GGUF reader's fields, the gRPC and HTTP
stacks), so one such collection can land inside a decode step and stall it for tens to hundreds of ms of host time
(gpu-run42: one warm solo step of ten took 247 ms against 29-36 ms). gc.freeze() once start-up is over moves them to
the permanent generation, which no collection walks (vLLM freezes after its CUDA graph capture, for the same reason).
What a collection costs stays visible: betelgeuse_gc_pause_seconds{generation} on the worker's /metrics and the pause
per pass in deploy/device/profile_batch.py's trace.
"""

from __future__ import annotations

import gc
import time
from typing import Callable


class GcPauses:
    """Pauses of the cyclic collector since start(): seconds and collections per generation (0, 1, 2), and
    on_pause(generation, seconds) after each. The collector calls its callbacks on the thread that collects, holding
    the GIL, so the start -> stop pair of one collection is never interleaved with another's."""

    def __init__(self, on_pause: Callable[[int, float], None] | None = None):
        self.on_pause = on_pause
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0: float | None = None

    def _cb(self, phase: str, info: dict):
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:                   # started before start()
            return
        dt, g, self._t0 = time.perf_counter() - self._t0, min(int(info["generation"]), 2), None
        self.seconds[g] += dt
        self.count[g] += 1
        if self.on_pause is not None:
            self.on_pause(g, dt)

    def start(self) -> "GcPauses":
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)
        return self

    def stop(self):
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def total_s(self) -> float:
        return sum(self.seconds)


def freeze() -> int:
    """Collect once, then move every object that survives to the permanent generation: later collections skip them.
    Returns how many objects are frozen (gc.get_freeze_count())."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def refreeze() -> int:
    """Once objects of a frozen start-up are let go (a re-attach drops the old attachment: its views of the old arena
    may sit in reference cycles, which only a collection frees, and frozen ones are never collected): unfreeze,
    collect, freeze again. Nothing frozen (the worker did not freeze, or a test): nothing done, 0."""
    if not gc.get_freeze_count():
        return 0
    gc.unfreeze()
    return freeze()
