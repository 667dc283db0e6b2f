#!/usr/bin/env python3
"""Calls a decode miss layer's disk experts cost the host with engine.disk_copy_early off and on (cpu-copy65, issue 21):
deploy/device/decode_host.py run as is with --calls, its `step` part narrowed to MoEStep._disk_groups (the disk
experts as they land: their copies, table and group; the rest of the expert step is the same either side) and
LoadStream.ready() answering False (every disk expert but a layer's last lands "late": the most copies ahead there
are; decode_host's own read jitter is not needed) -> decode_host's JSON plus "per_miss_layer": {py, torch, c} calls
inside _disk_groups per decode layer with a disk expert (calls_per_layer's step part x layers / mean_miss_layers).
Exact counts (sys.setprofile), on the CPU: CUDA adds the timing events and a bank copy's stream switch, which the CPU
path does not call (README).

    python3 docs/benchmarks/cpu-copy65/calls.py --preset ds4-wide --vram 49 --host 77 --form solo --flex on \\
        --flex-slots 40 --tokens 24 [--copy-early]
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

from betelgeuse.worker.store_session import LoadStream

sys.argv = [str(Path(__file__).parents[3] / "deploy/device/decode_host.py")] + sys.argv[1:] + ["--calls"]
LoadStream.ready = lambda self: False
mod = runpy.run_path(sys.argv[0], run_name="decode_host")
mod["_Calls"].ROOTS = ("_disk_groups",)
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    mod["main"]()
res = json.loads(buf.getvalue().strip().splitlines()[-1])
med = res["per_token_median"]
miss = med["mean_miss_layers"]
res["per_miss_layer"] = {k: round(v * res["layers"] / max(miss, 1e-9), 2)
                         for k, v in res["calls_per_layer"]["step"].items()}
print(json.dumps(res))
