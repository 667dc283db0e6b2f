"""uvicorn on a thread of the worker process, bound exclusively to one HOST:PORT, with the edge's limits.

    srv = HttpServer(build_app(engine, metrics), "127.0.0.1:8000", Limits.of(settings.worker)); srv.start(); ...

The socket is bound here (no SO_REUSEPORT, so a second server on a busy port fails at once with a line
naming the address) and handed to uvicorn, which installs no signal handlers off the main thread.

The limits (`Limits`, from [worker] http_*): idle and slow clients cannot hold the worker's file descriptors
(which gRPC, the store and the model need too):
- at most `max_connections` open connections: one more is answered `503` (JSON, Retry-After, Connection: close)
  and closed the moment it is accepted, so a flood costs one descriptor for microseconds per connection;
- a request's line and headers must arrive within `header_timeout` seconds of the connection (or of the first
  byte after a keep-alive pause), its body within `body_timeout` seconds of its headers: else `408` and close
  (a connection that never sent a byte is just closed);
- an idle keep-alive connection is closed after `keep_alive` seconds (uvicorn's timer).
uvicorn logs through the root logger (log_config=None): one line per event, in the process's format.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import split_hostport

log = logging.getLogger("betelgeuse.http")


@dataclass(slots=True, frozen=True)
class Limits:
    max_connections: int
    header_timeout: float               # seconds
    body_timeout: float                 # seconds
    keep_alive: float                   # seconds

    @classmethod
    def of(cls, worker) -> "Limits":
        """From the [worker] settings (betelgeuse/settings.py holds the defaults)."""
        return cls(worker.http_max_connections, worker.http_header_timeout, worker.http_body_timeout,
                   worker.http_keep_alive)


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


def _canned(status: int, reason: str, message: str, kind: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and header / body deadlines (see the module doc)."""

    limits: Limits                        # set per server by HttpServer (a subclass per server)

    def connection_made(self, transport):
        self._deadline = None
        self._seen_cycle = None
        self._got_bytes = False
        self._refused = len(self.server_state.connections) >= self.limits.max_connections
        if self._refused:
            n = self.limits.max_connections
            transport.write(_canned(503, "Service Unavailable", f"too many connections (the limit is {n}); retry "
                                    "later", "service_unavailable_error", "retry-after: 1\r\n"))
            transport.close()
            self.transport = transport
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc):
        self._disarm()
        if self._refused:
            return
        super().connection_lost(exc)

    def _arm(self, seconds: float):
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self):
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self):
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._got_bytes and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(_canned(408, "Request Timeout", "the request did not arrive in time (headers within "
                                         f"{self.limits.header_timeout:g} s, the body within "
                                         f"{self.limits.body_timeout:g} s)", "invalid_request_error"))
        self.transport.close()

    def data_received(self, data: bytes):
        if self._refused:
            return
        self._got_bytes = True
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self._deadline is None:          # the first byte of a request after a keep-alive pause
            self._arm(self.limits.header_timeout)
        super().data_received(data)
        self._track()

    def on_response_complete(self):
        super().on_response_complete()
        self._track()

    def _track(self):
        """After h11 has parsed what came: headers in -> the body's deadline; the whole body in -> no deadline."""
        cyc = self.cycle
        if cyc is None or cyc.response_complete:
            if cyc is not None and self._seen_cycle is cyc:
                self._disarm()                        # keep-alive now (uvicorn's timer); re-armed by the next byte
            return
        if cyc is not self._seen_cycle:               # a new request's headers are complete
            self._seen_cycle = cyc
            if cyc.more_body:
                self._arm(self.limits.body_timeout)
            else:
                self._disarm()
        elif not cyc.more_body:
            self._disarm()


class HttpServer:
    def __init__(self, app, addr: str, limits: Limits, tls: dict | None = None):
        """`tls`: {"cert", "key", "client_ca"} PEM paths (the gRPC listener's); client_ca requires client certs."""
        import uvicorn
        self.addr, self.limits = addr, limits
        self.sock = bind(addr)
        self.port = self.sock.getsockname()[1]
        proto = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": self.limits})
        kw = {}
        if tls:
            kw = dict(ssl_certfile=tls["cert"], ssl_keyfile=tls["key"])
            if tls.get("client_ca"):
                kw.update(ssl_ca_certs=tls["client_ca"], ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.scheme = "https" if tls else "http"
        cfg = uvicorn.Config(app, http=proto, log_config=None, log_level="warning", access_log=False,
                             timeout_keep_alive=self.limits.keep_alive, lifespan="off", server_header=False, **kw)
        try:
            cfg.load()                            # the TLS files are read here: a bad one is one line at start-up
        except (OSError, ssl.SSLError) as e:
            self.sock.close()
            raise BetelgeuseError(f"HTTP TLS ({tls['cert']}, {tls['key']}): {e}") from None
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
        log.info("OpenAI-compatible HTTP API on %s://%s/v1", self.scheme, self.addr)

    def stop(self, grace: float = 5.0):
        self.server.should_exit = True
        self.thread.join(grace)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(1.0)
        self.sock.close()
