"""The benchmark's budgets: the cgroup both processes share, and the monitor of peak cgroup memory and peak VRAM
while passes run (the kernel's peak and an NVML child process; a thread where neither is there).

The store is the real `python -m services.store_main`, a fresh child per case (empty slots: a cold start), started
by services/assembly.py's open_store(cfg, mode="process"); the worker is the bench process itself, which moves
itself into the cgroup before starting the store, so both are inside it (memory charged before the move stays with
the parent: torch's import, not the arena, the KV cache or the dense weights, which come later).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def watched(r: dict, memory_max: int | None, cgroup: bool, device, vram_budget) -> tuple[BenchCgroup, "Monitor"]:
    """A bench run's cgroup (BenchCgroup) and its Monitor, the results' "memory" and "vram" records filled (the VRAM
    baseline read before this process touches CUDA). A Monitor that cannot start (a bad BENCH_MONITOR) removes the
    cgroup before its error goes on."""
    cg = BenchCgroup(memory_max, cgroup)
    r["memory"] = {"cgroup": cg.cg.path if cg.cg else None, "reason": cg.reason}
    vram_base = vram_used_before_cuda() if device.type == "cuda" else 0
    try:
        mon = Monitor(cg.cg, device, vram_base)
    except BaseException:
        cg.close()
        raise
    r["vram"] = {"baseline_bytes": vram_base, "budget": vram_budget}
    return cg, mon


class Monitor:
    """Peak cgroup memory and peak VRAM while passes run, with no thread of this process waking for them where that can
    be helped: the bench times the decode in this process, and every wakeup of another thread takes the decode's GIL
    (issue 21; docs/benchmarks/cpu-gil66: the old poller was 20 wakeups a second, each a cudaMemGetInfo on CUDA).

      memory  the cgroup's own peak, kept by the kernel since the cgroup was made (v2 memory.peak, v1
              memory.max_usage_in_bytes; BenchCgroup.summary reads it): it bounds every memory.current a poller could
              read, so nothing polls; where the kernel keeps none (v2 before Linux 5.19) the thread polls
              memory.current every `period` s, as before (mem_peak)
      VRAM    device-wide GPU memory in use (total - free) above `vram_base` (what the GPU held before this process
              touched CUDA): sampled every `vram_period` s by a child process through NVML (services/bench/vram_peak.py:
              no CUDA context, started outside the bench cgroup, so it charges neither); where NVML is absent the
              thread polls cudaMemGetInfo every `period` s, as before. One more in-process sample at close() either way.

    `sources` says which ran: {"memory": "kernel" | "poll" | "kernel+poll" | None, "vram": "nvml" | "poll" | None}
    (BenchCgroup.summary's peak is the larger of the kernel's and the polled one). BENCH_MONITOR=poll
    in the environment runs the old thread for both instead (a device A/B of its cost to the decode's host time)."""

    ENV = "BENCH_MONITOR"

    def __init__(self, cg: CgroupMemory | None, device, vram_base: int, period: float = 0.05,
                 vram_period: float = 0.02, poll_memory: bool | None = None):
        self.cg, self.device, self.vram_base, self.period = cg, device, vram_base, period
        self.cuda = device.type == "cuda"
        mode = os.environ.get(self.ENV, "")
        if mode not in ("", "poll"):
            raise BetelgeuseError(f"{self.ENV}={mode!r}: 'poll' (the old polling thread) or unset")
        if mode == "poll":
            poll_memory = True
        self.mem_peak = 0
        self.vram_peak = 0
        self.vram_samples = 0
        self.vram_nvml_peak = None          # the NVML child's own peak above vram_base (beside close()'s last sample),
        self.vram_nvml_offset = None        # on cudaMemGetInfo's scale: + this offset, bytes (close())
        kernel = cg is not None and cg.peak() is not None          # the kernel keeps this cgroup's peak
        # poll_memory: None = only where the kernel keeps no peak; True: poll anyway (the old sampler, for a check)
        self.poll_memory = cg is not None and (not kernel if poll_memory is None else poll_memory)
        self._child: subprocess.Popen | None = None
        self.vram_note = ""
        if self.cuda and mode != "poll":
            self._child = self._start_nvml(vram_period)
        self.poll_vram = self.cuda and self._child is None
        self.sources = {"memory": None if cg is None else "+".join(["kernel"] * kernel + ["poll"] * self.poll_memory),
                        "vram": None if not self.cuda else ("poll" if self.poll_vram else "nvml")}
        self._stop = threading.Event()
        self._t = None
        if self.poll_memory or self.poll_vram:
            self._t = threading.Thread(target=self._run, name="bench-monitor", daemon=True)
            self._t.start()

    def _start_nvml(self, period: float) -> subprocess.Popen | None:
        """The NVML sampler child, or None (the reason in vram_note) where it cannot run: no NVML, no GPU."""
        parent = os.path.dirname(self.cg.path) if self.cg is not None else None

        def outside():              # the child's exec and Python outside the bench cgroup: it charges nothing there
            if parent is not None:
                with open(os.path.join(parent, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
        try:
            p = subprocess.Popen([sys.executable, "-S", str(Path(__file__).with_name("vram_peak.py")), str(period)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 preexec_fn=outside)
        except (OSError, subprocess.SubprocessError) as e:
            self.vram_note = f"cannot start the NVML sampler: {e}"
            return None
        first = _line(p, 30.0)
        try:
            head = json.loads(first)
            self.vram_devices = head["devices"]
        except (ValueError, KeyError, TypeError):
            self.vram_note = f"NVML sampler: {first.strip() or 'no answer'}"
            _end(p)
            return None
        return p

    def sample(self, memory: bool = True, vram: bool = True) -> int | None:
        """One in-process sample: memory.current, and device-wide VRAM in use (cudaMemGetInfo) on CUDA; returns that
        VRAM in use (total - free, bytes, before vram_base comes off), None where none was read."""
        if memory and self.cg is not None:
            self.mem_peak = max(self.mem_peak, self.cg.current())
        if vram and self.cuda:
            import torch
            free, total = torch.cuda.mem_get_info(self.device)
            self.vram_peak = max(self.vram_peak, total - free - self.vram_base)
            return total - free
        return None

    def _run(self):
        while not self._stop.wait(self.period):
            try:
                self.sample(self.poll_memory, self.poll_vram)
            except Exception:       # noqa: BLE001 - a monitor must never take the run down
                pass

    def vram_record(self) -> dict:
        """The bench record's VRAM figures after close() (CUDA): the peak, torch's own peaks, and what sampled it."""
        import torch
        return {"peak_bytes": self.vram_peak, "torch_max_reserved": torch.cuda.max_memory_reserved(self.device),
                "torch_max_allocated": torch.cuda.max_memory_allocated(self.device), "peak_by": self.sources["vram"],
                "nvml_samples": self.vram_samples, "nvml_peak_bytes": self.vram_nvml_peak,
                "nvml_offset_bytes": self.vram_nvml_offset, "note": self.vram_note}

    def _nvml_index(self) -> int:
        """The NVML device that is this process's CUDA device: by PCI domain, bus and device where torch says them,
        else NVML's index 0 (nvidia-smi's GPU 0: vram_used_before_cuda's baseline)."""
        if len(self.vram_devices) > 1:
            import torch
            pr = torch.cuda.get_device_properties(self.device)
            key = [getattr(pr, "pci_domain_id", None), getattr(pr, "pci_bus_id", None),
                   getattr(pr, "pci_device_id", None)]
            for d in self.vram_devices:
                if d["pci"] == key:
                    return d["index"]
        return 0

    def close(self):
        self._stop.set()
        if self._t is not None:
            self._t.join()
        if self._child is None:
            self.sample()
            return
        out = _end(self._child)
        self._child = None
        used = self.sample()                # close's own sample: the same quiet moment as the child's last read
        try:
            res = json.loads(out.strip().splitlines()[-1])
            i = self._nvml_index()
            # NVML's total - free and cudaMemGetInfo's differ by a constant (the totals differ: the driver's reserve
            # counts in one and not the other), so the child's peak is put on the old sampler's scale by the
            # difference of the two reads at this quiet moment (the passes are done: nothing allocates)
            self.vram_nvml_offset = used - res["last_used"][i]
            self.vram_nvml_peak = res["peak_used"][i] + self.vram_nvml_offset - self.vram_base
            self.vram_peak = max(self.vram_peak, self.vram_nvml_peak)
            self.vram_samples = res["samples"]
        except (ValueError, KeyError, IndexError, TypeError):
            self.vram_note = f"NVML sampler ended without its peak: {out.strip()[-200:] or 'no output'}"


def _line(p: subprocess.Popen, timeout: float) -> str:
    """The child's first line of output, or "" if none comes within `timeout` s."""
    import select
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if ready else ""


def _end(p: subprocess.Popen) -> str:
    """Close the child's stdin (its signal to finish), return the rest of its output; killed if it does not end."""
    try:
        out, _ = p.communicate(timeout=10.0)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    return out or ""


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
