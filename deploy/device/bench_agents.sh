#!/usr/bin/env bash
# The serving benchmark (`betelgeuse bench --suite agents`: agent loop with the prefix cache off/on, 1-16
# concurrent clients, expert loads per batched decode pass) on the lent GPU machine, in ONE command
# (< 9 minutes, model writing included): deploy/device/bench.sh with `--suite agents` (its wheels, budgets and
# model handling).
#
#   bash deploy/device/bench_agents.sh           # GPU: bench geometry, 12G memory.max, 12 GiB VRAM, BUDGET s (470)
#   bash deploy/device/bench_agents.sh --quick   # CPU, small model: validates this script end to end (~1 min)
#   BUDGET=300 bash deploy/device/bench_agents.sh --clients 1,8 --turns 6
#
# Results land in $OUT/$RUN_NAME/: bench.json, bench.md, bench.log, store.log; bench.md is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
kind=gpu
for a in "$@"; do [ "$a" = "--quick" ] && kind=quick; done
export RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-agents-$kind}
exec bash deploy/device/bench.sh --suite agents "$@"
