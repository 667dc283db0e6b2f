"""betelgeuse-store: the expert-store process (no CUDA context).

    python -m services.store_main --config /etc/betelgeuse/betelgeuse.toml

Start-up: plan slots against the cgroup (refuse with numbers if they cannot fit), create and pre-fault
the memfd arena, then serve the control API (gRPC on a Unix socket) and hand the arena fd to workers
on a second Unix socket. READY=1 once both listen.

Trust: the runtime directory is locked (one store per directory); both sockets are created 0600 (0660 with
[store] socket_group) whatever the umask; the fd socket checks each peer's SO_PEERCRED (the service's uid, root,
or the socket group), hands out an O_RDONLY descriptor of the arena and an attach token bound to that
connection, and Attach needs the token. The connection stays open as the worker's lease: a second worker
is refused while the first one's lease is open.
"""

from __future__ import annotations

import argparse
import fcntl
import grp
import json
import logging
import os
import queue
import secrets
import signal
import socket
import stat
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import numpy as np

from betelgeuse import __version__, sdnotify
from betelgeuse.config import engine_config
from betelgeuse.errors import BetelgeuseError, StoreBusyError, StoreUnavailableError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.logs import event
from betelgeuse.metrics import make_store_metrics
from betelgeuse.store.arena import peer_credentials, send_fds
from betelgeuse.store.cgroup import CgroupMemory
from betelgeuse.store.plan import plan_slots
from betelgeuse.store.store import ExpertStore, Lease
from services.common import common_args, listen_metrics, run_main, settings_from_args
from services.grpc import session_seq
from services.pb.betelgeuse.v1 import store_pb2 as pb
from services.pb.betelgeuse.v1 import store_pb2_grpc as pb_grpc
from services.signals import stop_on_signals

log = logging.getLogger("betelgeuse.store")


_END = object()


def _keys(ids) -> list[tuple[int, int]]:
    return [(x.layer, x.expert) for x in ids]


def _status(e: BetelgeuseError) -> grpc.StatusCode:
    """The code a store call answers one of our errors with (the worker's client turns FAILED_PRECONDITION into
    StoreUnavailableError): the store gone for this session, or a request it refuses."""
    return grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, StoreUnavailableError) else \
        grpc.StatusCode.INVALID_ARGUMENT


class _SeqOut:
    """A SEQPACKET session's answers: put(SessionEvent) sends it at once from the calling thread (the reader's, a
    loader's: a datagram send is atomic; the lock only keeps a send off a closed descriptor); put(None) (the
    reader's end) closes the connection. A send that fails (the worker went) ends the stream: alive() -> False."""

    __slots__ = ("conn", "lock", "closed")

    def __init__(self, conn: socket.socket):
        self.conn, self.lock, self.closed = conn, threading.Lock(), False

    def alive(self) -> bool:
        return not self.closed

    def put(self, ev):
        if ev is None:
            with self.lock:
                if not self.closed:
                    self.closed = True
                    try:
                        self.conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self.conn.close()
            return
        data = ev.SerializeToString()               # an answer is ~10-30 bytes: always under the datagram limit
        with self.lock:
            if self.closed:
                return
            try:
                self.conn.send(data)
            except OSError:
                self.closed = True                  # the reader sees EOF or the error, and closes


class StoreServicer(pb_grpc.ExpertStoreServicer):
    """Thin: protobuf in, ExpertStore call, protobuf out. Errors become status codes."""

    def __init__(self, store: ExpertStore, leases: "Leases"):
        self.store = store
        self.leases = leases
        # the loads of the session streams with experts still to come (_Delivery, under _ticks), ticked every WAIT_S by
        # one thread (_tick: started at the first load)
        self._open: list[_Delivery] = []
        self._ticks = threading.Lock()
        self._ticker: threading.Thread | None = None

    def _guard(self, context, fn):
        try:
            return fn()
        except BetelgeuseError as e:
            context.abort(_status(e), str(e))

    def Attach(self, request, context):
        lease = self.leases.redeem(request.attach_token)
        if lease is None:
            log.warning("refused an Attach without a valid token (claimed pid %d)", request.worker_pid)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "Attach needs the token handed out with the arena fd "
                          "on the store's fd socket")
        try:
            session, plan = self.store.attach(lease.pid, lease)
        except StoreBusyError as e:
            log.warning("refused a second worker (pid %d): %s", lease.pid, e)
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except StoreUnavailableError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        event(log, "attach", worker_pid=lease.pid, session=session[:8], attaches=self.store.counters.attaches)
        return pb.AttachReply(session=session, layout_json=plan)

    def BeginPass(self, request, context):
        epoch = self._guard(context, lambda: self.store.begin_pass(request.session, not request.no_wait))
        return pb.BeginPassReply(epoch=epoch, consolidating=self.store.consolidating)

    def TrimVram(self, request, context):
        plan = self._guard(context, lambda: self.store.trim_vram(request.session, request.vram_slots,
                                                                 json.loads(request.trim_json or "{}")))
        return pb.TrimVramReply(layout_json=plan)

    def Session(self, request_iterator, context):
        """The worker session's stream (store.proto) on gRPC: every answer goes out through this generator (the
        handling is _read_session's, shared with the SEQPACKET transport: session_seq)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        context.add_callback(lambda: out.put(None))         # the stream ended (closed, cancelled, the worker died)
        threading.Thread(target=self._read_session, args=(request_iterator, context.is_active, out),
                         name="store-session", daemon=True).start()
        while (ev := out.get()) is not None:
            yield ev

    def session_seq(self, conn: socket.socket):
        """The worker session's stream on a SOCK_SEQPACKET connection (services/grpc/session_seq.py): requests read
        here in order (_read_session, as on gRPC), answers sent by whichever thread has one (_SeqOut)."""
        out = _SeqOut(conn)
        self._read_session(session_seq.receiver(conn, pb.SessionRequest.FromString), out.alive, out)

    def _read_session(self, requests, active, out):
        """One session stream's requests (either transport), handled in the order sent by this one thread (a load's
        reads are started here too, so the store reads in the order sent), each load's experts then waited for on a
        pooled thread (loads may overlap: one waiting for staging slots must not hold up the release that frees
        them); every answer is out.put(SessionEvent) tagged with its request's id, and out.put(None) at the end.
        active() -> False once the stream ended (a load still reading stops handing experts over)."""
        cancelled: set[int] = set()
        try:
            for r in requests:
                kind = r.WhichOneof("kind")
                if kind == "load":
                    self._start_load(r.id, r.load, active, out, cancelled)
                elif kind == "prefetch":
                    q = r.prefetch
                    out.put(self._answer(r.id, "prefetched", lambda: pb.PrefetchReply(queued=self.store.prefetch(
                        q.session, _keys(q.experts), list(q.release), _keys(q.drop)))))
                elif kind == "release":
                    q = r.release
                    out.put(self._answer(r.id, "released", lambda: (
                        self.store.release(q.session, list(q.staging_slots)), pb.ReleaseReply())[1]))
                elif kind == "cancel":
                    cancelled.add(r.id)
        except (grpc.RpcError, OSError, BetelgeuseError) as e:
            # gRPC: the stream was cancelled; SEQPACKET: the connection failed, or a datagram came truncated
            log.debug("session stream ended: %s", e)
        finally:
            out.put(None)

    @staticmethod
    def _failed(rid: int, e: Exception, started: bool) -> pb.SessionEvent:
        """A request's failure as its own call's status was (_guard's codes; grpc's words for a handler's bug, or for
        a load's error once it had started streaming)."""
        if isinstance(e, StoreUnavailableError) or (isinstance(e, BetelgeuseError) and not started):
            code, details = _status(e), str(e)
        else:
            code = grpc.StatusCode.UNKNOWN
            details = f"Exception {'iterating responses' if started else 'calling application'}: {e}"
            if not isinstance(e, BetelgeuseError):
                log.exception("session stream: request %d failed", rid)
        return pb.SessionEvent(id=rid, failed=pb.Failed(code=code.value[0], details=details))

    def _answer(self, rid: int, kind: str, fn) -> pb.SessionEvent:
        try:
            return pb.SessionEvent(id=rid, **{kind: fn()})
        except Exception as e:                              # noqa: BLE001 -- answered as the request's failure
            return self._failed(rid, e, False)

    def _start_load(self, rid: int, q, active, out, cancelled: set):
        """Hand back `release`, drop, start the reads (store.load's `started`) and hand over the experts already
        staged, here; the rest as they land, from the read's completion (_Delivery). With engine.session_reads, the
        first piece of the load's reads is read here too (ExpertStore.read_here)."""
        def alive() -> bool:
            return rid not in cancelled and active()
        try:
            it = self.store.load(q.session, _keys(q.experts), list(q.release), _keys(q.ahead), _keys(q.drop),
                                 alive=alive, started=True, wait=False)
        except Exception as e:                              # noqa: BLE001
            out.put(self._failed(rid, e, False))
            return
        try:
            landed = next(it, _END)                         # the reads started (the Load call's first steps)
            if landed is _END:                              # no expert: answered as a release
                out.put(pb.SessionEvent(id=rid, released=pb.ReleaseReply()))
                return
            n = len(q.experts)
            while n and landed.qsize():                     # staged already: no wait, no loader thread
                out.put(self._loaded(rid, next(it)))
                n -= 1
            if not n:
                next(it, None)                              # the load's end (its keys unclaimed)
                return
        except Exception as e:                              # noqa: BLE001
            out.put(self._failed(rid, e, True))
            return
        d = _Delivery(rid, it, landed, out, cancelled)
        landed.on_land = d.pump                             # from now on: a read's completion hands its expert over
        if landed.qsize():                                  # landed since the loop above looked, before on_land
            d.pump()
        # engine.session_reads: the load's first piece read here (this thread would block in its recv next), before the
        # tick's bookkeeping; its completion, if it is a read's last, hands the expert over from here (on_land is set)
        self.store.read_here(landed)
        with self._ticks:
            self._open.append(d)
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="store-load-tick", daemon=True)
                self._ticker.start()

    def _tick(self):
        """Every WAIT_S, each open load's pump (_Delivery: what no landing triggers); the loads that ended leave. It
        ticks on while none is open (20 wake-ups a second, a few µs each) rather than wait to be notified: that
        notify woke this thread at the start of each load that found none open (every load, one at a time), a
        Python Condition.notify on the session reader's thread and a second thread wanting the GIL just as the
        load's read wakes a reader thread that needs it before its preadv (the store link: docs/benchmarks/
        cpu-store61)."""
        while True:
            time.sleep(ExpertStore.WAIT_S)
            with self._ticks:
                self._open = [d for d in self._open if not d.over]
                open_ = list(self._open)
            for d in open_:
                d.pump()

    @staticmethod
    def _loaded(rid: int, got) -> pb.SessionEvent:
        return pb.SessionEvent(id=rid, loaded=pb.Loaded(
            layer=got.layer, expert=got.expert, staging_slot=got.staging_slot, disk_bytes=got.disk_bytes,
            prefetched=got.prefetched, ahead_queued=got.ahead_queued))

    def EndPass(self, request, context):
        usage = np.asarray(request.usage, dtype=np.int64).reshape(request.n_layer, request.n_expert)
        n = self._guard(context, lambda: self.store.end_pass(request.session, usage, request.consolidate,
                                                             list(request.release)))
        return pb.EndPassReply(promoted=n or 0)

    def Status(self, request, context):
        since = request.disk_gaps_since if request.HasField("disk_gaps_since") else None
        return pb.StatusReply(json=json.dumps(self.store.status(since)))

    def EngramRead(self, request, context):
        bank = self._guard(context, lambda: self.store.engram_read(
            request.session, np.asarray(request.tables, dtype=np.int64), np.asarray(request.rows, dtype=np.int64),
            list(request.release)))
        return pb.EngramReadReply(bank=bank)

    def EngramWait(self, request, context):
        got = self._guard(context, lambda: self.store.engram_wait(request.session, request.bank))
        return pb.EngramLanded(bank=got.bank, rows=got.rows, disk_rows=got.disk_rows, cache_rows=got.cache_rows,
                               disk_bytes=got.disk_bytes, read_seconds=got.read_seconds)


class _Delivery:
    """A load's experts not landed when its message was read, each sent from the thread whose read completed it (a
    reader thread's future callback: Landing.on_land -> pump), with no hop to a thread waiting on the landing queue
    (land: ~29 -> ~15 µs a load on a 2-core CPU, docs/benchmarks/cpu-chain58). The load's generator (store.load,
    wait=False) runs on one thread at a time (`lock`): a caller that finds another pumping leaves the queue to it, and
    that one looks at the queue again after letting go, so no landed key waits for a tick. The servicer's tick thread
    pumps every WAIT_S (StoreServicer._tick) for what no landing triggers: a cancel (alive()), a replaced session, a
    stall's warning, reads still waiting for a staging slot. The generator's end (all sent, a failure answered, a
    cancel) ends the ticks and forgets the request's cancel entry, as the loader thread's loop did."""

    __slots__ = ("rid", "it", "landed", "out", "cancelled", "lock", "over")

    def __init__(self, rid: int, it, landed, out, cancelled: set):
        self.rid, self.it, self.landed, self.out, self.cancelled = rid, it, landed, out, cancelled
        self.lock = threading.Lock()
        self.over = False                   # the generator ended (set once, under lock; read anywhere: a bool, not
        # a threading.Event, whose Condition was ~3 µs of each load's start on the session reader's thread)

    def pump(self):
        """Send what has landed (any thread; never waits for another pump and never raises: it runs on the store's
        reader threads)."""
        while not self.over and self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()
            if self.over or not self.landed.qsize():
                return                      # else a key landed while we held the lock and its pump left: again

    def _drain(self):
        """(holding lock) Run the generator until it has nothing landed (None) or ends."""
        try:
            while (got := next(self.it, _END)) is not None:
                if got is _END:
                    break
                self.out.put(StoreServicer._loaded(self.rid, got))
        except Exception as e:                              # noqa: BLE001 -- answered as the load's failure
            self.out.put(StoreServicer._failed(self.rid, e, True))
        else:
            if got is None:
                return
        self.over = True
        self.cancelled.discard(self.rid)


class Leases:
    """Attach tokens handed out with the arena fd; each is bound to the connection it went out on, and dies
    with it (the worker holds that connection open for as long as it lives)."""

    MAX = 64                                      # open hand-off connections at once (a local flood is refused)

    def __init__(self):
        self._lock = threading.Lock()
        self._by_token: dict[str, Lease] = {}

    def issue(self, pid: int, conn_id: int) -> tuple[str, Lease] | None:
        with self._lock:
            if len(self._by_token) >= self.MAX:
                return None
            token = secrets.token_hex(16)
            lease = Lease(pid, key=("pid", pid) if pid > 0 else ("conn", conn_id))
            self._by_token[token] = lease
            return token, lease

    def redeem(self, token: str) -> Lease | None:
        with self._lock:
            lease = self._by_token.get(token) if token else None
        return lease if lease is not None and lease.alive else None

    def end(self, token: str):
        with self._lock:
            lease = self._by_token.pop(token, None)
        if lease is not None:
            lease.alive = False


def peer_allowed(uid: int, gid: int, pid: int, group_gid: int | None) -> bool:
    """The service's own uid, root, or (with socket_group) a member of that group."""
    if uid in (os.geteuid(), 0):
        return True
    if group_gid is None:
        return False
    if gid == group_gid:
        return True
    try:                                          # supplementary groups of the peer, as the kernel lists them
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return str(group_gid) in line.split()[1:]
    except OSError:
        pass
    return False


def _allowed_peers(srv: socket.socket, stop: threading.Event, group_gid: int | None, what: str):
    """The connections accepted on srv from allowed peers (SO_PEERCRED: peer_allowed), until stop or srv's close:
    (conn, pid) each; a refused one is logged (naming `what` it was refused) and closed."""
    while not stop.is_set():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            log.warning("%s: %s", what, e)
            conn.close()
            continue
        if not peer_allowed(uid, gid, pid, group_gid):
            log.warning("refused the %s to pid %d (uid %d, gid %d): not the service's user or group", what, pid, uid,
                        gid)
            conn.close()
            continue
        yield conn, pid


def serve_fds(store: ExpertStore, path: str, header: dict, stop: threading.Event, leases: Leases,
              group_gid: int | None = None) -> socket.socket:
    """Hand a read-only arena fd (and the prefix host tier's, writable) (SCM_RIGHTS) and an attach token to an allowed peer of `path` (the worker);
    the connection then stays open as its lease. A thread per connection."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)

    def hold(conn: socket.socket, token: str):
        with conn:
            try:
                while conn.recv(64):                 # the worker sends nothing; EOF = it closed or died
                    pass
            except OSError:
                pass
        leases.end(token)

    def loop():
        for conn, pid in _allowed_peers(srv, stop, group_gid, "arena fd"):
            try:
                issued = leases.issue(pid, id(conn))
                if issued is None:
                    log.warning("refused the arena fd to pid %d: %d hand-off connections open", pid, Leases.MAX)
                    conn.close()
                    continue
                token, _lease = issued
                fds = [store.arena.readonly_fd()]
                if store.prefix_arena is not None:       # the worker writes the prefix host tier (only it reads it)
                    fds.append(os.dup(store.prefix_arena.fd))
                try:
                    send_fds(conn, fds, {**header, "token": token})
                finally:
                    for fd in fds:
                        os.close(fd)
            except OSError as e:
                log.warning("fd hand-off failed: %s", e)
                conn.close()
                continue
            threading.Thread(target=hold, args=(conn, token), name="fd-lease", daemon=True).start()
    threading.Thread(target=loop, name="fd-handoff", daemon=True).start()
    return srv


def serve_session_seq(servicer: StoreServicer, path: str, stop: threading.Event,
                      group_gid: int | None = None) -> socket.socket:
    """The session stream's SOCK_SEQPACKET socket (services/grpc/session_seq.py): an allowed peer (SO_PEERCRED, as
    the fd socket checks) gets a thread reading its requests (StoreServicer.session_seq). Served whatever
    store.session_transport says: the worker chooses; an idle listener costs one thread."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(8)

    def loop():
        for conn, _pid in _allowed_peers(srv, stop, group_gid, "session socket"):
            try:
                session_seq.tune(conn)
            except OSError as e:
                log.warning("session socket: %s", e)
                conn.close()
                continue
            threading.Thread(target=servicer.session_seq, args=(conn,), name="store-session-seq",
                             daemon=True).start()
    threading.Thread(target=loop, name="session-seq", daemon=True).start()
    return srv


def lock_runtime_dir(directory: str) -> int:
    """An exclusive flock on DIR/store.lock for this process's life: a second store on the same sockets is
    refused, naming the first one's pid. Returns the lock's fd (kept open)."""
    path = os.path.join(directory, "store.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreBusyError(f"another expert store (pid {other}) is running on {directory} (it holds {path})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def clear_stale_socket(path: str):
    """Remove a stale socket left by a store that died (we hold the directory's lock); anything else at the
    path is not ours and stays: refuse instead."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise BetelgeuseError(f"{path} exists and is not a socket; refusing to replace it (move it away or "
                              "choose another [store] socket path)")
    os.unlink(path)


def secure_socket(path: str, group_gid: int | None) -> int:
    """Mode 0600 (0660 and the group with socket_group) whatever the umask; returns the socket's inode."""
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    os.chmod(path, 0o660 if group_gid is not None else 0o600)
    return os.lstat(path).st_ino


def group_id(name: str) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise BetelgeuseError(f"[store] socket_group: no group named {name!r}") from None


def _sync_metrics(m, store: ExpertStore, stop: threading.Event):
    """Copy the store's counters into Prometheus every half second (deltas for counters)."""
    last = {}

    def delta(key, value):
        d = value - last.get(key, 0)
        last[key] = value
        return max(d, 0)

    while not stop.wait(0.5):
        r = store.reader.stats.copy()
        st = store.status()
        m.disk_read_bytes.labels(reason="demand").inc(delta("bd", r.request_bytes[0]))
        # reads ahead the store dropped before they started were never read (store.py: drop)
        m.disk_read_bytes.labels(reason="prefetch").inc(delta("bp", r.request_bytes[1] - r.cancelled_bytes))
        m.disk_reads.labels(reason="demand").inc(delta("rd", r.requests[0]))
        m.disk_reads.labels(reason="prefetch").inc(delta("rp", r.requests[1] - r.cancelled))
        m.disk_active_seconds.inc(delta("da", st["disk_active_seconds"]))
        m.expert_loads.labels(reason="demand").inc(delta("ld", st["demand_loads"] - st["staged_hits"]))
        m.expert_loads.labels(reason="prefetch").inc(delta("lp", st["readahead_reads"] + st["consolidation_reads"]))
        m.consolidations.inc(delta("c", st["consolidations"]))
        used = st["slots"]["host_slots"]
        m.expert_slots.labels(tier="host", state="used").set(used)
        m.expert_slots.labels(tier="host", state="free").set(store.plan.n_layer * store.plan.host_per_layer - used)
        m.workers_attached.set(1 if st["session"] else 0)
        if store.prefix_disk is not None:            # the prefix host tier's save file ([store] prefix_save_path)
            m.prefix_file_entries.set(st["prefix_file_entries"])
            m.prefix_loaded_entries.set(st["prefix_loaded_entries"])
            m.prefix_saved_bytes.inc(delta("ps", st["prefix_saved_bytes"]))
            m.prefix_last_save.set(st["prefix_last_save_unix"])
        if store.engram is not None:                 # deepseek41: Engram rows, on the Engram tier's own reader
            e = store.engram.reader.stats.copy()
            m.disk_read_bytes.labels(reason="engram").inc(delta("be", e.request_bytes[0]))
            m.disk_reads.labels(reason="engram").inc(delta("re", e.requests[0]))
            m.engram_rows.labels(source="disk").inc(delta("ed", st["engram_disk_rows"]))
            m.engram_rows.labels(source="cache").inc(delta("ec", st["engram_cache_rows"]))


def watch_model(store: ExpertStore, health_servicer, m, stop: threading.Event, every: float = 1.0):
    """Every second: is the model file still the one opened (betelgeuse/store/watch.py)? A change turns health
    NOT_SERVING (the worker's probe sees the reason and refuses work with it); the same file again, SERVING."""
    was = None
    while not stop.wait(every):
        try:
            why = store.watch.check()
        except OSError as e:                     # the descriptor itself failed: nothing can be read either
            why = f"the model file {store.model.path} cannot be checked: {e.strerror or e}"
            store.watch.why = why
        if why == was:
            continue
        serving = why is None
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving else
                            health_pb2.HealthCheckResponse.NOT_SERVING)
        m.ready.set(1 if serving else 0)
        if serving:
            event(log, "model_file", status="same again", path=store.model.path, action="serving")
        else:
            event(log, "model_file", logging.ERROR, status="changed", path=store.model.path, action="refusing work",
                  why=why)
        was = why


def main(argv=None) -> int:
    hups = []                                     # SIGHUP: logged and ignored (logs go to stderr, nothing to re-open)
    signal.signal(signal.SIGHUP, lambda *_: hups.append(1))
    p = argparse.ArgumentParser(prog="betelgeuse-store", description=__doc__.splitlines()[0])
    common_args(p, metrics="store")
    settings = settings_from_args(p.parse_args(argv))
    cfg = engine_config(settings, use_torch=False)
    metrics_addr = settings.store.metrics

    group_gid = group_id(settings.store.socket_group)
    for path in (settings.store.socket, settings.store.fd_socket):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lock_fd = lock_runtime_dir(os.path.dirname(os.path.abspath(settings.store.socket)))   # held until exit
    seq_path = session_seq.session_path(settings.store.socket)
    for path in (settings.store.socket, settings.store.fd_socket, seq_path):
        clear_stale_socket(path)

    sdnotify.notify(status="opening model")
    model = GGUFModelFile.open(cfg.model_path)
    cg = CgroupMemory.of_process()
    limit = cg.limit() if cg else None
    current = cg.in_use() if cg else 0          # page cache (the worker's mmap reads) can be reclaimed
    plan = plan_slots(model, cfg, limit, current)
    event(log, "plan", model=cfg.model_path, n_vram=plan.n_vram, n_host=plan.n_host, n_staging=plan.n_staging,
          **{k: v for k, v in plan.describe().items() if k not in ("vram_slots", "host_slots", "staging_slots")})
    sdnotify.notify(status=f"pre-faulting a {plan.arena_bytes / 2**30:.2f} GiB arena",
                    extend_timeout_us=int(120e6))
    store = ExpertStore(model, plan, read_threads=cfg.read_threads, read_request_bytes=cfg.read_request_bytes,
                        engram_read_depth=cfg.engram_read_depth, bound_fills=cfg.fill_budget,
                        hysteresis=cfg.placement_hysteresis, prefix_save_path=settings.store.prefix_save_path,
                        session_reads=cfg.session_reads)

    m = make_store_metrics(__version__)
    m.arena_bytes.set(plan.arena_bytes)
    m.disk_direct_io.set(1 if store.reader.mode == "direct" else 0)
    store.reader.on_read = m.disk_read_duration.observe     # seconds per preadv piece, from the reader threads
    if store.engram is not None:
        store.engram.reader.on_read = m.disk_read_duration.observe
    if cg:
        m.set_cgroup_reader(cg.current, lambda: float(cg.limit() or "nan"))
    stop = threading.Event()
    if metrics_addr:
        listen_metrics(m.registry, metrics_addr)
    threading.Thread(target=_sync_metrics, args=(m, store, stop), daemon=True).start()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="store-rpc"),
                         options=[("grpc.so_reuseport", 0)])
    leases = Leases()
    servicer = StoreServicer(store, leases)
    pb_grpc.add_ExpertStoreServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    old_umask = os.umask(0o177)                   # sockets are born 0600: no window where others may connect
    try:
        if server.add_insecure_port(f"unix:{settings.store.socket}") == 0:
            raise BetelgeuseError(f"cannot listen on unix:{settings.store.socket}")
        server.start()
        fd_srv = serve_fds(store, settings.store.fd_socket, {"arena_bytes": store.arena.nbytes,
                                                                    "prefix_bytes": plan.prefix_host_bytes}, stop, leases,
                           group_gid)
        seq_srv = serve_session_seq(servicer, seq_path, stop, group_gid)
    finally:
        os.umask(old_umask)
    ours = {path: secure_socket(path, group_gid) for path in (settings.store.socket, settings.store.fd_socket,
                                                               seq_path)}
    m.ready.set(1)
    sdnotify.notify(ready=True, status=f"serving: {plan.n_vram}+{plan.n_host} slots/layer, "
                                        f"{store.reader.mode} I/O, arena {plan.arena_bytes / 2**30:.2f} GiB")
    event(log, "ready", role="store", version=__version__, control=settings.store.socket, fds=settings.store.fd_socket,
          io=store.reader.mode, metrics=metrics_addr or None)

    stop_on_signals(stop)                         # set by a thread, not in a handler (services/signals.py)
    threading.Thread(target=watch_model, args=(store, health_servicer, m, stop), name="model-watch",
                     daemon=True).start()
    interval = sdnotify.watchdog_interval()
    while not stop.wait(min(interval / 2, 1.0) if interval else 1.0):
        while hups:
            hups.pop()
            event(log, "sighup", role="store", action="ignored (logs go to stderr: nothing to re-open)")
        if interval:
            sdnotify.notify(watchdog=True)
    sdnotify.notify(stopping=True, status="stopping")
    server.stop(grace=2).wait()
    fd_srv.close()
    seq_srv.close()
    for path, ino in ours.items():                # only the sockets we made (a successor may have replaced them)
        try:
            if os.lstat(path).st_ino == ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
    store.close()
    os.close(lock_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
