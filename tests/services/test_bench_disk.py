"""The bench's disk ceiling (services/bench/ceilings.py measure_disk): sampled in both ways the store's loads read,
on the real reader (ExpertReader, O_DIRECT where the filesystem honours it) over a real GGUF. "layer" reads whole
layers' experts in file order with the reader's queue kept full (a prefill), "random" batches of random experts each
waited for (decode); the rate the bounds use is the faster (serve_meter.disk_rate). The reader's read() is wrapped to
record each call's ranges and how many earlier reads had not landed yet when it was issued (the queue's depth)."""

from __future__ import annotations

import pytest

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.arena import Arena
from betelgeuse.store.reader import JITTER_ENV, PAGE, ExpertReader
from services.bench import ceilings as C

THREADS = 2


@pytest.fixture
def spied(monkeypatch, tiny_model):
    """(file, calls): calls gets (ranges, future, reads still in flight when it was issued) per read()."""
    monkeypatch.setenv(JITTER_ENV, "5:10")      # each piece up to 10 ms late: reads land one by one, not at once
    calls = []
    real = ExpertReader.read

    def read(self, ranges, priority=0):
        in_flight = sum(not fut.done() for _, fut, _ in calls)
        fut = real(self, ranges, priority)
        calls.append((ranges, fut, in_flight))
        return fut
    monkeypatch.setattr(ExpertReader, "read", read)
    f = GGUFModelFile.open(str(tiny_model))
    yield f, calls
    f.close()


def _experts(f: GGUFModelFile) -> dict:
    """{(file offset, bytes) of a part: (layer, expert)} over the whole file."""
    c = f.config
    return {(p.offset, p.nbytes): (layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)
            for p in f.expert_parts(layer, e)}


def _slot(f: GGUFModelFile) -> int:
    return -(-(f.expert_nbytes(0) + 3 * 2 * PAGE) // PAGE) * PAGE


def _reader_mode(path: str) -> str:
    """What the store's reader picks on this file (direct wherever the filesystem honours O_DIRECT)."""
    arena = Arena.create(PAGE, name="betelgeuse-test-mode")
    try:
        r = ExpertReader(path, arena, threads=1)
        mode = r.mode
        r.close()
        return mode
    finally:
        arena.close()


def test_layer_pattern_reads_whole_layers_in_file_order_with_the_queue_full(spied):
    f, calls = spied
    c = f.config
    E, L = c.n_expert, c.n_layer
    two_layers = 2 * E * f.expert_nbytes(0)
    s = C.measure_disk(f, THREADS, 1 << 20, two_layers, 60.0, seed=3, t0=0.0, arena_bytes=8 * _slot(f),
                       pattern="layer")
    where = _experts(f)
    got = []
    for ranges, _, _ in calls:
        parts = {where[(off, n)] for off, n, _ in ranges}
        assert len(ranges) == 3 and len(parts) == 1, ranges      # one read per expert: its gate, up and down
        got.append(parts.pop())
    first = got[0][0]
    # layer after layer from the drawn first one (wrapping), each layer's experts in file order, whole layers
    assert got == [((first + i // E) % L, i % E) for i in range(2 * E)]
    # the queue kept full: after the first `queue` reads, each was issued with at least a read per reader thread
    # still in flight (a batch waited for before the next would issue it with none)
    assert s.queue == 8 and min(q for _, _, q in calls[s.queue:]) >= THREADS, [q for _, _, q in calls]
    assert s.pattern == "layer" and s.bytes >= two_layers and s.seconds > 0 and s.bps > 0
    assert s.mode == _reader_mode(f.path)                            # O_DIRECT wherever the store's reader is
    # each sample draws its first layer from its seed: samples of a run (distinct seeds) read different layers
    firsts = set()
    for seed in range(4):
        calls.clear()
        C.measure_disk(f, THREADS, 1 << 20, E * f.expert_nbytes(0), 60.0, seed, 0.0, 8 * _slot(f), "layer")
        firsts.add(where[calls[0][0][0][:2]][0])
    assert len(firsts) > 1, firsts


def test_random_pattern_waits_for_each_batch(spied):
    f, calls = spied
    s = C.measure_disk(f, THREADS, 1 << 20, 4 * _slot(f), 60.0, seed=3, t0=0.0, arena_bytes=2 * _slot(f))
    assert s.pattern == "random" and s.queue == 2 and s.bps > 0 and s.mode == _reader_mode(f.path)
    assert [len(r) for r, _, _ in calls] == [6] * len(calls) and all(q == 0 for _, _, q in calls)


def test_both_rates_and_the_faster_bounds(tiny_model):
    f = GGUFModelFile.open(str(tiny_model))
    try:
        d = C.measure_disk_rates(f, THREADS, 1 << 20, 2 * f.config.n_expert * f.expert_nbytes(0), 60.0, 5, 0.0)
    finally:
        f.close()
    assert d["random"]["pattern"] == "random" and d["layer"]["pattern"] == "layer"
    assert min(d["random"]["bps"], d["layer"]["bps"]) > 0
    assert d["bps"] == max(d["random"]["bps"], d["layer"]["bps"]) and d["bps"] == d[d["pattern"]]["bps"]
    assert d["bytes"] == d["random"]["bytes"] + d["layer"]["bytes"]
    assert C.disk_rate({"random": 1.6e9, "layer": 2.2e9}) == (2.2e9, "layer")
    assert C.disk_rate({"random": 1.6e9, "layer": 1.1e9}) == (1.6e9, "random")
