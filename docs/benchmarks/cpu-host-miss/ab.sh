#!/usr/bin/env bash
# A/B of decode_host.py with misses: main (PYTHONPATH=/work/main) and this branch alternately, 3 runs each, per
# configuration (configs.txt: few slots, most decode layers read an expert from disk). The script itself is this
# branch's (its miss_layer_us wraps either checkout's classes). The A/B tool: deploy/device/ab.py.
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-miss/ab.sh <branch checkout> [reps] > results.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
exec "$BR/.venv/bin/python" "$BR/deploy/device/ab.py" run /work/main "$BR" --reps "${2:-3}" \
  --configs "$(dirname "$0")/configs.txt" --python "$BR/.venv/bin/python"
