"""What one store message costs the worker's host, through a real store process (issue 21: decode host time).

A decode layer with a miss sends the store one load (worker/moe_step.py); its host cost is what the bench's decode
split calls store messages (`store_us_per_application`). This times, on this machine's CPU, against a
`services.store_main` child over its Unix socket (a tiny synth model; every key staged, so no disk read is timed),
through the client's own methods (so either checkout's: a Load RPC each before issue 21's session stream, a message on
the stream after): sending a load, its first message (the store's answer for a staged copy), its end, sending a
release (one-way), waiting for its answer, a prefetch round trip; and, for scale, a bare AF_UNIX SOCK_SEQPACKET round
trip between two processes (what a struct-packed hot-path channel beside gRPC would cost). Each kind is timed on
both session transports (store.session_transport: grpc, seqpacket), one store child each.

    python3 deploy/device/store_messages.py [--n 300] [--transports grpc,seqpacket] [--out store_messages.md]

Runs on the CPU only (no GPU; ~20 s); prints a markdown table of medians and p90s in µs.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs) * 1e6, xs[int(0.9 * (len(xs) - 1))] * 1e6


def grpc_costs(n: int, tmp: Path, transport: str = "grpc") -> dict[str, list[float]]:
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.synth import PRESETS, write_model
    from services.assembly import open_store
    path = tmp / "tiny.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=2, n_expert=16, seed=3), progress=False)
    cfg = EngineConfig(model_path=str(path), vram_slots=1, host_slots=2, read_threads=2)
    # grpc: open_store's default (no keyword: a checkout from before store.session_transport runs this too, ab.py)
    kw = {} if transport == "grpc" else {"session_transport": transport}
    store = open_store(cfg, "process", str(tmp / f"store-{transport}"), **kw)
    c = store.client
    out: dict[str, list[float]] = {k: [] for k in ("Load: send", "Load: first message (staged copy)",
                                                   "Load: end", "Load: whole", "Load: whole, the caller's CPU",
                                                   "Release: send (one-way)",
                                                   "Release: answered", "Prefetch: round trip")}
    try:
        c.attach()
        c.begin_pass(False)
        keys = [(1, e) for e in range(4)]
        for got in c.load(keys):                  # staged once: later loads are answered from the staged copies
            c.release([got.staging_slot])
        c._reap(wait=True)                        # every release answered
        for i in range(n):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            loads = c.load([keys[i % len(keys)]])
            t1 = time.perf_counter()
            m = next(loads)
            t2 = time.perf_counter()
            for _ in loads:
                pass
            t3 = time.perf_counter()
            c3 = time.thread_time()
            c.release([m.staging_slot])
            t4 = time.perf_counter()
            c._reap(wait=True)                    # the client's own wait for the answers of what it sent
            t5 = time.perf_counter()
            c.prefetch([])
            t6 = time.perf_counter()
            for k, v in zip(out, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0, t4 - t3, t5 - t4, t6 - t5)):
                out[k].append(v)
        c.end_pass(np.zeros((2, 16), dtype=np.int64), False)
    finally:
        c.close()
        store.close()
    return out


def seqpacket_rtt(n: int) -> list[float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:                                   # the answering process: one reply per request
        a.close()
        while True:
            m = b.recv(4096)
            if not m:
                os._exit(0)
            (i,) = struct.unpack_from("<I", m)
            b.send(struct.pack("<IiiiQ?", i, 1, 2, 3, 0, False))
    b.close()
    rtt = []
    try:
        for i in range(n):
            t = time.perf_counter()
            a.send(struct.pack("<I", i) + bytes(64))
            a.recv(4096)
            rtt.append(time.perf_counter() - t)
    finally:
        a.close()
        os.waitpid(pid, 0)
    return rtt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=300, help="messages timed per kind")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--transports", default="grpc,seqpacket", help="session transports timed (comma-separated)")
    a = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bg-store-messages-") as d:
        for t in a.transports.split(","):
            rows.update({f"{t}: {k}": v for k, v in grpc_costs(a.n, Path(d), t).items()})
    rows["bare SOCK_SEQPACKET round trip (scale)"] = seqpacket_rtt(10 * a.n)
    lines = [f"store messages on {os.cpu_count()} CPUs ({a.n} per kind; µs)", "",
             "| message | median µs | p90 µs |", "|---|---|---|"]
    lines += [f"| {k} | {m:,.0f} | {q:,.0f} |" for k, (m, q) in ((k, _stats(v)) for k, v in rows.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
