"""betelgeuse-store: the expert-store process (no CUDA context).

    python -m services.store_main --config /etc/betelgeuse/betelgeuse.toml

Start-up: plan slots against the cgroup (refuse with numbers if they cannot fit), create and pre-fault
the memfd arena, then serve the control API (gRPC on a Unix socket) and hand the arena fd to workers
on a second Unix socket. READY=1 once both listen.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import numpy as np

from betelgeuse import __version__, sdnotify
from betelgeuse.errors import BetelgeuseError, StoreUnavailableError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.logs import event
from betelgeuse.metrics import make_store_metrics, serve_metrics
from betelgeuse.settings import split_hostport
from betelgeuse.store.arena import send_fd
from betelgeuse.store.cgroup import CgroupMemory
from betelgeuse.store.plan import plan_slots
from betelgeuse.store.store import ExpertStore
from services.common import common_args, engine_config, run_main, settings_from_args
from services.pb.betelgeuse.v1 import store_pb2 as pb
from services.pb.betelgeuse.v1 import store_pb2_grpc as pb_grpc

log = logging.getLogger("betelgeuse.store")


class StoreServicer(pb_grpc.ExpertStoreServicer):
    """Thin: protobuf in, ExpertStore call, protobuf out. Errors become status codes."""

    def __init__(self, store: ExpertStore):
        self.store = store

    def _guard(self, context, fn):
        try:
            return fn()
        except StoreUnavailableError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BetelgeuseError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Attach(self, request, context):
        session, plan = self.store.attach(request.worker_pid)
        event(log, "attach", worker_pid=request.worker_pid, session=session[:8], attaches=self.store.counters.attaches)
        return pb.AttachReply(session=session, layout_json=plan)

    def BeginPass(self, request, context):
        return pb.BeginPassReply(epoch=self._guard(context, lambda: self.store.begin_pass(request.session)))

    def Load(self, request, context):
        keys = [(x.layer, x.expert) for x in request.experts]
        it = self._guard(context, lambda: self.store.load(request.session, keys))
        try:
            for got in it:
                yield pb.Loaded(layer=got.layer, expert=got.expert, staging_slot=got.slot,
                                disk_bytes=got.disk_bytes, prefetched=got.prefetched)
        except StoreUnavailableError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def Prefetch(self, request, context):
        keys = [(x.layer, x.expert) for x in request.experts]
        return pb.PrefetchReply(queued=self._guard(context, lambda: self.store.prefetch(request.session, keys)))

    def Release(self, request, context):
        self._guard(context, lambda: self.store.release(request.session, list(request.staging_slots)))
        return pb.ReleaseReply()

    def EndPass(self, request, context):
        usage = np.asarray(request.usage, dtype=np.int64).reshape(request.n_layer, request.n_expert)
        n = self._guard(context, lambda: self.store.end_pass(request.session, usage, request.consolidate))
        return pb.EndPassReply(promoted=n or 0)

    def Status(self, request, context):
        import json
        return pb.StatusReply(json=json.dumps(self.store.status()))


def serve_fds(store: ExpertStore, path: str, header: dict, stop: threading.Event) -> socket.socket:
    """Hand the arena fd (SCM_RIGHTS) to whoever connects to `path` (the worker); a thread per accept."""
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o660)
    srv.listen(8)

    def loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                try:
                    send_fd(conn, store.arena.fd, header)
                except OSError as e:
                    log.warning("fd hand-off failed: %s", e)
    threading.Thread(target=loop, name="fd-handoff", daemon=True).start()
    return srv


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
        m.disk_read_bytes.labels(reason="prefetch").inc(delta("bp", r.request_bytes[1]))
        m.disk_reads.labels(reason="demand").inc(delta("rd", r.requests[0]))
        m.disk_reads.labels(reason="prefetch").inc(delta("rp", r.requests[1]))
        m.expert_loads.labels(reason="demand").inc(delta("ld", st["demand_loads"] - st["staged_hits"]))
        m.expert_loads.labels(reason="prefetch").inc(delta("lp", st["readahead_reads"] + st["consolidation_reads"]))
        m.consolidations.inc(delta("c", st["consolidations"]))
        used = st["slots"]["host_slots"]
        m.expert_slots.labels(tier="host", state="used").set(used)
        m.expert_slots.labels(tier="host", state="free").set(store.plan.n_layer * store.plan.host_per_layer - used)
        m.workers_attached.set(1 if st["session"] else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="betelgeuse-store", description=__doc__.splitlines()[0])
    common_args(p)
    a = p.parse_args(argv)
    settings, over = settings_from_args(a)
    cfg = dataclasses.replace(engine_config(settings, use_torch=False), **over)
    metrics_addr = a.metrics if a.metrics is not None else settings.store.metrics

    sdnotify.notify(status="opening model")
    model = GGUFModelFile.open(cfg.model_path)
    cg = CgroupMemory.of_process()
    limit = cg.limit() if cg else None
    current = cg.in_use() if cg else 0          # page cache (the worker's mmap reads) can be reclaimed
    plan = plan_slots(model, cfg, limit, current)
    event(log, "plan", model=cfg.model_path, n_vram=plan.n_vram, n_host=plan.n_host, n_staging=plan.n_staging,
          vram_backing=cfg.vram_backing, arena_bytes=plan.arena_bytes, memory_limit_bytes=limit,
          memory_in_use_bytes=current, vram_budget_bytes=cfg.vram_budget)
    sdnotify.notify(status=f"pre-faulting a {plan.arena_bytes / 2**30:.2f} GiB arena",
                    extend_timeout_us=int(120e6))
    store = ExpertStore(model, plan, read_threads=cfg.read_threads, read_request_bytes=cfg.read_request_bytes)

    m = make_store_metrics(__version__)
    m.arena_bytes.set(plan.arena_bytes)
    m.disk_direct_io.set(1 if store.reader.mode == "direct" else 0)
    store.reader.on_read = m.disk_read_duration.observe     # seconds per preadv piece, from the reader threads
    if cg:
        m.set_cgroup_reader(cg.current, lambda: float(cg.limit() or "nan"))
    stop = threading.Event()
    if metrics_addr:
        host, port = split_hostport(metrics_addr, "metrics")
        serve_metrics(m.registry, host, port)
    threading.Thread(target=_sync_metrics, args=(m, store, stop), daemon=True).start()

    for path in (settings.store.socket, settings.store.fd_socket):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(settings.store.socket):
        os.unlink(settings.store.socket)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="store-rpc"))
    pb_grpc.add_ExpertStoreServicer_to_server(StoreServicer(store), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"unix:{settings.store.socket}")
    server.start()
    fd_srv = serve_fds(store, settings.store.fd_socket, {"arena_bytes": store.arena.nbytes}, stop)
    m.ready.set(1)
    sdnotify.notify(ready=True, status=f"serving: {plan.n_vram}+{plan.n_host} slots/layer, "
                                        f"{store.reader.mode} I/O, arena {plan.arena_bytes / 2**30:.2f} GiB")
    event(log, "ready", role="store", version=__version__, control=settings.store.socket, fds=settings.store.fd_socket,
          io=store.reader.mode, metrics=metrics_addr or None)

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    interval = sdnotify.watchdog_interval()
    while not stop.wait(interval / 2 if interval else 1.0):
        if interval:
            sdnotify.notify(watchdog=True)
    sdnotify.notify(stopping=True, status="stopping")
    server.stop(grace=2).wait()
    fd_srv.close()
    for path in (settings.store.socket, settings.store.fd_socket):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
