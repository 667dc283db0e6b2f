"""The application's composition root: the expert store in this process or as its own process, and the runner
or engine over either (betelgeuse/assembly.py wires the library's parts; this adds the process and gRPC).

    store = open_store(cfg, mode="process")    # a services.store_main child planned with cfg, and its client
    runner = open_runner(cfg, store)           # or open_engine(cfg, store); mode="in-process": no child
    ...
    runner.close(); store.close()              # the child ended by its PID; its exit code

The child is told every key of cfg (config.engine_settings -> its flags), so it plans its slots with exactly the
configuration the worker side runs with. `connect_store` is the way in to a store someone else started (the
worker process under systemd or `betelgeuse serve`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from betelgeuse.assembly import LocalStore, open_engine, open_runner  # noqa: F401  (re-exported: one place to import)
from betelgeuse.assembly import open_store as open_local_store
from betelgeuse.config import EngineConfig, engine_settings
from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import BY_KEY, from_text
from services.grpc.store_client import GrpcStoreClient
from services.launcher import Cluster, Proc

MODES = ("in-process", "process")


def connect_store(socket: str, fd_socket: str, session_transport: str | None = None, **timeouts) -> GrpcStoreClient:
    """A client of the store listening on `socket` (control, gRPC) and `fd_socket` (the arena's fd); `timeouts`:
    GrpcStoreClient's timeout / per_expert / probe_timeout. Nothing is sent until the runner attaches.
    session_transport: store.session_transport; None: that setting's environment variable
    (BETELGEUSE_STORE_SESSION_TRANSPORT, read as resolve_settings reads it: how the bench, which builds no Settings,
    is switched), else the setting's default. store.session_reader: its environment variable
    (BETELGEUSE_STORE_SESSION_READER) likewise, else its default."""
    if session_transport is None:
        session_transport = _from_env("session_transport")
    return GrpcStoreClient(socket, fd_socket, session_transport=session_transport,
                           session_reader=_from_env("session_reader"), **timeouts)


def _from_env(name: str):
    """Setting store.<name> from its environment variable, as resolve_settings reads it, else its default."""
    key = BY_KEY[("store", name)]
    raw = os.environ.get(key.env, "").strip()
    return from_text(key, raw) if raw else key.field.default


@dataclass(slots=True)
class ChildStore:
    """A `services.store_main` child (started by the launcher) and the client to it."""
    client: GrpcStoreClient
    cluster: Cluster            # the launcher that started it: runtime_dir, its sockets and log
    ready_s: float              # seconds from the spawn until it answered (its arena pre-faulted)
    temporary: bool             # its runtime directory is ours to remove

    @property
    def proc(self) -> Proc:
        return self.cluster.store

    def close(self) -> int | None:
        """The client, then the child (SIGTERM by PID, SIGKILL after a grace period): its exit code. A temporary
        runtime directory goes when the child ended cleanly, and stays with its log otherwise."""
        self.client.close()
        rc = self.cluster.stop()
        if self.temporary and rc == 0:
            shutil.rmtree(self.cluster.runtime_dir, ignore_errors=True)
        return rc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_store(cfg: EngineConfig, mode: str = "in-process", runtime_dir: str | None = None,
               timeout: float = 120.0, session_transport: str | None = None) -> ChildStore | LocalStore:
    """The expert store for `cfg`: in this process (`in-process`: an ExpertStore and its client), or as a
    `services.store_main` child (`process`) with its sockets and log (store.log) in `runtime_dir` (default: a
    temporary directory), ready once its arena is pre-faulted (at most `timeout` seconds). session_transport:
    connect_store's."""
    if mode == "in-process":
        return open_local_store(cfg)
    if mode != "process":
        raise BetelgeuseError(f"store mode must be one of {', '.join(MODES)}, got {mode!r}")
    temporary = runtime_dir is None
    runtime_dir = tempfile.mkdtemp(prefix="betelgeuse-store-") if temporary else runtime_dir
    settings = {f"{section}.{key}": v for (section, key), v in engine_settings(cfg).items()}
    cluster = Cluster(cfg.model_path, runtime_dir, device=cfg.device, settings=settings, worker_metrics="",
                      store_metrics="")
    t = time.monotonic()
    try:
        cluster.start_store(timeout)
    except BaseException:
        cluster.stop()                           # a child that did not come up in time; its log stays
        raise
    ready_s = time.monotonic() - t
    return ChildStore(connect_store(cluster.store_socket, cluster.fd_socket, session_transport), cluster, ready_s,
                      temporary)
