"""deploy/systemd hardening: the `systemd-analyze security --offline` exposure of each unit stays at the
figure noted in the unit (1.5 worker, 1.3 store; 3.5 / 3.3 before issue 12), and every system call
the two processes really make (traced with strace around a start-up, one generation and a SIGTERM
on the CPU path) is allowed by the unit's SystemCallFilter=. systemd is never booted; the syscall
groups come from `systemd-analyze syscall-filter`. The CUDA path is not traced here (no GPU in CI):
the syscalls the driver is known to need (ioctl, mmap, mremap, mbind, sched_setaffinity, mlock)
are checked against the filter by name instead."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

try:
    from tests import service_helpers as h
    from tests.test_systemd_units import CONFIG, UNITS, VENV_PY, exec_start_argv, parse_unit, values
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h
    from test_systemd_units import CONFIG, UNITS, VENV_PY, exec_start_argv, parse_unit, values

from services.launcher import free_port

service_model = h.service_model
analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")

EXPOSURE = {"betelgeuse.service": 1.5, "betelgeuse-store.service": 1.3}   # the figures the units' comments state
CUDA_SYSCALLS = {"ioctl", "mmap", "munmap", "mremap", "mprotect", "madvise", "mbind", "get_mempolicy",
                 "set_mempolicy", "sched_setaffinity", "sched_getaffinity", "mlock", "munlock", "memfd_create",
                 "clone3", "futex", "eventfd2", "poll", "openat"}


def exposure(unit_path: Path) -> float:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit_path)],
                       capture_output=True, text=True, timeout=60, cwd=unit_path.parent)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def _copy_units(tmp_path: Path) -> Path:
    for n in ("betelgeuse.service", "betelgeuse-store.service", "betelgeuse.slice"):
        (tmp_path / n).write_text((UNITS / n).read_text().replace(VENV_PY, sys.executable))
    return tmp_path


@analyze
@pytest.mark.parametrize("name", sorted(EXPOSURE))
def test_security_exposure(name, tmp_path):
    d = _copy_units(tmp_path)
    got = exposure(d / name)
    print(f"systemd-analyze security --offline=yes {name}: {got}")
    assert got <= EXPOSURE[name], f"{name}: exposure {got} > {EXPOSURE[name]} (a hardening setting went missing)"
    assert f": {EXPOSURE[name]} (was" in (UNITS / name).read_text(), "the unit's comment states the figure"


@analyze
def test_security_figure_can_fail(tmp_path):
    d = _copy_units(tmp_path)
    text = (d / "betelgeuse-store.service").read_text()
    weak = "\n".join(l for l in text.splitlines() if not l.startswith(("SystemCallFilter=", "PrivateUsers=")))
    (d / "betelgeuse-store.service").write_text(weak + "\n")
    assert exposure(d / "betelgeuse-store.service") > EXPOSURE["betelgeuse-store.service"]


def _groups() -> dict[str, list[str]]:
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True, text=True,
                         timeout=60).stdout
    groups: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if not line.startswith(" ") and s.startswith("@"):
            cur = groups.setdefault(s, [])
        elif cur is not None:
            cur.append(s)
    return groups


def allowed_syscalls(unit_name: str) -> set[str]:
    """The allow list SystemCallFilter= lines build: allow-list entries, then '~' entries removed."""
    groups = _groups()

    def expand(item: str) -> set[str]:
        if not item.startswith("@"):
            return {item}
        return set().union(*(expand(x) for x in groups[item]))

    allow: set[str] = set()
    for v in values(parse_unit(UNITS / unit_name), "Service", "SystemCallFilter"):
        items = v.lstrip("~").split()
        s = set().union(*(expand(i) for i in items))
        allow = allow - s if v.startswith("~") else allow | s
    assert allow, unit_name
    return allow


@analyze
def test_cuda_syscalls_allowed():
    allow = allowed_syscalls("betelgeuse.service")
    assert CUDA_SYSCALLS <= allow, CUDA_SYSCALLS - allow
    assert "setuid" not in allow and "mount" not in allow   # the filter does filter


def _traced(unit_name: str, config: Path, out: Path, log: Path) -> subprocess.Popen:
    unit = parse_unit(UNITS / unit_name)
    argv = [sys.executable if a == VENV_PY else str(config) if a == CONFIG else a for a in exec_start_argv(unit_name)]
    env = dict(os.environ)
    for assignment in values(unit, "Service", "Environment"):
        k, _, v = assignment.partition("=")
        env[k] = v
    with log.open("wb") as f:
        return subprocess.Popen(["strace", "-f", "-c", "-o", str(out), *argv], cwd=h.ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop_traced(p: subprocess.Popen) -> None:
    """SIGTERM to the traced python (strace's child), so it exits as systemd would stop it; strace then
    writes its summary and exits."""
    if p.poll() is not None:
        return
    kids = []
    for task in Path(f"/proc/{p.pid}/task").glob("*"):
        kids += (task / "children").read_text().split()
    for k in kids:
        os.kill(int(k), signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def syscalls_of(summary: Path) -> set[str]:
    names = set()
    for line in summary.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and re.match(r"^[0-9.]+$", parts[0]) and parts[-1] != "total":
            names.add(parts[-1])
    return names


@analyze
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_processes_make_only_allowed_syscalls(service_model, tmp_path):
    probe = subprocess.run(["strace", "-f", "-c", "-o", os.devnull, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here: {probe.stderr.decode()[-200:]}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    api_port = free_port()
    cfg = h.write_toml(tmp_path / "betelgeuse.toml", {
        "model": {"path": str(service_model)},
        "slots": {"vram_per_layer": 2, "host_per_layer": 6},
        "worker": {"listen": [f"127.0.0.1:{api_port}"], "metrics": f"127.0.0.1:{free_port()}", "device": "cpu"},
        "store": {"socket": str(run_dir / "store.sock"), "fd_socket": str(run_dir / "store.fds"),
                  "metrics": f"127.0.0.1:{free_port()}"},
    })
    store = worker = None
    try:
        store = _traced("betelgeuse-store.service", cfg, tmp_path / "store.strace", tmp_path / "store.log")
        worker = _traced("betelgeuse.service", cfg, tmp_path / "worker.strace", tmp_path / "worker.log")
        with grpc.insecure_channel(f"127.0.0.1:{api_port}") as ch:
            assert h.wait_health(ch, 1, timeout=240) == 1, "worker never SERVING"
            r = h.run_stream(h.stub(ch).Generate(h.request(text="Hello", max_tokens=3, ignore_eos=True), timeout=120))
            assert r.code is None and len(r.tokens) == 3, r.details
    except BaseException:
        h.print_logs(tmp_path)
        raise
    finally:
        for p in (worker, store):
            if p is not None:
                _stop_traced(p)
        time.sleep(0.1)
    for unit, name in (("betelgeuse-store.service", "store"), ("betelgeuse.service", "worker")):
        used = syscalls_of(tmp_path / f"{name}.strace")
        assert len(used) > 20, (name, used)   # the summary was parsed
        denied = used - allowed_syscalls(unit)
        print(f"{name}: {len(used)} distinct syscalls, outside SystemCallFilter=: {sorted(denied)}")
        assert not denied, f"{unit} would get EPERM for {sorted(denied)}"
