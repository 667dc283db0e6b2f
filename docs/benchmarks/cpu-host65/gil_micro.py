#!/usr/bin/env python3
"""What the seqpacket session stream's reader thread costs a busy main thread (issue 21, cpu-host65): a child process
sends N landed-expert answers (store.proto SessionEvent with a Loaded, ~30 bytes each) `--gap-us` apart on a
SOCK_SEQPACKET connection while the main thread runs a fixed loop of Python work broken by calls that release the
GIL (os.stat: a few µs, as a CUDA call of torch's releases it on the device); the loop's wall against the same loop with the
answers left in the socket (store.session_reader "caller": read by the main thread once, after the loop) and with no
answers at all. The reader thread wakes once an answer and takes the GIL at the main thread's next release; the main
thread waits for it back. -> JSON: the loop's µs per answer more with the thread reader than with the caller.

    python3 docs/benchmarks/cpu-host65/gil_micro.py [--answers 2000] [--gap-us 300] [--work-us 20] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time

from services.grpc import store_client as sc
from services.pb.betelgeuse.v1 import store_pb2 as pb


def _store(path: str, n: int, gap_s: float, ready):
    """The store's end: accept, read the request (its id), send n answers to it gap_s apart, wait for the close."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    rid = pb.SessionRequest.FromString(conn.recv(1 << 16)).id
    data = pb.SessionEvent(id=rid, loaded=pb.Loaded(layer=3, expert=17, staging_slot=2, disk_bytes=13 << 20))
    data = data.SerializeToString()
    conn.recv(1 << 16)                              # "go": the main thread's loop starts
    t = time.perf_counter()
    for i in range(n):
        while time.perf_counter() < t + i * gap_s:
            pass
        conn.send(data)
    conn.recv(1 << 16)                              # the client's end
    conn.close()


def _loop(iters: int, work_s: float) -> float:
    """iters x (work_s of Python, then a call that releases the GIL) -> wall seconds."""
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        while time.perf_counter() - t < work_s:
            pass
        os.stat(".")
    return time.perf_counter() - t0


def one(reader: str | None, a) -> float:
    """The loop's wall with the answers read by `reader` (None: no answers sent)."""
    d = tempfile.mkdtemp(prefix="gil-micro-")
    path = os.path.join(d, "s.seq")
    n = a.answers if reader else 0
    ready = mp.Event()
    p = mp.Process(target=_store, args=(path, n, a.gap_us * 1e-6, ready), daemon=True)
    p.start()
    ready.wait(10)
    s = sc._SeqStream(path, 5.0, reader or "thread")
    s.send(lambda rid: pb.SessionRequest(id=rid))
    iters = int(a.answers * a.gap_us / (a.work_us + 5))     # the loop spans the answers' sends
    s._post(pb.SessionRequest(id=0))                        # go
    wall = _loop(iters, a.work_us * 1e-6)
    got = 0
    deadline = time.monotonic() + 10
    rid = max(s._box)
    while got < n:                                          # every answer routed (the caller's read: now)
        s.take(rid, deadline)
        got += 1
    s._post(pb.SessionRequest(id=0))
    s.close()
    p.join(10)
    return wall / iters * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", type=int, default=2000)
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--work-us", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    runs = {k: [] for k in ("none", "thread", "caller")}
    for _ in range(a.reps):                                 # alternating: the box's drift falls on all three
        for k in runs:
            runs[k].append(one(None if k == "none" else k, a))
    med = {k: statistics.median(v) for k, v in runs.items()}
    iters = int(a.answers * a.gap_us / (a.work_us + 5))
    per_answer = (med["thread"] - med["caller"]) * iters / a.answers
    print(json.dumps({"args": vars(a), "loop_us_per_iteration": {k: round(v, 3) for k, v in med.items()},
                      "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()},
                      "thread_minus_caller_us_per_answer": round(per_answer, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
