"""betelgeuse (the GPU worker): attaches to the expert store, loads the model, serves gRPC.

    python -m services.worker_main --config /etc/betelgeuse/betelgeuse.toml

READY=1 once the model is loaded and the store attached; health is SERVING only then, and
NOT_SERVING while the store is away (the engine re-attaches by itself when it is back).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

if __name__ == "__main__":     # before the imports below (torch takes seconds): a SIGHUP meanwhile is not fatal either
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

from betelgeuse import __version__, gc_pauses, sdnotify
from betelgeuse.errors import BetelgeuseError, StoreUnavailableError
from betelgeuse.logs import event
from betelgeuse.metrics import make_worker_metrics
from betelgeuse.config import engine_config
from betelgeuse.store.cgroup import CgroupMemory
from betelgeuse.worker.engine import LLMEngine
from services.auth import load_api_keys
from services.common import common_args, listen_metrics, run_main, settings_from_args
from services.grpc.server import build_server, server_credentials, set_health
from services.grpc.store_client import GrpcStoreClient
from services.signals import stop_on_signals

log = logging.getLogger("betelgeuse.worker")


def wait_for_store(client: GrpcStoreClient, timeout: float):
    """The store may still be pre-faulting its arena: retry until it answers or `timeout` passes."""
    t0 = time.monotonic()
    while True:
        try:
            return client.ping()
        except StoreUnavailableError:
            if time.monotonic() - t0 > timeout:
                raise
            sdnotify.notify(status="waiting for the expert store", extend_timeout_us=int(10e6))
            time.sleep(0.25)


def store_probe(engine: LLMEngine, client: GrpcStoreClient, stop: threading.Event, every: float = 0.5):
    """Ping the store while the engine counts it as attached; one that does not answer within the probe timeout
    (dead, or hung: SIGSTOP, a stuck disk) is reported down at once: health NOT_SERVING, the calls in flight are
    aborted so their requests fail UNAVAILABLE now, and the engine re-attaches when the store answers again."""
    while not stop.wait(every):
        if not engine.store_ok or engine._store_lost is not None:
            continue
        try:
            client.ping()
        except StoreUnavailableError as e:
            if engine.store_ok:
                engine.report_store_down(e)
                client.abort(e)


FD_RESERVE = 512            # descriptors beyond the HTTP connections: gRPC clients, the store, the model, logs, torch


def raise_fd_limit(http_connections: int) -> int:
    """Lift the soft RLIMIT_NOFILE towards the hard one (systemd's default soft limit is 1024) so that the HTTP cap
    plus FD_RESERVE fit; one that cannot fit is refused at start, naming the numbers. Returns the soft limit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = http_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, max(need, 4096))
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < need:
        raise BetelgeuseError(f"[worker] http_max_connections = {http_connections} needs {need} file descriptors "
                              f"with the {FD_RESERVE} the rest of the worker uses, but the limit is {soft} (raise "
                              "LimitNOFILE= / ulimit -n, or lower http_max_connections)")
    return soft


def main(argv=None) -> int:
    # SIGHUP (a terminal closing, `kill -HUP`, a log rotator) never stops the worker: its logs go to stderr (the
    # journal, or the launcher's file), so there is nothing to re-open; it is logged and ignored
    hups = []
    signal.signal(signal.SIGHUP, lambda *_: hups.append(time.monotonic()))
    p = argparse.ArgumentParser(prog="betelgeuse-worker", description=__doc__.splitlines()[0])
    common_args(p, metrics="worker")
    p.add_argument("--store-wait", type=float, default=120.0, help="seconds to wait for the store at start-up")
    a = p.parse_args(argv)
    settings = settings_from_args(a)
    cfg = engine_config(settings)
    listen, metrics_addr, http_addr = settings.worker.listen, settings.worker.metrics, settings.worker.http
    ws = settings.worker
    api_keys = load_api_keys(ws.api_keys, ws.api_key_file)
    tls = server_credentials(ws.tls_cert, ws.tls_key, ws.tls_client_ca) if (ws.tls_cert or ws.tls_key) else None
    if http_addr:
        raise_fd_limit(ws.http_max_connections)

    m = make_worker_metrics(__version__)
    pause = [m.gc_pause.labels(str(g)) for g in range(3)]     # bound once: a young collection runs every few ms
    gc_pauses.GcPauses(lambda g, s: pause[g].observe(s)).start()
    m.vram_budget_bytes.set(cfg.vram_budget)
    cg = CgroupMemory.of_process()
    if cg:
        m.set_cgroup_reader(cg.current, lambda: float(cg.limit() or "nan"))
    if metrics_addr:
        listen_metrics(m.registry, metrics_addr)

    sdnotify.notify(status="attaching to the expert store")
    client = GrpcStoreClient(settings.store.socket, settings.store.fd_socket, timeout=ws.store_timeout,
                             probe_timeout=ws.store_probe_timeout,
                             session_transport=settings.store.session_transport,
                             session_reader=settings.store.session_reader)
    wait_for_store(client, a.store_wait)         # the engine attaches itself; this waits until the store answers
    sdnotify.notify(status="loading the model", extend_timeout_us=int(300e6))
    interval = sdnotify.watchdog_interval()
    health_ref: list = []

    def on_state(ok: bool):                       # event-driven health: the moment the store goes or comes back
        if health_ref:
            set_health(health_ref[0], ok and engine.is_ready())
            m.ready.set(1 if ok else 0)

    engine = LLMEngine(cfg, client, metrics=m, on_state=on_state)

    def on_lost(err):                             # the store died: its end of our lease closed
        if engine.store_ok:
            engine.report_store_down(err)
            client.abort(err)
    client.on_lost = on_lost
    mi = engine.model_info()
    m.model_info.info({"name": mi.name, "arch": mi.arch, "quant": mi.quant, "n_layer": str(mi.n_layer),
                       "n_expert": str(mi.n_expert), "n_expert_used": str(mi.n_expert_used)})
    server, health_servicer, ports = build_server(engine, listen, metrics=m, api_keys=api_keys, tls=tls,
                                                  max_request_bytes=ws.max_request_bytes)
    health_ref.append(health_servicer)
    server.start()
    http = None
    if http_addr:                                 # the same engine, queue, limits, metrics, keys and TLS as gRPC
        from services.http.app import build_app
        from services.http.server import HttpServer, Limits
        http = HttpServer(build_app(engine, metrics=m, api_keys=api_keys), http_addr, Limits.of(ws),
                          tls={"cert": ws.tls_cert, "key": ws.tls_key, "client_ca": ws.tls_client_ca} if tls else None)
        http.start()
    stop = threading.Event()
    stop_on_signals(stop)                         # set by a thread, not in a handler (services/signals.py)
    threading.Thread(target=store_probe, args=(engine, client, stop), name="store-probe", daemon=True).start()
    ready_sent = False
    event(log, "ready", role="worker", version=__version__, listen=",".join(listen), metrics=metrics_addr or None,
          model=mi.name, arch=mi.arch, quant=mi.quant, device=cfg.device, dtype=str(engine.runner.dtype).removeprefix("torch.")
          if hasattr(engine.runner, "dtype") else cfg.dtype, n_vram=mi.vram_slots_per_layer,
          n_host=mi.host_slots_per_layer, schedule=cfg.schedule, routing=mi.routing,
          approximate=mi.routing != "exact", max_running=engine.cfg.max_running, max_queue=cfg.max_queue,
          max_context=cfg.max_context, prefill_chunk=mi.prefill_chunk or None,
          api_keys=len(api_keys) or None, tls=tls is not None)
    while not stop.is_set():
        while hups:
            event(log, "sighup", role="worker", action="ignored (logs go to stderr: nothing to re-open)")
            hups.pop()
        ok = engine.is_ready()
        set_health(health_servicer, ok)
        m.ready.set(1 if ok else 0)
        if ok and not ready_sent:
            # start-up's objects (model, reader, servers) out of every later collection's walk (gc_pauses.py)
            event(log, "gc_frozen", role="worker", objects=gc_pauses.freeze())
            sdnotify.notify(ready=True, status=f"serving {mi.name} on {', '.join(listen)}")
            ready_sent = True
        elif not ok:
            sdnotify.notify(status="expert store unavailable; re-attaching")
        # the watchdog is fed only while the engine loop turns: a dead or stuck engine thread lets systemd restart us
        if interval and not engine.stalled(interval / 2):
            sdnotify.notify(watchdog=True)
        cache = engine.runner.cache
        used = int((cache.vram_owner[:, :, 0] >= 0).sum())
        m.expert_slots.labels(tier="vram", state="used").set(used)
        m.expert_slots.labels(tier="vram", state="free").set(engine.runner.plan.n_layer * engine.runner.plan.n_vram - used)
        if cache.is_cuda:
            import torch
            m.vram_used_bytes.labels(pool="experts").set(cache.vram.numel() + cache.ring.numel())
            m.vram_used_bytes.labels(pool="workspace").set(torch.cuda.memory_reserved(engine.runner.device))
        stop.wait(min(0.5, interval / 4) if interval else 0.5)
    # drain: refuse new work, let running requests finish for drain_grace, end the rest with a final message
    sdnotify.notify(stopping=True, status=f"draining (up to {ws.drain_grace:.0f} s)")
    set_health(health_servicer, False)
    busy = len(engine.running) + len(engine.waiting)
    log.info("SIGTERM: draining %d request(s) for up to %.0f s", busy, ws.drain_grace)
    cancelled = engine.drain(ws.drain_grace)
    if cancelled:
        log.warning("drain grace over: %d request(s) ended with finish_reason CANCELLED", cancelled)
    if http is not None:
        http.stop()
    server.stop(grace=2).wait()
    engine.close()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
