"""The worker's StoreClient over gRPC on a Unix socket, plus the arena fd over a second socket.

Every call has a deadline that matches its work (`timeout` for control calls; a load adds `per_expert` seconds
per expert it asks for), so a hung store can hold the engine for a bounded time only; abort() (from the health
probe) ends the calls in flight at once. The fd-socket connection stays open for the session: it is the
worker's lease on the store (the store refuses a second worker while it is open).

A session's loads, reads ahead and releases go as messages on ONE long-lived stream (store.proto `Session`; _Stream),
opened when the channel is bound and re-opened after it failed: a new RPC per Load cost the worker's thread ~140 µs of
CPU on a 2-core box, a message on the open stream ~40 µs, its send a queue put (docs/benchmarks/cpu-store-stream).
grpc consumes the requests on one thread per stream and the caller that waits for an answer reads the stream itself,
routing the answers of other requests to them by id (no thread per message; no hop through a reader thread). The
other calls (attach, passes, status, Engram) stay unary RPCs on the same channel: a pass begins and ends only once
every message on the stream is answered (_reap), so the store sees them in the order sent.

store.session_transport = "seqpacket" (the default; gpu-run57) moves the session stream (only it) off gRPC onto a SOCK_SEQPACKET connection
of its own (services/grpc/session_seq.py; _SeqStream): the same messages, sent by the caller's thread, answers
routed by one reader thread (store.session_reader = "caller": read by the caller that waits for one, no thread);
gRPC's three thread hops a message out of the way.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import queue
import select
import socket
import threading
import time

import grpc
import numpy as np

from betelgeuse.errors import BetelgeuseError, StoreBusyError, StoreUnavailableError
from betelgeuse.store.arena import Arena, recv_fds
from betelgeuse.store.engram import EngramLanded
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.store import Loaded
from services.grpc import session_seq
from services.pb.betelgeuse.v1 import store_pb2 as pb
from services.pb.betelgeuse.v1 import store_pb2_grpc as pb_grpc


def _unavailable(e: grpc.RpcError) -> BetelgeuseError:
    code = e.code() if hasattr(e, "code") else None
    detail = (e.details() if hasattr(e, "details") else str(e)) or ""
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return StoreBusyError(detail)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return BetelgeuseError(f"the expert store refused this worker: {detail}")
    # grpc's connection errors are long and repetitive; the first clause says what happened
    detail = detail.split(";")[0].strip()
    return StoreUnavailableError(f"expert store unavailable ({code.name if code else 'error'}): {detail}")


def _load_request(rid: int, kind: str, session: str, experts=(), release=(), ahead=(), drop=()):
    """SessionRequest(id=rid, <kind>=LoadRequest(...)) (kind: load or prefetch; experts, ahead, drop: (layer, expert)
    pairs) built in place: upb copies a sub-message passed to a constructor (the LoadRequest into the SessionRequest,
    each ExpertId into its list), ~5.1 -> ~2.7 us a decode message on a 2-vCPU box; the same message (the test
    compares the two: tests/services/test_store_client_encode.py)."""
    m = pb.SessionRequest(id=rid)
    req = getattr(m, kind)
    req.session = session             # sets the oneof, also to "" with every list empty (the test's empty prefetch)
    for field, keys in ((req.experts, experts), (req.ahead, ahead), (req.drop, drop)):
        add = field.add
        for l, e in keys:
            add(layer=l, expert=e)
    req.release.extend(release)
    return m


def _release_request(rid: int, session: str, slots):
    """SessionRequest(id=rid, release=ReleaseRequest(session=session, staging_slots=slots)) built in place, as
    _load_request."""
    m = pb.SessionRequest(id=rid)
    m.release.session = session             # sets the oneof, also to "" with no slot
    m.release.staging_slots.extend(slots)
    return m


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _Failed(grpc.RpcError):
    """A request's `failed` answer (or the stream's end), as the RpcError its own call would have raised."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


# what StoreClient._failing turns into the worker's errors (_as_worker), in its order of rules
_FAILING = (grpc.RpcError, ValueError, grpc.FutureCancelledError)


def _failed(ev) -> _Failed:
    return _Failed(_CODES.get(ev.failed.code, grpc.StatusCode.UNKNOWN), ev.failed.details)


class _Boxes:
    """What both session streams share: each request's answers routed to its box by id (_cv's lock, _lock, guards
    _box and error);
    a subclass sends with _post and says alive()."""

    def forget(self, rid: int):
        with self._lock:
            self._box.pop(rid, None)

    def answered(self, rid: int) -> bool:
        """An answer to `rid` is routed, or the stream ended (no waiting: what a waiting caller read meanwhile)."""
        return bool(self._box.get(rid)) or self.error is not None

    def cancel(self, rid: int):
        """Stop the load `rid` at the store (an abandoned pass) and drop what still comes for it."""
        self.forget(rid)
        if self.alive():
            self._post(pb.SessionRequest(id=rid, cancel=pb.Cancel()))

    def _failure(self) -> grpc.RpcError:
        """What a take raises where rid's box is empty and the stream ended (its error), or where the box is gone
        (forget: an abandoned load, CANCELLED). The takes read the box themselves (the caller holds _cv), this only
        where one of those holds: no call a routed answer (a landed expert's: issue 21, cpu-host60)."""
        return self.error if self.error is not None else _Failed(grpc.StatusCode.CANCELLED, "the request was cancelled")


class _Stream(_Boxes):
    """ONE Session call (store.proto): requests put on a queue that grpc's thread for the call sends, in order; the
    answers read by whichever caller waits for one (one at a time: `_pumping`), each routed to its request's box
    by id; a box nobody owns any more (a load abandoned, its cancel sent) drops what still comes for it.

    Deadlines: a caller waiting past its request's deadline (a hung store) cancels the call; every request on it then
    fails with DEADLINE_EXCEEDED, as each call did on its own deadline (a watch thread per stream looks 4x a second).
    The call's end (the store died, abort() closed the channel) fails every request still waiting, with its error.

    Hand-off (off: HANDOFF_S = 0): a load of experts would wait, at most HANDOFF_S, until grpc's send thread has sent
    it (taken it off the queue and come back for the next: _requests counts them). That thread needs this process's
    GIL to take and send it; without the wait it gets it once the caller blocks or releases it (a torch call does),
    or after the interpreter's 5 ms switch interval, so the load sits in the queue through the caller's pure-Python
    work after the send while the disk idles for it: on a 2-core CPU, 300 us of Python after the send put ~500 us
    between the send and the store taking the message, ~150-210 us with the hand-off (0.002 s), at ~200-350 us of
    the caller's wait (counted as the message's host time). A CPU decode showed no change (its layer's work after the
    load is mostly torch calls): off until a device run's idle chain (services/bench/disk_idle.py "message") says the
    load waits there (docs/benchmarks/cpu-crit51). A prefetch never waits (the caller has no answer to wait for)."""

    WATCH_S = 0.25
    HANDOFF_S = 0.0     # s; 0.002 turns the hand-off on (class doc)

    def __init__(self, method):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._put = 0                                   # requests queued / taken by grpc's send thread (hand-off)
        self._taken = 0
        self._handoff = threading.Condition()
        self.call = method(self._requests())            # no deadline: it lives as long as the session
        # _cv's lock, entered directly (`with self._lock`; wait / notify stay _cv's, which owns it): what Condition's
        # __enter__ / __exit__ do, less their two Python calls a time (a landed expert's take: issue 21, cpu-host59)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._box: dict[int, collections.deque] = {}    # request id -> answers routed, not yet taken
        self._waits: dict[int, float] = {}              # request id -> deadline of the caller waiting for it
        self._pumping = False
        self.error: grpc.RpcError | None = None         # what the call ended with
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        # the call ended (grpc runs its done callbacks as it ends, at once where it has): what alive() reads instead of
        # call.done() at every message, which takes grpc's call lock (its event thread holds it handling events)
        self._ended = False
        self.call.add_done_callback(self._on_end)
        threading.Thread(target=self._watch, name="store-stream-watch", daemon=True).start()

    def _on_end(self, _call):
        self._ended = True

    def _requests(self):
        """The call's requests to grpc's send thread, each counted once sent (the thread asks for the next only after
        its send of the last completed: send's hand-off; the condition taken only while the hand-off is on)."""
        while (r := self._q.get()) is not None:
            yield r
            self._taken += 1
            if self.HANDOFF_S:
                with self._handoff:
                    self._handoff.notify_all()

    def _queue(self, req, handoff: bool = False):
        """Put a request on the call's queue; handoff (and HANDOFF_S): wait (<= HANDOFF_S) until grpc's send thread has
        sent it. Off, a count and the put: nothing more a message (the stream's per-message host cost, cpu-host51)."""
        self._put += 1
        if not (handoff and self.HANDOFF_S):
            self._q.put(req)
            return
        n = self._put
        with self._handoff:
            self._q.put(req)
            self._handoff.wait_for(lambda: self._taken >= n, self.HANDOFF_S)

    def alive(self) -> bool:
        return self.error is None and not self._ended

    def send(self, make, args=(), handoff: bool = False) -> int:
        """Queue the request make(id, *args) -> its id (the answers' box open from now on). handoff: once grpc's send
        thread has sent it (class doc)."""
        rid = next(self._ids)
        with self._lock:
            if self.error is not None:
                raise self.error
            self._box[rid] = collections.deque()
        self._queue(make(rid, *args), handoff)
        return rid

    def _post(self, req):
        self._queue(req)

    def take(self, rid: int, deadline: float):
        """The next answer to `rid` (its own in the order sent), reading the stream meanwhile if nobody else does."""
        with self._lock:
            self._waits[rid] = deadline
        try:
            while True:
                with self._lock:
                    while True:
                        box = self._box.get(rid)
                        if box:                     # rid's next answer, routed
                            return box.popleft()
                        if box is None or self.error is not None:
                            raise self._failure()
                        if not self._pumping:
                            self._pumping = True
                            break
                        self._cv.wait()
                ev = err = None
                try:
                    ev = next(self.call)            # the one reader, outside the lock
                except StopIteration:
                    err = _Failed(grpc.StatusCode.UNAVAILABLE, "the store ended the session stream")
                except grpc.RpcError as e:
                    err = e
                with self._lock:
                    self._pumping = False
                    if err is not None:
                        self.error = self.error or err      # a deadline the watch set stays the reason
                    else:
                        box = self._box.get(ev.id)
                        if box is not None:
                            box.append(ev)
                    self._cv.notify_all()
        finally:
            with self._lock:
                self._waits.pop(rid, None)

    def _watch(self):
        while not self._closed.wait(self.WATCH_S):
            with self._lock:
                late = self.error is None and any(t < time.monotonic() for t in self._waits.values())
                if late:
                    self.error = _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if late:
                self.call.cancel()
            if self.call.done():
                return

    def close(self):
        self._closed.set()
        self._q.put(None)                       # half-close: the store's end of the stream finishes
        self.call.cancel()


class _SeqStream(_Boxes):
    """The session stream on a SOCK_SEQPACKET connection (services/grpc/session_seq.py) with _Stream's interface:
    the caller's thread sends its request itself (one datagram: no queue, no send thread); the answers are routed to
    their requests' boxes by id, read by one of two readers (store.session_reader):

    thread  (the default) one reader thread reads every answer as it arrives and wakes the callers waiting: answers
            nobody waits for yet (releases, prefetches) are drained as they come. Each answer is a wakeup of that
            thread and a turn of the GIL it takes from the caller's, also while the caller works (issue 21: ~14 a
            decode token, one a landed expert; docs/benchmarks/cpu-host62, cpu-host65).
    caller  no thread: a caller that waits for an answer reads the socket itself (one at a time, `_reading`, as
            _Stream's _pumping: the others wait on _cv and the reader wakes them), routing what it reads to its
            box; the answers nobody waits for are drained (read without a wait) before each message's send (alive:
            _session_stream asks it first) and where a caller asks whether one has come (answered: a load's
            ready()), so at most a message's answers queue in the socket between sends (a load's landed experts,
            a few hundred bytes: the store's sends never wait on a full buffer while it has requests to read). A
            landed expert waited for is one wakeup of the waiting thread itself (its poll), and none of another
            thread while the caller works (issue 21: gpu-run67's profile, cpu-host65).
    spin    the caller reader whose wait busy-polls the socket (poll with no timeout, the GIL released each turn) for
            at most SPIN_S before it sleeps in poll: the waiting thread stays on its core. Why: gpu-run68 measured
            the caller reader no faster than the thread (host 141 against 122-163 µs an application), and a token's
            host growing with its wait for the disk at the same work (49 µs of host per ms of wall; gpu-run67: a copy
            call 83 µs against 6-30 alone); if that is a core woken cold after each of the ~17 sleeps a token
            (deploy/device/h2d_call.py --idle measures it), spinning removes it, at the price of one core busy while
            a decode waits for the disk. For device A/B runs; not a default.

    Deadlines: a caller waiting past its request's deadline fails the stream with DEADLINE_EXCEEDED (as _Stream's
    watch does) and shuts the connection; the connection's end (EOF: the store died or closed it; close(); abort())
    fails every request still waiting with the error it ended with, as _Stream's call's end does."""

    READERS = ("thread", "caller", "spin")
    SPIN_S = 0.05       # spin: the longest busy poll of one wait, s (a disk expert of 13.4 MB lands in ~5-15 ms)

    def __init__(self, path: str, timeout: float, reader: str = "thread"):
        assert reader in self.READERS, reader
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.limit = session_seq.tune(sock)     # bytes: the largest request this end sends
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise StoreUnavailableError(f"expert store unavailable (UNAVAILABLE): cannot reach its session socket "
                                        f"{path}: {e.strerror or e}") from None
        self.sock = sock
        # _cv's lock, entered directly (`with self._lock`; wait / notify stay _cv's, which owns it): what Condition's
        # __enter__ / __exit__ do, less their two Python calls a time (a landed expert's take: issue 21, cpu-host59)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._box: dict[int, collections.deque] = {}    # request id -> answers routed, not yet taken
        self.error: grpc.RpcError | None = None         # what the stream ended with
        self._ids = itertools.count(1)
        # takes in _cv.wait now (under _lock): the reader wakes them only where one waits. An answer nobody waits
        # for (a release's, a prefetch's, a landed expert read from its box before any wait) costs the reader no
        # notify_all (two Python calls and the waiters' walk an answer: issue 21, cpu-host62)
        self._waiting = 0
        self.caller = reader in ("caller", "spin")      # store.session_reader (class doc)
        self.spin_s = self.SPIN_S if reader == "spin" else 0.0
        if self.caller:
            self._reader = session_seq.Reader(sock, pb.SessionEvent.FromString)
            self._reading = False                       # a caller reads the socket now (class doc)
            self._poll = select.poll()                  # its wait for the next datagram, within a deadline
            self._poll.register(sock, select.POLLIN)
        else:
            threading.Thread(target=self._read, name="store-session-seq", daemon=True).start()

    def _read(self):
        err = _Failed(grpc.StatusCode.UNAVAILABLE, "the store ended the session stream")
        try:
            for ev in session_seq.receiver(self.sock, pb.SessionEvent.FromString):
                with self._lock:
                    self._route(ev)
        except (OSError, BetelgeuseError) as e:
            err = _Failed(grpc.StatusCode.UNAVAILABLE, f"the session socket failed: {e}")
        self._end(err)
        self.sock.close()                           # here only: no other thread reads it any more

    def _route(self, ev):
        """An answer read (under _lock) to its request's box (a box forgotten: dropped), the waiting takes woken."""
        box = self._box.get(ev.id)
        if box is not None:
            box.append(ev)
            if self._waiting:
                self._cv.notify_all()

    def _end(self, err: grpc.RpcError):
        """The stream ends with `err` (the first reason stays), every waiter fails with it; the reader sees EOF."""
        with self._lock:
            self.error = self.error or err
            self._cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _pump(self, wait_s: float | None) -> bool:
        """caller: read one answer and route it (the caller holds `_reading`, not _lock); wait_s None: without a wait.
        -> whether one was read; the connection's end or failure ends the stream (error set)."""
        try:
            # poll first (0: none queued -> False, no exception raised), then the datagram it saw, without a wait;
            # spin: polls with no timeout for up to spin_s of the wait first, then one that sleeps for the rest
            ready = False
            if wait_s is not None and self.spin_s:
                end = time.monotonic() + min(wait_s, self.spin_s)
                while not ready and time.monotonic() < end:
                    ready = bool(self._poll.poll(0))
                wait_s = max(0.0, wait_s - self.spin_s)
            if not ready and not self._poll.poll(0 if wait_s is None else max(1, int(wait_s * 1000) + 1)):
                return False
            ev = self._reader.read(socket.MSG_DONTWAIT)
        except BlockingIOError:                     # another reader took it (a drain beside a closing stream)
            return False
        except (OSError, BetelgeuseError) as e:
            self._end(_Failed(grpc.StatusCode.UNAVAILABLE, f"the session socket failed: {e}"))
            return False
        if ev is None:
            self._end(_Failed(grpc.StatusCode.UNAVAILABLE, "the store ended the session stream"))
            return False
        with self._lock:
            self._route(ev)
        return True

    def _drain(self):
        """caller: the answers queued in the socket routed, without a wait, unless a caller reads it now."""
        with self._lock:
            if self._reading or self.error is not None:
                return
            self._reading = True
        try:
            while self._pump(None):
                pass
        finally:
            with self._lock:
                self._reading = False
                if self._waiting:
                    self._cv.notify_all()

    def answered(self, rid: int) -> bool:
        if self.caller and not self._box.get(rid):
            self._drain()
        return bool(self._box.get(rid)) or self.error is not None

    def alive(self) -> bool:
        """caller: the answers queued drained first (each message's send asks this first: _session_stream), so a
        store that ended the connection reads as gone here, as the reader thread's EOF makes it."""
        if self.caller:
            self._drain()
        return self.error is None

    def send(self, make, args=(), handoff: bool = False) -> int:
        """Send the request make(id, *args) now, from this thread -> its id (the answers' box open from now on).
        handoff: _Stream's; nothing to wait for here (the send is the kernel's)."""
        rid = next(self._ids)
        data = make(rid, *args).SerializeToString()
        session_seq.check_size(len(data), self.limit)
        with self._lock:
            if self.error is not None:
                raise self.error
            self._box[rid] = collections.deque()
        try:
            self.sock.send(data)
        except OSError as e:
            self._end(_Failed(grpc.StatusCode.UNAVAILABLE, f"the session socket failed: {e.strerror or e}"))
            raise self.error from None
        return rid

    def _post(self, req):
        try:
            self.sock.send(req.SerializeToString())
        except OSError:
            pass                                    # the reader sees the end

    def take(self, rid: int, deadline: float):
        """The next answer to `rid` (its own in the order sent), waiting at most until `deadline` (caller: reading
        the socket meanwhile where no other caller does)."""
        with self._lock:
            while True:
                box = self._box.get(rid)
                if box:                             # rid's next answer, routed
                    return box.popleft()
                if box is None or self.error is not None:
                    raise self._failure()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if self.caller and not self._reading:
                    self._reading = True            # this caller reads (outside the lock), then looks again
                    self._lock.release()
                    try:
                        self._pump(left)
                    finally:
                        self._lock.acquire()
                        self._reading = False
                        if self._waiting:           # another caller may read now, or its answer came
                            self._cv.notify_all()
                    continue
                self._waiting += 1                  # the reader's notify (an exception here leaves it high:
                self._cv.wait(left)                 # a notify more, never one less)
                self._waiting -= 1
        self._end(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        raise self.error

    def close(self, err: grpc.RpcError | None = None):
        self._end(err or _Failed(grpc.StatusCode.CANCELLED, "the session stream was closed"))
        if self.caller:
            with self._lock:
                reading = self._reading
            if not reading:                         # a caller reading sees the end and leaves it to the GC
                self.sock.close()


class _Answer:
    """A prefetch or release sent without waiting: done() (answered, or the stream ended), result() (the answer, read
    once and kept; a refusal raises as the unary call's error)."""

    __slots__ = ("stream", "rid", "timeout", "kind", "reply", "error")

    def __init__(self, stream: _Stream | _SeqStream, rid: int, timeout: float, kind: str):
        self.stream, self.rid, self.timeout, self.kind = stream, rid, timeout, kind
        self.reply = self.error = None

    def done(self) -> bool:
        return self.reply is not None or self.error is not None or self.stream.answered(self.rid)

    def result(self):
        if self.reply is None and self.error is None:
            try:
                ev = self.stream.take(self.rid, time.monotonic() + self.timeout)   # from now: sent long ago
                if ev.WhichOneof("kind") == "failed":
                    raise _failed(ev)
                self.reply = getattr(ev, self.kind)
            except grpc.RpcError as e:
                self.error = e
            finally:
                self.stream.forget(self.rid)
        if self.error is not None:
            raise self.error
        return self.reply


class _Landed:
    """A load's experts as they land (Loaded, completion order) within its deadline, ready(): whether the next one is
    there already, asked without a wait (MoEStep._disk_groups' early flush), and ahead_queued: the last landed one's
    (worker/store_session.LoadStream reads it). A class, not a generator under a wrapper (issue 21, cpu-host61: a
    landed expert's next() is one Python call; an answer already routed is read from its box here, without take).
    Ends with its n experts, a failed answer (nothing more of it follows) or a failure of the stream (the worker's
    error, as _as_worker makes it). Closed (close(), or dropped: __del__) before its end, the store is sent a cancel
    of the load and stops sending it; else the answers' box is forgotten. seqpacket (_SeqStream): its reader thread
    routes every answer as it arrives (the caller reader: ready() drains the socket first), so an empty box is an
    expert not landed yet. grpc (_Stream): answers are
    routed only while a caller reads the call (take), so an answer still in grpc's buffer reads as not landed: ready()
    may say False early there (a flush sooner than needed, never a wait)."""

    __slots__ = ("_client", "_s", "_rid", "_left", "_deadline", "_open", "ahead_queued")

    def __init__(self, client: "GrpcStoreClient", s: _Stream | _SeqStream, rid: int, n: int, deadline: float):
        self._client, self._s, self._rid, self._left, self._deadline = client, s, rid, n, deadline
        self._open = True                   # neither ended nor closed: its box to forget, or its load to cancel
        self.ahead_queued = 0

    def __iter__(self):
        return self

    def __next__(self) -> Loaded:
        if self._left <= 0 or not self._open:
            self.close()
            raise StopIteration
        s = self._s
        # the box read as take's first step (one taker a load: the reader threads only append to it, deque's
        # popleft and append are atomic); an empty or gone box, or none yet: take waits, raises or reads the call
        box = s._box.get(self._rid)
        try:
            ev = box.popleft() if box else s.take(self._rid, self._deadline)
            if ev.WhichOneof("kind") != "loaded":
                self._left = 0              # nothing more of it follows: its box forgotten, no cancel
                raise _failed(ev)
        except _FAILING as e:
            self.close()
            raise self._client._as_worker(e) from None
        m = ev.loaded
        self._left -= 1
        self.ahead_queued = m.ahead_queued
        # from_pb at the edge: the worker gets the store's Loaded, never a protobuf message
        return Loaded(m.layer, m.expert, m.staging_slot, m.disk_bytes, m.prefetched, m.ahead_queued)

    def ready(self) -> bool:
        """True: next() returns without a wait (an answer is routed, the stream ended with an error it raises, or
        the load is done); False: the next expert has not reached this process yet."""
        return self._left <= 0 or self._s.answered(self._rid)

    def close(self):
        """Stop reading it: before its end, the store's cancel of the load (an abandoned pass); else the box forgotten.
        Once."""
        if self._open:
            self._open = False
            if self._left > 0:
                self._s.cancel(self._rid)   # closed before its end: the store stops sending it
            else:
                self._s.forget(self._rid)

    __del__ = close                         # dropped before its end: the cancel a generator's close sent


class GrpcStoreClient:
    TRANSPORTS = ("grpc", "seqpacket")

    def __init__(self, socket_path: str, fd_socket_path: str, timeout: float = 10.0, per_expert: float = 0.5,
                 probe_timeout: float = 2.0, on_lost=None, session_transport: str = "seqpacket",
                 session_reader: str = "thread"):
        self.socket_path, self.fd_socket_path = socket_path, fd_socket_path
        if session_transport not in self.TRANSPORTS:
            raise BetelgeuseError(f"store.session_transport must be one of {', '.join(self.TRANSPORTS)}, got "
                                  f"{session_transport!r}")
        if session_reader not in _SeqStream.READERS:
            raise BetelgeuseError(f"store.session_reader must be one of {', '.join(_SeqStream.READERS)}, got "
                                  f"{session_reader!r}")
        # the session stream's transport (store.session_transport): grpc (_Stream) or seqpacket (_SeqStream), and who
        # reads the seqpacket one's answers (store.session_reader: _SeqStream's doc)
        self.session_transport, self.session_reader = session_transport, session_reader
        self.timeout, self.per_expert, self.probe_timeout = timeout, per_expert, probe_timeout
        self.channel = None
        self.stub = None
        self.session = ""
        self._lease: socket.socket | None = None
        self._lock = threading.Lock()
        # on_lost(StoreUnavailableError): the store's end of our lease closed (it died): called at once, from a thread
        self.on_lost = on_lost
        self._releases: list = []     # Release calls sent and not yet seen answered (release() does not wait)
        self.consolidating = False    # the last BeginPass: a consolidation was still filling its slots
        self._prefix: Arena | None = None   # the prefix host tier received at the last attach (take_prefix_arena)
        self._aborted: StoreUnavailableError | None = None  # why abort() closed the channel (for the calls it failed)
        self._stream: _Stream | _SeqStream | None = None    # the session's loads, reads ahead, releases (module doc)
        self._session_call = None                # the channel's Session method (bind)

    def _drop_lease(self):
        """Close our lease socket (shutdown first: it wakes the watcher's recv, which close alone does not)."""
        old, self._lease = self._lease, None
        if old is not None:
            try:
                old.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            old.close()

    def _watch(self, s: socket.socket):
        """EOF on the lease = the store process is gone: tell the engine now (event-driven health)."""
        try:
            while s.recv(64):
                pass
        except OSError:
            pass
        with self._lock:
            current = s is self._lease
        if current and self.on_lost is not None:
            self.on_lost(StoreUnavailableError("expert store unavailable: it closed the worker's lease (exited)"))

    @contextlib.contextmanager
    def _failing(self, what: str = "call"):
        """What a store call raises, as the worker's errors: a gRPC error (StoreBusyError, ..., or abort()'s reason
        for a call it cancelled), a call on the channel abort() closed ("Cannot invoke RPC on closed channel!"), a
        future cancelled (`what`: the call's kind, for the message). The decode step's calls (_call, _send, _Landed)
        catch _FAILING and raise _as_worker's instead: the same errors, less the context manager's ~5 Python calls
        a time (issue 21, cpu-host59)."""
        try:
            yield
        except _FAILING as e:
            raise self._as_worker(e, what) from None

    def _as_worker(self, e: BaseException, what: str = "call") -> BaseException:
        """_failing's rule: a store call's error (one of _FAILING) -> the worker's error to raise from None."""
        if isinstance(e, grpc.RpcError):
            return self._unavailable(e)
        if isinstance(e, ValueError):
            return self._closed(e)
        return StoreUnavailableError(f"expert store unavailable: a {what} call was cancelled")

    def _call(self, fn, *args, timeout: float | None = None, **kw):
        try:
            return fn(*args, timeout=timeout or self.timeout, **kw)
        except _FAILING as e:
            raise self._as_worker(e) from None

    def attach(self) -> tuple[Arena, SlotPlan]:
        with self._lock:
            self._drop_lease()                        # our old lease ends first (the store sees EOF)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self.fd_socket_path)
            fds, header = recv_fds(s)
        except OSError as e:
            s.close()
            raise StoreUnavailableError(f"cannot reach the expert store at {self.fd_socket_path}: {e.strerror or e}") from None
        except StoreUnavailableError as e:
            s.close()
            raise StoreUnavailableError(f"the expert store at {self.fd_socket_path} refused the arena hand-off "
                                        f"({e}); is this worker running as the store's user or socket_group?") from None
        s.settimeout(None)
        with self._lock:
            self._close_channel()
            self._releases = []                     # the old session's slots are freed by the new attach
            self._aborted = None
            self.channel = grpc.insecure_channel(f"unix:{self.socket_path}")
            self.bind(self.channel)
        try:
            reply = self._call(self.stub.Attach, pb.AttachRequest(worker_pid=os.getpid(),
                                                                  attach_token=header.get("token", "")))
        except BaseException:
            for fd in fds:
                os.close(fd)
            s.close()
            raise
        with self._lock:
            self._lease = s
        threading.Thread(target=self._watch, args=(s,), name="store-lease", daemon=True).start()
        self.session = reply.session
        if self._prefix is not None:
            self._prefix.close()
        # the prefix host tier: written by this worker only once Attach made it the store's one worker
        self._prefix = Arena.attach(fds[1], header["prefix_bytes"], readonly=False) if len(fds) > 1 else None
        return Arena.attach(fds[0], header["arena_bytes"], readonly=True), SlotPlan.from_json(reply.layout_json)

    def take_prefix_arena(self) -> Arena | None:
        """The prefix host tier received at the last attach (writable; the caller owns it), or None."""
        out, self._prefix = self._prefix, None
        return out

    def abort(self, why: StoreUnavailableError | None = None) -> None:
        """From another thread: the store stopped answering (`why`: how it was seen). Calls in flight fail now, with
        `why` for their error rather than the closed channel's "CANCELLED: Channel closed!"."""
        with self._lock:
            self._aborted = why
            if self.channel is not None:
                self.channel.close()
            if isinstance(self._stream, _SeqStream):     # not on the channel: its waiters fail as the channel's do
                self._stream.close(_Failed(grpc.StatusCode.CANCELLED, "Channel closed!"))

    def _closed(self, e: ValueError) -> StoreUnavailableError:
        """A call on the channel abort() closed ("Cannot invoke RPC on closed channel!")."""
        return StoreUnavailableError(str(self._aborted or f"expert store unavailable: {e}"))

    def _unavailable(self, e: grpc.RpcError) -> BetelgeuseError:
        why = self._aborted
        if why is not None and getattr(e, "code", lambda: None)() == grpc.StatusCode.CANCELLED:
            return StoreUnavailableError(str(why))
        return _unavailable(e)

    def ping(self, timeout: float | None = None) -> dict:
        """The store's status on a fresh channel, without attaching (start-up and the health probe)."""
        timeout = timeout or self.probe_timeout
        with grpc.insecure_channel(f"unix:{self.socket_path}") as ch:
            try:
                reply = pb_grpc.ExpertStoreStub(ch).Status(pb.StatusRequest(), timeout=timeout)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise StoreUnavailableError(f"expert store unavailable: it did not answer within {timeout:g} s "
                                                "(stopped, or hung)") from None
                raise self._unavailable(e) from None
        st = json.loads(reply.json)
        if st.get("refusing"):                       # up, but refusing work (its model file changed under it)
            raise StoreUnavailableError(f"expert store unavailable: {st['refusing']}")
        return st

    BEGIN_PASS_TIMEOUT = 120.0    # BeginPass first waits for a pending consolidation's disk reads

    def begin_pass(self, wait: bool = True) -> int:
        self._reap(wait=True)
        reply = self._call(self.stub.BeginPass, pb.BeginPassRequest(session=self.session, no_wait=not wait),
                           timeout=max(self.timeout, self.BEGIN_PASS_TIMEOUT))
        self.consolidating = reply.consolidating
        return reply.epoch

    def _session_stream(self) -> _Stream:
        """The session's stream, re-opened where the last one ended (the store restarted or failed a deadline; after
        abort() the closed channel refuses: _failing says why)."""
        s = self._stream
        if s is None or not s.alive():
            if s is not None:
                s.close()
                self._stream = None                     # dropped, whether or not a new one opens
            if self.session_transport == "seqpacket":
                if self._aborted is not None:           # as the closed channel refuses a new call
                    raise StoreUnavailableError(str(self._aborted))
                s = _SeqStream(session_seq.session_path(self.socket_path), self.timeout, self.session_reader)
            else:
                s = _Stream(self._session_call)
            self._stream = s
        return s

    def _send(self, kind: str, make, args, handoff: bool = False) -> tuple[_Stream | _SeqStream, int]:
        """One request of `kind` (SessionRequest's field) on the session's stream, make(id, *args) -> the
        SessionRequest (built in place: _load_request; its arguments passed, not bound in a lambda: a Python call less
        a message, issue 21, cpu-host62) -> (the stream, its id). handoff: _Stream's (class doc)."""
        try:
            s = self._session_stream()
            return s, s.send(make, args, handoff)
        except _FAILING as e:
            raise self._as_worker(e) from None

    def load(self, keys, release=(), ahead=(), drop=()):
        """Demand loads, sent now (the store starts reading at once; it first takes back `release` and reads `ahead`
        ahead once the loads' reads have started) -> the experts in completion order."""
        keys, sid = list(keys), self.session
        s, rid = self._send("load", _load_request, ("load", sid, keys, release, ahead, drop),
                            handoff=bool(keys))             # the disk waits for it (_Stream's hand-off)
        if not keys:       # answered as a release (no expert follows): checked with the releases (_reap)
            self._releases.append(_Answer(s, rid, self.timeout, "released"))
            return iter(())
        return _Landed(self, s, rid, len(keys), time.monotonic() + self.timeout + self.per_expert * len(keys))

    def prefetch(self, keys, release=()) -> int:
        return self.prefetch_start(keys, release)()

    def prefetch_start(self, keys, release=(), drop=()):
        """Prefetch without waiting for the answer -> a function that waits for it (the reads started)."""
        sid = self.session
        f = _Answer(*self._send("prefetch", _load_request, ("prefetch", sid, keys, release, (), drop)),
                    self.timeout, "prefetched")
        # its answer checked with the releases' (_reap: before the pass begins or ends), whether or not the caller
        # asks for it: a failed Prefetch raises there (the staging slots riding on it were the worker's)
        self._releases.append(f)

        def queued() -> int:
            with self._failing("prefetch"):
                return f.result().queued
        return queued

    def release(self, slots) -> None:
        """Hand staging slots back without waiting for the answer: a round trip is ~1 ms and a batched decode pass
        releases slots several times a layer (deploy/device/profile_batch.py --top). The store frees them when the
        message arrives (in the order sent: before a load sent after it); a failed release raises from the next call
        that reaps (release, begin_pass, end_pass), and every release is answered before a pass begins or ends."""
        self._reap(wait=False)
        sid, slots = self.session, list(slots)
        self._releases.append(_Answer(*self._send("release", _release_request, (sid, slots)),
                                      self.timeout, "released"))

    def _reap(self, wait: bool):
        """Check the answered release and prefetch calls (wait: all of them); the first failure raises."""
        pending, self._releases = self._releases, []
        for i, f in enumerate(pending):
            if not wait and not f.done():
                self._releases = pending[i:]
                return
            with self._failing("release"):
                f.result()

    def end_pass(self, usage: np.ndarray, consolidate: bool, release=()) -> int:
        self._reap(wait=True)
        L, E = usage.shape
        req = pb.EndPassRequest(session=self.session, n_layer=L, n_expert=E,
                                usage=usage.astype(np.uint32).ravel().tolist(), consolidate=consolidate,
                                release=list(release))
        return self._call(self.stub.EndPass, req).promoted

    def trim_vram(self, n_vram: int, trim: dict) -> SlotPlan:
        """The VRAM tier keeps n_vram slots per layer (store.proto TrimVram; it may wait for a consolidation's reads,
        as BeginPass does) -> the new plan."""
        req = pb.TrimVramRequest(session=self.session, vram_slots=n_vram, trim_json=json.dumps(trim))
        reply = self._call(self.stub.TrimVram, req, timeout=max(self.timeout, self.BEGIN_PASS_TIMEOUT))
        return SlotPlan.from_json(reply.layout_json)

    def engram_read(self, tables, rows, release) -> int:
        req = pb.EngramReadRequest(session=self.session, tables=np.asarray(tables, dtype=np.uint32).tolist(),
                                   rows=np.asarray(rows, dtype=np.uint64).tolist(), release=list(release))
        return self._call(self.stub.EngramRead, req).bank

    def engram_wait(self, bank: int) -> EngramLanded:
        m = self._call(self.stub.EngramWait, pb.EngramWaitRequest(session=self.session, bank=bank),
                       timeout=max(self.timeout, self.BEGIN_PASS_TIMEOUT))
        return EngramLanded(m.bank, m.rows, m.disk_rows, m.cache_rows, m.disk_bytes, m.read_seconds)

    def status(self, disk_gaps_since: float | None = None) -> dict:
        """The store's status (ExpertStore.status); disk_gaps_since: with the disk's idle gaps since then."""
        req = pb.StatusRequest() if disk_gaps_since is None else pb.StatusRequest(disk_gaps_since=disk_gaps_since)
        return json.loads(self._call(self.stub.Status, req).json)

    def bind(self, channel):
        """Every call of the session on `channel`: attach's own, or it wrapped in interceptors (grpc.intercept_channel:
        tests count the messages and bytes of every kind); the session's stream is re-opened on it."""
        self.stub = pb_grpc.ExpertStoreStub(channel)
        self._session_call = self.stub.Session
        if self._stream is not None:
            self._stream.close()
        # gRPC's call opened now (it costs nothing until used); a SEQPACKET connection at the first message
        self._stream = _Stream(self._session_call) if self.session_transport == "grpc" else None

    def _close_channel(self):
        """Close the session's stream and the channel (its calls in flight fail) (under _lock)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def close(self) -> None:
        if self._prefix is not None:                 # received and never taken by a runner
            self._prefix.close()
            self._prefix = None
        with self._lock:
            self._close_channel()
            self._drop_lease()
