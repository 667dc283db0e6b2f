#!/usr/bin/env bash
# Installs what Betelgeuse needs on a fresh Debian machine (root): system packages through apt,
# then a virtual environment in .venv with a pinned CPU torch and the package in editable mode.
# Idempotent: a second run only checks. Usage: bash deploy/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: promtool checks the rules; strace: tests/services/test_systemd_sandbox.py traces the syscalls
apt_pkgs=(prometheus strace)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# the Debian prometheus package starts a server of its own on :9090; our tests run their own
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.betelgeuse-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # the CPU build from local disk; an unpinned torch would download a multi-GB CUDA build
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
.venv/bin/python -m services.codegen
