"""The store's session stream hands a load's experts over from the reads' completions (services/store_main.py
_Delivery; issue 21's land link: no hop to a thread waiting on the load's landing queue), keeping the rules the loader
thread kept. Checked on StoreServicer._read_session with an in-process ExpertStore over a tiny synth model, real
reads (each piece held 20 ms by the reader's on_read hook, so every expert lands after its message was read):

- every expert of a load is answered from the reader thread whose read completed it (bg-reader-*), not another thread;
- three loads in flight at once on one stream, more experts than staging slots (the rest wait for slots the worker
  hands back): each gets exactly its own experts, once, tagged with its request id, and the servicer forgets each
  load once it ended (its cancel entry, its tick);
- a load cancelled (the worker's Cancel) before its reads land: nothing more is answered for it, no failure either,
  and its experts stay staged for whoever asks.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.plan import plan_slots
from betelgeuse.store.store import ExpertStore
from engine_helpers import ENGINE_SPEC, write_synth
from services.grpc.store_client import _load_request, _release_request
from services.pb.betelgeuse.v1 import store_pb2 as pb
from services.store_main import Leases, StoreServicer

SLOW_S = 0.02


class _Out:
    """A session's answers as sent: (thread name, event), and each load's handed slots given back at once when
    `give_back` (the worker copied the expert), on the session's own stream, as the worker's release is."""

    def __init__(self, requests: queue.SimpleQueue, session: str, give_back: bool):
        self.got: list[tuple[str, pb.SessionEvent]] = []
        self.lock = threading.Lock()
        self.requests, self.session, self.give_back = requests, session, give_back

    def alive(self) -> bool:
        return True

    def put(self, ev):
        if ev is None:
            return
        with self.lock:
            self.got.append((threading.current_thread().name, ev))
        if self.give_back and ev.WhichOneof("kind") == "loaded":
            self.requests.put(_release_request(10_000 + ev.loaded.staging_slot * 1000 + len(self.got), self.session,
                                               [ev.loaded.staging_slot]))

    def loaded(self, rid: int) -> list[tuple[str, pb.SessionEvent]]:
        with self.lock:
            return [(t, ev) for t, ev in self.got if ev.id == rid and ev.WhichOneof("kind") == "loaded"]

    def failed(self) -> list:
        with self.lock:
            return [ev for _, ev in self.got if ev.WhichOneof("kind") == "failed"]


def _serve(tmp_path, staging_slots: int, give_back: bool = False):
    path = write_synth(tmp_path / "m.gguf", **ENGINE_SPEC)
    f = GGUFModelFile.open(str(path))
    cfg = EngineConfig(model_path=str(path), vram_slots=0, host_slots=0, staging_slots=staging_slots)
    store = ExpertStore(f, plan_slots(f, cfg, None), read_threads=2)
    store.reader.on_read = lambda _s: time.sleep(SLOW_S)     # every piece: each read lands well after its message
    session, _ = store.attach(os.getpid())
    store.begin_pass(session)
    servicer = StoreServicer(store, Leases())
    requests: queue.SimpleQueue = queue.SimpleQueue()
    out = _Out(requests, session, give_back)
    t = threading.Thread(target=servicer._read_session, args=(iter(requests.get, None), out.alive, out),
                         name="test-session", daemon=True)
    t.start()
    return store, session, servicer, requests, out, t


def _wait(cond, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_loads_experts_are_answered_from_their_reads_completions(tmp_path):
    store, session, _servicer, requests, out, t = _serve(tmp_path, staging_slots=8)
    try:
        keys = [(0, e) for e in range(4)]
        requests.put(_load_request(1, "load", session, keys))
        _wait(lambda: len(out.loaded(1)) == len(keys))
        got = out.loaded(1)
        assert sorted((ev.loaded.layer, ev.loaded.expert) for _, ev in got) == keys
        assert all(ev.loaded.disk_bytes > 0 for _, ev in got), got
        names = {name for name, _ in got}
        assert all(n.startswith("bg-reader-") for n in names), names       # not a loader thread's hop
    finally:
        requests.put(None)
        t.join(5)
        store.close()


def test_overlapping_loads_each_get_their_own_experts_once(tmp_path):
    store, session, servicer, requests, out, t = _serve(tmp_path, staging_slots=4, give_back=True)
    try:
        loads = {1: [(0, e) for e in range(10)], 2: [(1, e) for e in range(3)], 3: [(0, e) for e in range(8, 11)]}
        for rid, keys in loads.items():          # 3 uses two of 1's experts: staged copies or the same reads
            requests.put(_load_request(rid, "load", session, keys))
        _wait(lambda: all(len(out.loaded(rid)) >= len(k) for rid, k in loads.items()))
        time.sleep(3 * SLOW_S)
        for rid, keys in loads.items():
            got = sorted((ev.loaded.layer, ev.loaded.expert) for _, ev in out.loaded(rid))
            assert got == sorted(keys), (rid, got)
        assert not out.failed()
        _wait(lambda: not servicer._open, 2.0)     # each load forgotten once it ended (the tick prunes it)
        assert store.status()["staging_handed"] == 0
    finally:
        requests.put(None)
        t.join(5)
        store.close()


def test_a_cancelled_load_answers_nothing_more(tmp_path):
    store, session, servicer, requests, out, t = _serve(tmp_path, staging_slots=8)
    try:
        keys = [(1, e) for e in range(3)]
        requests.put(_load_request(1, "load", session, keys))
        requests.put(pb.SessionRequest(id=1, cancel=pb.Cancel()))
        _wait(lambda: store.status()["reads_in_flight"] == 0)
        _wait(lambda: not servicer._open, 2.0)
        time.sleep(2 * SLOW_S)
        assert out.loaded(1) == [] and not out.failed(), out.got
        assert 1 not in servicer._open and store.status()["staging_handed"] == 0
        reads = store.reader.stats.requests[0]
        requests.put(_load_request(2, "load", session, keys))           # staged: answered with no read
        _wait(lambda: len(out.loaded(2)) == len(keys))
        assert store.reader.stats.requests[0] == reads
    finally:
        requests.put(None)
        t.join(5)
        store.close()
