"""sd_notify over a real AF_UNIX datagram socket, from a real child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, sys
if sys.argv[1] == "noimport":
    sys.modules["systemd"] = None   # no systemd-python anywhere: sdnotify is the one implementation
from betelgeuse import sdnotify
assert "systemd" not in sys.modules or sys.modules["systemd"] is None
print(sdnotify.watchdog_interval())
ok = [
    sdnotify.notify(status="loading model 3/48 layers", extend_timeout_us=90_000_000),
    sdnotify.notify(ready=True, status="serving on 127.0.0.1:50051"),
    sdnotify.notify(watchdog=True),
    sdnotify.notify(stopping=True, status="draining\n2 requests"),
]
print(ok)
"""


def _receive_all(sock: socket.socket) -> list[str]:
    sock.settimeout(5)
    out = []
    for _ in range(4):
        data, _ = sock.recvfrom(4096)
        out.append(data.decode())
    return out


def _run_child(env_extra: dict[str, str], mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30, check=True)


def _check(messages: list[str]) -> None:
    assert messages[0].split("\n") == ["STATUS=loading model 3/48 layers", "EXTEND_TIMEOUT_USEC=90000000"]
    assert messages[1].split("\n") == ["READY=1", "STATUS=serving on 127.0.0.1:50051"]
    assert messages[2] == "WATCHDOG=1"
    assert messages[3].split("\n") == ["STOPPING=1", "STATUS=draining 2 requests"]


def test_path_socket_in_child_process(tmp_path):
    for mode in ("default", "fallback", "noimport"):
        path = tmp_path / f"notify-{mode}.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            r = _run_child({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "30000000"}, mode)
            _check(_receive_all(sock))
        interval, ok = r.stdout.splitlines()
        assert float(interval) == 30.0  # WATCHDOG_PID unset: the process is the watched one
        assert ok == "[True, True, True, True]"


def test_abstract_namespace_socket(tmp_path):
    name = f"betelgeuse-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        _run_child({"NOTIFY_SOCKET": "@" + name}, "fallback")
        _check(_receive_all(sock))


def test_no_socket_is_a_noop():
    r = _run_child({}, "default")
    interval, ok = r.stdout.splitlines()
    assert interval == "None" and ok == "[False, False, False, False]"


def test_vanished_socket_is_harmless(tmp_path):
    for mode in ("default", "fallback"):
        r = _run_child({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}, mode)
        assert r.stdout.splitlines()[1] == "[False, False, False, False]"


def test_watchdog_pid_other_process(monkeypatch):
    from betelgeuse import sdnotify

    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert sdnotify.watchdog_interval() is None
