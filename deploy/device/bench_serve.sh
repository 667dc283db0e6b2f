#!/usr/bin/env bash
# The live service's benchmark (`betelgeuse bench --suite serve`, issue 24) on the lent GPU machine, in ONE command
# (< 9 minutes, model writing included): the real `betelgeuse serve` (store + worker) in a cgroup of memory.max=12G
# and memory.swap.max=0, 12 GiB VRAM budget, the bench-geometry model, driven over the OpenAI HTTP API by the
# bench's own client, once with the shipped configuration (deploy/betelgeuse.toml) and once with explicit auto slots.
# deploy/device/bench.sh does the rest (its wheels from .whl/, the generated gRPC modules, budgets, the model).
#
#   bash deploy/device/bench_serve.sh            # GPU: --config shipped,auto, BUDGET s (default 430)
#   bash deploy/device/bench_serve.sh --config auto,5+15    # auto against the old fixed 5+15 slots
#   bash deploy/device/bench_serve.sh --quick    # CPU, tiny model: validates this script end to end (~30 s)
#   BUDGET=300 bash deploy/device/bench_serve.sh --config auto --clients 1,8 --serve-args "--max-running 8"
#   BUDGET=210 bash deploy/device/bench_serve.sh --config auto,auto:prefetch-batch-rule=union --clients 4,8 \
#     --no-agent-loop --prompt 64 --decode 16     # an A/B of a setting: a configuration adds serve flags of its own
#   BUDGET=300 bash deploy/device/bench_serve.sh --config auto,auto:host-in-place=never --clients 1,4,8 \
#     --no-agent-loop     # decode's host experts: in place for one-row steps (auto) against always banked
#   BUDGET=430 bash deploy/device/bench_serve.sh --config auto,auto:tile-experts    # engine.tile_experts' A/B
#
# BUDGET (the bench's --time-budget, model writing included) defaults to 430 s: with the wheels' install before it,
# each serve's stop after it and a cut stream ending at its case's deadline, the command ends within ~8 minutes (the
# hard timeout, BUDGET + 60 s, within 9). Each configuration gets an even share of what is left when it starts, and
# runs its phases most important first: the 512-token prompt (TTFT, TG), the same prompt again, 1 / 4 / 8 clients
# (aggregate decode and its bound, TTFT against the lone prompt), then the agent loop; what the share does not reach
# is listed under "Skipped" (a phase cut mid-way keeps what it measured; --no-agent-loop gives the agent loop's time to
# the next configuration).
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
[ $kind = gpu ] && export BUDGET=${BUDGET:-430}
exec bash deploy/device/bench.sh --suite serve "${config[@]}" "$@"
