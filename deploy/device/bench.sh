#!/usr/bin/env bash
# The Betelgeuse benchmark on the lent GPU machine, in ONE command (< 9 minutes, model writing included).
#
#   bash deploy/device/bench.sh              # GPU: the whole plan, cut to fit BUDGET seconds (default 470)
#   bash deploy/device/bench.sh --quick      # CPU, small model: validates this script end to end (~1-2 min)
#   BUDGET=300 bash deploy/device/bench.sh --prompts 64 --slots 5+15
#   for P in no-tile-experts tile-experts; do RUN_NAME=tl-$P BUDGET=280 bash deploy/device/bench.sh --slots auto \
#     --prompts 64 --decode 128 --standard-cap 0 --$P; done     # an engine setting's A/B (every engine.* key is a flag)
#
# Extra arguments go to `betelgeuse bench` (see docs/benchmarks/README.md). Results land in
# $OUT/$RUN_NAME/: bench.json, bench.md, bench.png, bench.log, store.log (5 files, 2 folders deep);
# the markdown table is printed last. The model (~32 GB) is written to $WORK (default /var/tmp/betelgeuse-bench)
# once and reused by later runs on the same machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.bench-out}
WORK=${WORK:-/var/tmp/betelgeuse-bench}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
if [ $quick = 1 ]; then
  BUDGET=${BUDGET:-150}; RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-quick}; WORK=${WORK_QUICK:-/tmp/betelgeuse-bench-quick}
else
  BUDGET=${BUDGET:-470}; RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-gpu}
fi
DEST=$OUT/$RUN_NAME
mkdir -p "$DEST" "$WORK"
LOG=$DEST/bench.log

# 1. Python modules: the carried wheels (gguf, grpcio, protobuf, ...) where this Python lacks them
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
check_modules() {
  "$PY" - <<'EOF'
import importlib
mods = ["torch", "numpy", "gguf", "grpc", "google.protobuf", "grpc_health.v1", "tokenizers", "prometheus_client"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{m} ({type(e).__name__})")
print(" ".join(bad))
EOF
}
missing=$(check_modules)
if [ -n "$missing" ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { echo "bench.sh: installing .whl/*.whl failed (see $LOG)"; tail -5 "$LOG"; exit 2; }
  export PYTHONPATH=/tmp/site:$ROOT
  missing=$(check_modules)
fi
if [ -n "$missing" ]; then echo "bench.sh: missing Python modules: $missing (carry their wheels in .whl/)"; exit 2; fi

# 2. the generated gRPC modules are gitignored: carried (services/pb/betelgeuse) or generated here
if [ ! -f services/pb/betelgeuse/v1/store_pb2.py ]; then
  "$PY" -m services.codegen >>"$LOG" 2>&1 || {
    echo "bench.sh: services/pb/betelgeuse is missing and cannot be generated (no grpcio-tools): carry it"; exit 2; }
fi

# 3. the machine, for the log
{
  echo "== $(date -u) $(uname -a)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
  df -h "$WORK" | tail -1
  free -g | head -2
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} >>"$LOG" 2>&1

# 4. the benchmark (its own time budget; the hard timeout only guards against a hang)
echo "== betelgeuse bench --time-budget $BUDGET $*" >>"$LOG"
timeout --signal=INT $((${BUDGET%.*} + 60)) "$PY" -m services.bench.cli --work-dir "$WORK" --out "$DEST" \
  --run-name "$RUN_NAME" --time-budget "$BUDGET" "$@" >>"$LOG" 2>&1
rc=$?
store_log=$(ls -t "$WORK"/run-*/store.log 2>/dev/null | head -1)
[ -n "$store_log" ] && tail -n 400 "$store_log" >"$DEST/store.log"
echo "== exit $rc" >>"$LOG"
tail -n 25 "$LOG"
echo
if [ -f "$DEST/bench.md" ]; then cat "$DEST/bench.md"; else echo "bench.sh: no bench.md written (exit $rc)"; fi
exit $rc
