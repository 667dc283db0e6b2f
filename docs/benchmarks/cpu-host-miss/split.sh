#!/usr/bin/env bash
# A miss layer's expert step by function (decode_host.py --split), main and this branch alternately, REPS runs each:
# one JSON line per run (deploy/device/ab.py). Table: docs/benchmarks/cpu-host-miss/split_table.py split.jsonl
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-miss/split.sh <branch checkout> [reps] [args] > split.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
ARGS=${3:---preset tiny --vram 2 --host 3 --form solo --tokens 200}
exec "$BR/.venv/bin/python" "$BR/deploy/device/ab.py" run /work/main "$BR" --reps "${2:-3}" --config="$ARGS" \
  --extra=--split --python "$BR/.venv/bin/python"
