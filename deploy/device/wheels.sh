#!/usr/bin/env bash
# Makes .whl/: the Python packages Betelgeuse needs that the lent GPU machine's image (Python 3.12, torch 2.11 CUDA 13,
# Triton) lacks, as wheels for CPython 3.12 on x86-64 Linux, at the versions of this checkout's .venv (the generated
# gRPC modules in services/pb need the grpcio/protobuf they were generated with). Nothing can be fetched there, so the
# wheels travel with the working tree (`carry: [".whl", "services/pb/betelgeuse"]`, ~25 MB) and the device scripts
# install them into /tmp/site where a module is missing (deploy/device/bench.sh step 1).
#
#   bash deploy/device/wheels.sh            # after deploy/bootstrap.sh; a second run only checks
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=".venv/bin/python -m pip"
[ -x .venv/bin/python ] || { echo "wheels.sh: run deploy/bootstrap.sh first (the versions come from .venv)"; exit 2; }
# what the device lacks (KINDS.md lists its image), plus what those need that it lacks too
pkgs=(gguf grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic-core pydantic-settings
      python-dotenv typing-inspection annotated-types annotated-doc fastapi starlette opentelemetry-api uvicorn
      llguidance)
pinned=()
for p in "${pkgs[@]}"; do
  v=$($PIP show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "wheels.sh: $p is not installed in .venv"; exit 2; }
  pinned+=("$p==$v")
done
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# manylinux tags: llguidance is tagged manylinux_2_31, grpcio manylinux_2_17; pip matches each N exactly
plats=()
for n in 17 24 27 28 31 34; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${pinned[@]}"
# one version of each: two stop the whole install on the device
python3 - <<'PY'
import collections, os, re
seen = collections.defaultdict(list)
for f in sorted(os.listdir(".whl")):
    if f.endswith(".whl"):
        seen[re.split(r"-\d", f, 1)[0].lower().replace("_", "-")].append(f)
dup = {k: v for k, v in seen.items() if len(v) > 1}
if dup:
    raise SystemExit(f"wheels.sh: several versions in .whl: {dup} (remove the stale ones)")
print(f"wheels.sh: {sum(len(v) for v in seen.values())} wheels in .whl "
      f"({sum(os.path.getsize(os.path.join('.whl', f)) for v in seen.values() for f in v) / 2**20:.1f} MiB)")
PY
