#!/usr/bin/env bash
# A/B of decode_host.py: main (PYTHONPATH=/work/main) and this branch alternately, 3 runs each, per configuration
# (configs.txt). The script itself is this branch's (its --form/--gate and nomiss_layer_us wrap either checkout's
# classes). The A/B tool: deploy/device/ab.py.
# Usage: OMP_NUM_THREADS=1 bash docs/benchmarks/cpu-host-fast/ab.sh <branch checkout> > results.jsonl
set -euo pipefail
BR=${1:-$(pwd)}
exec "$BR/.venv/bin/python" "$BR/deploy/device/ab.py" run /work/main "$BR" --reps 3 \
  --configs "$(dirname "$0")/configs.txt" --python "$BR/.venv/bin/python"
