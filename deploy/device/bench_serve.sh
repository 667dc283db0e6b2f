#!/usr/bin/env bash
# The live service's benchmark (`betelgeuse bench --suite serve`, issue 24) on the lent GPU machine, in ONE command
# (< 9 minutes, model writing included): the real `betelgeuse serve` (store + worker) in a cgroup of memory.max=12G
# and memory.swap.max=0, 12 GiB VRAM budget, the bench-geometry model, driven over the OpenAI HTTP API by the
# bench's own client, once with the shipped configuration (deploy/betelgeuse.toml) and once with explicit auto slots.
# deploy/device/bench.sh does the rest (its wheels from .whl/, the generated gRPC modules, budgets, the model).
#
#   bash deploy/device/bench_serve.sh            # GPU: --config shipped,auto, BUDGET s (default 470)
#   bash deploy/device/bench_serve.sh --quick    # CPU, tiny model: validates this script end to end (~30 s)
#   BUDGET=300 bash deploy/device/bench_serve.sh --config auto --clients 1,8 --serve-args "--max-running 8"
#
# Results land in $OUT/$RUN_NAME/: bench.json, bench.md, bench.log, serve-<k>-<config>.log (the end of each serve's
# own log, the store's and the worker's); bench.md is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
kind=gpu
config=(--config shipped,auto)
for a in "$@"; do
  [ "$a" = "--quick" ] && kind=quick && config=()
  [ "$a" = "--config" ] && config=()
done
export RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-serve-$kind}
exec bash deploy/device/bench.sh --suite serve "${config[@]}" "$@"
