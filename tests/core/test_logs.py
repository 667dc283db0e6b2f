"""Logs an operator can use: the formatter's text (logfmt) and JSON lines parse back to their fields;
under systemd ($JOURNAL_STREAM naming stderr) lines carry a <N> syslog priority and no timestamp; the
level and format come from flags, then BETELGEUSE_LOG_*, then [log], then defaults; and two real
processes write one `request` line per request (fields equal to the usage the gRPC API returned),
plus start-up (`plan`, `ready`) and store events (`attach`, `consolidation`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import grpc
import pytest

try:
    from tests import service_helpers as h
except ImportError:
    import service_helpers as h

from betelgeuse import logs
from betelgeuse.errors import BetelgeuseError

ROOT = Path(__file__).resolve().parents[2]
service_model = h.service_model


def _record(msg="request", level=logging.INFO, fields=None, exc=None) -> logging.LogRecord:
    r = logging.LogRecord("betelgeuse.engine", level, __file__, 1, msg, (), exc)
    if fields is not None:
        r.fields = fields
    return r


FIELDS = {"id": "req 1", "status": "stop", "prompt_tokens": 12, "ttft_ms": 81.23456, "approximate": False,
          "metrics": None, "error": 'say "hi"\nthere'}


def test_text_and_json_round_trip():
    text = logs.Formatter("text").format(_record(fields=FIELDS))
    assert "\n" not in text
    got = logs.parse_text_line(text)
    assert got["level"] == "INFO" and got["logger"] == "betelgeuse.engine" and got["event"] == "request"
    assert got["ts"].endswith("Z") and got["id"] == "req 1" and got["prompt_tokens"] == "12"
    assert got["ttft_ms"] == "81.235" and got["approximate"] == "false" and got["metrics"] == "null"
    assert got["error"] == 'say "hi"\nthere'
    j = json.loads(logs.Formatter("json").format(_record(fields=FIELDS)))
    assert j["event"] == "request" and j["level"] == "info" and j["prompt_tokens"] == 12
    assert j["ttft_ms"] == 81.235 and j["approximate"] is False and j["metrics"] is None and j["id"] == "req 1"
    plain = json.loads(logs.Formatter("json").format(_record(msg="hello %s")))
    assert plain["msg"] == "hello %s" and "event" not in plain


def test_exception_stays_on_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = _record(msg="engine step failed", level=logging.ERROR, exc=sys.exc_info())
    line = logs.Formatter("text").format(rec)
    assert "\n" not in line and "ValueError: boom" in line
    assert "ValueError: boom" in json.loads(logs.Formatter("json").format(rec))["exception"]


CHILD = r"""
import logging, sys
from betelgeuse import logs
logs.setup("debug", sys.argv[1])
log = logging.getLogger("betelgeuse.test")
logs.event(log, "request", id="a", status="stop")
log.warning("store unavailable")
log.debug("detail")
"""


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_journald_priority_prefix(tmp_path, fmt):
    out = tmp_path / "stderr"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with out.open("wb") as f:
        st = os.fstat(f.fileno())
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"           # as systemd sets it: this file is stderr
        subprocess.run([sys.executable, "-c", CHILD, fmt], stderr=f, env=env, check=True, timeout=60)
    lines = out.read_text().splitlines()
    assert [l[:3] for l in lines] == ["<6>", "<4>", "<7>"], lines
    if fmt == "text":
        assert lines[0] == "<6>betelgeuse.test request id=a status=stop"    # journald stamps the time
    else:
        assert json.loads(lines[0][3:])["event"] == "request"
    # JOURNAL_STREAM naming another file: not the journal, no prefix
    env["JOURNAL_STREAM"] = "1:2"
    r = subprocess.run([sys.executable, "-c", CHILD, fmt], capture_output=True, text=True, env=env, timeout=60)
    assert not r.stderr.startswith("<"), r.stderr


def test_precedence(monkeypatch):
    from betelgeuse.settings import settings_from_dict
    from services.common import configure_logging
    monkeypatch.delenv("BETELGEUSE_LOG_LEVEL", raising=False)
    monkeypatch.delenv("BETELGEUSE_LOG_FORMAT", raising=False)
    toml = settings_from_dict({"log": {"level": "warning", "format": "json"}})
    none = Namespace(log_level=None, log_format=None, verbose=False)
    try:
        assert configure_logging(none) == ("info", "text")                        # defaults
        assert configure_logging(none, toml) == ("warning", "json")               # [log]
        monkeypatch.setenv("BETELGEUSE_LOG_LEVEL", "error")
        monkeypatch.setenv("BETELGEUSE_LOG_FORMAT", "text")
        assert configure_logging(none, toml) == ("error", "text")                 # environment over [log]
        flags = Namespace(log_level="debug", log_format="json", verbose=False)
        assert configure_logging(flags, toml) == ("debug", "json")                # flags over everything
        assert logging.getLogger().level == logging.DEBUG
        assert configure_logging(Namespace(log_level=None, log_format=None, verbose=True), toml)[0] == "debug"
        monkeypatch.setenv("BETELGEUSE_LOG_LEVEL", "loud")
        with pytest.raises(BetelgeuseError, match="log level must be one of"):
            configure_logging(none, toml)
        with pytest.raises(BetelgeuseError, match="log.level"):
            settings_from_dict({"log": {"level": "loud"}})
    finally:
        logs.setup()


def test_bad_log_level_is_one_clean_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT), BETELGEUSE_LOG_LEVEL="loud")
    r = subprocess.run([sys.executable, "-m", "services.store_main", "--model", "x.gguf"], capture_output=True,
                       text=True, env=env, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == \
        "betelgeuse: error: log level must be one of debug, info, warning, error, got 'loud'", r.stderr


def _json_lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]


def test_real_processes_log_requests_and_store_events(service_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BETELGEUSE_LOG_FORMAT", "json")           # the worker: JSON from the environment
    c = h.start_cluster(service_model, tmp_path / "run", extra_store_args=["--log-format", "text"])  # a flag wins
    finals = {}
    try:
        with c.channel() as ch:
            for rid, n in (("req-a", 3), ("req-b", 5)):
                req = h.request(text="Hello there", max_tokens=n, ignore_eos=True)
                req.request_id = rid
                r = h.run_stream(h.stub(ch).Generate(req, timeout=120))
                assert r.code is None, r.details
                finals[rid] = r.final
            bad = h.request(text="Hello", max_tokens=3, temperature=-1.0)
            bad.request_id = "req-bad"
            r = h.run_stream(h.stub(ch).Generate(bad, timeout=60))
            assert r.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.stop()
    # req-b repeats req-a's prompt: served whole from the prefix cache
    assert finals["req-a"].usage.cached_tokens == 0
    assert finals["req-b"].usage.cached_tokens == finals["req-b"].usage.prompt_n > 0
    worker = _json_lines(Path(c.worker.log_path))
    requests = {e["id"]: e for e in worker if e.get("event") == "request"}
    assert [e["id"] for e in worker if e.get("event") == "request"] == ["req-a", "req-b", "req-bad"]
    for rid, final in finals.items():
        e, u = requests[rid], final.usage                         # the log agrees with what the API returned
        from services.pb.betelgeuse.v1 import inference_pb2 as pb
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert e["status"] == "length" and e["level"] == "info"
        assert e["prompt_tokens"] == u.prompt_n and e["completion_tokens"] == u.predicted_n
        assert e["cached_tokens"] == u.cached_tokens
        assert (e["reads_vram"], e["reads_host"], e["reads_disk"]) == \
            (u.expert_reads_vram, u.expert_reads_host, u.expert_reads_disk)
        assert e["disk_bytes"] == u.disk_bytes
        assert e["ttft_ms"] == pytest.approx(u.ttft_ms, abs=0.01)
        assert e["tg_tok_s"] == pytest.approx(u.predicted_per_second, abs=0.01)
        assert e["pp_tok_s"] == pytest.approx(u.prompt_per_second, abs=0.01)
        assert e["duration_ms"] >= e["ttft_ms"] > 0
    assert requests["req-bad"]["status"] == "rejected" and requests["req-bad"]["level"] == "warning"
    assert "temperature" in requests["req-bad"]["error"]
    ready = next(e for e in worker if e.get("event") == "ready")
    assert ready["role"] == "worker" and ready["routing"] == "exact" and ready["device"] == "cpu"
    # the store: text lines (its --log-format flag over the environment), parsed back
    store = [logs.parse_text_line(l) for l in Path(c.store.log_path).read_text().splitlines()
             if l[:4].isdigit() and " betelgeuse." in l]
    assert store, Path(c.store.log_path).read_text()
    events = [e["event"] for e in store]
    assert events[:2] == ["plan", "ready"] and "attach" in events and "consolidation" in events
    plan = store[0]
    assert (int(plan["n_vram"]), int(plan["n_host"])) == (ready["n_vram"], ready["n_host"])
    cons = [e for e in store if e["event"] == "consolidation"]
    assert all(int(e["moves"]) == int(e["to_vram"]) + int(e["to_host"]) + int(e["evicted"]) for e in cons)
    assert int(cons[0]["moves"]) > 0
