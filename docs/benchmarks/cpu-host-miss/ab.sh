#!/usr/bin/env bash
# A/B of decode_host.py with misses: main (PYTHONPATH=/work/main) and this branch alternately, 3 runs each, per
# configuration (few slots: most decode layers read an expert from disk). The script itself is this branch's (its
# miss_layer_us wraps either checkout's classes).
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-miss/ab.sh <branch checkout> [reps] > results.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
REPS=${2:-3}
PY=$BR/.venv/bin/python
S=$BR/deploy/device/decode_host.py
export OMP_NUM_THREADS=1
while read -r args; do
  for rep in $(seq "$REPS"); do
    for side in main branch; do
      P=$([ $side = main ] && echo /work/main || echo "$BR")
      out=$(PYTHONPATH=$P $PY $S $args)
      echo "{\"side\": \"$side\", \"rep\": $rep, \"args\": \"$args\", \"run\": $out}"
    done
  done
done <<'CONFIGS'
--preset tiny --vram 2 --host 3 --tokens 200 --form solo
--preset tiny --vram 2 --host 3 --tokens 200 --form lanes
--preset tiny --vram 2 --host 3 --tokens 200 --form default
--preset ds4-tiny --vram 2 --host 3 --tokens 200 --form solo
--preset ds4-tiny --vram 2 --host 3 --tokens 200 --form lanes
CONFIGS
