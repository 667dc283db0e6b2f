"""The attach's steps, measured on the GPU, and its warm-ups guarded (issue 21).

The compile warm-ups at attach (MoEStep.warm_routes, MoEStep.warm_kernels, worker/warm_decode.py) took the first
decode token from 1.65 s of host to 37 ms, and raised the service's peak VRAM by ~350 MiB, of which torch's caching
allocator holds ~60 (gpu-run serve / ds4 benches, H100): the rest is outside torch (CUDA modules loaded for each
variant, the driver's local-memory reservation grown by a variant that spills: its local bytes per thread x every
resident thread of the GPU, kept; cuBLAS workspaces; Triton's per-stream workspaces). So each step is measured:

    steps = AttachSteps(device)
    flex = steps.run("flex_cache", make_flex)            # measured; an exception propagates
    got = steps.run("warm_kernels", warm, guard=True)    # measured; an Exception -> {"failed": "Type: message"}
    steps.vram  -> {step: {"device_mib": +used, "torch_reserved_mib": +reserved, "used_mib": used after,
                           "torch_peak_mib": torch's peak reserve, where the step raised it (its scratch)}}

device_mib is the device-wide used bytes' change (torch.cuda.mem_get_info: total - free, after a sync: every
process on the GPU, the driver's own reservations included), torch_reserved_mib the caching allocator's reserved
bytes' change; their difference is what the step put on the GPU outside torch. Measured on CUDA only (the CPU has no
such figures: vram stays empty).

A guarded step (a warm-up) that raises does not stop attach: a warning event names the step and the error, its
result is {"failed": "<error>"}, and the kernels it would have compiled compile in the first token instead. Only
Exception is caught (a KeyboardInterrupt, a SystemExit still stop attach); the caching allocator's free blocks are
given back after, once the exception (and with it the failed step's frames and scratch tensors) is dropped.
"""

from __future__ import annotations

import logging

import torch

from betelgeuse.logs import event

log = logging.getLogger("betelgeuse.worker")

MiB = 1 << 20


def vram_now(device: torch.device) -> tuple[int, int, int] | None:
    """(device-wide used bytes, torch's reserved bytes, torch's peak reserved bytes so far) after a sync, on CUDA;
    None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)


def error_text(e: BaseException, limit: int = 300) -> str:
    """"Type: message" on one line, at most `limit` characters (a log field, a bench.json value)."""
    msg = " ".join(str(e).split())
    txt = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return txt if len(txt) <= limit else txt[:limit - 3] + "..."


class AttachSteps:
    """An attach's steps: each one's VRAM deltas (CUDA) and, for a guarded one, its failure (module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.vram: dict[str, dict] = {}     # step -> {"device_mib", "torch_reserved_mib", "used_mib", ...} (CUDA)
        self.failed: dict[str, str] = {}    # step -> its error (guarded steps)

    def run(self, name: str, fn, guard: bool = False):
        """fn() measured as step `name` -> its result; guard: an Exception is logged and recorded, and the result is
        {"failed": error} (module doc)."""
        before = vram_now(self.device)
        failed = None
        try:
            out = fn()
        except Exception as e:
            if not guard:
                raise
            failed = error_text(e)
        if failed is not None:                      # the exception and its frames are gone: their blocks back
            event(log, "warm_up_failed", logging.WARNING, step=name, error=failed)
            self.failed[name] = failed
            out = {"failed": failed}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        after = vram_now(self.device)
        if before is not None and after is not None:
            self.vram[name] = {"device_mib": round((after[0] - before[0]) / MiB, 1),
                               "torch_reserved_mib": round((after[1] - before[1]) / MiB, 1),
                               "used_mib": round(after[0] / MiB, 1)}
            if after[2] > before[2]:                # a new peak of torch's reserve inside the step (scratch)
                self.vram[name]["torch_peak_mib"] = round(after[2] / MiB, 1)
        return out

    def summary(self) -> str:
        """"step +device/+torch MiB, ..." for the attach event ("" on the CPU)."""
        return ", ".join(f"{k} {v['device_mib']:+.0f}/{v['torch_reserved_mib']:+.0f}" for k, v in self.vram.items())
