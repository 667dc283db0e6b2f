"""The bench's disk ceiling read both ways passes read (services/bench/ceilings.measure_disk): random experts a batch
at a time (decode's misses) and whole layers in file order with two batches in flight (a prefill). A bound must not
be beaten by a pass's access pattern, so the serve bench bounds every window with the faster (Run._disk_rate)."""

from __future__ import annotations

import threading
import time

import pytest

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store import reader as R
from services.bench import ceilings as C
from services.bench.serve import _disk_rates

MiB = 1 << 20


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


def _sample(model, pattern, arena_bytes, max_bytes=1 << 40):
    f = GGUFModelFile.open(model)
    try:
        s = C.measure_disk(f, 2, 1 * MiB, max_bytes, 30.0, 0, time.perf_counter(), arena_bytes=arena_bytes,
                           pattern=pattern)
        return s, f.config, {(l, e): [p.offset for p in f.expert_parts(l, e)]
                             for l in range(f.config.n_layer) for e in range(f.config.n_expert)}
    finally:
        f.close()


def test_the_layer_pattern_reads_whole_layers_in_file_order_with_the_queue_kept_full(tiny_model, recorded):
    s, c, parts = _sample(tiny_model, "layer", arena_bytes=1)          # one expert a batch
    offsets = [r[0] for ranges, _ in recorded for r in ranges]
    # every expert of every layer once (the byte budget is not reached on the tiny model), layer by layer
    by_offset = {o: le for le, os_ in parts.items() for o in os_}
    seen = [by_offset[o] for o in offsets]
    assert sorted(set(seen)) == sorted(parts) and len(seen) == 3 * len(parts)
    layers = [l for l, _ in seen]
    changes = [a for a, b in zip(layers, layers[1:]) if a != b]
    assert len(changes) == c.n_layer - 1, layers                       # each layer's experts read together
    for l in set(layers):
        es = [e for (ll, e) in seen if ll == l]
        assert es == sorted(es), (l, es)                             # in file order
    assert len(recorded) > 2 and max(n for _, n in recorded) == 1      # the next batch issued before one finished
    assert s.bps > 0 and s.bytes >= sum(r[1] for ranges, _ in recorded for r in ranges)


def test_the_random_pattern_reads_one_batch_at_a_time(tiny_model, recorded):
    s, _, _ = _sample(tiny_model, "random", arena_bytes=1, max_bytes=1 << 20)
    assert s.bps > 0 and len(recorded) >= 1 and max(n for _, n in recorded) == 0


def test_the_rates_line_names_the_faster_and_both_samples():
    GB = 1e9
    disk = {"bps": 1.63 * GB, "mode": "direct", "random": {"bps": 1.41 * GB}, "layer": {"bps": 1.63 * GB}}
    assert _disk_rates(disk) == "1.63 GB/s (direct; random 1.41, layer 1.63)"
