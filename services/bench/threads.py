"""A census of a process's threads between two moments (Linux /proc): each thread's wakeups and CPU, by name.

Issue 21's host time on the device is GIL hand-offs (docs/benchmarks/cpu-host65): every torch call releases the GIL,
any other thread of the worker waiting for it runs, and the decode's thread waits to get it back. Which threads wake
during a decode, and how often, is what this counts (docs/benchmarks/cpu-gil66).

  wakeups  voluntary + nonvoluntary context switches (/proc/<pid>/task/<tid>/status): each is one time the thread
           left a core, so one time it came back to one (the one it may be off at the end aside): a wakeup, or a
           resumption after preemption (the nonvoluntary part, given apart)
  cpu      ns on a core (/proc/<pid>/task/<tid>/schedstat's first field); runq: ns runnable, waiting for a core
  name     this process's Python threads by threading's name (a "Thread-N (target)" by its target's name); any other
           thread, and every thread of another process, by its kernel name (comm: gRPC's C threads name theirs,
           Python 3.11's threads carry the process's own, e.g. "python")

Exact: counters the kernel keeps, read at the two moments only (nothing runs in between). A thread that ended between
them is missing from the delta (its counters went with it: `ended` says how many); one that started is counted from 0.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThreadCount:
    name: str
    cpu_ns: int         # on a core
    runq_ns: int        # runnable, waiting for a core
    voluntary: int      # context switches: blocked (a wait, a read, the GIL)
    involuntary: int    # context switches: preempted
    python: bool | None = None      # a Python thread (one that takes the GIL to run); None: another process's


def python_name(name: str) -> str:
    """threading's "Thread-3 (_run)" -> "_run" (its target); any other name as is."""
    return name.split(" (", 1)[1].rstrip(")") if name.startswith("Thread-") and " (" in name else name


def snapshot(pid: int | str = "self") -> dict[int, ThreadCount]:
    """tid -> its counters now. Raises OSError where the process (or /proc) is not there."""
    own = pid == "self" or int(pid) == os.getpid()
    names = {t.native_id: python_name(t.name) for t in threading.enumerate() if t.native_id is not None} if own else {}
    base = f"/proc/{pid}/task"
    out = {}
    for d in os.listdir(base):
        tid = int(d)
        try:
            with open(f"{base}/{d}/status") as f:
                status = f.read()
            with open(f"{base}/{d}/schedstat") as f:
                cpu, runq, _slices = f.read().split()
        except OSError:             # ended meanwhile
            continue
        field = {k: v.strip() for k, _, v in (ln.partition(":") for ln in status.splitlines())}
        name = names.get(tid) or field.get("Name", "?")
        out[tid] = ThreadCount(name, int(cpu), int(runq), int(field.get("voluntary_ctxt_switches", 0)),
                               int(field.get("nonvoluntary_ctxt_switches", 0)), (tid in names) if own else None)
    return out


def delta(before: dict[int, ThreadCount], after: dict[int, ThreadCount]) -> tuple[dict[int, ThreadCount], int]:
    """Per thread alive at `after`: its counters since `before` (from 0 for one started since); and how many threads
    of `before` had ended by `after` (their counts are lost)."""
    out = {}
    for tid, b in after.items():
        a = before.get(tid)
        out[tid] = b if a is None else ThreadCount(b.name, b.cpu_ns - a.cpu_ns, b.runq_ns - a.runq_ns,
                                                    b.voluntary - a.voluntary, b.involuntary - a.involuntary,
                                                    b.python)
    return out, sum(1 for tid in before if tid not in after)


def by_name(d: dict[int, ThreadCount], per: int = 1) -> dict[str, dict]:
    """Threads of one name summed -> {name: {threads, wakeups, involuntary, cpu_us, runq_us[, python]}}, each over `per`
    (tokens: a figure per token; counts exact, shown to 0.01), the most wakeups first; threads with no wakeup and no
    CPU in the window left out (asleep throughout)."""
    acc: dict[str, list] = {}
    for c in d.values():
        if c.voluntary + c.involuntary == 0 and c.cpu_ns == 0:
            continue
        r = acc.setdefault(c.name, [0, 0, 0, 0, 0, c.python])
        r[0] += 1
        r[1] += c.voluntary + c.involuntary
        r[2] += c.involuntary
        r[3] += c.cpu_ns
        r[4] += c.runq_ns
    per = max(1, per)
    rows = {k: {"threads": n, "wakeups": round(w / per, 2), "involuntary": round(inv / per, 2),
                "cpu_us": round(cpu / per / 1e3, 1), "runq_us": round(q / per / 1e3, 1),
                **({} if py is None else {"python": py})}
            for k, (n, w, inv, cpu, q, py) in acc.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["wakeups"]))


class Census:
    """Processes' threads between start() and stop(): census = Census({"worker": "self", "store": pid}).start(); ...;
    census.stop(tokens) -> {label: {"threads": by_name(...), "ended": n, "seconds": wall between the reads}} (or
    {"error": ...} for a process that could not be read: gone, or no /proc). Two reads of /proc a process, outside
    what it measures."""

    def __init__(self, pids: dict[str, int | str]):
        self.pids = pids
        self.t0: dict[str, dict | str] = {}
        self.at = 0.0

    @staticmethod
    def _read(pid) -> dict | str:
        try:
            return snapshot(pid)
        except (OSError, ValueError, TypeError) as e:      # TypeError: no pid (a process not started)
            return f"{type(e).__name__}: {e}"

    def start(self) -> "Census":
        self.t0 = {k: self._read(p) for k, p in self.pids.items()}
        self.at = time.perf_counter()
        return self

    def stop(self, per: int = 1) -> dict:
        out, wall = {}, time.perf_counter() - self.at
        for k, p in self.pids.items():
            a, b = self.t0.get(k), self._read(p)
            if isinstance(a, str) or isinstance(b, str) or a is None:
                out[k] = {"error": b if isinstance(b, str) else a or "not started"}
                continue
            d, ended = delta(a, b)
            out[k] = {"threads": by_name(d, per), "ended": ended, "seconds": round(wall, 4)}
        return out
