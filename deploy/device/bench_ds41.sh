#!/usr/bin/env bash
# DeepSeek-V4.1-Flash-shaped benchmark (deepseek41: Engram rows read by the store from disk with O_DIRECT) on the
# lent GPU machine, in ONE command (< 7 minutes in all: TOTAL=400 s by default, the bench gets what the model write and
# the check leave, minus 75 s): bench_ds4.sh's steps on the ds41-flash preset.
#
#   bash deploy/device/bench_ds41.sh           # write ds41-flash (36 GB, if absent), the engine check, the bench
#   TOTAL=500 bash deploy/device/bench_ds41.sh --prompts 64,512 --decode 32    # extra args go to `betelgeuse bench`
#   PRESET=ds41-tiny CHECK_ARGS="--device cpu" TRITON_INTERPRET=1 TOTAL=400 \
#     bash deploy/device/bench_ds41.sh --device cpu --no-cgroup --slots 2+3 --prompts 8 --decode 2   # CPU dry run
#
# The model, $WORK/ds41-flash.gguf: V4.1-Flash's layer shapes (hidden 5120, 64 heads x 512, 384 MXFP4 experts of
# 18,800,640 B, top-6 + shared) on 4 of its 40 layers (sliding-only 0-1, a ratio-2 KV source 2, a ratio-1 KV source 3
# that is also the candidate layer), Engram before layers 1 and 2 with its tables scaled down 64x (bucket primes
# above 250,000 instead of 16,000,000: 6.0M rows of 272 B = 1.63 GB per table at Q8_0 instead of 384M rows /
# 104.4 GB): 28.9 GB of experts, ~36 GB in all. The disk has 64 GB, so an older ds4-flash.gguf (31 GB) in $WORK is
# removed first when both do not fit. The check is check_ds4.py's engine step on ds41-tiny (Engram through the
# store, bit-identical across slot configurations and to the reference on the device). bench.md then has the
# prefill and decode tables as for ds4-flash plus "Engram rows": rows and disk bytes per token, rows from disk /
# from the store's row cache, store round trips, the Engram wait and its share (and the feed's) of the pass time.
# Results in $OUT/$RUN_NAME/: bench_ds4.log, check_ds4.md, check_ds4.json, bench.json, bench.md, bench.png, bench.log,
# store.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PRESET=${PRESET:-ds41-flash}
export TOTAL=${TOTAL:-400}
export RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-ds41}
export CHECK_ARGS="--only engine --preset ds41-tiny ${CHECK_ARGS:-}"
exec bash deploy/device/bench_ds4.sh "$@"
