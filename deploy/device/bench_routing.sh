#!/usr/bin/env bash
# The headline figures on a realistic routing workload (issue 27), in ONE command of ~6 minutes on the lent GPU
# machine (model writing included): the reference table (cold/warm prefill: PP tok/s, disk read share, disk wait),
# decode TG and the live-service agents suite, on the CALIBRATED router (popularity and temporal locality fitted to
# published Qwen3-30B-A3B decode statistics, gguf/synth_router.py) beside the skew-1.0 router of earlier runs and
# uniform routing (the worst case). The three models have the bench geometry at LAYERS layers (default 12: three
# 8.6 GB files fit the disk and ~60 s of writing; 48 layers would be 3 x 32 GB).
#
#   bash deploy/device/bench_routing.sh            # GPU (carry .whl and services/pb/betelgeuse, as bench.sh)
#   bash deploy/device/bench_routing.sh --quick    # CPU, small models: checks this script end to end (~3 min)
#   LAYERS=16 BUDGET_PASSES=260 BUDGET_AGENTS=110 bash deploy/device/bench_routing.sh
#
# Results: $OUT/<stamp>-routing-passes/ and $OUT/<stamp>-routing-agents/ (bench.json, bench.md, bench.log,
# store.log); each bench.md is printed. In the passes report: the prefill and decode tables per router (cases
# "5+15 p64/p512" = calibrated, "variant skew1 ..." and "variant skew0 ..." = skew 1.0 and uniform) and the
# "Routing" table: the statistics the passes actually saw, beside the target.
set -uo pipefail
cd "$(dirname "$0")/../.."
quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
if [ $quick = 1 ]; then       # the quick defaults' slots and prompts (small model, CPU)
  LAYERS=${LAYERS:-2}; BUDGET_PASSES=${BUDGET_PASSES:-150}; BUDGET_AGENTS=${BUDGET_AGENTS:-90}; plan=()
else
  LAYERS=${LAYERS:-12}; BUDGET_PASSES=${BUDGET_PASSES:-230}; BUDGET_AGENTS=${BUDGET_AGENTS:-110}
  plan=(--slots 5+15 --prompts 64,512 --standard-cap 5)
fi
stamp=$(date -u +%Y%m%d-%H%M%S)

# 1. the passes suite: calibrated main model, skew 1.0 and uniform comparison models of the same depth; the
#    reference slots (5+15) at 64 and 512 tokens, decode 128; the standard schedule capped (it is not the point here)
RUN_NAME=$stamp-routing-passes BUDGET=$BUDGET_PASSES bash deploy/device/bench.sh --router calibrated \
  --layers "$LAYERS" --variant-skew 1.0,uniform --variant-layers "$LAYERS" ${plan[@]+"${plan[@]}"} "$@"
rc1=$?

# 2. the agents suite (the live service over its APIs) on the same calibrated model file (reused, not rewritten)
RUN_NAME=$stamp-routing-agents BUDGET=$BUDGET_AGENTS bash deploy/device/bench.sh --suite agents --router calibrated \
  --layers "$LAYERS" "$@"
rc2=$?
exit $(( rc1 > rc2 ? rc1 : rc2 ))
