"""deploy/systemd: `systemd-analyze verify` accepts the units, and the settings the service depends on
are there. Never boots systemd or starts anything; verify only parses and resolves."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
VENV_PY = "/opt/betelgeuse/.venv/bin/python"
CONFIG = "/etc/betelgeuse/betelgeuse.toml"

EXEC_START = {  # the lead's end-to-end test starts the processes from these argv lists
    "betelgeuse-store.service": [VENV_PY, "-m", "services.store_main", "--config", CONFIG],
    "betelgeuse.service": [VENV_PY, "-m", "services.worker_main", "--config", CONFIG],
}


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """section -> [(key, value)] in order; repeated keys (DeviceAllow=) kept."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}: no line continuations, keep ExecStart= on one line"
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict, section: str, key: str) -> str:
    vs = values(unit, section, key)
    assert len(vs) == 1, (section, key, vs)
    return vs[0]


def exec_start_argv(unit_name: str) -> list[str]:
    """The exact argv of a unit's ExecStart= (what systemd would run)."""
    return shlex.split(one(parse_unit(UNITS / unit_name), "Service", "ExecStart"))


@pytest.mark.parametrize("name", sorted(EXEC_START))
def test_exec_start_lines(name):
    assert exec_start_argv(name) == EXEC_START[name]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    names = ["betelgeuse.service", "betelgeuse-store.service", "betelgeuse.slice"]
    for n in names:
        text = (UNITS / n).read_text()
        # verify insists the binary exists: point it at this venv's python, the argv otherwise unchanged
        (tmp_path / n).write_text(text.replace(VENV_PY, sys.executable))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *[str(tmp_path / n) for n in names]],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    # verify exits 0 on unknown keys and bad values ("ignoring"); any line about our units is a defect
    ours = [line for line in out.splitlines() if "betelgeuse" in line]
    assert not ours, "\n".join(ours)


def test_systemd_analyze_catches_a_bad_key(tmp_path):
    """The check above can fail: a misspelt key in a copy is reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    text = (UNITS / "betelgeuse-store.service").read_text().replace(VENV_PY, sys.executable)
    bad = tmp_path / "betelgeuse-store.service"
    bad.write_text(text.replace("Restart=on-failure", "Restart=onfailure"))
    shutil.copy(UNITS / "betelgeuse.slice", tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert "onfailure" in r.stdout + r.stderr


def test_unit_semantics():
    worker = parse_unit(UNITS / "betelgeuse.service")
    store = parse_unit(UNITS / "betelgeuse-store.service")
    slice_ = parse_unit(UNITS / "betelgeuse.slice")

    assert one(slice_, "Slice", "MemoryMax") == "12G"
    assert one(slice_, "Slice", "MemorySwapMax") == "0"
    for unit in (worker, store):
        assert one(unit, "Service", "Type") == "notify"
        assert one(unit, "Service", "Slice") == "betelgeuse.slice"
        assert one(unit, "Service", "LimitMEMLOCK") == "infinity"
        assert one(unit, "Service", "Restart") == "on-failure"
        assert one(unit, "Service", "WatchdogSec")
        assert one(unit, "Service", "RuntimeDirectory") == "betelgeuse"
        assert one(unit, "Service", "RuntimeDirectoryPreserve") == "yes"
        assert one(unit, "Service", "NoNewPrivileges") == "yes"
        assert one(unit, "Service", "ProtectSystem") == "strict"
    # systemctl start betelgeuse == the worker, which pulls in the store; the store follows it
    assert "betelgeuse-store.service" in one(worker, "Unit", "Requires").split()
    assert "betelgeuse-store.service" in one(worker, "Unit", "After").split()
    assert one(store, "Unit", "PartOf") == "betelgeuse.service"
    assert one(worker, "Install", "WantedBy") == "multi-user.target"
    assert "Install" not in store  # static: only the worker is enabled
    # the worker sees the GPU, the store does not
    assert one(worker, "Service", "PrivateDevices") == "no"
    assert {"char-nvidiactl rw", "char-nvidia-uvm rw"} <= set(values(worker, "Service", "DeviceAllow"))
    assert one(store, "Service", "PrivateDevices") == "yes"
    # issue 25, item 2: descriptors sized for the HTTP connection cap (the default soft limit, 1024, is what a
    # flood of idle connections exhausted), and the worker's own check agrees with the unit
    from betelgeuse.settings import Settings
    from services.worker_main import FD_RESERVE
    assert int(one(worker, "Service", "LimitNOFILE")) >= 8 * (Settings().worker.http_max_connections + FD_RESERVE)
    assert int(one(store, "Service", "LimitNOFILE")) >= 4096


def test_config_paths_agree_with_units():
    from betelgeuse.settings import load_settings

    s = load_settings(ROOT / "deploy" / "betelgeuse.toml")
    run_dir = "/run/" + one(parse_unit(UNITS / "betelgeuse-store.service"), "Service", "RuntimeDirectory")
    assert Path(s.store.socket).parent == Path(run_dir)
    assert Path(s.store.fd_socket).parent == Path(run_dir)
    assert all(Path(a.removeprefix("unix:")).parent == Path(run_dir) for a in s.worker.listen if a.startswith("unix:"))
    install = (ROOT / "deploy" / "install.sh").read_text()
    assert "PREFIX=${PREFIX:-/opt/betelgeuse}" in install and '"$PREFIX/.venv"' in install
    assert "CONF_DIR=${CONF_DIR:-/etc/betelgeuse}" in install and "systemctl daemon-reload" in install
