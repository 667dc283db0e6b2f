"""The store<->worker chain's host links, one load at a time, through a real store process and real disk reads
(issue 21: exact decode's disk idle; services/bench/disk_idle.py's land / deliver / message / store links).

A `services.store_main` child (as store_messages.py and decode_host.py start it: services.assembly.open_store) serves
a synth model file written here (experts of ~0.4 MB, Q8_0). Each load asks for one expert that is not staged (the
keys cycle through more experts than the store has staging slots, so every load is a disk read: the table says how
many were), on the session stream (store.session_transport, seqpacket by default), and is timed on CLOCK_MONOTONIC
(the same clock in both processes) at:

  send      the worker's main thread sends the load (this process)
  took      the store's session reader took it              (the store's message log: status' disk_msgs[0])
  read      its first preadv started                        (disk_msgs[1])
  landed    the read's last preadv returned                 (the reader's idle gap that starts after it: disk_gaps)
  handed    the store's delivering thread has the expert    (disk_msgs[2]: the load's generator saw it)
  recv      the worker's session reader has the answer, routed to its box (this process: _SeqStream._route,
            wrapped here; the reader thread, or with store.session_reader "caller" the waiting caller itself)
  woken     the worker's main thread has it                 (next() on the load returned)

and the links are the differences: message = took - send, store = read - took, disk = landed - read (the read
itself, for scale), land = handed - landed, deliver = recv - handed (the store's answer built and sent, the socket,
the worker's reader thread and its GIL), wake = woken - recv (the routing to the box, the main thread's wakeup), host
= total less disk (a load's host links together, each load's own sum: the figure the disk waits on). Two
modes: `idle` (the main thread waits in take() at once) and `busy` (it runs BUSY_US of Python and small torch CPU
ops after the send before it waits, as a decode layer's host work does: the worker's reader thread then contends
for the GIL; wake is then counted from max(recv, the work's end)).

    python deploy/device/chain_latency.py [--n 300] [--modes idle,busy] [--transport seqpacket] [--out chain.md]
                                          [--session-reads]

CPU only (no GPU needed; ~30 s). Prints a markdown table of medians and p90s in µs per link and mode, and the read
mode (direct: O_DIRECT; buffered: the filesystem refused it, reads are buffered + POSIX_FADV_DONTNEED).
"""
from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

LINKS = ("message", "store", "disk", "land", "deliver", "wake", "host", "total")   # host: total less disk, a load's
BUSY_US = 1500.0


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs) * 1e6, xs[int(0.9 * (len(xs) - 1))] * 1e6


def _busy(until: float, x):
    """Python and small torch CPU ops until `until` (monotonic s): the GIL held most of the time, as a layer's host
    work holds it between its torch calls."""
    n = 0
    while time.monotonic() < until:
        n += sum(range(200))
        x = x * 1.0001 + 1.0
    return n, x


def measure(n: int, tmp: Path, mode: str, transport: str,
            session_reads: bool = False) -> tuple[dict[str, list[float]], dict]:
    import torch
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.synth import PRESETS, write_model
    from services.assembly import open_store
    from services.grpc import session_seq, store_client

    path = tmp / "chain.gguf"
    if not path.exists():
        write_model(path, replace(PRESETS["tiny"], n_layer=2, n_embd=256, n_ff_exp=512, n_expert=32, seed=5),
                    progress=False)
    recv: dict[int, float] = {}                 # session event id -> monotonic s its reader had it
    route = getattr(store_client._SeqStream, "_route", None)
    if route is not None:
        # each event stamped as it is routed to its box: by the reader thread, or (store.session_reader "caller")
        # by the caller that read it
        def routed(self, ev):
            recv.setdefault(ev.id, time.monotonic())
            return route(self, ev)
        store_client._SeqStream._route = routed
    else:                                       # a checkout from before _route (an A/B's base): its receiver
        plain = session_seq.receiver

        def stamped(sock, parse):               # the client's receiver, each event stamped as the reader has it
            for ev in plain(sock, parse):
                recv.setdefault(ev.id, time.monotonic())
                yield ev
        store_client.session_seq.receiver = stamped  # the client module's reference (store_client imports it)
    cfg = EngineConfig(model_path=str(path), vram_slots=1, host_slots=1, read_threads=2,
                       staging_slots=8, session_reads=session_reads)
    store = open_store(cfg, "process", str(tmp / f"store-{mode}"), session_transport=transport)
    c = store.client
    rows: dict[str, list[float]] = {k: [] for k in LINKS}
    info = {"disk_reads": 0, "loads": 0}
    x = torch.ones(64)
    try:
        c.attach()
        c.begin_pass(False)
        st = c.status()
        info["read_mode"], n_staging = st["read_mode"], st["n_staging"]
        keys = [(l, e) for l in (0, 1) for e in range(32)]
        assert len(keys) > 2 * n_staging, (len(keys), n_staging)
        t_first = time.monotonic()
        sends = []
        for i in range(n + 10):
            key = keys[i % len(keys)]
            t_send = time.monotonic()
            loads = c.load([key])
            rid = loads._rid
            t_work = t_send
            if mode == "busy":
                _, x = _busy(t_send + BUSY_US / 1e6, x)
                t_work = time.monotonic()
            got = next(loads)
            t_woken = time.monotonic()
            for _ in loads:
                pass
            c.release([got.staging_slot])
            c._reap(wait=True)
            if i >= 10:                         # warm-up first
                sends.append((t_send, t_work, t_woken, rid, got.disk_bytes > 0))
            time.sleep(0.002)                   # the disk idle between loads (the gap the next read ends)
        st = c.status(disk_gaps_since=t_first)
        c.end_pass(np.zeros((2, 32), dtype=np.int64), False)
    finally:
        c.close()
        store.close()
        if route is not None:
            store_client._SeqStream._route = route
        else:
            store_client.session_seq.receiver = plain
    msgs = sorted(st["disk_msgs"])
    taken = [m[0] for m in msgs]
    gap_starts = sorted(g[0] for g in st["disk_gaps"])
    for t_send, t_work, t_woken, rid, from_disk in sends:
        j = bisect.bisect_left(taken, t_send)
        if j >= len(msgs) or rid not in recv or msgs[j][1] is None or msgs[j][2] is None:
            continue
        took, read, handed = msgs[j]
        g = bisect.bisect_right(gap_starts, handed) - 1     # the disk's last idle start before the hand-over: the
        if g < 0 or gap_starts[g] < read:                  # read's last piece (a pause between pieces is earlier)
            continue
        landed, r = gap_starts[g], recv[rid]
        info["loads"] += 1
        info["disk_reads"] += from_disk
        for k, v in zip(LINKS, (took - t_send, read - took, landed - read, handed - landed, r - handed,
                                t_woken - max(r, t_work), t_woken - t_send - (landed - read), t_woken - t_send)):
            rows[k].append(v)
    return rows, info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=300, help="loads timed per mode")
    p.add_argument("--modes", default="idle,busy", help="idle, busy (comma-separated)")
    p.add_argument("--transport", default="seqpacket", help="store.session_transport (seqpacket; grpc: no recv)")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--session-reads", action="store_true",
                   help="engine.session_reads on: the store's session reader reads each load's first piece itself")
    p.add_argument("--worker-switch", type=float, default=None,
                   help="s: this (the worker's) process's GIL switch interval (sys.setswitchinterval; Python's 0.005)")
    a = p.parse_args()
    if a.worker_switch:
        sys.setswitchinterval(a.worker_switch)
    out, infos = {}, {}
    with tempfile.TemporaryDirectory(prefix="bg-chain-", dir=os.environ.get("CHAIN_TMP", "/var/tmp")) as d:
        for mode in a.modes.split(","):
            out[mode], infos[mode] = measure(a.n, Path(d), mode, a.transport, a.session_reads)
    modes = list(out)
    lines = [f"store<->worker chain on {os.cpu_count()} CPUs, {a.transport}, python {sys.version.split()[0]}, the "
             f"worker's switch interval {sys.getswitchinterval() * 1e3:g} ms, engine.session_reads "
             f"{'on' if a.session_reads else 'off'} (µs; median / p90)", ""]
    for m in modes:
        i = infos[m]
        lines.append(f"- {m}: {i['loads']} loads matched, {i['disk_reads']} read from disk, reads {i['read_mode']}"
                     + (f", main thread busy {BUSY_US:.0f} µs after each send" if m == "busy" else ""))
    lines += ["", "| link | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for k in LINKS:
        cells = []
        for m in modes:
            med, p90 = _stats(out[m][k]) if out[m][k] else (float("nan"), float("nan"))
            cells.append(f"{med:,.0f} / {p90:,.0f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
