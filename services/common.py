"""Glue shared by the process entry points: CLI flags, logging, /metrics, clean exits (settings -> EngineConfig is
betelgeuse.config.engine_config)."""

from __future__ import annotations

import argparse
import logging
import sys

from betelgeuse.errors import BetelgeuseError
from betelgeuse.logs import setup as setup_logging
from betelgeuse.settings import Resolved, Settings, add_flags, flag_values, resolve_settings

log = logging.getLogger("betelgeuse")


def listen_metrics(registry, addr: str):
    """Serve /metrics on HOST:PORT; a busy or bad address is one line naming it, not a traceback."""
    from betelgeuse.metrics import serve_metrics
    from betelgeuse.settings import split_hostport
    host, port = split_hostport(addr, "metrics")
    try:
        return serve_metrics(registry, host, port)
    except OSError as e:
        raise BetelgeuseError(f"cannot serve /metrics on {addr}: {e.strerror or e}") from None


def common_args(p: argparse.ArgumentParser, metrics: str | None = None, exclude=()):
    """--config, -v and one flag per settings key (betelgeuse/settings.py); `metrics` ("worker" | "store"):
    whose /metrics address --metrics also sets."""
    p.add_argument("--config", help="TOML settings file (deploy/betelgeuse.toml); flags override it, "
                   "BETELGEUSE_<SECTION>_<KEY> variables too")
    p.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    add_flags(p, exclude=exclude, aliases={f"{metrics}.metrics": "--metrics"} if metrics else None)


def configure_logging(a=None, s: Settings | None = None) -> tuple[str, str]:
    """Logging from, in order of precedence: flags, BETELGEUSE_LOG_* environment, the [log] table, defaults
    (before the settings are read: run_main's pre-parse; after: the resolved settings already agree)."""
    import os
    flag = lambda *names: next((getattr(a, n) for n in names if getattr(a, n, None)), None)  # noqa: E731
    level = (flag("log_level", "log.level") or ("debug" if getattr(a, "verbose", False) else None)
             or os.environ.get("BETELGEUSE_LOG_LEVEL") or (s.log.level if s else "info"))
    fmt = flag("log_format", "log.format") or os.environ.get("BETELGEUSE_LOG_FORMAT") or (s.log.format if s else "text")
    setup_logging(level.lower(), fmt.lower())
    return level, fmt


def resolve_from_args(a, require_model: bool = True) -> Resolved:
    """Defaults < --config file < BETELGEUSE_* environment < flags, each value with its source."""
    flags = flag_values(a)
    if getattr(a, "verbose", False) and ("log", "level") not in flags:
        flags[("log", "level")] = ("debug", "flag --verbose")
    r = resolve_settings(getattr(a, "config", None), flags=flags)
    if require_model and not r.settings.model.path:
        raise BetelgeuseError("no model: give --model PATH or [model] path in the config file")
    return r


def settings_from_args(a) -> Settings:
    """Settings from --config, the environment and the flags; logging configured from them."""
    s = resolve_from_args(a).settings
    configure_logging(a, s)
    return s


PR_SET_PDEATHSIG = 1


def die_with_parent():
    """Started by a launcher (`betelgeuse serve`, tests) that set BETELGEUSE_PARENT_PID: get SIGTERM when it dies,
    even by SIGKILL, so no orphan keeps sockets and ports. Set here, after exec, not in a preexec_fn: forking
    through Python runs grpc's fork handlers, which abort a child of a process that has used grpc."""
    import ctypes
    import os
    import signal
    parent = os.environ.pop("BETELGEUSE_PARENT_PID", "")
    if not parent.isdigit():
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):              # the parent died before prctl took effect
        raise SystemExit(1)


def run_main(fn, argv=None) -> int:
    """Run a process main; a BetelgeuseError is one line on stderr and exit 2, never a traceback."""
    die_with_parent()
    pre = argparse.ArgumentParser(add_help=False)        # logging until the config file is read
    pre.add_argument("-v", "--verbose", action="store_true")
    pre.add_argument("--log-level")
    pre.add_argument("--log-format")
    try:
        configure_logging(pre.parse_known_args(argv)[0])
    except BetelgeuseError as e:                           # a bad flag or BETELGEUSE_LOG_* value
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        return fn(argv) or 0
    except BetelgeuseError as e:
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
