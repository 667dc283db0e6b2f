"""The store's session stream hands a load's experts over from the reads' completions (services/store_main.py
_Delivery; issue 21's land link: no hop to a thread waiting on the load's landing queue), keeping the rules the loader
thread kept. Checked on StoreServicer._read_session with an in-process ExpertStore over a tiny synth model, real
reads (each piece held 20 ms by the reader's on_read hook, so every expert lands after its message was read):

- every expert of a load is answered from the reader thread whose read completed it (bg-reader-*), not another thread;
- three loads in flight at once on one stream, more experts than staging slots (the rest wait for slots the worker
  hands back): each gets exactly its own experts, once, tagged with its request id, and the servicer forgets each
  load once it ended (its cancel entry, its tick);
- a load cancelled (the worker's Cancel) before its reads land: nothing more is answered for it, no failure either,
  and its experts stay staged for whoever asks;
- engine.session_reads (store61): the session reader reads each load's first demand piece itself, and the bytes that
  lands put in the staging slots are the file's (read here from the GGUF file at each part's offset); off, it reads
  none.
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
        # not a loader thread's hop: a reader thread, or the session reader whose own piece (session_reads) was a
        # read's last
        assert all(n.startswith("bg-reader-") or n == "test-session" for n in names), names
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
    assert not store.session_reads               # the Cancel read at once, not after the session's own piece
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


def _pieces_by_thread(store) -> list[tuple[str, int]]:
    """(thread name, file offset) of each piece read from now on, in the order their preadv started."""
    seen: list[tuple[str, int]] = []
    plain = store.reader._read_piece

    def read_piece(p):
        seen.append((threading.current_thread().name, p.offset))
        plain(p)
    store.reader._read_piece = read_piece
    return seen


def test_the_session_reader_reads_each_loads_first_piece(tmp_path):
    store, session, _servicer, requests, out, t = _serve(tmp_path, staging_slots=8)
    try:
        store.session_reads = True
        requests.put(_load_request(1, "load", session, [(2, 0)]))       # warm-up: the servicer's tick thread started
        _wait(lambda: len(out.loaded(1)) == 1)
        seen = _pieces_by_thread(store)
        mine = []
        for rid in range(2, 8):                  # one load at a time, one expert not staged each (as the chain bench)
            key = (rid % 2, rid)
            first = store.model.expert_parts(*key)[0].offset         # the first queued: its first part's first piece
            requests.put(_load_request(rid, "load", session, [key]))
            _wait(lambda: len(out.loaded(rid)) == 1)
            mine.append([off for name, off in seen if name == "test-session"])
            del seen[:]
            (_, ev), = out.loaded(rid)           # the bytes landed are the file's, wherever each piece was read
            with open(store.model.path, "rb") as f:
                for k, part in enumerate(store.model.expert_parts(*key)):
                    f.seek(part.offset)
                    at = store.layout.staging_slot_offset(ev.loaded.staging_slot) + \
                        store.layout.slot.part_data(k, part.offset)
                    assert bytes(store.arena.view(at, part.nbytes)) == f.read(part.nbytes), (key, k)
            mine[-1].append(first - first % 4096)
        # the session's thread read exactly the load's first piece (a reader thread that had the GIL first may take it:
        # a race the session thread wins where nothing hands the GIL over between its queue put and its own take)
        assert sum(len(m) == 2 and m[0] == m[1] for m in mine) >= 5, mine
        assert all(len(m) == 1 or m[0] == m[1] for m in mine), mine           # no other piece
        assert not out.failed()
    finally:
        requests.put(None)
        t.join(5)
        store.close()


def test_no_session_reads_when_off(tmp_path):
    store, session, _servicer, requests, out, t = _serve(tmp_path, staging_slots=8)
    assert not store.session_reads                       # the default (engine.session_reads)
    try:
        seen = _pieces_by_thread(store)
        keys = [(0, e) for e in range(3)]
        requests.put(_load_request(1, "load", session, keys))
        _wait(lambda: len(out.loaded(1)) == len(keys))
        assert seen and all(name.startswith("bg-reader-") for name, _ in seen), seen
    finally:
        requests.put(None)
        t.join(5)
        store.close()
