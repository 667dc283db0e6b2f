"""deploy/device/calls.sh, the device session's calls (NEXT.md "The calls"), printed with DRY=1 (nothing runs):
each of NEXT.md's calls 1-4 is its list of steps; named steps run in the order given, a step named twice gets its own
results folder (gpu-run68: a second `caller` overwrote the first's); an unknown step or call is refused with a message
and exit 2 before anything runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry(tmp_path, *args):
    env = dict(os.environ, DRY="1", OUT=str(tmp_path))
    return subprocess.run(["bash", "deploy/device/calls.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def _names(out: str) -> list[str]:
    return re.findall(r"RUN_NAME=(\S+)", out)


def test_the_default_calls_and_named_steps(tmp_path):
    r = _dry(tmp_path, "1")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("+ ")]
    assert "hold_latency.py --show" in lines[0]
    assert "h2d_call.py" in lines[1] and "--idle none,sleep:5,spin:5" in lines[1] and "hold_latency" not in lines[1]
    assert "hold_latency.py" in lines[2] and "h2d_call.py" in lines[2]
    assert _names(r.stdout) == ["thread", "lat"]
    assert "hold_latency.py" in lines[4] and "hold_latency" not in lines[3] and "READER" not in r.stdout
    assert "--gpu-marks" not in r.stdout                       # host figures come from runs without marks
    r = _dry(tmp_path, "2")
    assert _names(r.stdout) == ["spin", "thread", "lat", "spin-2"]
    r = _dry(tmp_path, "7", "thread", "spin", "thread", "thread", "early")
    assert r.returncode == 0, r.stderr
    assert _names(r.stdout) == ["thread", "spin", "thread-2", "thread-3", "u-disk-copy-early"]
    assert r.stdout.count("--disk-copy-early") == 1


def test_an_unknown_step_or_call_is_refused(tmp_path):
    r = _dry(tmp_path, "7", "thread", "nope")
    assert r.returncode == 2 and "no step nope" in r.stdout and "RUN_NAME" not in r.stdout   # nothing ran first
    r = _dry(tmp_path, "12")
    assert r.returncode == 2 and "no call 12" in r.stdout
    r = subprocess.run(["bash", "deploy/device/calls.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage: calls.sh N" in r.stderr


def _hold(tmp_path, *args):
    return subprocess.run(["python3", "deploy/device/hold_latency.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_hold_latency_keeps_its_request_open_in_the_command(tmp_path):
    """The PM QoS request holds only while its fd is open: the command (exec'd) must inherit it. A plain file stands
    in for /dev/cpu_dma_latency: the 0 written is 4 bytes, and the command sees the file among its open fds."""
    q = tmp_path / "qos"
    q.write_bytes(b"")
    probe = "import os; print([os.readlink(f'/proc/self/fd/{f}') for f in range(3, 64) if os.path.lexists(f'/proc/self/fd/{f}')])"
    r = _hold(tmp_path, "--path", str(q), "--log", str(tmp_path / "l.log"), "--", "python3", "-c", probe)
    assert r.returncode == 0, r.stderr
    assert f"0 µs requested on {q}" in r.stdout and str(q) in r.stdout.splitlines()[-1]
    assert q.read_bytes() == b"\0\0\0\0"
    assert "requested" in (tmp_path / "l.log").read_text()                      # the run's folder keeps its label
    r = _hold(tmp_path, "--path", str(tmp_path / "none"), "--", "python3", "-c", "print('ran')")
    assert r.returncode == 0 and "unavailable" in r.stdout and r.stdout.splitlines()[-1] == "ran"
    r = _hold(tmp_path)
    assert r.returncode == 2 and "no command given" in r.stderr
    r = _hold(tmp_path, "--path", str(q), "--", "no-such-command-here")
    assert r.returncode == 127 and "cannot run no-such-command-here" in r.stderr
    r = _hold(tmp_path, "--show")
    assert r.returncode == 0 and r.stdout.startswith("cpuidle driver:")
