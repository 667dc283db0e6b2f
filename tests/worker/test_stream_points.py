"""The compute stream's points (worker/expert_cache.py StreamPoint, issue 21, cpu-host60): a decode miss layer's
direct flex copies and the at-hand table's uploads are marked by a point, not a CUDA event (no record, no stream
lookup, no synchronize at the next store message), known done once the host synchronized on a routing sync whose
start (or the graph launch that ran it: expect) came after the point (RoutingSync.finish -> ExpertCache.pass_points);
a point not passed yet is waited for by a device-wide sync (never shorter than its own event would have been).

The bookkeeping runs here on the CPU over a stand-in for the device (torch.cuda.synchronize recorded; the CPU's
cache makes no point: its copies are synchronous); on CUDA (skipped here) a RoutingSync of the pool's device passes
what was made before its start and nothing made after it, and resolves the device's index once. What the device
itself orders (the event after the point's work on one stream): tests/worker/test_cuda_streams.py."""

from __future__ import annotations

import pytest
import torch

from betelgeuse.worker import expert_cache as ec


class _Device:
    """An ExpertCache's point bookkeeping on a stand-in CUDA device (the class's own mark and pass_points)."""

    is_cuda, _index, stream_points = True, 0, True           # engine.stream_points on
    mark, pass_points = ec.ExpertCache.mark, ec.ExpertCache.pass_points

    def __init__(self):
        self.points = self.passed = 0


def test_points_pass_by_the_syncs_that_came_after_them(monkeypatch):
    """Points made before a sync's start are done once it finished, those made after are not (query False, asking
    nothing of the device) until a later sync passes them or they are waited for: then one device sync, and every
    point made so far is done with it. Passing never moves back (an older sync finishing later). Fails with
    pass_points passing every point made (`passed = points`) or query() testing `<`."""
    syncs = []
    monkeypatch.setattr(ec.torch.cuda, "synchronize", lambda index=None: syncs.append(index))
    dev = _Device()
    a, b = dev.mark(), dev.mark()
    started = dev.points                        # a routing sync's start now (its event after a and b)
    c = dev.mark()
    assert not any(p.query() for p in (a, b, c)) and syncs == []
    dev.pass_points(started)                    # its finish
    assert a.query() and b.query() and not c.query()
    a.synchronize()                             # passed: no device call
    assert syncs == []
    d = dev.mark()
    c.synchronize()                             # not passed: one device-wide sync, made for every point so far
    assert syncs == [0] and c.query() and d.query() and dev.passed == dev.points
    e = dev.mark()
    dev.pass_points(started)                    # an older finish: nothing moves back, nothing new passes
    assert d.query() and not e.query() and dev.passed == dev.points - 1


def test_the_cpu_cache_makes_no_point():
    """On the CPU mark() is None (copies are synchronous: nothing to wait for) and a RoutingSync keeps no points."""
    from betelgeuse.worker.moe_step import RoutingSync
    cache = _Device()
    cache.is_cuda = False
    assert cache.mark() is None and cache.points == 0
    sync = RoutingSync(torch.device("cpu"), points=cache)
    assert sync.points is None and sync.index is None


def test_the_pass_end_sync_passes_the_points_made_before_it(tmp_path):
    """StoreSession.end_counts (a pass's end sync: its copy runs behind every point's work on the compute stream)
    passes the points made before it: the step's last miss layer's slots go back with the next message at no wait.
    (Points made by hand on the CPU's cache, which makes none itself.) Fails with end_counts not passing them."""
    from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth
    rn, st = in_process_runner(write_synth(tmp_path / "m.gguf", **ENGINE_SPEC), 2, 3)
    try:
        rn.forward(prompt(8, ENGINE_SPEC["n_vocab"], seed=1), rn.new_cache(32))
        cache = rn.session.cache
        cache.points = cache.passed + 3         # three points queued since the last pass
        rn.session.end_counts()
        assert cache.passed == cache.points
    finally:
        close_runner(rn, st)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("cap", [None, 64])
def test_a_routing_sync_passes_what_came_before_its_start(cap):
    """CUDA: RoutingSync(points=the cache) on the engine's device name ("cuda", no index): its index resolved once
    (the current device's), and its finish passes the points made before its start (or, for a captured start, before
    expect: the graph's launch), not one made after. Fails with finish passing every point made."""
    from betelgeuse.worker.moe_step import RoutingSync
    dev = _Device()
    sync = RoutingSync(torch.device("cuda"), cap=cap, points=dev)
    assert sync.index == torch.cuda.current_device() and sync.points is dev
    counts = torch.arange(16, dtype=torch.int64, device="cuda")
    before = dev.mark()
    sync.start(counts, None)
    if cap is not None:
        sync.expect(counts, None)               # a replay's: what was made before now (no point in between)
    after = dev.mark()
    c, _ = sync.finish()
    assert c.tolist() == counts.tolist()
    assert before.query() and not after.query()
