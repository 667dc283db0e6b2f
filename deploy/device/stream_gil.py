"""What one session-stream message costs the worker's main thread beyond its own send (issue 21: the GIL).

A store message on the session stream (services/grpc/store_client.py `_Stream`) is a queue put on the main thread;
grpc's Python threads then send it (the request iterator's consumer) and complete it (the channel's event thread),
each taking the GIL. While the main thread runs the dense part (torch ops and kernel launches, each releasing the GIL)
those threads take it between two ops, and the main thread waits for it back. This times a fixed workload of
`--ops` small torch ops on `--device` (plus a little Python each) right after a one-way message (a release of no
staging slots) against the same workload with no message, alternating, and prints the medians and their difference:
the main thread's time one message costs (host time that a pass counts wherever the main thread runs next: the rest
or the expert step). A real store process (`services.store_main`) over ds4-tiny, as decode_host.py starts it.

    python3 deploy/device/stream_gil.py [--device cpu] [--reps 1500] [--ops 150] [--switch-interval 0.005]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def run(a, tmp: Path) -> dict:
    import torch
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    sys.path.insert(0, str(Path(__file__).parent))
    from decode_host import _model
    cfg = EngineConfig(model_path=str(_model("ds4-tiny", tmp)), vram_slots=2, host_slots=3, read_threads=2,
                       device=a.device)
    store = open_store(cfg, "process", str(tmp / "store"))
    rn = None
    try:
        rn = open_runner(cfg, store)             # attached: the session's stream is open
        client = store.client
        sys.setswitchinterval(a.switch_interval)
        x = torch.zeros(16, device=a.device)

        def work():
            s = 0
            for i in range(a.ops):
                x.add_(1)                        # releases the GIL, as each of the dense part's ops and launches
                s += i * i
            return s
        for _ in range(100):
            work()
        times: dict = {True: [], False: []}
        for rep in range(a.reps):
            send = rep % 2 == 0
            if send:
                client.release([])               # one one-way message (no slots: nothing changes at the store)
            t = time.perf_counter()
            work()
            times[send].append(time.perf_counter() - t)
            client._reap(wait=True)              # its answer read before the next rep
            time.sleep(0.001)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        return {"device": a.device, "switch_interval": a.switch_interval, "ops": a.ops, "reps": a.reps,
                "work_after_message_us": round(med[True], 1), "work_alone_us": round(med[False], 1),
                "message_cost_us": round(med[True] - med[False], 1)}
    finally:
        if rn is not None:
            rn.close()
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=1500)
    p.add_argument("--ops", type=int, default=150, help="torch ops in the timed workload")
    p.add_argument("--switch-interval", type=float, default=0.005, help="sys.setswitchinterval (CPython's 5 ms)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bg-stream-gil-") as d:
        print(json.dumps(run(a, Path(d))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
