#!/usr/bin/env bash
# Installs Betelgeuse as two systemd services on this machine (run as root from a checkout):
#
#   sudo bash deploy/install.sh
#   sudoedit /etc/betelgeuse/betelgeuse.toml        # set [model] path, slots, budgets
#   sudo systemctl enable --now betelgeuse           # starts betelgeuse-store.service, then the worker
#   systemctl status betelgeuse betelgeuse-store betelgeuse.slice
#   journalctl -u betelgeuse -u betelgeuse-store -f
#
# What it does (idempotent; a second run updates code and units, never the configuration):
#   - creates the system user "betelgeuse" (systemd-sysusers, else useradd)
#   - copies the code to $PREFIX (default /opt/betelgeuse) and builds the venv $PREFIX/.venv
#     (torch from $TORCH_SPEC, default "torch": PyPI's Linux wheel carries CUDA), generates the
#     gRPC modules, and installs systemd-python when it builds (optional: needs libsystemd-dev,
#     pkg-config and a compiler; without it sd_notify goes over a plain socket)
#   - copies deploy/systemd/betelgeuse{,-store}.service and betelgeuse.slice to /etc/systemd/system
#   - copies deploy/betelgeuse.toml to /etc/betelgeuse/betelgeuse.toml only if that file is absent
#   - runs `systemctl daemon-reload` (when systemd is running)
# Prometheus/Grafana: deploy/prometheus/prometheus.yml (+ rules/) and deploy/grafana/ (provisioning,
# dashboards) are meant to be copied into those services' own configuration.
# Uninstall: systemctl disable --now betelgeuse; rm /etc/systemd/system/betelgeuse{,-store}.service
#   /etc/systemd/system/betelgeuse.slice; rm -r $PREFIX; systemctl daemon-reload
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${PREFIX:-/opt/betelgeuse}
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch}
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
CONF_DIR=${CONF_DIR:-/etc/betelgeuse}

[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root (sudo bash deploy/install.sh)" >&2; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "install.sh: $PY is older than Python 3.11" >&2; exit 1; }

# 1. user
if ! id betelgeuse >/dev/null 2>&1; then
  install -D -m 0644 deploy/systemd/betelgeuse.sysusers /usr/lib/sysusers.d/betelgeuse.conf
  if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers /usr/lib/sysusers.d/betelgeuse.conf
  else
    useradd --system --user-group --home-dir /var/lib/betelgeuse --shell /usr/sbin/nologin betelgeuse
  fi
fi

# 2. code and venv (root-owned; the services only read it)
mkdir -p "$PREFIX"
for d in betelgeuse services proto deploy docs; do
  [ -d "$d" ] || continue
  rm -rf "${PREFIX:?}/$d"
  cp -a "$d" "$PREFIX/$d"
done
for f in pyproject.toml README.md LICENSE; do [ -f "$f" ] && cp -a "$f" "$PREFIX/$f"; done
find "$PREFIX" -name __pycache__ -prune -exec rm -rf {} +
[ -x "$PREFIX/.venv/bin/python" ] || "$PY" -m venv "$PREFIX/.venv"
VPY="$PREFIX/.venv/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q "$TORCH_SPEC" grpcio-tools
(cd "$PREFIX" && "$VPY" -m services.codegen --force)
"$VPY" -m pip install -q -e "$PREFIX[systemd]" 2>/dev/null || {
  echo "install.sh: systemd-python did not build (optional); installing without it" >&2
  "$VPY" -m pip install -q -e "$PREFIX"
}
chmod -R go-w "$PREFIX"

# 3. units and configuration
for u in betelgeuse.service betelgeuse-store.service betelgeuse.slice; do
  install -m 0644 "deploy/systemd/$u" "$UNIT_DIR/$u"
done
install -d -m 0750 -g betelgeuse "$CONF_DIR"
if [ ! -e "$CONF_DIR/betelgeuse.toml" ]; then
  install -m 0640 -g betelgeuse deploy/betelgeuse.toml "$CONF_DIR/betelgeuse.toml"
else
  echo "install.sh: kept the existing $CONF_DIR/betelgeuse.toml (new defaults: deploy/betelgeuse.toml)"
fi

# 4. tell systemd
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "install.sh: done. Set [model] path in $CONF_DIR/betelgeuse.toml, then: systemctl enable --now betelgeuse"
else
  echo "install.sh: systemd is not running here; units are in $UNIT_DIR for the next boot"
fi
