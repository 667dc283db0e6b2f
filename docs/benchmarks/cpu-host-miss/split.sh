#!/usr/bin/env bash
# A miss layer's expert step by function (decode_host.py --split), main and this branch alternately, REPS runs each:
# one JSON line per run. Table: docs/benchmarks/cpu-host-miss/split_table.py split.jsonl
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-miss/split.sh <branch checkout> [reps] [args] > split.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
REPS=${2:-3}
ARGS=${3:---preset tiny --vram 2 --host 3 --form solo --tokens 200}
export OMP_NUM_THREADS=1
for rep in $(seq "$REPS"); do
  for side in main branch; do
    P=$([ $side = main ] && echo /work/main || echo "$BR")
    out=$(PYTHONPATH=$P $BR/.venv/bin/python $BR/deploy/device/decode_host.py $ARGS --split)
    echo "{\"side\": \"$side\", \"rep\": $rep, \"args\": \"$ARGS\", \"run\": $out}"
  done
done
