"""Peak device-wide GPU memory in use, sampled by a child process through NVML, so that no thread of the bench
process (whose main thread times the decode) wakes for it: the bench's Monitor thread polled cudaMemGetInfo 20 times
a second, each a wakeup that takes the decode's GIL (issue 21, docs/benchmarks/cpu-gil66).

Run as `python -S services/bench/vram_peak.py PERIOD_S` (stdlib only: ctypes, no torch, no CUDA context, so it takes
no VRAM of its own). It prints one line at start, `{"devices": [{"index", "pci": [domain, bus, device], "total"}]}`
or `{"error": "..."}` (then exits: no NVML here), samples every GPU's nvmlDeviceGetMemoryInfo every PERIOD_S seconds
until its stdin reaches EOF (the parent closed it, or died), then prints `{"peak_used": [bytes a device],
"last_used": [bytes a device, read after the EOF], "samples": n}` and exits. Used = total - free: cudaMemGetInfo's
own arithmetic (the old sampler's), device-wide.
"""

from __future__ import annotations

import ctypes
import json
import select
import sys


class _Memory(ctypes.Structure):        # nvmlMemory_t (v1): bytes
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Pci(ctypes.Structure):           # nvmlPciInfo_t (as nvmlDeviceGetPciInfo_v3 fills it)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


def open_nvml():
    """(the library, its device handles) or raise OSError with the reason."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        raise OSError(f"no NVML: {e}") from None
    rc = lib.nvmlInit_v2()
    if rc != 0:
        raise OSError(f"nvmlInit_v2 returned {rc}")
    n = ctypes.c_uint(0)
    rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
    if rc != 0 or n.value == 0:
        raise OSError(f"nvmlDeviceGetCount_v2 returned {rc}, {n.value} devices")
    handles = []
    for i in range(n.value):
        h = ctypes.c_void_p()
        rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h))
        if rc != 0:
            raise OSError(f"nvmlDeviceGetHandleByIndex_v2({i}) returned {rc}")
        handles.append(h)
    return lib, handles


def used(lib, h) -> tuple[int, int]:
    """(total - free, total) of one device, bytes."""
    m = _Memory()
    rc = lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m))
    if rc != 0:
        raise OSError(f"nvmlDeviceGetMemoryInfo returned {rc}")
    return m.total - m.free, m.total


def main(argv: list[str]) -> int:
    period = float(argv[0]) if argv else 0.02
    try:
        lib, handles = open_nvml()
        devices = []
        for i, h in enumerate(handles):
            p = _Pci()
            pci = [p.domain, p.bus, p.device] if lib.nvmlDeviceGetPciInfo_v3(h, ctypes.byref(p)) == 0 else None
            devices.append({"index": i, "pci": pci, "total": used(lib, h)[1]})
        peak = [used(lib, h)[0] for h in handles]
    except (OSError, AttributeError) as e:      # AttributeError: an NVML too old for a symbol
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    print(json.dumps({"devices": devices}), flush=True)
    n = 1
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], period)
        if ready and not sys.stdin.buffer.read1(4096):      # EOF: the parent is done (or gone)
            break
        for i, h in enumerate(handles):
            try:
                peak[i] = max(peak[i], used(lib, h)[0])
            except OSError:
                pass        # one failed read: the next sample counts
        n += 1
    last = [None] * len(handles)        # the last moment too, also on its own: the parent's cudaMemGetInfo at the same
    for i, h in enumerate(handles):     # quiet moment puts NVML's figure on cudaMemGetInfo's scale (Monitor.close)
        try:
            last[i] = used(lib, h)[0]
            peak[i] = max(peak[i], last[i])
        except OSError:
            pass
    print(json.dumps({"peak_used": peak, "last_used": last, "samples": n}), flush=True)
    lib.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
