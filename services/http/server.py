"""uvicorn on a thread of the worker process, bound exclusively to one HOST:PORT.

    srv = HttpServer(build_app(engine, metrics), "127.0.0.1:8000"); srv.start(); ...; srv.stop()

The socket is bound here (no SO_REUSEPORT, so a second server on a busy port fails at once with a line
naming the address) and handed to uvicorn, which installs no signal handlers off the main thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import split_hostport

log = logging.getLogger("betelgeuse.http")


def bind(addr: str) -> socket.socket:
    host, port = split_hostport(addr, "http")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR (not SO_REUSEPORT): a restarted worker can bind while the old one's connections sit in
    # TIME_WAIT, and a second server on a port someone LISTENs on still fails (Linux refuses that either way)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(512)
    except OSError as e:
        s.close()
        raise BetelgeuseError(f"cannot listen for HTTP on {addr}: {e.strerror or e}") from None
    s.set_inheritable(True)
    return s


class HttpServer:
    def __init__(self, app, addr: str, timeout_keep_alive: int = 5):
        import uvicorn
        self.addr = addr
        self.sock = bind(addr)
        self.port = self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=timeout_keep_alive,
                             lifespan="off", server_header=False)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self):
        try:
            self.server.run(sockets=[self.sock])
        except Exception:                 # noqa: BLE001 (logged: the worker keeps serving gRPC)
            log.exception("the HTTP server stopped")

    def start(self, timeout: float = 10.0):
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started and self.thread.is_alive() and time.monotonic() - t0 < timeout:
            time.sleep(0.02)
        log.info("OpenAI-compatible HTTP API on http://%s/v1", self.addr)

    def stop(self, grace: float = 5.0):
        self.server.should_exit = True
        self.thread.join(grace)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(1.0)
        self.sock.close()
