"""CUDA graph capture for the decode paths: the eager -> capture -> replay modes and a capture without syncs.

The solo static decode (worker/decode_graphs.py) and the batched decode lanes (worker/lanes.py) run a step eagerly
first (it also warms the kernels up), capture it on the next step and replay it after: the same kernels on the
same shapes each time, so the bits never depend on which it was (invariant 1).
"""

from __future__ import annotations

import torch

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
CAPTURED = [0]          # graphs captured by this process (profile traces: a step that captured is not a warm one)


def capture(pool, fn):
    """Capture fn() into a new CUDA graph in `pool` (None: a new private pool) and replay it once (capture does
    not run the work). Returns (graph, fn's result). Unlike torch.cuda.graph(), no device sync, gc.collect()
    or empty_cache() per capture: a sequence captures ~100 graphs at once."""
    g = torch.cuda.CUDAGraph()
    cur = torch.cuda.current_stream()
    side = _side_stream(cur.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            g.capture_end()
    cur.wait_stream(side)
    g.replay()
    CAPTURED[0] += 1
    return g, out


_SIDE: dict = {}


def side_stream(device) -> torch.cuda.Stream:
    """The stream captures run on (one per device; worker/group_graphs.py launches a group's first sighting there)."""
    return _side_stream(device)


def _side_stream(device) -> torch.cuda.Stream:
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s
