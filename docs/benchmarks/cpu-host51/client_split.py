#!/usr/bin/env python3
"""deploy/device/decode_host.py with the store client's message calls timed in place (docs/benchmarks/cpu-host51):
its JSON, plus "client_us": {call: [median us a call, calls a run]} for GrpcStoreClient.load / prefetch_start /
release (the worker's host time of one message: encoding, the stream's checks, the queue put) and _Stream.alive
(the per-message check of the session stream). Wraps whichever checkout PYTHONPATH names (deploy/device/ab.py runs it
on both sides: `--script docs/benchmarks/cpu-host51/client_split.py`); its arguments are decode_host.py's."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import statistics
import sys
import time
from pathlib import Path

import services.grpc.store_client as sc

TIMES: dict[str, list[float]] = {}


def _timed(cls, name: str, label: str):
    fn = getattr(cls, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES.setdefault(label, []).append(time.perf_counter() - t)
    setattr(cls, name, wrapper)


for _name in ("load", "prefetch_start", "release"):
    _timed(sc.GrpcStoreClient, _name, f"client.{_name}")
_timed(sc._Stream, "alive", "stream.alive")


def main():
    script = Path(__file__).resolve().parents[3] / "deploy" / "device" / "decode_host.py"
    sys.argv = [str(script)] + sys.argv[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:             # decode_host.py's main() return code
            if e.code:
                raise
    res = json.loads(out.getvalue())
    res["client_us"] = {k: [statistics.median(v) * 1e6, len(v)] for k, v in sorted(TIMES.items())}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
