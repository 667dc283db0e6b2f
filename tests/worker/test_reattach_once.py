"""The store's loss reported twice (a pass's failure, then its request's release in the same turn) starts ONE
re-attach: two threads attaching in turn left the first attachment's next pass with a session the store had
replaced ("this worker session was replaced by a newer attach"; CI's test_kill9_of_the_store_mid_stream)."""

from __future__ import annotations

import threading
import time

from betelgeuse.errors import StoreUnavailableError
from betelgeuse.worker.engine import LLMEngine


class _Runner:
    def __init__(self):
        self.attaches = 0
        self.go = threading.Event()

    def attach(self):
        self.go.wait(5)                     # the store comes back once the test says so
        self.attaches += 1


class _Empty:
    running: list = []

    def abort_waiting(self):
        return []

    def bind_host(self):
        pass


def _engine() -> LLMEngine:
    e = object.__new__(LLMEngine)           # only what _store_down / _reattach touch
    e.store_ok, e.store_why, e.on_state, e._stop = True, None, None, False
    e.cv, e.scheduler, e.kv_manager, e.settle_idle = threading.Condition(), _Empty(), _Empty(), False
    e._reattach_lock, e._reattaching, e.runner = threading.Lock(), False, _Runner()
    return e


def _wait(cond, s: float = 5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < s:
        time.sleep(0.01)
    return cond()


def test_a_loss_reported_twice_attaches_once():
    e = _engine()
    err = StoreUnavailableError("expert store unavailable: gone")
    e._store_down(err)
    e._store_down(err)                      # the same loss, from the request's release
    e.runner.go.set()
    assert _wait(lambda: e.store_ok and not e._reattaching)
    time.sleep(0.1)
    assert e.runner.attaches == 1
    e.runner.go.clear()
    e._store_down(err)                      # a later loss re-attaches again
    e.runner.go.set()
    assert _wait(lambda: e.store_ok and not e._reattaching and e.runner.attaches == 2)
