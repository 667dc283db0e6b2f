#!/usr/bin/env bash
# Installs Betelgeuse as two systemd services on this machine (run as root from a checkout):
#
#   sudo bash deploy/install.sh
#   sudoedit /etc/betelgeuse/betelgeuse.toml        # set [model] path, slots, budgets
#   sudo systemctl enable --now betelgeuse           # starts betelgeuse-store.service, then the worker
#   systemctl status betelgeuse betelgeuse-store betelgeuse.slice
#   journalctl -u betelgeuse -u betelgeuse-store -f
#   sudo bash deploy/install.sh --uninstall          # removes all of it (the model file stays)
#
# What it does (idempotent; a second run updates code and units, never the configuration):
#   - creates the system user "betelgeuse" (systemd-sysusers, else useradd)
#   - builds a wheel of this checkout (with the generated gRPC modules) and installs it into a fresh
#     venv $PREFIX/.venv, after the pinned CUDA build of torch: $TORCH_SPEC from $TORCH_INDEX
#     (default torch 2.11.0 for CUDA 13.0, the build the benchmarks ran on: NVIDIA driver >= 580).
#     For an older driver use the CUDA 12.8 build (driver >= 570):
#       TORCH_INDEX=https://download.pytorch.org/whl/cu128 sudo -E bash deploy/install.sh
#   - links $PREFIX/.venv/bin/betelgeuse to $BIN_DIR/betelgeuse (default /usr/local/bin)
#   - copies deploy/systemd/betelgeuse{,-store}.service and betelgeuse.slice to $UNIT_DIR
#   - copies deploy/betelgeuse.toml to $CONF_DIR/betelgeuse.toml only if that file is absent
#   - runs `systemctl daemon-reload` (when systemd is running)
# pip's output and errors are shown; any failure stops the script (set -e).
# Prometheus/Grafana: deploy/prometheus/prometheus.yml (+ rules/) and deploy/grafana/ (provisioning,
# dashboards) are meant to be copied into those services' own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${PREFIX:-/opt/betelgeuse}
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.11.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
CONF_DIR=${CONF_DIR:-/etc/betelgeuse}
BIN_DIR=${BIN_DIR:-/usr/local/bin}
SYSUSERS=/usr/lib/sysusers.d/betelgeuse.conf
UNITS=(betelgeuse.service betelgeuse-store.service betelgeuse.slice)

[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root (sudo bash deploy/install.sh)" >&2; exit 1; }
have_systemd() { [ -d /run/systemd/system ]; }

if [ "${1:-}" = "--uninstall" ]; then
  if have_systemd; then systemctl disable --now betelgeuse betelgeuse-store || true; fi
  for u in "${UNITS[@]}"; do rm -f "$UNIT_DIR/$u"; done
  if have_systemd; then systemctl daemon-reload; fi
  [ -L "$BIN_DIR/betelgeuse" ] && rm -f "$BIN_DIR/betelgeuse"
  rm -rf "${PREFIX:?}" "${CONF_DIR:?}" /var/lib/betelgeuse /var/cache/betelgeuse
  rm -f "$SYSUSERS"
  if id betelgeuse >/dev/null 2>&1; then userdel betelgeuse; fi
  if getent group betelgeuse >/dev/null 2>&1; then groupdel betelgeuse; fi
  echo "install.sh: uninstalled (the model files were not touched)"
  exit 0
fi
[ $# -eq 0 ] || { echo "install.sh: unknown argument $1 (only --uninstall)" >&2; exit 2; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "install.sh: $PY is older than Python 3.11" >&2; exit 1; }

# 1. user
if ! id betelgeuse >/dev/null 2>&1; then
  install -D -m 0644 deploy/systemd/betelgeuse.sysusers "$SYSUSERS"
  if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers "$SYSUSERS"
  else
    useradd --system --user-group --home-dir /var/lib/betelgeuse --shell /usr/sbin/nologin betelgeuse
  fi
fi

# 2. a wheel of this checkout, built in a throw-away venv (grpcio-tools generates the gRPC modules)
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$PY" -m venv "$build/venv"
"$build/venv/bin/python" -m pip install --upgrade pip build grpcio-tools
"$build/venv/bin/python" -m services.codegen --force
"$build/venv/bin/python" -m build --wheel --outdir "$build/dist" .
wheel=$(ls "$build"/dist/betelgeuse-*.whl)

# 3. the service venv: pinned torch first (so the wheel's torch>=2.4 is already met), then the wheel
rm -rf "$PREFIX/.venv"
mkdir -p "$PREFIX"
"$PY" -m venv "$PREFIX/.venv"
VPY="$PREFIX/.venv/bin/python"
"$VPY" -m pip install --upgrade pip
"$VPY" -m pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"
"$VPY" -m pip install "$wheel"
install -D -m 0644 -t "$PREFIX/docs" docs/architecture.md docs/scaling.md
chmod -R go-w "$PREFIX"
ln -sfn "$PREFIX/.venv/bin/betelgeuse" "$BIN_DIR/betelgeuse"

# 4. units and configuration
for u in "${UNITS[@]}"; do install -m 0644 "deploy/systemd/$u" "$UNIT_DIR/$u"; done
install -d -m 0750 -g betelgeuse "$CONF_DIR"
if [ ! -e "$CONF_DIR/betelgeuse.toml" ]; then
  install -m 0640 -g betelgeuse deploy/betelgeuse.toml "$CONF_DIR/betelgeuse.toml"
else
  echo "install.sh: kept the existing $CONF_DIR/betelgeuse.toml (new defaults: deploy/betelgeuse.toml)"
fi

# 5. tell systemd
if have_systemd; then
  systemctl daemon-reload
  echo "install.sh: done. Set [model] path in $CONF_DIR/betelgeuse.toml, then: systemctl enable --now betelgeuse"
else
  echo "install.sh: systemd is not running here; units are in $UNIT_DIR for the next boot"
fi
"$VPY" -c 'import torch; print(f"install.sh: torch {torch.__version__}, CUDA {torch.version.cuda}")'
