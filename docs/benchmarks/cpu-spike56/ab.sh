#!/usr/bin/env bash
# cpu-spike56: decode_host.py --per-token on main (BASE) and this branch (NEW), alternating, the same script on both
# (PYTHONPATH picks the checkout; run from it so the store child imports the same tree). Out: ab_<rep>_<side>_<cfg>.json
set -euo pipefail
NEW=$(cd "$(dirname "$0")/../../.." && pwd); BASE=${BASE:-/work/main}; PY=${PY:-$NEW/.venv/bin/python}
OUT=${OUT:-$NEW/docs/benchmarks/cpu-spike56}; REPS=${REPS:-2}; TOKENS=${TOKENS:-70}
declare -A CFG=(
  [tiny-solo]="--preset ds4-tiny --form solo --flex on --flex-slots 3"
  [tiny-lanes]="--preset ds4-tiny --form lanes --flex on --flex-slots 3"
  [wide-solo]="--preset ds4-wide --vram 49 --host 77 --form solo --flex on --flex-slots 3"
)
for rep in $(seq 1 "$REPS"); do
  for cfg in tiny-solo tiny-lanes wide-solo; do
    for side in base new; do
      tree=$BASE; [ "$side" = new ] && tree=$NEW
      (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH=$tree timeout 600 "$PY" "$NEW/deploy/device/decode_host.py" \
         ${CFG[$cfg]} --tokens "$TOKENS" --per-token > "$OUT/ab_${rep}_${side}_${cfg}.json")
      echo "rep $rep $cfg $side done" >&2
    done
  done
done
