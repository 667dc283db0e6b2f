#!/usr/bin/env bash
# One device command: wheels, CUDA checks of the new kernels, then a short resident + auto-slots bench.
#   bash deploy/device/hotpath.sh [bench args...]     (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
