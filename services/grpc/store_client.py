"""The worker's StoreClient over gRPC on a Unix socket, plus the arena fd over a second socket.

Every call has a deadline that matches its work (`timeout` for control calls; a Load adds `per_expert` seconds
per expert it asks for), so a hung store can hold the engine for a bounded time only; abort() (from the health
probe) ends the calls in flight at once. The fd-socket connection stays open for the session: it is the
worker's lease on the store (the store refuses a second worker while it is open).

No thread is started per message. grpc's own streams and futures start a "channel spin thread" whenever the channel's
calls in flight drop to none: in decode that is one thread start per miss layer's Load (~0.2-0.3 ms of host on a
busy CPU: docs/benchmarks/cpu-host-miss). So the channel runs its unary-stream calls on the caller's thread (grpc's
SingleThreadedUnaryStream): a Load's experts are read by the thread that iterates them, and the messages sent without
waiting for their answer (Prefetch, Release) go as one-message unary-stream calls on the same methods (the same
bytes on the wire), sent on the caller's thread, their answers read in the order sent by ONE thread per channel
(_Answers) that lives as long as the channel.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading

import grpc
import grpc.experimental
import numpy as np

from betelgeuse.errors import BetelgeuseError, StoreBusyError, StoreUnavailableError
from betelgeuse.store.arena import Arena, recv_fds
from betelgeuse.store.engram import EngramLanded
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.store import Loaded
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


def _ids(keys) -> list:
    return [pb.ExpertId(layer=l, expert=e) for l, e in keys]


# the channel's unary-stream calls on the caller's thread (module doc)
_CHANNEL_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


def _one_way(channel, method: str, reply):
    """ExpertStore's unary `method` called as a unary-stream (one message): on this channel, sent on the caller's thread
    with no spin thread (module doc). reply: the answer's message class."""
    svc = pb.DESCRIPTOR.services_by_name["ExpertStore"]
    m = svc.methods_by_name[method]
    return channel.unary_stream(f"/{svc.full_name}/{m.name}",
                                request_serializer=lambda r: r.SerializeToString(),
                                response_deserializer=reply.FromString)


class _Pending:
    """A message sent without waiting: its answer once _Answers has read it (done(), result(): the future grpc's
    would have been)."""

    __slots__ = ("call", "event", "reply", "error")

    def __init__(self, call):
        self.call, self.event, self.reply, self.error = call, threading.Event(), None, None

    def done(self) -> bool:
        return self.event.is_set()

    def result(self):
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.reply


class _Answers:
    """ONE thread per channel that reads the answers of the messages sent without waiting, in the order sent (module
    doc): each call's one message, then its status (which frees the call). A cancelled or failed call (abort() closed
    the channel, the store died) records its RpcError for the caller; stop() ends the thread after what was sent."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="store-answers", daemon=True).start()

    def add(self, call) -> _Pending:
        p = _Pending(call)
        self._q.put(p)
        return p

    def stop(self):
        self._q.put(None)

    def _run(self):
        while (p := self._q.get()) is not None:
            try:
                reply = next(p.call, None)
                for _ in p.call:             # the status: the call ends here
                    pass
                if reply is None:
                    raise StoreUnavailableError("expert store unavailable: a call was answered with no message")
                p.reply = reply
            except BaseException as e:      # noqa: BLE001 -- the caller's to raise (result())
                p.error = e
            p.event.set()


class GrpcStoreClient:
    def __init__(self, socket_path: str, fd_socket_path: str, timeout: float = 10.0, per_expert: float = 0.5,
                 probe_timeout: float = 2.0, on_lost=None):
        self.socket_path, self.fd_socket_path = socket_path, fd_socket_path
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
        self._answers: _Answers | None = None   # the channel's reader of Prefetch / Release answers (module doc)
        self._prefetch = self._release = None   # those methods as one-message streams (_one_way)

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
        future cancelled (`what`: the call's kind, for the message)."""
        try:
            yield
        except grpc.RpcError as e:
            raise self._unavailable(e) from None
        except ValueError as e:
            raise self._closed(e) from None
        except grpc.FutureCancelledError:
            raise StoreUnavailableError(f"expert store unavailable: a {what} call was cancelled") from None

    def _call(self, fn, *args, timeout: float | None = None, **kw):
        with self._failing():
            return fn(*args, timeout=timeout or self.timeout, **kw)

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
            self.channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=_CHANNEL_OPTIONS)
            self.bind(self.channel)
            self._answers = _Answers()
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

    def load(self, keys, release=(), ahead=(), drop=()):
        """Demand loads, sent now (the store starts reading at once; it first takes back `release` and reads `ahead`
        ahead once the loads' reads have started) -> the experts in completion order."""
        keys = list(keys)
        req = pb.LoadRequest(session=self.session, experts=_ids(keys), release=list(release), ahead=_ids(ahead),
                             drop=_ids(drop))
        with self._failing():
            call = self.stub.Load(req, timeout=self.timeout + self.per_expert * len(keys))
        return self._landed(call)

    def _landed(self, call):
        try:
            with self._failing():
                for m in call:
                    yield Loaded(m.layer, m.expert, m.staging_slot, m.disk_bytes, m.prefetched, m.ahead_queued)
        finally:
            call.cancel()           # closed before its end (an abandoned pass): the store stops; else a no-op

    def prefetch(self, keys, release=()) -> int:
        req = pb.LoadRequest(session=self.session, experts=_ids(keys), release=list(release))
        return self._call(self.stub.Prefetch, req).queued

    def prefetch_start(self, keys, release=(), drop=()):
        """Prefetch without waiting for the answer -> a function that waits for it (the reads started)."""
        req = pb.LoadRequest(session=self.session, experts=_ids(keys), release=list(release), drop=_ids(drop))
        f = self._answers.add(self._call(self._prefetch, req))
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
        call arrives (a load meanwhile just finds fewer free slots); a failed release raises from the next call that
        reaps (release, begin_pass, end_pass), and every release is answered before a pass begins or ends."""
        self._reap(wait=False)
        req = pb.ReleaseRequest(session=self.session, staging_slots=list(slots))
        with self._failing():
            self._releases.append(self._answers.add(self._release(req, timeout=self.timeout)))

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

    def engram_read(self, tables, rows, release) -> int:
        req = pb.EngramReadRequest(session=self.session, tables=np.asarray(tables, dtype=np.uint32).tolist(),
                                   rows=np.asarray(rows, dtype=np.uint64).tolist(), release=list(release))
        return self._call(self.stub.EngramRead, req).bank

    def engram_wait(self, bank: int) -> EngramLanded:
        m = self._call(self.stub.EngramWait, pb.EngramWaitRequest(session=self.session, bank=bank),
                       timeout=max(self.timeout, self.BEGIN_PASS_TIMEOUT))
        return EngramLanded(m.bank, m.rows, m.disk_rows, m.cache_rows, m.disk_bytes, m.read_seconds)

    def status(self) -> dict:
        return json.loads(self._call(self.stub.Status, pb.StatusRequest()).json)

    def bind(self, channel):
        """Every call of the session on `channel`: attach's own, or it wrapped in interceptors (grpc.intercept_channel:
        tests count the messages and bytes of every kind, the one-way Prefetch / Release included)."""
        self.stub = pb_grpc.ExpertStoreStub(channel)
        self._prefetch = _one_way(channel, "Prefetch", pb.PrefetchReply)
        self._release = _one_way(channel, "Release", pb.ReleaseReply)

    def _close_channel(self):
        """Close the channel (its calls in flight fail) and end its answers' thread (under _lock)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self._answers is not None:
            self._answers.stop()
            self._answers = None

    def close(self) -> None:
        if self._prefix is not None:                 # received and never taken by a runner
            self._prefix.close()
            self._prefix = None
        with self._lock:
            self._close_channel()
            self._drop_lease()
