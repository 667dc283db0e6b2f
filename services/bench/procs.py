"""The benchmark's budgets: the cgroup both processes share, and a monitor thread that records peak cgroup
memory and peak VRAM while passes run.

The store is the real `python -m services.store_main`, a fresh child per case (empty slots: a cold start), started
by services/assembly.py's open_store(cfg, mode="process"); the worker is the bench process itself, which moves
itself into the cgroup before starting the store, so both are inside it (memory charged before the move stays with
the parent: torch's import, not the arena, the KV cache or the dense weights, which come later).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from betelgeuse.errors import BetelgeuseError
from betelgeuse.store.cgroup import CgroupMemory, make_cgroup, move_pid, remove_cgroup


class BenchCgroup:
    """A cgroup of our own (memory.max, no swap) that the bench process moves itself into.
    Where that is impossible (no root, no memory controller) the run continues outside one, says so,
    and the store still plans its arena against --memory-max."""

    def __init__(self, memory_max: int | None, enabled: bool):
        self.cg: CgroupMemory | None = None
        self.reason = ""
        self.oom0 = 0
        if not enabled or not memory_max:
            self.reason = "disabled" if not enabled else "no --memory-max"
            return
        try:
            self.cg = make_cgroup(f"betelgeuse-bench-{os.getpid()}", memory_max, swap_max=0)
            move_pid(self.cg, os.getpid())
        except (OSError, BetelgeuseError) as e:
            if self.cg is not None:
                remove_cgroup(self.cg)
                self.cg = None
            self.reason = f"cannot create a memory cgroup: {e}"
            return
        self.oom0 = self.cg.oom_kills()

    def _file(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.cg.path, name)) as f:
                return f.read().strip()
        except OSError:
            return None

    def summary(self, polled_peak: int) -> dict:
        if self.cg is None:
            return {"cgroup": None, "reason": self.reason}
        peak = self.cg.peak()
        swap = self._file("memory.swap.peak") or self._file("memory.swap.current")
        return {"cgroup": self.cg.path, "version": self.cg.version, "limit": self.cg.limit(),
                "swap_limit": self.cg.swap_limit(), "peak": max(peak or 0, polled_peak),
                "peak_source": "memory.peak" if self.cg.version == 2 else "memory.max_usage_in_bytes",
                "oom_kills": self.cg.oom_kills() - self.oom0,
                "swap_peak": int(swap) if swap and swap.isdigit() else None,
                "events": self._events()}

    def _events(self) -> dict:
        """v2 memory.events (low/high/max/oom/oom_kill counters); v1: oom_control."""
        raw = self._file("memory.events" if self.cg.version == 2 else "memory.oom_control") or ""
        return {k: int(v) for k, _, v in (ln.partition(" ") for ln in raw.splitlines()) if v.strip().isdigit()}

    def close(self):
        if self.cg is not None:
            remove_cgroup(self.cg)           # moves us (and any child left) back to the parent first
            self.cg = None


class Monitor:
    """Polls cgroup memory.current and device-wide GPU memory in use (cudaMemGetInfo) every `period` s.
    VRAM in use is counted above `vram_base` (what the GPU held before this process touched CUDA)."""

    def __init__(self, cg: CgroupMemory | None, device, vram_base: int, period: float = 0.05):
        self.cg, self.device, self.vram_base, self.period = cg, device, vram_base, period
        self.cuda = device.type == "cuda"
        self.mem_peak = 0
        self.vram_peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-monitor", daemon=True)
        self._t.start()

    def sample(self):
        if self.cg is not None:
            self.mem_peak = max(self.mem_peak, self.cg.current())
        if self.cuda:
            import torch
            free, total = torch.cuda.mem_get_info(self.device)
            self.vram_peak = max(self.vram_peak, total - free - self.vram_base)

    def _run(self):
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception:       # noqa: BLE001 - a monitor must never take the run down
                pass

    def close(self):
        self._stop.set()
        self._t.join()
        self.sample()


def cgroup_of(pid) -> str | None:
    cg = CgroupMemory.of_process(pid)
    return cg.path if cg else None


def arena_mappings() -> int:
    """Mappings of a store arena (memfd) left in this process: must be 0 once detached, or the old
    arena stays charged to the cgroup while the next store pre-faults its own."""
    with open("/proc/self/maps") as f:
        return sum("memfd:betelgeuse-arena" in ln for ln in f)


def mkdir(p: str) -> Path:
    d = Path(p)
    d.mkdir(parents=True, exist_ok=True)
    return d


def vram_used_before_cuda() -> int:
    """GPU memory in use before this process creates a CUDA context (nvidia-smi; 0 if unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return int(float(out.splitlines()[0])) << 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0
