"""The exact ExecStart= command lines of deploy/systemd start the two processes, and both speak the
sd_notify protocol to a real NOTIFY_SOCKET (AF_UNIX, SOCK_DGRAM, in a tmp dir) that this test listens
on, as systemd would: STATUS= while loading, READY=1 once serving, WATCHDOG=1 pings within WatchdogSec
(WATCHDOG_USEC=2 s here), STOPPING=1 on SIGTERM. systemd itself is never booted nor called; the
unit files are parsed with tests/services/test_systemd_units.py's parser (which also runs `systemd-analyze verify`).

Only two things in argv are rewritten: the interpreter path (/opt/betelgeuse/.venv/bin/python ->
this interpreter) and the config path (-> a test TOML with tmp sockets, the tiny model and free
loopback ports). WorkingDirectory= becomes the checkout; Environment= is applied as written."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

try:
    from tests import service_helpers as h
    from tests.test_systemd_units import CONFIG, UNITS, VENV_PY, exec_start_argv, one, parse_unit, values
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h
    from test_systemd_units import CONFIG, UNITS, VENV_PY, exec_start_argv, one, parse_unit, values

from services.launcher import free_port

service_model = h.service_model   # the session fixture, under its name in this module
WATCHDOG_USEC = 2_000_000


class NotifySocket:
    """What systemd listens on: one datagram per sd_notify() call, newline-separated assignments.
    A thread receives them as they arrive, so each carries its arrival time (monotonic seconds)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)          # so the receiver notices close() within 0.1 s
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self):
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            kv = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            self.messages.append((time.monotonic(), kv))

    def wait_for(self, key: str, value: str | None = None, timeout: float = 120.0, proc=None):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for t, kv in list(self.messages):
                if key in kv and (value is None or kv[key] == value):
                    return t, kv
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"process exited ({proc.returncode}) before {key}; messages: {self.messages}")
            time.sleep(0.05)
        raise AssertionError(f"no {key}={value} within {timeout} s; got {self.messages}")

    def values(self, key: str) -> list[str]:
        return [kv[key] for _, kv in list(self.messages) if key in kv]

    def close(self):
        self._closed = True
        self._thread.join(1.0)
        self.sock.close()


def unit_launch(unit_name: str, config: Path, notify_path: str, log: Path) -> tuple[subprocess.Popen, list[str]]:
    unit = parse_unit(UNITS / unit_name)
    argv = exec_start_argv(unit_name)
    assert argv[0] == VENV_PY and argv.count(CONFIG) == 1, argv
    run = [sys.executable if a == VENV_PY else str(config) if a == CONFIG else a for a in argv]
    assert [a for a in run if a not in (sys.executable, str(config))] == [a for a in argv if a not in (VENV_PY, CONFIG)]
    env = dict(os.environ)
    for assignment in values(unit, "Service", "Environment"):
        for kv in shlex.split(assignment):
            k, _, v = kv.partition("=")
            env[k] = v
    env.update(NOTIFY_SOCKET=notify_path, WATCHDOG_USEC=str(WATCHDOG_USEC))
    env.pop("WATCHDOG_PID", None)
    assert one(unit, "Service", "WorkingDirectory") == "/opt/betelgeuse"
    with log.open("wb") as f:
        p = subprocess.Popen(run, cwd=h.ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return p, run


def stop(p: subprocess.Popen):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_units_start_the_processes_and_notify(service_model, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    api_port, wm, sm = free_port(), free_port(), free_port()
    cfg = h.write_toml(tmp_path / "betelgeuse.toml", {
        "model": {"path": str(service_model)},
        "slots": {"vram_per_layer": 2, "host_per_layer": 6},
        "worker": {"listen": [f"127.0.0.1:{api_port}", f"unix:{run_dir}/api.sock"], "metrics": f"127.0.0.1:{wm}",
                   "device": "cpu"},
        "store": {"socket": str(run_dir / "store.sock"), "fd_socket": str(run_dir / "store.fds"),
                  "metrics": f"127.0.0.1:{sm}"},
    })
    store_n = NotifySocket(str(tmp_path / "store.notify"))
    worker_n = NotifySocket(str(tmp_path / "worker.notify"))
    store = worker = None
    try:
        store, store_argv = unit_launch("betelgeuse-store.service", cfg, store_n.path, tmp_path / "store.log")
        t_ready, kv = store_n.wait_for("READY", "1", proc=store)
        assert "serving" in kv.get("STATUS", ""), kv
        assert any("arena" in s for s in store_n.values("STATUS")), store_n.messages
        # After=betelgeuse-store.service with Type=notify: systemd starts the worker once the store is READY
        worker, worker_argv = unit_launch("betelgeuse.service", cfg, worker_n.path, tmp_path / "worker.log")
        print("ExecStart (store): ", shlex.join(store_argv))
        print("ExecStart (worker):", shlex.join(worker_argv))
        w_ready, wkv = worker_n.wait_for("READY", "1", proc=worker)
        statuses = worker_n.values("STATUS")
        print("worker STATUS lines:", statuses)
        assert f"127.0.0.1:{api_port}" in wkv.get("STATUS", ""), wkv
        assert any("loading" in s for s in statuses) and any("attaching" in s for s in statuses), statuses
        # READY means ready: health is SERVING on both listen addresses and a generation works
        for addr in (f"127.0.0.1:{api_port}", f"unix:{run_dir}/api.sock"):
            with grpc.insecure_channel(addr) as ch:
                assert h.health_status(ch) == health_pb2.HealthCheckResponse.SERVING, addr
        with grpc.insecure_channel(f"127.0.0.1:{api_port}") as ch:
            r = h.run_stream(h.stub(ch).Generate(h.request(text="Hello", max_tokens=3, ignore_eos=True), timeout=60))
            assert r.code is None and len(r.tokens) == 3, r.details
        for url in (f"http://127.0.0.1:{wm}/metrics", f"http://127.0.0.1:{sm}/metrics"):
            assert h.value(h.scrape(url), "betelgeuse_ready") == 1, url
        # watchdog pings keep coming, each well within WatchdogSec (2 s)
        time.sleep(3.0)
        for n, since in ((store_n, t_ready), (worker_n, w_ready)):
            pings = [t for t, kv in n.messages if kv.get("WATCHDOG") == "1" and t >= since]
            assert len(pings) >= 2, n.messages
            gaps = [b - a for a, b in zip([since] + pings, pings + [time.monotonic()])]
            assert max(gaps) < WATCHDOG_USEC / 1e6, gaps
        # SIGTERM (KillSignal=) -> STOPPING=1 and a clean exit
        stop(worker)
        worker_n.wait_for("STOPPING", "1", timeout=5)
        assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-2000:]
        stop(store)
        store_n.wait_for("STOPPING", "1", timeout=5)
        assert store.returncode == 0, (tmp_path / "store.log").read_text()[-2000:]
    except BaseException:
        h.print_logs(tmp_path)
        raise
    finally:
        for p in (worker, store):
            if p is not None:
                stop(p)
        store_n.close()
        worker_n.close()


def test_notify_socket_listener_can_fail(tmp_path):
    """Without NOTIFY_SOCKET in its environment nothing arrives: the listener above is not fooled."""
    n = NotifySocket(str(tmp_path / "n"))
    try:
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        code = "from betelgeuse import sdnotify; import sys; sys.exit(0 if not sdnotify.notify(ready=True) else 3)"
        assert subprocess.run([sys.executable, "-c", code], cwd=h.ROOT, env=env, timeout=60).returncode == 0
        time.sleep(0.2)
        assert n.values("READY") == []
        env["NOTIFY_SOCKET"] = n.path
        code = "from betelgeuse import sdnotify; import sys; sys.exit(0 if sdnotify.notify(ready=True) else 3)"
        assert subprocess.run([sys.executable, "-c", code], cwd=h.ROOT, env=env, timeout=60).returncode == 0
        assert n.wait_for("READY", "1", timeout=5)
    finally:
        n.close()
