"""betelgeuse/gc_pauses.py: the collector's pauses as timed by its callbacks, and the freeze the worker makes once ready
(later collections skip what start-up left; a re-attach's refreeze collects what it let go)."""

from __future__ import annotations

import gc
import weakref

from betelgeuse.gc_pauses import GcPauses, freeze, refreeze


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a            # only the cyclic collector frees these
    return weakref.ref(a)


def test_each_collection_is_timed_by_generation():
    seen = []
    p = GcPauses(lambda g, s: seen.append((g, s))).start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        p.stop()
    assert p.count[2] >= 1 and p.count[0] >= 1 and p.seconds[2] > 0
    assert any(g == 2 for g, _ in seen)
    assert sum(s for _, s in seen) == p.total_s() and len(seen) == sum(p.count)
    n = sum(p.count)
    gc.collect()                        # stopped: no longer counted
    assert sum(p.count) == n


def test_frozen_objects_are_skipped_until_refreeze_collects_what_was_let_go():
    assert gc.get_freeze_count() == 0
    try:
        held = [_Node() for _ in range(100)]
        ref = _cycle()                  # garbage before the freeze: its collection frees it
        kept = _Node()
        kept.me = kept                  # alive at the freeze (start-up's), in a cycle
        gone = weakref.ref(kept)
        n = freeze()
        assert ref() is None and n >= len(held)
        later = _cycle()
        del kept                        # a frozen object let go (a re-attach's old attachment)
        gc.collect()
        assert gone() is not None       # frozen: no collection walks it
        assert later() is None          # made after the freeze: collected as ever
        assert refreeze() > 0 and gone() is None
    finally:
        gc.unfreeze()
    assert refreeze() == 0              # nothing frozen: nothing done


def test_the_worker_histogram_has_every_generation():
    from prometheus_client import generate_latest

    from betelgeuse.metrics import make_worker_metrics
    m = make_worker_metrics()
    p = GcPauses(lambda g, s: m.gc_pause.labels(str(g)).observe(s)).start()
    try:
        gc.collect()
    finally:
        p.stop()
    text = generate_latest(m.registry).decode()
    for g in "012":
        assert f'betelgeuse_gc_pause_seconds_count{{generation="{g}"}}' in text
    assert 'betelgeuse_gc_pause_seconds_count{generation="2"} 0.0' not in text
