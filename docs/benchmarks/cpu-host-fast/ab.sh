#!/usr/bin/env bash
# A/B of decode_host.py: main (PYTHONPATH=/work/main) and this branch alternately, 3 runs each, per configuration.
# The script itself is this branch's (its --form/--gate and nomiss_layer_us wrap either checkout's classes).
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-fast/ab.sh <branch checkout> > results.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
PY=$BR/.venv/bin/python
S=$BR/deploy/device/decode_host.py
export OMP_NUM_THREADS=1
while read -r args; do
  for rep in 1 2 3; do
    for side in main branch; do
      P=$([ $side = main ] && echo /work/main || echo "$BR")
      out=$(PYTHONPATH=$P $PY $S $args)
      echo "{\"side\": \"$side\", \"rep\": $rep, \"args\": \"$args\", \"run\": $out}"
    done
  done
done <<'CONFIGS'
--preset tiny --vram 20 --host 12 --tokens 200 --form solo
--preset tiny --vram 20 --host 12 --tokens 200 --form lanes
--preset tiny --vram 20 --host 12 --tokens 200 --form lanes --gate
--preset tiny --vram 20 --host 12 --tokens 200 --form default
--preset ds4-tiny --vram 4 --host 4 --tokens 200 --form solo
--preset ds4-tiny --vram 4 --host 4 --tokens 200 --form lanes
--preset ds4-tiny --vram 4 --host 4 --tokens 200 --form default
CONFIGS
