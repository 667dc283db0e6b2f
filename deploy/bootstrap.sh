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
# The deepseek41 oracle: NeMo AutoModel 0.7.0's `deepseek_v41` (tests/nemo_oracle.py). Its wheel declares heavy
# requirements (another torch, transformers 5.18, megatron-fsdp...) that the CPU model code does not import, so
# it is never pip-installed: the pinned wheel (checked against its sha256) is unpacked into .venv/oracles and
# the tests put that directory on sys.path. Everything it does import (transformers, tokenizers) is in [test].
nemo=.venv/oracles/nemo_automodel-0.7.0
if [ ! -d "$nemo/nemo_automodel" ]; then
  mkdir -p .venv/oracles
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: nemo-automodel==0.7.0 -d .venv/oracles
  whl=.venv/oracles/nemo_automodel-0.7.0-py3-none-any.whl
  echo "37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674  $whl" | sha256sum -c --quiet
  .venv/bin/python -m zipfile -e "$whl" "$nemo"
  rm -f "$whl"
fi
.venv/bin/python -m services.codegen
