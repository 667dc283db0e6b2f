"""The current-stream lookups of the expert step (kernels/streams.py) enqueue where torch.cuda.current_stream() does.

CUDA only (skipped on a CPU: the CPU paths make no stream call). Each check puts a long sleep kernel on one stream and
asks an event whether it completed: work enqueued behind the sleep is not done, work on an idle stream is. A lookup
that went to the wrong stream (the default stream cached at attach where a graph capture or a caller's side stream is
current, a bank copy left on the copy stream, the compute stream not waiting for a bank) turns an answer over.

The device machine has no pytest: `python3 tests/worker/test_cuda_streams.py` runs the same checks (__main__).
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

try:
    import pytest
except ImportError:             # the device machine: run as a script (__main__)
    pytest = None

if pytest is not None:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SLEEP = 300_000_000          # GPU cycles (~0.15 s): far longer than the host's calls between a sleep and a query


def test_current_stream_is_torchs():
    from betelgeuse.kernels import streams
    side = torch.cuda.Stream()
    assert streams.current_stream(None) == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        s = streams.current_stream(None)
        assert s == side == torch.cuda.current_stream()
        assert s.cuda_stream == side.cuda_stream
        assert streams.current_stream(torch.cuda.current_device()) is s          # one object per stream
        assert streams.stream_key(None) == (side.stream_id, side.device_index, side.device_type)
    assert streams.current_stream(None) == torch.cuda.current_stream(torch.device("cuda"))
    assert streams.current_stream(None) != side


def test_workspace_per_current_stream():
    from betelgeuse.kernels import triton_moe as tm
    dev = torch.device("cuda", torch.cuda.current_device())
    a = tm._workspace(dev, 1, 1)[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = tm._workspace(dev, 1, 1)[0]
        assert tm._workspace(dev, 1, 1)[0] is b
    assert b is not a and tm._workspace(dev, 1, 1)[0] is a


@contextmanager
def _open_runner(tmp: Path):
    """A runner on CUDA over an in-process store (tests/engine_helpers.py), closed after."""
    from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, write_synth
    rn, store = in_process_runner(write_synth(tmp / "m.gguf", **ENGINE_SPEC), 5, 15, device="cuda")
    try:
        yield rn
    finally:
        close_runner(rn, store)


if pytest is not None:
    @pytest.fixture(scope="module")
    def runner(tmp_path_factory):
        with _open_runner(tmp_path_factory.mktemp("streams")) as rn:
            yield rn


def _idle():
    torch.cuda.synchronize()


def test_bank_copy_on_the_copy_stream_and_back(runner):
    cache = runner.session.cache
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, (cache.slot_bytes,), dtype=torch.uint8, generator=gen).pin_memory() for _ in range(2)]
    want = torch.stack(srcs)
    # the copies go on the copy stream (idle) while the caller's stream sleeps; the caller's stream is current after
    cache.ring.zero_()
    _idle()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        b = cache.bank_next()
        offs = cache.bank_copy(b, 0, srcs, wait=False)
        assert torch.cuda.current_stream() == side
        cache.copy_stream.synchronize()
        assert not side.query()                                    # still asleep: the copies did not wait for it
        got = torch.stack([cache.pool[o: o + cache.slot_bytes] for o in offs]).cpu()
        assert torch.equal(got, want)
    _idle()
    # wait=True: the CURRENT stream (side here, not the default one) waits for the bank's copies
    with torch.cuda.stream(side):
        with torch.cuda.stream(cache.copy_stream):
            torch.cuda._sleep(SLEEP)
        b = cache.bank_next()
        cache.bank_copy(b, 0, srcs)
        ev = torch.cuda.Event()
        ev.record(side)
        assert torch.cuda.current_stream() == side
        assert not ev.query()                                      # behind the copy stream's sleep
        assert torch.cuda.default_stream().query()                 # the default stream waits for nothing
    _idle()


def test_bank_copy_carries_its_table_on_the_copy_stream(runner):
    """A group's slot table made with copy=False and named in its bank copy (moe_step._bank_group) lands on the device
    with the slots, on the copy stream (the caller's stream asleep meanwhile)."""
    cache = runner.session.cache
    side = torch.cuda.Stream()
    srcs = [torch.full((cache.slot_bytes,), 7 + i, dtype=torch.uint8).pin_memory() for i in range(2)]
    _idle()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        b = cache.bank_next()
        offs = cache.bank_offsets(b, 0, len(srcs))
        host, dev = cache.table([3, 1], offs, copy=False)
        assert cache.bank_copy(b, 0, srcs, table=dev) == offs
        cache.copy_stream.synchronize()
        assert not side.query()                                    # still asleep: the table did not wait for it
        want = torch.full((host.shape[0],), -1, dtype=torch.int64)
        want[3], want[1] = offs
        assert torch.equal(dev.cpu(), want) and torch.equal(torch.from_numpy(host), want)
    _idle()


def test_bank_done_and_routing_sync_record_on_the_current_stream(runner):
    cache, sync = runner.session.cache, runner.moe.sync
    side = torch.cuda.Stream()
    counts = torch.zeros(runner.mcfg.n_expert, dtype=torch.int64, device="cuda")
    sync.start(counts, None)            # its pinned buffer made here, not behind the sleep (an allocation may sync)
    sync.finish()
    _idle()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        b = cache.bank_next()
        cache.bank_done(b)
        sync.start(counts, None)
        assert not cache._bank_free[b].query()                     # recorded behind side's sleep
        assert not sync.event.query()
    sync.finish()
    _idle()
    # on the default stream, idle: both complete at once
    b = cache.bank_next()
    cache.bank_done(b)
    sync.start(counts, None)
    sync.finish()
    cache._bank_free[b].synchronize()
    _idle()


def test_mark_and_routing_sync_with_guesses_on_the_current_stream(runner):
    """ExpertCache.mark (the point after a decode miss layer's flex copies, queued on the compute stream:
    MoEStep._direct_group; a StreamPoint, no event) is passed by the next RoutingSync.finish whose start came after it
    (its event recorded on the current stream, behind the point's work), not before; a point made after that start
    is not. RoutingSync.start's one _foreach_copy_ of the counts and the guesses runs there too, behind the stream's
    work, and lands both."""
    cache, sync = runner.session.cache, runner.moe.sync
    cache.stream_points = True                  # engine.stream_points (off by default): mark() makes points
    E = runner.mcfg.n_expert
    side = torch.cuda.Stream()
    counts = torch.arange(E, dtype=torch.int64, device="cuda")
    guess = (torch.arange(2 * 3 * 4, dtype=torch.int64, device="cuda") * 5 % E).reshape(2, 3, 4)
    sync.start(counts, guess)           # its pinned buffer made here, not behind the sleep
    sync.finish()
    _idle()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        ev = cache.mark()
        later = counts * 3                                         # made behind the sleep
        sync.start(later, guess)
        after = cache.mark()                                       # after the start: not the finish's to pass
        assert not ev.query() and not sync.event.query()           # recorded behind side's sleep
    c, marks = sync.finish()
    assert c.tolist() == (counts * 3).tolist() and marks.ids == guess.tolist()
    assert ev.query() and not after.query()                       # passed by the finish / not
    after.synchronize()                                            # the fallback: a device sync, every point passed
    assert after.query() and cache.passed == cache.points
    _idle()


def test_layer_timing_events_on_the_current_stream(runner):
    from betelgeuse.worker.stats import LayerStats
    clock = runner.clock
    was, clock.timing = clock.timing, True
    side = torch.cuda.Stream()
    try:
        _idle()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP)
            ev = clock.layer_start()
            assert not ev.query()
            clock.layer_end(ev, LayerStats())
        _idle()
    finally:
        clock.timing = was
        clock.abandon()


if __name__ == "__main__":
    here = Path(__file__).resolve()
    sys.path[:0] = [str(here.parents[2]), str(here.parents[1])]         # the checkout, tests/ (engine_helpers)
    assert torch.cuda.is_available(), "needs CUDA"
    test_current_stream_is_torchs()
    test_workspace_per_current_stream()
    with tempfile.TemporaryDirectory() as d, _open_runner(Path(d)) as rn:
        for t in (test_bank_copy_on_the_copy_stream_and_back, test_bank_copy_carries_its_table_on_the_copy_stream,
                  test_bank_done_and_routing_sync_record_on_the_current_stream,
                  test_mark_and_routing_sync_with_guesses_on_the_current_stream,
                  test_layer_timing_events_on_the_current_stream):
            t(rn)
            print("ok", t.__name__)
    print("test_cuda_streams: 7 passed")
