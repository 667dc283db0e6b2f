"""CPU: one read message's way from the worker's send to the store taking it (crit51's "message" part), by what the
worker's thread does right after the send.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python docs/benchmarks/cpu-crit51/message_hop.py [--n 200]

A `services.store_main` child over ds4-tiny, the worker's session stream (services/grpc/store_client.py); per message
a load of one disk-tier expert (the store logs it as taken: ExpertStore._mark, status' disk_msgs; read once, then a
staged copy; its staging slot released after), the worker's thread then (idle) waiting for its answer at once (the
GIL free: grpc's send thread takes it), (busy) running Python for --busy-us first (as a decode layer's host step
after its load's send), or (sleep) sleeping as long (the GIL free, the thread busy elsewhere); the stream's hand-off
(_Stream.HANDOFF_S: 0.002 on, 0 off) each. Prints the median / p90 us from the send to the store's take, and the
median us the send call itself took. CPU only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "deploy/device"))
from decode_host import _model                                          # noqa: E402


def spin(us: float):
    end = time.perf_counter() + us * 1e-6
    x = 0
    while time.perf_counter() < end:
        x += 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--busy-us", type=float, default=300.0)
    p.add_argument("--modes", default="idle,busy,sleep,idle,busy,sleep")
    p.add_argument("--handoff", default="on,off", help="the stream's load hand-off (off: HANDOFF_S = 0)")
    a = p.parse_args()
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    from betelgeuse.store.directory import TIER_DISK
    from services.grpc.store_client import _Stream
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = EngineConfig(model_path=str(_model("ds4-tiny", tmp)), vram_slots=1, host_slots=1, read_threads=2,
                           device="cpu")
        store = open_store(cfg, "process", str(tmp / "store"))
        rn = open_runner(cfg, store)
        client = rn.session.store
        snap = rn.session.directory.snapshot()
        key = [tuple(int(x) for x in np.argwhere(snap["tier"] == TIER_DISK)[0])]
        try:
            print("| after the send | hand-off | n | send -> taken us, median | p90 | the send call us, median |\n"
                  "|---|---|---|---|---|---|")
            for mode, h in [(m, h) for m in a.modes.split(",") for h in a.handoff.split(",")]:
                _Stream.HANDOFF_S = 0.002 if h == "on" else 0.0
                sent, inside = [], []
                t0 = time.monotonic()
                for _ in range(a.n):
                    sent.append(time.monotonic())
                    it = client.load(key)
                    inside.append(time.monotonic() - sent[-1])
                    if mode == "yield0":
                        time.sleep(0)
                    if mode == "sched":
                        os.sched_yield()
                    if mode in ("busy", "yield0", "sched"):
                        spin(a.busy_us)
                    elif mode == "sleep":
                        time.sleep(a.busy_us * 1e-6)
                    client.release([g.slot for g in it])
                    time.sleep(0.002)          # the store quiet again before the next
                taken = [m[0] for m in client.status(disk_gaps_since=t0)["disk_msgs"]][-len(sent):]
                assert len(taken) == len(sent), (len(taken), len(sent))
                d_us = (np.array(taken) - np.array(sent)) * 1e6
                print(f"| {mode} ({a.busy_us:.0f} us)" if mode != "idle" else "| idle", f"| {h} | {a.n} | "
                      f"{np.median(d_us):.0f} | {np.percentile(d_us, 90):.0f} | {np.median(inside) * 1e6:.0f} |")
        finally:
            rn.close()
            store.close()


if __name__ == "__main__":
    main()
