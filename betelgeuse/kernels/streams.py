"""The current CUDA stream, looked up without torch.cuda.current_stream's per-call device resolution.

torch.cuda.current_stream(device) resolves the device each call (`None` or a torch.device without an index: the
availability check, the device attribute lookups, then the current device) and builds a new Stream object: ~38 us
of host a call under cProfile on the H100 machine, 12.8 calls a decode token on ds4-tiny (a bank copy's stream switch
and the compute stream's wait for the bank, bank_done, the routing sync's event, the Triton launches' workspaces:
docs/benchmarks/cpu-host-miss4). Here the same stream comes from torch._C._cuda_getCurrentStream (the
call torch.cuda.current_stream makes) on the index of the current device (torch.cuda.current_device: one C call
after the lazy init), and its Stream object is made once per stream: the same stream whichever the caller gets,
so nothing enqueued on it changes.
"""

from __future__ import annotations

import torch

_STREAMS: dict = {}        # (stream id, device index, device type) -> its torch.cuda.Stream, made at its first use


def stream_key(index: int | None) -> tuple[int, int, int]:
    """(stream id, device index, device type) of the current stream of CUDA device `index` (None: the current
    device's), as torch.cuda.current_stream(index) would name it."""
    return torch._C._cuda_getCurrentStream(torch.cuda.current_device() if index is None else index)


def current_stream(index: int | None) -> torch.cuda.Stream:
    """torch.cuda.current_stream(index) (index None: the current device's stream), one Stream object per stream. CUDA
    is initialized already where an index is given (it comes from a stream or tensor on that device)."""
    key = stream_key(index)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return s
