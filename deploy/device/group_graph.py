"""Host us of one decode expert group: launched (gate_up + down, two Triton launches) vs replayed as a CUDA graph
(issue 21; engine.group_graphs, worker/group_graphs.py). CUDA only (on a machine without one: a message, exit 0).

    python3 deploy/device/group_graph.py [--iters 300] [--bg-busy-us 50] [--bg-sleep-us 200]   # ~30 s on an H100

On a ds4-flash-shaped bank (MXFP4 experts, H 4096, F 2048, 256 experts, swiglu limit 10; a pool of 6 expert slots
of 13.4 MB, one slot table naming them; one token routed to those 6, bf16), median and p90 host us per call of:
  (a) noop      a trivial Triton kernel's launch (Triton's dispatch alone), and a torch x.add_(1) beside it
  (b) eager     MoEKernels.apply: the group's two launches with their Python (_plan, the workspace, ...)
  (c) replay    the same apply captured once (worker/graphs.capture, the decode graphs' path) and replayed:
                CUDAGraph.replay(); and GroupGraphs.apply (the engine's memo: key, lookup, replay). bits: the
                replay's y and inter equal (b)'s bit for bit, for two different h written in place (the graph reads
                its tensors at run time)
  (d) contended (b) and (c) again while a background Python thread does store-stream-like work (a busy Python loop
                of --bg-busy-us, then a sleep of --bg-sleep-us, as grpc's threads take the GIL per message:
                deploy/device/stream_gil.py): the GIL's cost on each
Also the group's GPU us (events over the eager loop), one capture's host ms, and GroupGraphs' first sighting (launched
on the capture stream) and second (captured) host ms: what a key costs before it replays. A small table, then the JSON
line.
Host us are per call, measured on the host clock around the call; the loop syncs every 50 calls outside the timed
calls so the launch queue never blocks one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import _common  # noqa: F401  first: puts this checkout on sys.path
import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # no triton: main() says so on a CPU machine before anything needs it
    triton = None

H, F, E, K = 4096, 2048, 256, 6          # ds4-flash (betelgeuse/gguf/synth_ds4.py PRESETS["ds4-flash"])
MXFP4, LIMIT = 39, 10.0                  # GGML type id; DS4Spec.swiglu_limit
EXPERTS = [3, 40, 77, 128, 190, 251]     # the group's 6 experts (any ids: the table names them)
DEVICE, DTYPE = "cuda", torch.bfloat16


if triton is not None:
    @triton.jit
    def _noop(x_ptr, BLOCK: tl.constexpr):
        """(a): the least a launch can be: one program storing BLOCK zeros."""
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs) * 1e6, 1), "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1)}


def _time(fn, iters: int) -> dict:
    """Host seconds of each fn() call (median, p90 in us); a sync every 50 calls, outside the timed calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for i in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return _stats(out)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs included)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(it), b.view(it))


def _mxfp4_parts(rng, shape) -> torch.Tensor:
    """Random valid MXFP4 blocks for a [rows, cols] matrix: uint8 [rows * cols / 32 * 17]: a scale byte (e8m0) within
    2 of the one that gives weights ~1/sqrt(cols) (e2m1 codes have std ~3; so no output saturates at the swiglu limit
    and different inputs give different outputs), then 16 bytes of e2m1 pairs (every code)."""
    b = rng.integers(0, 256, (shape[0] * shape[1] // 32, 17), dtype=np.uint8)
    mid = 127 + round(np.log2(1 / (3 * np.sqrt(shape[1]))))
    b[:, 0] = rng.integers(mid - 2, mid + 3, len(b))
    return torch.from_numpy(b.reshape(-1))


class Background:
    """A Python thread that takes the GIL as a store stream's threads do: busy Python for busy_us, then sleep_us."""

    def __init__(self, busy_us: float, sleep_us: float):
        self.busy, self.sleep = busy_us * 1e-6, sleep_us * 1e-6
        self.stop, self.rounds = threading.Event(), 0
        self.t = threading.Thread(target=self._run, daemon=True, name="bg-stream")

    def _run(self):
        while not self.stop.is_set():
            end = time.perf_counter() + self.busy
            s = 0
            while time.perf_counter() < end:       # pure Python: holds the GIL (a message's encode / callbacks)
                s += sum(i * i for i in range(20))
            self.rounds += 1
            time.sleep(self.sleep)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
        return False


def run(a) -> dict:
    from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts
    from betelgeuse.worker.graphs import capture
    from betelgeuse.worker.group_graphs import GroupGraphs

    dev = torch.device(DEVICE)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": {"H": H, "F": F, "E": E, "k": K, "qtype": "MXFP4", "rows": 1}, "iters": a.iters}

    # (a) Triton's dispatch alone, and a torch op
    x = torch.zeros(16, device=dev)
    res["noop_launch"] = _time(lambda: _noop[(1,)](x, BLOCK=16), a.iters)
    res["torch_add"] = _time(lambda: x.add_(1), a.iters)

    # the bank: 6 MXFP4 experts packed one a slot (64-byte aligned parts), a table naming them
    rng = np.random.default_rng(0)
    shapes = ((F, H), (F, H), (H, F))
    parts = {e: [_mxfp4_parts(rng, s) for s in shapes] for e in EXPERTS}
    pool, starts, base, slot = pack_experts(lambda e: parts[e], EXPERTS, E, dev)
    res["slot_mb"] = round(slot / 1e6, 2)
    kern = MoEKernels("triton", E, F, starts[None], [(MXFP4, MXFP4)], 16, act_limit=LIMIT)
    table = torch.from_numpy(base).to(dev)
    g = Group(None, base, table)
    h1 = torch.randn(1, H, device=dev, dtype=DTYPE)
    h2 = torch.randn(1, H, device=dev, dtype=DTYPE)
    ids = torch.tensor([EXPERTS], device=dev, dtype=torch.int64)
    w = torch.softmax(torch.randn(1, K, device=dev), -1).to(DTYPE)
    r = kern.route(h1.clone(), ids, w)

    def apply():
        kern.apply(r, 0, pool, g, slot)

    # (b) eager: the outputs for h1 and h2 first (the bits the replays must give), then the timed loop
    apply()
    y1, i1 = r.y.clone(), r.inter.clone()
    r.h.copy_(h2)
    apply()
    y2, i2 = r.y.clone(), r.inter.clone()
    assert not torch.equal(y1, y2)
    res["eager"] = _time(apply, a.iters)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(100):
        apply()
    e1.record()
    torch.cuda.synchronize()
    res["gpu_us_per_group"] = round(e0.elapsed_time(e1) * 1e3 / 100, 1)

    # (c) captured once (the decode graphs' capture: side stream, replayed once), replayed
    t = time.perf_counter()
    graph, _ = capture(None, apply)
    torch.cuda.synchronize()
    res["capture_ms"] = round((time.perf_counter() - t) * 1e3, 2)

    def bits_after(h, y, inter) -> bool:
        r.h.copy_(h)
        r.y.zero_()
        r.inter.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return same(r.y, y) and same(r.inter, inter)
    res["bits_equal"] = bits_after(h1, y1, i1) and bits_after(h2, y2, i2)
    res["replay"] = _time(graph.replay, a.iters)
    gg = GroupGraphs(kern, max_rows=8)
    for name in ("memo_first_ms", "memo_capture_ms"):   # a key's first sighting (launched on the side stream), then
        torch.cuda.synchronize()                        # its second (captured): what a key that comes back costs
        t = time.perf_counter()
        gg.apply(r, 0, pool, g, slot)
        res[name] = round((time.perf_counter() - t) * 1e3, 3)
    gg.apply(r, 0, pool, g, slot)
    res["memo_replay"] = _time(lambda: gg.apply(r, 0, pool, g, slot), a.iters)
    res["memo"] = gg.stats()
    r.h.copy_(h1)
    gg.apply(r, 0, pool, g, slot)
    torch.cuda.synchronize()
    res["bits_equal"] = res["bits_equal"] and same(r.y, y1)

    # (d) the same under a background thread's GIL traffic
    sw = sys.getswitchinterval()
    with Background(a.bg_busy_us, a.bg_sleep_us) as bg:
        time.sleep(0.01)
        res["eager_contended"] = _time(apply, a.iters)
        res["replay_contended"] = _time(graph.replay, a.iters)
        res["memo_replay_contended"] = _time(lambda: gg.apply(r, 0, pool, g, slot), a.iters)
    res["background"] = {"busy_us": a.bg_busy_us, "sleep_us": a.bg_sleep_us, "rounds": bg.rounds,
                         "switch_interval_s": sw}
    return res


def table(res: dict) -> str:
    rows = [("(a) Triton noop launch", "noop_launch"), ("(a) torch x.add_(1)", "torch_add"),
            ("(b) eager group (2 launches)", "eager"), ("(c) CUDAGraph.replay", "replay"),
            ("(c) GroupGraphs.apply replay", "memo_replay"), ("(d) eager, contended", "eager_contended"),
            ("(d) replay, contended", "replay_contended"), ("(d) GroupGraphs replay, contended",
                                                             "memo_replay_contended")]
    out = [f"{res['device']}: host us per call (median / p90), {res['iters']} calls",
           f"{'':36s} {'median':>8s} {'p90':>8s}"]
    out += [f"{name:36s} {res[k]['median_us']:8.1f} {res[k]['p90_us']:8.1f}" for name, k in rows]
    out.append(f"group GPU us {res['gpu_us_per_group']}, capture {res['capture_ms']} ms; GroupGraphs: first sighting "
               f"{res['memo_first_ms']} ms, capture {res['memo_capture_ms']} ms; replay bits == eager: "
               f"{res['bits_equal']}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--bg-busy-us", type=float, default=50.0, help="the background thread's busy Python a round")
    p.add_argument("--bg-sleep-us", type=float, default=200.0, help="its sleep between rounds")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("group_graph.py: no CUDA device here (it measures CUDA launches and graphs); nothing to do")
        return 0
    res = run(a)
    print(table(res))
    print(json.dumps(res))
    return 0 if res["bits_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
