"""The worker's session stream to a real store process (store.proto `Session`; services/grpc/store_client.py, issue 21):
the loads, reads ahead and releases of a session are messages on ONE stream (gRPC, or a SOCK_SEQPACKET connection:
store.session_transport; each test below runs on both, the latter also with store.session_reader "caller"), answered
tagged with the request's id. Checked here against a
`services.store_main` child (a tiny synth model, few slots):

- two loads in flight at once, their experts read in turn and one before the other, with a read ahead and a release
  sent between them: each load gets exactly its own experts (none twice, none of the other's), the release's slot is
  the store's again, and a load abandoned half-way (closed) is stopped at the store: a later load on the same stream
  (one of its experts staged by the read ahead) gets only its own experts and the pass ends with every slot back;
- a load dropped half-way (no close) is cancelled at the store as a closed one is; one read to its end is not;
- the store stopped while a load waits: it fails at its deadline (DEADLINE_EXCEEDED, as its call did) and the next
  message opens a new stream;
- the store killed while a load waits for its next expert: the load raises StoreUnavailableError ("expert store
  unavailable (UNAVAILABLE): ...", the worker's error, not a gRPC one) within seconds, no hang; so does the next
  message, and the client's reap at the next pass;
- the store killed with no request in flight: the stream is no longer alive once its call ended (the flag its done
  callback sets) and the next message opens a new one;
- seqpacket only: a message over the datagram limit is refused with MessageTooBig before it is sent (the stream goes
  on), and the largest real message (a load of every expert of a 61-layer, 384-expert model) fits the limit a
  default-capped send buffer gives;
- the hand-off (_Stream's class doc; off by default), on: a load of experts returns from its send only once grpc's
  send thread has sent it (a fake call whose sends take 20 ms each: the request is out when send returns), a send
  without it (a release, a prefetch) at once (it is not out yet).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from betelgeuse.config import EngineConfig
from betelgeuse.errors import StoreUnavailableError

L, E = 2, 16
# seqpacket+caller: the seqpacket stream with store.session_reader "caller" (no reader thread: the waiting caller
# reads its answers, _SeqStream's doc; issue 21, cpu-host65); +spin: the caller busy-polling while it waits (gpu-run68)
TRANSPORTS = ("grpc", "seqpacket", "seqpacket+caller", "seqpacket+spin")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = tmp_path_factory.mktemp("stream") / "tiny.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=L, n_expert=E, seed=3), progress=False)
    return path


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


def _store(model, tmp_path, transport):
    from services.assembly import open_store
    cfg = EngineConfig(model_path=str(model), vram_slots=1, host_slots=2, read_threads=2)
    transport, _, reader = transport.partition("+")
    store = open_store(cfg, "process", str(tmp_path / "store"), session_transport=transport)
    assert store.client.session_transport == transport
    store.client.session_reader = reader or "thread"      # before the stream opens (at the first message)
    return store


def _disk(c) -> tuple:
    """Attach -> (the plan, per layer its experts only on disk: a load of the others is refused)."""
    from betelgeuse.store.directory import TIER_DISK, SlotDirectory
    arena, plan = c.attach()
    d = SlotDirectory(arena, plan.layout, create=False)
    return plan, [[(l, e) for e in range(E) if d.lookup(l, e)[0] == TIER_DISK] for l in range(L)]


def test_overlapping_loads_get_their_own_experts(model, tmp_path, transport):
    store = _store(model, tmp_path, transport)
    try:
        c = store.client
        plan, disk = _disk(c)
        n = min(3, plan.n_staging // 4)
        assert n >= 2 and all(len(d) >= 2 * n for d in disk), (plan.n_staging, [len(d) for d in disk])
        c.begin_pass(False)
        a_keys, b_keys = disk[0][:n], disk[1][:n]
        a, b = c.load(a_keys), c.load(b_keys)
        queued = c.prefetch_start(disk[1][n:n + 1])                 # answered between the loads' experts
        got_a, got_b = [next(a)], []
        got_b += list(b)                                          # b's experts read while a's keep coming
        c.release([got_b[0].staging_slot])                                # back mid-way, in order with the next load
        got_a += list(a)
        assert sorted((x.layer, x.expert) for x in got_a) == sorted(a_keys), got_a
        assert sorted((x.layer, x.expert) for x in got_b) == sorted(b_keys), got_b
        slots = [x.staging_slot for x in got_a + got_b]
        assert len(set(slots)) == len(slots), slots               # no slot handed twice
        assert queued() == 1                                      # the read ahead started
        # a load abandoned half-way: stopped at the store; what comes next on the stream is the next load's only
        rest = disk[0][n:2 * n]
        half = c.load(rest)
        first = next(half)
        half.close()
        again = list(c.load(disk[1][n:n + 2]))      # the one read ahead is staged: answered by the store's reader
        assert sorted((x.layer, x.expert) for x in again) == disk[1][n:n + 2], again
        assert any(x.prefetched for x in again), again
        held = [x.staging_slot for x in got_a + got_b[1:] + again] + [first.staging_slot]
        c.end_pass(np.zeros((L, E), dtype=np.int64), False, held)
        c.begin_pass(False)                                       # the slots the abandoned load left are taken back
        c.end_pass(np.zeros((L, E), dtype=np.int64), False)
        assert c.status()["staging_handed"] == 0
    finally:
        store.close()


def test_the_caller_reader_reads_with_no_thread_and_two_waiting_callers_each_get_theirs(model, tmp_path,
                                                                                        monkeypatch):
    """store.session_reader "caller" (_SeqStream's doc): no reader thread; two loads read at once from two threads
    each get their own experts (one thread reads the socket at a time and routes the other's: it wakes the other,
    which reads in its turn), well within their deadlines (the store's reads slowed: they land apart, so one caller
    has its experts while the other's are still coming); an answer nobody waits for (a read ahead's) is routed by
    the next message's drain, not left in the socket. Fails with the reading caller waking nobody (neither as it
    routes an answer nor as it stops reading: the other take waits out its deadline) and with no drain before a
    send (the read ahead's box stays empty); both checked."""
    from betelgeuse.store.reader import JITTER_ENV
    monkeypatch.setenv(JITTER_ENV, "7:80")          # the store child's reads land apart (<= 80 ms a piece)
    store = _store(model, tmp_path, "seqpacket+caller")
    try:
        c = store.client
        plan, disk = _disk(c)
        n = min(3, plan.n_staging // 4)
        c.begin_pass(False)
        before = {t.name for t in threading.enumerate()}
        s = c._session_stream()
        assert s.caller and "store-session-seq" not in {t.name for t in threading.enumerate()} - before
        c.timeout = 3.0                                     # a caller left waiting fails in seconds, not minutes
        # the first caller (one expert) reads the socket first; the second (n experts, asked after it) waits
        # meanwhile, and its experts land after the first's: the first, done, must hand the reading over
        keys = [disk[0][:1], disk[1][:n]]
        loads = [c.load(k) for k in keys]
        got: list = [None, None]

        def read(i):
            got[i] = list(loads[i])
        threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
        t0 = time.monotonic()
        threads[0].start()
        time.sleep(0.005)
        threads[1].start()
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 < 2.5, time.monotonic() - t0
        for i in (0, 1):
            assert got[i] is not None and sorted((x.layer, x.expert) for x in got[i]) == keys[i], (i, got)
        queued = c.prefetch_start(disk[1][n:n + 1])
        rid = max(s._box)                                   # the read ahead's box: nobody waits for it
        t0 = time.monotonic()
        while not s._box.get(rid) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
            s.alive()                                       # each message's first step: the drain
        assert s._box.get(rid), "the read ahead's answer was not routed by the drain"
        assert queued() == 1
        held = [x.staging_slot for x in got[0] + got[1]]
        c.end_pass(np.zeros((L, E), dtype=np.int64), False, held)
        assert c.status()["staging_handed"] == 0
    finally:
        store.close()


class _CountingPoll:
    """select.poll's stand-in counting the calls by timeout (0: a look; > 0: a sleep until a datagram or the time)."""

    def __init__(self, poll):
        self.poll_, self.looks, self.sleeps = poll, 0, 0

    def register(self, *a):
        self.poll_.register(*a)

    def poll(self, ms):
        if ms:
            self.sleeps += 1
        else:
            self.looks += 1
        return self.poll_.poll(ms)


def test_the_spin_reader_busy_polls_its_waits_and_the_caller_reader_sleeps(model, tmp_path, monkeypatch):
    """store.session_reader "spin" (_SeqStream's doc, gpu-run68): a take waiting for a landed expert polls the socket
    with no timeout, many times, for up to SPIN_S before it sleeps in poll; "caller" sleeps in poll at once (its looks
    without a wait are the drains'). Both get the load's experts. The store's reads slowed (the expert lands ~40-80
    ms after the ask, longer than the test's 5 ms spin: the wait's rest a sleep). Fails with the spin loop gone (no looks beyond the
    caller's) or spinning past SPIN_S (no sleep: the whole wait spun)."""
    from betelgeuse.store.reader import JITTER_ENV
    monkeypatch.setenv(JITTER_ENV, "11:80")
    seen = {}
    for reader in ("caller", "spin"):
        store = _store(model, tmp_path / reader, "seqpacket+" + reader)
        try:
            c = store.client
            plan, disk = _disk(c)
            c.begin_pass(False)
            s = c._session_stream()
            assert s.caller and bool(s.spin_s) == (reader == "spin")
            s.spin_s = 0.005 if s.spin_s else 0.0              # shorter than the slowed reads
            s._poll = counting = _CountingPoll(s._poll)
            keys = disk[0][:2]
            got = list(c.load(keys))
            assert sorted((x.layer, x.expert) for x in got) == keys
            seen[reader] = (counting.looks, counting.sleeps)
            c.end_pass(np.zeros((L, E), dtype=np.int64), False, [x.staging_slot for x in got])
        finally:
            store.close()
    (c_looks, c_sleeps), (s_looks, s_sleeps) = seen["caller"], seen["spin"]
    assert c_sleeps >= 1 and s_sleeps >= 1, seen                 # the reads outlast a spin: both slept at last
    assert s_looks >= c_looks + 20, seen                        # 5 ms of polls without a wait, ~µs each


def test_a_load_dropped_before_its_end_is_cancelled_at_the_store(model, tmp_path, transport):
    """A load's stream (GrpcStoreClient._Landed, a class since cpu-host61, was a generator) dropped half-way with no
    close() sends the store a cancel of the load as close() does (__del__; the generator's close did at its drop), and
    its box is forgotten; a load read to its end is forgotten, not cancelled, whether dropped or read past its end.
    The cancels are recorded on the client's stream; the store stops the dropped load: the next load gets only its
    own experts and the pass ends with every slot back. Fails without _Landed.__del__ (no cancel) or with close()
    cancelling a finished load."""
    import gc
    store = _store(model, tmp_path, transport)
    try:
        c = store.client
        plan, disk = _disk(c)
        c.begin_pass(False)
        s = c._session_stream()
        cancels, cancel = [], s.cancel
        s.cancel = lambda rid: (cancels.append(rid), cancel(rid))[1]
        whole = c.load(disk[0][:2])
        got = list(whole)                                     # read past its end: forgotten there
        assert cancels == [] and whole._rid not in s._box
        whole2 = c.load(disk[0][2:3])
        got += [next(whole2)]                                 # its last: dropped with nothing left
        rid = whole2._rid
        del whole2
        gc.collect()
        assert cancels == [] and rid not in s._box
        half = c.load(disk[0][3:6])
        first = next(half)
        rid = half._rid
        del half                                              # two of its experts still coming
        gc.collect()
        assert cancels == [rid] and rid not in s._box
        again = list(c.load(disk[1][:2]))
        assert sorted((x.layer, x.expert) for x in again) == disk[1][:2], again
        c.end_pass(np.zeros((L, E), dtype=np.int64), False,
                   [x.staging_slot for x in got + again] + [first.staging_slot])
        c.begin_pass(False)                                   # the slots the dropped load left are taken back
        c.end_pass(np.zeros((L, E), dtype=np.int64), False)
        assert c.status()["staging_handed"] == 0
    finally:
        store.close()


def test_store_killed_mid_load_raises_the_workers_error(model, tmp_path, transport):
    store = _store(model, tmp_path, transport)
    try:
        c = store.client
        plan, disk = _disk(c)
        keys = disk[0] + disk[1]
        assert len(keys) > plan.n_staging, (len(keys), plan.n_staging)
        c.begin_pass(False)
        loads = c.load(keys)                         # more than the staging slots: it waits once all are held
        held = [next(loads) for _ in range(plan.n_staging)]
        out: dict = {}

        def wait_next():
            try:
                out["got"] = next(loads)
            except BaseException as e:                # noqa: BLE001 -- what the test checks
                out["error"] = e
        t = threading.Thread(target=wait_next, daemon=True)
        t.start()
        t.join(0.3)
        assert t.is_alive(), f"the load did not wait for a staging slot: {out}"
        os.kill(store.proc.pid, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "the load hung after the store died"
        e = out.get("error")
        assert isinstance(e, StoreUnavailableError), out
        assert str(e).startswith("expert store unavailable (UNAVAILABLE)"), str(e)
        with pytest.raises(StoreUnavailableError, match=r"^expert store unavailable \(UNAVAILABLE\)"):
            c.release([x.staging_slot for x in held])
            c.begin_pass(False)
    finally:
        store.close()


def test_a_hung_store_fails_the_load_at_its_deadline_and_the_stream_reopens(model, tmp_path, transport):
    """The store stopped (SIGSTOP) while a load waits: the load fails at its deadline with the error its own call's
    deadline gave ("expert store unavailable (DEADLINE_EXCEEDED)"), not later than the watch's period after it; once
    the store goes on, the next message opens a new stream and is answered."""
    import time
    store = _store(model, tmp_path, transport)
    pid = store.proc.pid
    try:
        c = store.client
        plan, disk = _disk(c)
        c.begin_pass(False)
        c.timeout, c.per_expert = 0.5, 0.0
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=r"^expert store unavailable \(DEADLINE_EXCEEDED\)"):
            list(c.load(disk[0][:1]))
        assert 0.5 <= time.monotonic() - t < 0.5 + 4 * getattr(c._stream, "WATCH_S", 0.25), time.monotonic() - t
        os.kill(pid, signal.SIGCONT)
        c.timeout = 10.0
        got = list(c.load(disk[1][:1]))
        assert [(x.layer, x.expert) for x in got] == disk[1][:1]
    finally:
        os.kill(pid, signal.SIGCONT)
        store.close()


def test_a_stream_whose_store_died_is_not_alive(model, tmp_path, transport):
    """_Stream.alive() (a flag the call's done callback sets, not call.done() at every message) turns False once the
    call ends with no request in flight, as call.done() does: the next message opens a new stream."""
    import time
    store = _store(model, tmp_path, transport)
    try:
        c = store.client
        _disk(c)
        c.begin_pass(False)
        s = c._session_stream()
        # seqpacket: the reader thread's EOF, or (caller) the drain alive() runs
        ended = (lambda: s.call.done()) if transport == "grpc" else (lambda: not s.alive())
        assert transport == "grpc" or s.caller == ("+" in transport), (transport, s.caller)
        assert s.alive() and not ended()
        os.kill(store.proc.pid, signal.SIGKILL)
        t = time.monotonic()
        while not ended() and time.monotonic() - t < 10:
            time.sleep(0.01)
        assert ended(), "the stream's call did not end after the store died"
        t = time.monotonic()
        while s.alive() and time.monotonic() - t < 1:      # the callback runs right after done() turns True
            time.sleep(0.01)
        assert not s.alive(), "alive() after the call ended"
        with pytest.raises(StoreUnavailableError):
            c.release([])
            c.begin_pass(False)
        assert c._stream is not s, "the next message did not open a new stream"
    finally:
        store.close()


def test_a_datagram_over_the_receivers_buffer_is_refused_not_cut(monkeypatch):
    """session_seq.receiver reads each datagram whole (recv_into with MSG_TRUNC: its length even where longer than the
    buffer, cpu-host62): one of MAX_BYTES is a message, one byte more raises MessageTooBig rather than parsing the
    first MAX_BYTES; the peer's close ends it. Fails where the length is taken from what fit (checked: a truncated
    read without the flag yields the cut bytes)."""
    import socket

    from services.grpc import session_seq
    monkeypatch.setattr(session_seq, "MAX_BYTES", 64)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        got = session_seq.receiver(b, bytes)
        a.send(b"x" * 64)
        assert next(got) == b"x" * 64
        a.send(b"y" * 65)
        with pytest.raises(session_seq.MessageTooBig, match="over 64 bytes arrived truncated"):
            next(got)
        got = session_seq.receiver(b, bytes)
        a.send(b"z")
        a.close()
        assert list(got) == [b"z"]
    finally:
        a.close()
        b.close()


def test_a_seqpacket_message_over_the_limit_is_refused_and_the_stream_goes_on(model, tmp_path):
    from services.grpc.session_seq import MessageTooBig
    from services.grpc.store_client import _load_request
    store = _store(model, tmp_path, "seqpacket")
    try:
        c = store.client
        plan, disk = _disk(c)
        c.begin_pass(False)
        s = c._session_stream()
        big = [(1, 1 + e % (E - 1)) for e in range(s.limit // 3)]  # 6 bytes an ExpertId: twice the limit
        with pytest.raises(MessageTooBig, match=r"over the SOCK_SEQPACKET session socket's \d+-byte datagram"):
            c.prefetch_start(big)
        assert c._stream is s and s.alive()
        got = list(c.load(disk[0][:2]))                             # the stream goes on, answers routed as before
        assert sorted((x.layer, x.expert) for x in got) == disk[0][:2]
        c.end_pass(np.zeros((L, E), dtype=np.int64), False, [x.staging_slot for x in got])
        assert c.status()["staging_handed"] == 0
        # the largest real message: a load of every expert of a 61-layer, 384-expert model in one request
        every = [(l, e) for l in range(61) for e in range(384)]
        n = len(_load_request(2**31, "load", "f" * 32, every).SerializeToString())
        assert n < 2 * 212992 - 1024, n            # the limit with SO_SNDBUF capped at the default wmem_max
        assert n < s.limit, (n, s.limit)
    finally:
        store.close()


class _FakeCall:
    """A Session call as grpc makes one: a thread takes each request and sends it (here: 20 ms, then recorded), and
    asks for the next only once that send has completed."""

    def __init__(self, requests):
        self.sent: list = []
        self._t = threading.Thread(target=self._consume, args=(requests,), daemon=True)
        self._t.start()

    def _consume(self, requests):
        for r in requests:
            time.sleep(0.02)
            self.sent.append(r)

    def done(self):
        return False

    def add_done_callback(self, fn):
        pass

    def cancel(self):
        pass


def test_a_load_returns_from_its_send_once_it_is_sent(monkeypatch):
    from services.grpc.store_client import _Stream
    monkeypatch.setattr(_Stream, "HANDOFF_S", 5.0)        # generous on a loaded CI box: never reached here
    s = _Stream(_FakeCall)
    try:
        for i in range(3):
            rid = s.send(lambda r: ("load", r), handoff=True)
            assert ("load", rid) in s.call.sent, (i, s.call.sent)
            rid = s.send(lambda r: ("release", r))
            assert ("release", rid) not in s.call.sent, (i, s.call.sent)    # 20 ms to go: not sent yet
    finally:
        s.close()


def test_session_transport_from_the_environment_is_checked(monkeypatch):
    """connect_store without a transport reads BETELGEUSE_STORE_SESSION_TRANSPORT as the settings do (quotes allowed,
    unset: the setting's default); a value that is no transport is refused naming the setting, before any socket."""
    from betelgeuse.errors import BetelgeuseError
    from services.assembly import connect_store
    monkeypatch.delenv("BETELGEUSE_STORE_SESSION_TRANSPORT", raising=False)
    assert connect_store("/nonexistent/s.sock", "/nonexistent/f.sock").session_transport == "seqpacket"
    monkeypatch.setenv("BETELGEUSE_STORE_SESSION_TRANSPORT", '"grpc"')
    assert connect_store("/nonexistent/s.sock", "/nonexistent/f.sock").session_transport == "grpc"
    monkeypatch.setenv("BETELGEUSE_STORE_SESSION_TRANSPORT", "udp")
    with pytest.raises(BetelgeuseError, match=r"store\.session_transport must be one of grpc, seqpacket, got 'udp'"):
        connect_store("/nonexistent/s.sock", "/nonexistent/f.sock")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_take_returns_routed_answers_first_then_the_end_or_the_cancel(transport):
    """A stream's take (both transports; the box read inline, cpu-host60): answers routed to the request are returned
    in order even where the stream ended since; an empty box of an ended stream raises its error, and a request whose
    box is gone (forget: an abandoned load) raises CANCELLED at once, not at its deadline. Fails with the box-gone
    test dropped (the take waits out its deadline, then fails the stream with DEADLINE_EXCEEDED)."""
    import collections
    import grpc
    from services.grpc import store_client as sc
    cls = sc._Stream if transport == "grpc" else sc._SeqStream
    s = cls.__new__(cls)                    # the take's state only (no call, no socket)
    s._lock = threading.RLock()
    s._cv = threading.Condition(s._lock)
    s._box, s.error, s._waits, s._pumping = {}, None, {}, False
    s._end = lambda err: setattr(s, "error", s.error or err)        # _SeqStream's deadline path, without a socket
    far = time.monotonic() + 30
    s._box[1] = collections.deque(["a", "b"])
    assert s.take(1, far) == "a"
    s.error = sc._Failed(grpc.StatusCode.UNAVAILABLE, "ended")
    assert s.take(1, far) == "b"                # routed before the end: still its own
    with pytest.raises(grpc.RpcError) as e:
        s.take(1, far)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    s.error = None
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        s.take(2, time.monotonic() + 2)         # no box: forgotten
    assert e.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t < 1
