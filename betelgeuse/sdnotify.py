"""systemd service notifications (sd_notify(3)) for Type=notify units; harmless everywhere else.

Writes the datagram to $NOTIFY_SOCKET itself (a path, or '@name' for the abstract namespace): the
protocol is one AF_UNIX datagram of newline-separated assignments, so this module is the only
implementation (systemd-python would add a compiler, pkg-config and libsystemd-dev to every install
and image for the same 20 lines). Without $NOTIFY_SOCKET (tests, Docker, a shell) every call is a
no-op that returns False.

How the processes use it:
    notify(status="indexing GGUF", extend_timeout_us=120_000_000)   # during long loads
    notify(ready=True, status="serving on 127.0.0.1:50051")          # model loaded, store attached
    notify(watchdog=True)      # from the engine loop, every watchdog_interval() / 2 seconds at most
    notify(stopping=True, status="draining 2 requests")
"""

from __future__ import annotations

import os
import socket


def _message(ready: bool, status: str | None, watchdog: bool, extend_timeout_us: int | None,
             stopping: bool) -> str:
    lines = []
    if ready:
        lines.append("READY=1")
    if stopping:
        lines.append("STOPPING=1")
    if status is not None:
        # one STATUS= line: a newline would start a new (bogus) assignment
        lines.append("STATUS=" + " ".join(str(status).split("\n")))
    if extend_timeout_us is not None:
        assert extend_timeout_us > 0, extend_timeout_us
        lines.append(f"EXTEND_TIMEOUT_USEC={int(extend_timeout_us)}")
    if watchdog:
        lines.append("WATCHDOG=1")
    return "\n".join(lines)


def _send_datagram(path: str, message: str) -> bool:
    addr = "\0" + path[1:] if path.startswith("@") else path  # '@' = Linux abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(addr)
            s.sendall(message.encode())
        except OSError:
            return False  # like sd_notify: a vanished manager is not our problem
    return True


def notify(ready: bool = False, status: str | None = None, watchdog: bool = False,
           extend_timeout_us: int | None = None, stopping: bool = False) -> bool:
    """Send one notification; True if it was delivered to a service manager."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    message = _message(ready, status, watchdog, extend_timeout_us, stopping)
    if not message:
        return False
    return _send_datagram(path, message)


def watchdog_interval() -> float | None:
    """Seconds within which systemd expects WATCHDOG=1 (WatchdogSec=), or None when not watched.

    Ping at about half of it. WATCHDOG_PID, when set, names the process that is watched: a child
    that inherited the environment is not it.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
