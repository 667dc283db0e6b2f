#!/usr/bin/env python3
"""deploy/device/decode_host.py under torch.profiler (CPU activity; CUDA's too on a device): the torch ops and CUDA
runtime calls of the whole run (prefill and warm steps included: ~64 decode steps dominate), by self host time, to
read what a miss layer's bank copies, flex copies and table uploads cost a call on the device's host
(moe.cache.bank_copy ~60 us, moe.flex.keep ~58 in gpu-run49-host: aten::copy_ / _foreach_copy_, cudaMemcpyAsync,
cudaEventRecord, cudaStreamWaitEvent, cudaLaunchKernel). Prints decode_host.py's JSON plus "ops": [{name, calls,
self_us_per_call, self_ms_total}] (the top --top by self host time; --match a,b: only names holding one of these).
Its arguments are decode_host.py's, then --top N and --match.

    python3 docs/benchmarks/cpu-host51/op_profile.py --preset ds4-tiny --form solo --flex on --flex-slots 3 \\
        --device cuda --top 30 --match copy,cuda,Event,Stream"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import torch


def main():
    argv, opt = sys.argv[1:], {"--top": "30", "--match": ""}
    for k in opt:
        if k in argv:
            i = argv.index(k)
            opt[k], argv = argv[i + 1], argv[:i] + argv[i + 2:]
    top, match = int(opt["--top"]), [m for m in opt["--match"].split(",") if m]
    script = Path(__file__).resolve().parents[3] / "deploy" / "device" / "decode_host.py"
    sys.argv = [str(script)] + argv
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    out = io.StringIO()
    with torch.profiler.profile(activities=acts) as prof, contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:             # decode_host.py's main() return code
            if e.code:
                raise
    res = json.loads(out.getvalue())
    ev = [e for e in prof.key_averages() if not match or any(m in e.key for m in match)]
    ev = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]
    res["ops"] = [{"name": e.key, "calls": e.count, "self_us_per_call": round(e.self_cpu_time_total / e.count, 2),
                   "self_ms_total": round(e.self_cpu_time_total / 1e3, 2)} for e in ev]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
