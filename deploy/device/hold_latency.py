#!/usr/bin/env python3
"""Run a command with the CPUs held out of deep idle states (a PM QoS request of 0 µs on /dev/cpu_dma_latency), or
print what governs this host's idle and clock (issue 21: is the decode's host time a cold core's?).

    python3 deploy/device/hold_latency.py --show                 # cpuidle driver / states, cpufreq governor, MHz
    python3 deploy/device/hold_latency.py -- bash deploy/device/bench_ds4.sh ...   # the command under the request

gpu-run68 found a decode token's host time growing 49 µs per ms it waited for the disk at the same work. A core that
sleeps ~5 ms in each of ~17 waits a token may drop into a deep C-state and wake slowly, with cold caches: the request
(the kernel's PM QoS interface, what tuned's latency-performance profile sets) keeps every core in C0/C1 while the
file stays open, so a run under it against one without shows how much of the host is the wake. The fd is left open
and inherited through exec: the request ends when the command's last process closes it. Where the file cannot be
opened (a VM without it, no root) the command still runs and the first line says why, so the run is labelled.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import sys
from pathlib import Path


def _read(p: str) -> str:
    try:
        return Path(p).read_text().strip()
    except OSError as e:
        return f"- ({e.strerror})"


def show() -> list[str]:
    """Lines naming cpu0's idle driver and states (name, exit latency µs, times entered) and its clock governor."""
    out = [f"cpuidle driver: {_read('/sys/devices/system/cpu/cpuidle/current_driver')}"
           f" governor: {_read('/sys/devices/system/cpu/cpuidle/current_governor_ro')}"]
    for s in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        out.append(f"  {Path(s).name}: {_read(s + '/name')} latency {_read(s + '/latency')} µs"
                   f" usage {_read(s + '/usage')} disabled {_read(s + '/disable')}")
    out.append(f"cpufreq governor: {_read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor')}"
               f" cur {_read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq')} kHz")
    mhz = [ln.split(":")[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("cpu MHz")]
    out.append(f"cpu MHz (cpuinfo, {len(mhz)} cpus): {' '.join(mhz[:16])}")
    return out


def hold(path: str = "/dev/cpu_dma_latency") -> tuple[int | None, str]:
    """Open the PM QoS file and ask for 0 µs; (fd, what happened). The fd must stay open for the request to hold."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return None, f"cpu_dma_latency: unavailable ({path}: {e.strerror}); the command runs without the request"
    os.write(fd, struct.pack("i", 0))
    os.set_inheritable(fd, True)
    return fd, f"cpu_dma_latency: 0 µs requested on {path} (held while the command runs)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--show", action="store_true", help="print the idle / clock state and exit")
    ap.add_argument("--log", help="also append the lines printed to this file (the run's folder keeps its label)")
    ap.add_argument("--path", default="/dev/cpu_dma_latency", help=argparse.SUPPRESS)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    def say(lines: list[str]) -> None:
        print("\n".join(lines), flush=True)
        if a.log:
            with open(a.log, "a") as f:
                f.write("\n".join(lines) + "\n")

    if a.show:
        say(show())
        if not cmd:
            return 0
    if not cmd:
        ap.error("no command given (hold_latency.py -- COMMAND ...)")
    fd, said = hold(a.path)
    say([said])
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"hold_latency.py: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
