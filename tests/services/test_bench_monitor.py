"""The bench's peak monitor with no thread in the bench process (services/bench/procs.py Monitor: the kernel's cgroup
peak, an NVML child for VRAM) and the thread census (services/bench/threads.py), on real processes and a real cgroup
(issue 21: a wakeup of another thread of the worker takes the timed decode's GIL; docs/benchmarks/cpu-gil66)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from betelgeuse.errors import BetelgeuseError
from betelgeuse.store.cgroup import CgroupMemory, make_cgroup, remove_cgroup
from services.bench import threads as T
from services.bench.procs import BenchCgroup, Monitor

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# a child that waits for a line on stdin, does what the line says, answers "done" and waits again; "sleep N": N
# nanosleeps of 1 ms (N voluntary context switches, nothing else blocks); "touch N": N MiB written (resident, charged
# to its memory cgroup), held until the next line; "free": drops them
CHILD = r"""
import sys, time
held = None
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, n = line.strip().partition(" ")
    if cmd == "sleep":
        for _ in range(int(n)):
            time.sleep(0.001)
    elif cmd == "touch":
        held = bytearray(int(n) << 20)
        for i in range(0, len(held), 4096):
            held[i] = 1
    elif cmd == "free":
        held = None
    print("done", flush=True)
"""


class Child:
    def __init__(self, preexec=None):
        self.p = subprocess.Popen([sys.executable, "-S", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, preexec_fn=preexec)
        assert self.p.stdout.readline().strip() == "ready"
        self.idle()

    def idle(self):
        """Until the child sleeps in its read of stdin (state S): its switch out of the core is counted by then."""
        for _ in range(2000):
            if open(f"/proc/{self.p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "S":
                return
            time.sleep(0.001)
        raise AssertionError("the child never blocked on its stdin")

    def do(self, cmd: str):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"
        self.idle()

    def close(self):
        self.p.stdin.close()
        self.p.wait(10)


def test_census_counts_a_threads_blocking_waits_exactly():
    """A child's N sleeps between two census reads are N voluntary context switches, and one more for its block on
    stdin after them: exactly N + 1 (the kernel's counters, not a timing); its CPU is counted and named by comm."""
    c = Child()
    try:
        n = 37
        census = T.Census({"child": c.p.pid}).start()
        c.do(f"sleep {n}")
        res = census.stop()
        d, ended = T.delta(census.t0["child"], T.snapshot(c.p.pid))
        assert ended == 0
        (only,) = d.values()                 # one thread, and nothing ran since stop()
        assert only.voluntary == n + 1, only
        row = res["child"]["threads"]
        (name,) = row
        assert name == open(f"/proc/{c.p.pid}/comm").read().strip()
        assert row[name]["wakeups"] == n + 1 + row[name]["involuntary"] and row[name]["cpu_us"] > 0
        per = T.Census({"child": c.p.pid}).start()
        c.do(f"sleep {2 * n}")
        r2 = per.stop(2)["child"]["threads"][name]      # per 2 (tokens): half of (2n + 1) + its preemptions
        assert r2["wakeups"] == round((2 * n + 1) / 2 + r2["involuntary"], 2)
    finally:
        c.close()
    assert "error" in T.Census({"gone": c.p.pid}).start().stop()["gone"]       # ended: said, not raised


def test_census_names_this_process_threads_by_python_name():
    stop = threading.Event()

    def napper():
        for _ in range(20):
            time.sleep(0.001)
        stop.wait()
    t = threading.Thread(target=napper, name="gil66-napper", daemon=True)
    census = T.Census({"me": "self"}).start()
    t.start()
    time.sleep(0.2)
    res = census.stop()["me"]["threads"]
    stop.set()
    t.join()
    assert res["gil66-napper"]["threads"] == 1 and res["gil66-napper"]["wakeups"] >= 20, res
    assert res["gil66-napper"]["python"] is True and res["MainThread"]["python"] is True
    assert T.python_name("Thread-3 (_run)") == "_run" and T.python_name("engine") == "engine"


@pytest.fixture
def cgroup():
    try:
        cg = make_cgroup(f"betelgeuse-test-gil66-{os.getpid()}-{uuid.uuid4().hex[:8]}", 1 << 30, swap_max=0)
    except (OSError, BetelgeuseError) as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")
    try:
        yield cg
    finally:
        remove_cgroup(cg)


def test_kernel_peak_bounds_the_old_sampler_and_no_thread_runs(cgroup):
    """A child in a real cgroup touches 96 MiB, frees them, touches 24: the kernel's peak (what the bench reports
    now, no thread) is at least the 96 MiB it touched (an independent count) and at least every memory.current the
    old 50 ms poller (here every 2 ms) read; the default monitor starts no thread in this process."""
    cg = cgroup
    assert cg.peak() is not None, "v1 memory.max_usage_in_bytes / v2 memory.peak: the kernel keeps the peak here"
    old = Monitor(cg, torch.device("cpu"), 0, period=0.002, poll_memory=True)       # the old sampler, as a check
    assert old.sources == {"memory": "kernel+poll", "vram": None} and old._t is not None
    before = {t.ident for t in threading.enumerate()}
    new = Monitor(cg, torch.device("cpu"), 0)
    assert new.sources == {"memory": "kernel", "vram": None}
    assert {t.ident for t in threading.enumerate()} == before          # no thread of its own: nothing wakes
    path = os.path.join(cg.path, "cgroup.procs")

    def inside():
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    c = Child(preexec=inside)
    try:
        assert CgroupMemory.of_process(c.p.pid).path == cg.path
        for cmd in ("touch 96", "free", "touch 24"):
            c.do(cmd)
            time.sleep(0.05)
    finally:
        c.close()
    old.close()
    new.close()
    peak = cg.peak()
    assert peak >= 96 * MiB, peak
    assert old.mem_peak >= 24 * MiB and peak >= old.mem_peak, (peak, old.mem_peak)
    assert new.mem_peak <= peak                     # close()'s one sample
    bc = BenchCgroup.__new__(BenchCgroup)           # the summary the bench writes, over this cgroup
    bc.cg, bc.reason, bc.oom0 = cg, "", 0
    s = bc.summary(new.mem_peak)
    assert s["peak"] == peak and s["peak_source"] == ("memory.peak" if cg.version == 2 else "memory.max_usage_in_bytes")


def test_vram_sampler_child_says_why_without_nvml():
    """services/bench/vram_peak.py with no NVML (this machine; a GPU host has it): one JSON line with the reason,
    exit 0, so the monitor falls back to its cudaMemGetInfo thread."""
    import ctypes
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("NVML is here: the device run checks the sampler (docs/benchmarks/cpu-gil66)")
    except OSError:
        pass
    p = subprocess.run([sys.executable, "-S", str(REPO / "services/bench/vram_peak.py"), "0.01"], capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and p.stdout.startswith('{"error": "no NVML'), (p.stdout, p.stderr)


def test_bench_monitor_env_runs_the_old_thread_or_says_what_it_takes(cgroup, monkeypatch):
    """BENCH_MONITOR=poll: the old polling thread (the device A/B's other side); anything else: a clear error."""
    monkeypatch.setenv("BENCH_MONITOR", "poll")
    m = Monitor(cgroup, torch.device("cpu"), 0)
    try:
        assert m.sources == {"memory": "kernel+poll", "vram": None}
        assert [t.name for t in threading.enumerate()].count("bench-monitor") == 1
    finally:
        m.close()
    assert "bench-monitor" not in [t.name for t in threading.enumerate()]
    monkeypatch.setenv("BENCH_MONITOR", "pol")
    with pytest.raises(BetelgeuseError, match="BENCH_MONITOR='pol': 'poll'"):
        Monitor(cgroup, torch.device("cpu"), 0)


def test_nvml_sampler_start_without_nvml_gives_the_reason(cgroup):
    """The monitor's start of its NVML child (a real child; its preexec writes it into the bench cgroup's parent, which
    would fail as "cannot start the NVML sampler") where there is no NVML: None and the child's own reason, so a CUDA
    bench falls back to the polling thread and says why."""
    import ctypes
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("NVML is here: the device run checks the sampler (docs/benchmarks/cpu-gil66)")
    except OSError:
        pass
    m = Monitor(cgroup, torch.device("cpu"), 0)
    assert m._start_nvml(0.01) is None and m.vram_note.startswith('NVML sampler: {"error": "no NVML'), m.vram_note
    m.close()


def test_a_monitor_that_cannot_start_leaves_no_cgroup_behind():
    """procs.watched (the bench's and the agents bench's start): the cgroup made and the process moved into it, the
    results' memory / vram records filled; a Monitor that raises (a bad BENCH_MONITOR) removes that cgroup before its
    error goes on. In a child process: it moves itself into the cgroup."""
    code = r"""
import json, os, sys, torch
from betelgeuse.errors import BetelgeuseError
from services.bench.procs import watched
r = {}
cg, mon = watched(r, 1 << 30, True, torch.device("cpu"), 123)
ok = {"memory": r["memory"], "vram": r["vram"], "sources": mon.sources}
mon.close(); cg.close()
os.environ["BENCH_MONITOR"] = "pol"
r2 = {}
try:
    watched(r2, 1 << 30, True, torch.device("cpu"), 123)
except BetelgeuseError as e:
    path = r2["memory"]["cgroup"]
    print(json.dumps({**ok, "error": str(e), "path": path, "left": bool(path) and os.path.exists(path)}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["vram"] == {"baseline_bytes": 0, "budget": 123} and "reason" in out["memory"]
    assert "BENCH_MONITOR='pol'" in out["error"]
    if out["path"] is None:
        pytest.skip(f"no cgroup here ({out['memory']['reason']}): the removal is not checked")
    assert out["left"] is False
