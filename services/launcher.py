"""The one launcher: start Betelgeuse's processes for a development run, a test, the bench or the CLI (no systemd
involved).

    with Cluster(model, tmpdir) as c:        # store process, then worker process, health SERVING
        ch = c.channel()                     # to the worker: InferenceService, health
    p = spawn("store", "services.store_main", args, log_path)     # one child, on its own (the tests' way)
Each process is a real `python -m services.store_main|worker_main` with its own sockets under
`runtime_dir`; they are ended by PID on exit (SIGTERM, then SIGKILL after a grace period), and die with
their parent (BETELGEUSE_PARENT_PID: services.common.run_main sets PR_SET_PDEATHSIG), so a `kill -9` of `betelgeuse serve` or of a test leaves no orphan.
`Cluster.supervise()` restarts a child that crashes (the worker comes back warm: the store keeps the arena)
and says which one died and how. A store child for one EngineConfig, with its client, is services/assembly.py's
open_store(cfg, mode="process").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from betelgeuse.errors import BetelgeuseError, StoreUnavailableError


# `betelgeuse serve` owns these keys: the sockets live in --runtime-dir, the gRPC address is --host/--port, the model
# is MODEL
SERVE_OWN = ("model.path", "store.socket", "store.fd_socket", "worker.listen")


def serve_arguments(p) -> None:
    """`betelgeuse serve`'s arguments (services/cli.py's command; the serve bench checks its flags against them)."""
    p.add_argument("model", nargs="?", help="GGUF model file (default: a built-in tiny synthetic model)")
    p.add_argument("--config", help="TOML settings (deploy/betelgeuse.toml); BETELGEUSE_* variables and flags "
                   "override it")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC API and /metrics listen on (default 127.0.0.1; 0.0.0.0 = all interfaces)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument("--runtime-dir", default=None,
                   help="sockets and logs (default: a temporary directory, removed on a clean stop, kept if a process dies)")
    from betelgeuse.settings import add_flags
    add_flags(p, exclude=SERVE_OWN, group="settings (betelgeuse/settings.py; both processes get them)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chosen_port(addr: str) -> str:
    """HOST:0 -> HOST:<a free port> ("" and fixed ports as given)."""
    host, sep, port = addr.rpartition(":")
    return f"{host}:{free_port()}" if sep and port == "0" else addr


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    started: float = field(default_factory=time.monotonic)
    args: list = field(default_factory=list)      # the command line it was started with

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:                              # gone with the runtime directory, or unreadable
            return ""

    def last_line(self) -> str:
        """The child's last error line from its log, without its prefix (else its last line; a missing or unreadable
        log gives "(no output)")."""
        lines = [l for l in self.log().splitlines() if l.strip()]
        err = [l.removeprefix("betelgeuse: error:").strip() for l in lines if l.startswith("betelgeuse: error:")]
        return (err or lines or ["(no output)"])[-1]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int):
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, SIGKILL after `grace` seconds; the exit code."""
        return terminate(self.popen, grace)

    def kill9(self) -> int:
        """SIGKILL (no clean shutdown); the exit code."""
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()


def spawn(name: str, module: str, args: list[str], log_path, env: dict | None = None, preexec=None,
          cwd: str | None = None) -> Proc:
    """`python -m module args` in a session of its own, stdout and stderr appended to `log_path`, stdin empty;
    `env` default: python_env(). The caller ends it by its PID (Proc.stop)."""
    cmd = [sys.executable, "-m", module, *args]
    with open(log_path, "ab") as logf:
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=python_env() if env is None else env, preexec_fn=preexec, cwd=cwd,
                             start_new_session=True)
    return Proc(name, p, str(log_path), args=cmd)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def terminate(popen: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM a child we started, SIGKILL it if it is still there after `grace` seconds; its exit code."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(grace)
        except subprocess.TimeoutExpired:
            popen.kill()
    return popen.wait()


def python_env(**extra: str) -> dict:
    """This environment with the repository first on PYTHONPATH, for `python -m services.*` children."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


@dataclass
class Cluster:
    model: str
    runtime_dir: str
    device: str = "cpu"
    config: str | None = None         # --config for both children (they read it, and the environment, themselves)
    settings: dict = field(default_factory=dict)  # "section.key" -> value: settings both children get as flags
    port: int = 0                     # worker gRPC port (0 = pick a free one)
    host: str = "127.0.0.1"           # worker gRPC listen host (0.0.0.0 / :: = every interface)
    worker_metrics: str = "127.0.0.1:0"
    store_metrics: str = "127.0.0.1:0"
    extra_store_args: list = field(default_factory=list)
    http: str = ""                    # worker's OpenAI HTTP API HOST:PORT ("" = off; "auto" = a free loopback port)
    extra_worker_args: list = field(default_factory=list)
    health_address: str | None = None  # where wait_serving asks (e.g. a plain unix: listener beside a TLS port)
    worker_stop_grace: float = 75.0   # SIGTERM -> SIGKILL for the worker: its drain_grace (60 s) plus shutdown
    store: Proc | None = None
    worker: Proc | None = None

    def __post_init__(self):
        os.makedirs(self.runtime_dir, exist_ok=True)
        self.store_socket = os.path.join(self.runtime_dir, "store.sock")
        self.fd_socket = os.path.join(self.runtime_dir, "store.fds")
        if not self.port:
            self.port = free_port()
        self.listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        local = self.host in ("0.0.0.0", "::", "")      # a wildcard listens on loopback too
        self.address = f"127.0.0.1:{self.port}" if local else self.listen
        if self.http == "auto":
            self.http = f"127.0.0.1:{free_port()}"
        # port 0 for /metrics: chosen here, as the gRPC port is, so the banner and the children name the same one
        for key, attr in (("worker.metrics", "worker_metrics"), ("store.metrics", "store_metrics")):
            addr = _chosen_port(self.settings.get(key, getattr(self, attr)))
            setattr(self, attr, addr)
            if key in self.settings:
                self.settings = {**self.settings, key: addr}
        self.http_url = f"http://{self.http}" if self.http else ""

    def child_settings(self) -> dict[tuple[str, str], object]:
        """What the children are told: the launcher's own keys (model, sockets in runtime_dir, addresses), then
        `settings`. Both get the same ones (each process uses its own [worker] / [store] keys)."""
        own = {"model.path": self.model, "store.socket": self.store_socket, "store.fd_socket": self.fd_socket,
               "worker.device": self.device, "worker.metrics": self.worker_metrics,
               "store.metrics": self.store_metrics, "worker.listen": [self.listen], "worker.http": self.http}
        return {tuple(k.split(".", 1)): v for k, v in {**own, **self.settings}.items()}

    def child_args(self) -> list[str]:
        """The children's arguments: --config and the flags the settings model derives for child_settings()."""
        from betelgeuse.settings import to_flags
        return (["--config", self.config] if self.config else []) + to_flags(self.child_settings())

    def _spawn(self, name: str, module: str, args: list[str], preexec=None) -> Proc:
        os.makedirs(self.runtime_dir, exist_ok=True)    # someone may have removed it (tmp cleaners, an operator)
        return spawn(name, module, args, os.path.join(self.runtime_dir, f"{name}.log"),
                     env=python_env(BETELGEUSE_PARENT_PID=str(os.getpid())), preexec=preexec)

    def _store_answers(self, pid: int) -> bool:
        """The store process `pid` (not a dead predecessor's stale socket) answers on the control socket."""
        if not os.path.exists(self.fd_socket):
            return False
        import grpc
        from services.pb.betelgeuse.v1 import store_pb2, store_pb2_grpc
        with grpc.insecure_channel(f"unix:{self.store_socket}") as ch:
            try:
                import json
                st = json.loads(store_pb2_grpc.ExpertStoreStub(ch).Status(store_pb2.StatusRequest(), timeout=2).json)
            except grpc.RpcError:
                return False
        return st.get("pid") == pid

    def start_store(self, timeout: float = 120.0, preexec=None) -> Proc:
        self.store = self._spawn("store", "services.store_main", self.child_args() + self.extra_store_args,
                                 preexec)
        t0 = time.monotonic()
        while not self._store_answers(self.store.pid):
            if not self.store.alive():
                raise BetelgeuseError(f"the store (pid {self.store.pid}) {describe_exit(self.store.popen.returncode)} "
                                      f"while starting: {self._last_line(self.store)}")
            if time.monotonic() - t0 > timeout:
                raise StoreUnavailableError(f"the store did not come up in {timeout:.0f} s; see {self.store.log_path}")
            time.sleep(0.1)
        return self.store

    def start_worker(self, timeout: float = 180.0, preexec=None, wait: bool = True, abort=None) -> Proc:
        self.worker = self._spawn("worker", "services.worker_main",
                                  self.child_args() + self.extra_worker_args,
                                  preexec)
        if wait:
            self.wait_serving(timeout, abort=abort)
        return self.worker

    def wait_serving(self, timeout: float = 180.0, abort=None):
        """Until the worker's health is SERVING; a child that dies meanwhile is named at once (not at the timeout)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        t0 = time.monotonic()
        with grpc.insecure_channel(self.health_address or self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if abort is not None and abort():
                    raise KeyboardInterrupt
                if self.worker is not None and not self.worker.alive():
                    raise BetelgeuseError(f"the worker (pid {self.worker.pid}) {describe_exit(self.worker.popen.returncode)}"
                                          f" while starting: {self._last_line(self.worker)}")
                if self.store is not None and not self.store.alive():
                    raise BetelgeuseError(f"the store (pid {self.store.pid}) {describe_exit(self.store.popen.returncode)}"
                                          f" while the worker was starting: {self._last_line(self.store)}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() - t0 > timeout:
                    raise BetelgeuseError(f"the worker did not become SERVING in {timeout:.0f} s; see {self.worker.log_path}")
                time.sleep(0.1)

    @staticmethod
    def _last_line(p: Proc) -> str:
        return p.last_line()

    def channel(self):
        import grpc
        return grpc.insecure_channel(self.address)

    def stop(self) -> int | None:
        """Worker first (it drains), then the store. Runs to the end even if signals arrive meanwhile. The store's
        exit code (None: none was started)."""
        if self.worker is not None:
            self.worker.stop(self.worker_stop_grace)
        if self.store is not None:
            return self.store.stop(20.0)
        return None

    def store_sockets_gone(self) -> bool:
        """The running store's sockets are no longer at their paths (the runtime directory was removed): no new
        worker could reach it, so it must be restarted."""
        return self.store is not None and self.store.alive() and not (
            os.path.exists(self.store_socket) and os.path.exists(self.fd_socket))

    def supervise(self, stop: threading.Event, say=print, max_restarts: int = 5, window: float = 120.0):
        """Until `stop` is set: restart a child that exits (store first; the worker re-attaches by itself, and a
        new worker re-maps the warm arena), naming it and how it ended; restart the store when its sockets are gone
        (the runtime directory removed: it is made again). A child restarts at once, then, while it keeps failing,
        after a back-off (0.5 s, doubling to 8 s), so a transient cause (the store still holding the dead worker's lease) clears
        instead of burning the budget. More than `max_restarts` restarts in `window` seconds is a crash loop: raise
        BetelgeuseError naming the process. Nothing else ends supervision: a failure of its own (a log it cannot
        read, a directory it must re-create) is said and retried."""
        restarts: list[float] = []
        backoff = {"store": 0.0, "worker": 0.0}
        not_before = {"store": 0.0, "worker": 0.0}
        while not stop.wait(0.2):
            for name in ("store", "worker"):
                p = getattr(self, name)
                gone = name == "store" and self.store_sockets_gone()
                now = time.monotonic()
                if (p.alive() and not gone) or now < not_before[name]:
                    if p.alive() and not gone and now - p.started > 30.0:
                        backoff[name] = 0.0            # up for a while: the next failure restarts at once
                    continue
                restarts = [t for t in restarts if now - t < window] + [now]
                last = self._last_line(p)
                if len(restarts) > max_restarts:
                    raise BetelgeuseError(f"the {name} (pid {p.pid}) {describe_exit(p.popen.returncode)} "
                                          f"({len(restarts) - 1} restarts in {window:.0f} s; giving up): {last}")
                if gone:
                    say(f"betelgeuse: the store's sockets in {self.runtime_dir} are gone (was the directory "
                        "removed?); restarting the store")
                else:
                    say(f"betelgeuse: the {name} (pid {p.pid}) {describe_exit(p.popen.returncode)}; restarting it "
                        f"(last log line: {last})")
                backoff[name] = min(8.0, backoff[name] * 2 or 0.5)
                not_before[name] = now + backoff[name]
                try:
                    if name == "store":
                        if gone:
                            self.store.stop(20.0)
                        self.start_store()
                        say(f"betelgeuse: store restarted (pid {self.store.pid}); the worker re-attaches by itself")
                    else:
                        self.start_worker(abort=stop.is_set)
                        say(f"betelgeuse: worker restarted (pid {self.worker.pid}), re-attached to the warm store")
                except KeyboardInterrupt:           # stop was set while the worker was starting
                    return
                except Exception as e:              # noqa: BLE001 (the new child died while starting, or our own
                    # bookkeeping failed: the next turn, after the back-off, tries again; the crash-loop limit holds)
                    say(f"betelgeuse: restarting the {name} failed: {' '.join(str(e).split())}")

    def __enter__(self):
        self.start_store()
        self.start_worker()
        return self

    def __exit__(self, *exc):
        self.stop()
