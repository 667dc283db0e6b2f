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
    assert "h2d_call.py" in lines[0] and "--idle none,sleep:5,spin:5" in lines[0]
    assert _names(r.stdout) == ["thread", "spin"]
    assert "BETELGEUSE_STORE_SESSION_READER=spin" in lines[2] and "READER" not in lines[1]
    assert "--gpu-marks" not in r.stdout                       # host figures come from runs without marks
    r = _dry(tmp_path, "2")
    assert _names(r.stdout) == ["spin", "thread", "caller"]
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
