"""betelgeuse (the GPU worker): attaches to the expert store, loads the model, serves gRPC.

    python -m services.worker_main --config /etc/betelgeuse/betelgeuse.toml

READY=1 once the model is loaded and the store attached; health is SERVING only then, and
NOT_SERVING while the store is away (the engine re-attaches by itself when it is back).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
import time

from betelgeuse import __version__, sdnotify
from betelgeuse.logs import event
from betelgeuse.errors import StoreUnavailableError
from betelgeuse.metrics import make_worker_metrics, serve_metrics
from betelgeuse.settings import split_hostport
from betelgeuse.store.cgroup import CgroupMemory
from betelgeuse.worker.engine import LLMEngine
from services.common import common_args, engine_config, run_main, settings_from_args
from services.grpc_server import build_server, set_health
from services.store_client import GrpcStoreClient

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="betelgeuse-worker", description=__doc__.splitlines()[0])
    common_args(p)
    p.add_argument("--listen", action="append", help="gRPC address HOST:PORT or unix:/path (repeatable)")
    p.add_argument("--http", help="HOST:PORT of the OpenAI-compatible HTTP API ('' = off; overrides [worker] http)")
    p.add_argument("--store-wait", type=float, default=120.0, help="seconds to wait for the store at start-up")
    a = p.parse_args(argv)
    settings, over = settings_from_args(a)
    cfg = dataclasses.replace(engine_config(settings), **over)
    listen = a.listen or settings.worker.listen
    metrics_addr = a.metrics if a.metrics is not None else settings.worker.metrics
    http_addr = a.http if a.http is not None else settings.worker.http
    if http_addr:
        split_hostport(http_addr, "--http")

    m = make_worker_metrics(__version__)
    m.vram_budget_bytes.set(cfg.vram_budget)
    cg = CgroupMemory.of_process()
    if cg:
        m.set_cgroup_reader(cg.current, lambda: float(cg.limit() or "nan"))
    if metrics_addr:
        host, port = split_hostport(metrics_addr, "metrics")
        serve_metrics(m.registry, host, port)

    sdnotify.notify(status="attaching to the expert store")
    client = GrpcStoreClient(settings.store.socket, settings.store.fd_socket)
    wait_for_store(client, a.store_wait)         # the engine attaches itself; this waits until the store answers
    sdnotify.notify(status="loading the model", extend_timeout_us=int(300e6))
    interval = sdnotify.watchdog_interval()
    last_ping = [0.0]

    def tick():                                   # the engine loop pings the watchdog
        now = time.monotonic()
        if interval and now - last_ping[0] > interval / 3:
            sdnotify.notify(watchdog=True)
            last_ping[0] = now

    engine = LLMEngine(cfg, client, metrics=m, on_tick=tick)
    mi = engine.model_info()
    m.model_info.info({"name": mi.name, "arch": mi.arch, "quant": mi.quant, "n_layer": str(mi.n_layer),
                       "n_expert": str(mi.n_expert), "n_expert_used": str(mi.n_expert_used)})
    server, health_servicer, ports = build_server(engine, listen, metrics=m)
    server.start()
    http = None
    if http_addr:                                 # the same engine, queue, limits and metrics as gRPC
        from services.http.app import build_app
        from services.http.server import HttpServer
        http = HttpServer(build_app(engine, metrics=m), http_addr)
        http.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ready_sent = False
    event(log, "ready", role="worker", version=__version__, listen=",".join(listen), metrics=metrics_addr or None,
          model=mi.name, arch=mi.arch, quant=mi.quant, device=cfg.device, dtype=str(engine.runner.dtype).removeprefix("torch.")
          if hasattr(engine.runner, "dtype") else cfg.dtype, n_vram=mi.vram_slots_per_layer,
          n_host=mi.host_slots_per_layer, schedule=cfg.schedule, routing=mi.routing,
          approximate=mi.routing != "exact", max_running=cfg.max_running, max_queue=cfg.max_queue,
          max_context=cfg.max_context)
    while not stop.is_set():
        if engine.store_ok:                       # notice a dead store while idle, not only when a request fails
            try:
                client.ping()
            except StoreUnavailableError as e:
                engine.report_store_down(e)
                time.sleep(0.05)
        ok = engine.is_ready()
        set_health(health_servicer, ok)
        m.ready.set(1 if ok else 0)
        if ok and not ready_sent:
            sdnotify.notify(ready=True, status=f"serving {mi.name} on {', '.join(listen)}")
            ready_sent = True
        elif not ok:
            sdnotify.notify(status="expert store unavailable; re-attaching")
        cache = engine.runner.cache
        used = int((cache.vram_owner[:, :, 0] >= 0).sum())
        m.expert_slots.labels(tier="vram", state="used").set(used)
        m.expert_slots.labels(tier="vram", state="free").set(engine.runner.plan.n_layer * engine.runner.plan.n_vram - used)
        if cache.is_cuda:
            import torch
            m.vram_used_bytes.labels(pool="experts").set(cache.vram.numel() + cache.ring.numel())
            m.vram_used_bytes.labels(pool="workspace").set(torch.cuda.memory_reserved(engine.runner.device))
        if not engine._thread.is_alive():
            tick()
        stop.wait(0.5)
    sdnotify.notify(stopping=True, status="draining")
    set_health(health_servicer, False)
    if http is not None:
        http.stop()
    server.stop(grace=5).wait()
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
