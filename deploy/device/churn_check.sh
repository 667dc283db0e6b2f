#!/usr/bin/env bash
# Placement churn on the device (store/residency.py: host <-> disk hysteresis, the fill budget; issue 24), in ONE
# command (< 5 minutes with the model written before; ~7 with it): the live-service bench (bench_serve.sh: the real
# `betelgeuse serve` under 12G / 12 GiB, auto slots) at 4 and 8 clients, once with the ranking alone
# (--no-placement-hysteresis: the policy before it), once as shipped (hysteresis), once with --fill-budget too.
#
#   bash deploy/device/churn_check.sh                     # GPU
#   bash deploy/device/churn_check.sh --quick             # CPU, tiny model: validates the script end to end
#
# Prints per configuration: consolidations, placement moves per consolidation, consolidation fills read from disk
# (each one expert's bytes), the store's disk GB over the run, and the aggregate decode tok/s at 4 and 8 clients;
# then a verdict: hysteresis helps when it moves fewer experts per consolidation and its 8-client aggregate is not
# lower (within 3%); the same for the fill budget against hysteresis alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/.bench-out}
export RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-churn}
quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
if [ $quick = 1 ]; then extra=(--quick); else extra=(); export BUDGET=${BUDGET:-270}; fi
bash deploy/device/bench_serve.sh "${extra[@]}" --config auto:no-placement-hysteresis,auto,auto:fill-budget \
  --clients 4,8 --no-agent-loop --prompt 128 --decode 32 >/dev/null 2>&1
rc=$?
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
"$PY" deploy/device/churn_verdict.py "$OUT/$RUN_NAME/bench.json" || exit $?
exit $rc
