"""The bench's disk ceiling read both ways passes read (services/bench/ceilings.measure_disk), on the real reader
(ExpertReader, O_DIRECT where the filesystem honours it) over a real GGUF: random experts a batch at a time, each
waited for (decode's misses), and whole layers in file order, one read per expert, the reader's queue kept full (a
prefill). A bound must not be beaten by a pass's access pattern, so every bound uses the faster
(serve_meter.disk_rate: max(random, layer)). The reader's read() is wrapped to record each call's ranges and how many
earlier reads had not landed when it was issued (the queue's depth)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store import reader as R
from betelgeuse.store.arena import Arena
from services.bench import ceilings as C
from services.bench.serve import _disk_rates

MiB = 1 << 20
THREADS = 2


@pytest.fixture
def recorded(monkeypatch):
    """Every read() the sample issues: (its ranges, the reads in flight when it was issued)."""
    calls, flying, lock = [], [0], threading.Lock()
    real = R.ExpertReader.read

    def read(self, ranges, priority=0):
        with lock:
            calls.append((list(ranges), flying[0]))
            flying[0] += 1
        fut = real(self, ranges, priority)

        def done(_):
            with lock:
                flying[0] -= 1
        fut.add_done_callback(done)
        return fut
    monkeypatch.setattr(R.ExpertReader, "read", read)
    return calls


def _sample(model, pattern, arena_bytes, max_bytes=1 << 40, seed=0):
    f = GGUFModelFile.open(model)
    try:
        s = C.measure_disk(f, THREADS, 1 * MiB, max_bytes, 30.0, seed, time.perf_counter(), arena_bytes=arena_bytes,
                           pattern=pattern)
        return s, f.config, {(l, e): [p.offset for p in f.expert_parts(l, e)]
                             for l in range(f.config.n_layer) for e in range(f.config.n_expert)}
    finally:
        f.close()


def _slot(model) -> int:
    """The arena bytes of one expert slot of the tiny model (its parts rounded out to 4 KiB, as measure_disk lays them)."""
    with GGUFModelFile.open(model) as f:
        return -(-(f.expert_nbytes(0) + 3 * 2 * R.PAGE) // R.PAGE) * R.PAGE


def _reader_mode(path) -> str:
    """What the store's reader picks on this file (direct wherever the filesystem honours O_DIRECT)."""
    arena = Arena.create(R.PAGE, name="betelgeuse-test-mode")
    try:
        r = R.ExpertReader(str(path), arena, threads=1)
        mode = r.mode
        r.close()
        return mode
    finally:
        arena.close()


def test_the_layer_pattern_reads_whole_layers_in_file_order_with_the_queue_kept_full(tiny_model, recorded):
    s, c, parts = _sample(tiny_model, "layer", arena_bytes=1)          # the fewest slots: 2 reads in flight
    offsets = [r[0] for ranges, _ in recorded for r in ranges]
    # every expert of every layer once (the byte budget is not reached on the tiny model), layer by layer
    by_offset = {o: le for le, os_ in parts.items() for o in os_}
    seen = [by_offset[o] for o in offsets]
    assert sorted(set(seen)) == sorted(parts) and len(seen) == 3 * len(parts)
    assert all(len({by_offset[r[0]] for r in ranges}) == 1 == len(ranges) / 3 for ranges, _ in recorded)  # a read an expert
    layers = [l for l, _ in seen]
    changes = [a for a, b in zip(layers, layers[1:]) if a != b]
    assert len(changes) == c.n_layer - 1, layers                       # each layer's experts read together
    for l in set(layers):
        es = [e for (ll, e) in seen if ll == l]
        assert es == sorted(es), (l, es)                             # in file order
    assert len(recorded) > 2 and max(n for _, n in recorded) == 1      # the next read issued before one finished
    assert s.queue == 2 and s.bps > 0 and s.bytes >= sum(r[1] for ranges, _ in recorded for r in ranges)


def test_the_layer_pattern_keeps_a_read_per_reader_thread_queued(tiny_model, recorded, monkeypatch):
    """With 8 slots and reads landing one by one (each piece up to 10 ms late), every read after the first 8 is issued
    with at least one read per reader thread still in flight: the queue never runs dry (a batch waited for before the
    next would issue it with none). Two layers' budget: consecutive layers from the drawn first one, then it stops."""
    monkeypatch.setenv(R.JITTER_ENV, "5:10")
    with GGUFModelFile.open(tiny_model) as f:
        E, L, nbytes = f.config.n_expert, f.config.n_layer, f.expert_nbytes(0)
    s, _, parts = _sample(tiny_model, "layer", 8 * _slot(tiny_model), max_bytes=2 * E * nbytes, seed=3)
    by_offset = {o: le for le, os_ in parts.items() for o in os_}
    got = [by_offset[ranges[0][0]] for ranges, _ in recorded]
    first = got[0][0]
    assert got == [((first + i // E) % L, i % E) for i in range(2 * E)]
    assert s.queue == 8 and min(n for _, n in recorded[s.queue:]) >= THREADS, [n for _, n in recorded]
    assert s.pattern == "layer" and s.mode == _reader_mode(tiny_model)   # O_DIRECT wherever the store's reader is
    # each sample draws its first layer from its seed: samples of a run (distinct seeds) read different layers
    firsts = set()
    for seed in range(4):
        recorded.clear()
        _sample(tiny_model, "layer", 8 * _slot(tiny_model), max_bytes=E * nbytes, seed=seed)
        firsts.add(by_offset[recorded[0][0][0][0]][0])
    assert len(firsts) > 1, firsts


def test_the_random_pattern_reads_one_batch_at_a_time(tiny_model, recorded):
    s, _, _ = _sample(tiny_model, "random", arena_bytes=1, max_bytes=1 << 20)
    assert s.bps > 0 and len(recorded) >= 1 and max(n for _, n in recorded) == 0
    assert s.pattern == "random" and s.queue == 1 and s.mode == _reader_mode(tiny_model)


def test_both_rates_sampled_and_the_faster_bounds(tiny_model):
    with GGUFModelFile.open(tiny_model) as f:
        d = C.measure_disk_rates(f, THREADS, 1 * MiB, 2 * f.config.n_expert * f.expert_nbytes(0), 30.0, 5, 0.0)
    assert (d["random"]["pattern"], d["layer"]["pattern"]) == ("random", "layer")
    assert min(d["random"]["bps"], d["layer"]["bps"]) > 0
    assert d["bps"] == max(d["random"]["bps"], d["layer"]["bps"]) == d[d["pattern"]]["bps"]
    assert d["bytes"] == d["random"]["bytes"] + d["layer"]["bytes"]
    assert C.disk_rate({"random": 1.6e9, "layer": 2.2e9}) == (2.2e9, "layer")
    assert C.disk_rate({"random": 1.6e9, "layer": 1.1e9}) == (1.6e9, "random")


def test_the_rates_line_names_the_faster_and_both_samples():
    GB = 1e9
    disk = {"bps": 1.63 * GB, "mode": "direct", "random": {"bps": 1.41 * GB}, "layer": {"bps": 1.63 * GB}}
    assert _disk_rates(disk) == "1.63 GB/s (direct; random 1.41, layer 1.63)"


def test_the_depth_curve_reads_exactly_n_experts_a_batch_one_sample_per_n(tiny_model, recorded):
    """measure_disk_depths: one random-pattern sample per N, each batch exactly N whole experts (3 ranges each) waited
    for before the next, so the rate is the disk's at N experts in flight."""
    with GGUFModelFile.open(tiny_model) as f:
        nbytes = f.expert_nbytes(0)
        got = C.measure_disk_depths(f, THREADS, 1 * MiB, 6 * nbytes, 30.0, 11, 0.0, (1, 2, 3))
    assert [s.queue for s in got] == [1, 2, 3] and all(s.bps > 0 and s.pattern == "random" for s in got)
    sizes = [len(ranges) // 3 for ranges, _ in recorded]
    assert max(n for _, n in recorded) == 0                              # each batch waited for before the next
    # batches of 1, then of 2, then of 3 experts: each sample reads until its budget in batches of its N
    assert [n for n, _ in itertools.groupby(sizes)] == [1, 2, 3], sizes
    assert all(s.bytes >= 6 * nbytes for s in got)


def test_reads_in_flight_while_busy_is_one_serially_and_more_with_several(tiny_model):
    """DiskSample.depth = the reader threads' summed seconds inside preadv / the wall seconds with one in flight:
    1.0 for one thread reading one piece at a time; above 1 with 4 threads and 8 experts in flight (pieces overlap)."""
    with GGUFModelFile.open(tiny_model) as f:
        budget = 4 * f.config.n_expert * f.expert_nbytes(0)
        one = C.measure_disk(f, 1, 64 << 10, budget, 30.0, 2, 0.0, queue=1)
        many = C.measure_disk(f, 4, 64 << 10, budget, 30.0, 2, 0.0, queue=8)
    assert one.active_s > 0 and one.depth == pytest.approx(1.0, abs=0.05), (one.busy_s, one.active_s)
    assert many.depth > 1.2, (many.busy_s, many.active_s)
    assert one.to_json()["depth"] == one.depth and one.to_json()["busy_s"] == one.busy_s
