"""Logging for both processes: one line per event, a level, text (logfmt fields) or JSON, journald-aware.

    from betelgeuse.logs import event
    event(log, "request", id=7, status="stop", prompt_tokens=12, ttft_ms=81.2)
    # text:  2026-12-02T18:40:01.123Z INFO betelgeuse.engine request id=7 status=stop prompt_tokens=12 ttft_ms=81.2
    # json:  {"ts": "2026-12-02T18:40:01.123Z", "level": "info", "logger": "betelgeuse.engine", "event": "request",
    #         "id": 7, "status": "stop", "prompt_tokens": 12, "ttft_ms": 81.2}
    # under systemd (stderr is the journal): "<6>betelgeuse.engine request id=7 ..." - journald reads the
    # <N> syslog priority (SyslogLevelPrefix=, on by default) and stamps the time itself.

Ordinary `log.info("...")` calls come out the same way, without fields. `setup(level, fmt)` is called by each
process main (services/common.py) from --log-level/--log-format, BETELGEUSE_LOG_LEVEL/BETELGEUSE_LOG_FORMAT
or the [log] table, in that order of precedence.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields) -> None:
    """One structured line: `name` plus key=value fields (numbers, strings, bools, None)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields})


def _ts(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _clean(v):
    if isinstance(v, float):
        return round(v, 3) if math.isfinite(v) else None
    return v


def _logfmt(v) -> str:
    v = _clean(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    s = str(v)
    if not s or any(c in s for c in ' ="\\\n\t'):
        return json.dumps(s)
    return s


def under_journald(stream=None) -> bool:
    """True when `stream` (stderr) is the journal: $JOURNAL_STREAM names its device:inode (systemd.exec(5))."""
    js = os.environ.get("JOURNAL_STREAM")
    if not js:
        return False
    stream = stream or sys.stderr
    try:
        st = os.fstat(stream.fileno())
        dev, ino = js.split(":")
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


class Formatter(logging.Formatter):
    def __init__(self, fmt: str = "text", journald: bool = False):
        assert fmt in FORMATS, fmt
        super().__init__()
        self.fmt, self.journald = fmt, journald

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        msg = record.getMessage().rstrip()
        if "\n" in msg and self.fmt == "text":      # one event, one line, whoever wrote the message (uvicorn, grpc)
            msg = msg.replace("\n", "\\n")
        exc = self.formatException(record.exc_info) if record.exc_info else None
        if self.fmt == "json":
            out = {"ts": _ts(record.created), "level": record.levelname.lower(), "logger": record.name}
            out["event" if fields else "msg"] = msg
            out.update({k: _clean(v) for k, v in fields.items()})
            if exc:
                out["exception"] = exc
            line = json.dumps(out, ensure_ascii=False, default=str)
        else:
            parts = [] if self.journald else [_ts(record.created), record.levelname]
            parts += [record.name, msg] + [f"{k}={_logfmt(v)}" for k, v in fields.items()]
            line = " ".join(parts)
            if exc:                          # one event, one line: the traceback's newlines escaped
                line += " exception=" + json.dumps(exc)
        if self.journald:
            line = f"<{_PRIORITY.get(record.levelno, 6)}>" + line
        return line


def setup(level: str = "info", fmt: str = "text", stream=None) -> None:
    """(Re)configure the root logger: one handler on stderr with our Formatter."""
    from betelgeuse.errors import BetelgeuseError
    if level not in LEVELS:
        raise BetelgeuseError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise BetelgeuseError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(Formatter(fmt, journald=under_journald(stream)))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("grpc", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


_FIELD = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|\S*)')


def parse_text_line(line: str) -> dict:
    """The fields of a text-format line (the inverse of Formatter, for tests and log tooling):
    {'ts', 'level', 'logger', 'event', <fields>}; values stay strings (quoted ones JSON-decoded)."""
    head = line.split(" ", 4)
    out = {"ts": head[0], "level": head[1], "logger": head[2], "event": head[3]}
    for m in _FIELD.finditer(head[4] if len(head) > 4 else ""):
        v = m.group(2)
        out[m.group(1)] = json.loads(v) if v.startswith('"') else v
    return out
