#!/usr/bin/env bash
# DeepSeek-V4-Flash-shaped runs on the lent GPU machine, each ONE command under 8 minutes on a bare H200:
#
#   bash deploy/device/bench_ds4.sh            # speed: write ds4-flash (31 GB, if absent), quick checks, the bench,
#                                              # then the issue-21 figures (decode tok/s, host µs / expert
#                                              # application, launches / layer, peak VRAM vs budget, disk bound)
#   CHECK_STEPS=vram bash deploy/device/bench_ds4.sh --slots auto --prompts 64 --decode 64
#                                              # issue 21's target table in ~7 min: each case in exact routing and
#                                              # then in the APPROXIMATE pool mode (ROUTING, default exact,pool),
#                                              # one bench run sharing the model write; PASS/MISS per target
#   STORE_MESSAGES=1 ... bash deploy/device/bench_ds4.sh ...   # also times one store message on this CPU first
#   CHAIN_LATENCY=1 ... bash deploy/device/bench_ds4.sh ...    # also the store<->worker chain's host links first
#                                              # (deploy/device/chain_latency.py: chain_latency.md; with
#                                              # engine.session_reads on: chain_latency_reads.md)
#   CHECK_ONLY=1 bash deploy/device/bench_ds4.sh   # correctness: every check_ds4.py step (kernels, engine, the fused
#                                              # ops at V4-Flash shapes, eager == graph replay, batch invariance,
#                                              # launches per decode layer); no model write, no bench
#   TOTAL=400 bash deploy/device/bench_ds4.sh --prompts 64 --decode 32     # extra args go to `betelgeuse bench`
#   ... bash deploy/device/bench_ds4.sh ... --disk-depths 1,2,4,8,19   # also the disk's rate at N experts in flight
#                                              # (one random sample per N before the cases; one ds4_summary line)
#   PRESET=ds4-tiny CHECK_ARGS="--device cpu --hidden 256 --ff 128" TRITON_INTERPRET=1 TOTAL=400 \
#     bash deploy/device/bench_ds4.sh --device cpu --no-cgroup --slots 2+3 --prompts 8 --decode 2   # CPU dry run
#
# 1. the wheels in .whl/ into /tmp/site where this Python lacks a module (as bench.sh), PYTHONPATH=/tmp/site:$PWD
# 2. the ds4-flash model (8 layers, 256 MXFP4 experts of 13.4 MB per layer) at $WORK/ds4-flash.gguf, written
#    once (fsync'd and dropped from the page cache, as `betelgeuse bench` does) and reused by later runs
# 3. deploy/device/check_ds4.py (CHECK_STEPS, default kernel,engine,vram with the vram step on this model; every
#    step on ds4-tiny with CHECK_ONLY=1): its rows say PASS/FAIL; the bench runs either way
# 4. bench.sh --preset ds4-flash --variant-skew none --memory-max 12G --vram-budget 12GiB --routing $ROUTING with
#    the time left (BUDGET = TOTAL - elapsed - 75 s: bench.sh's hard timeout is BUDGET + 60); ROUTING (default
#    exact,pool) runs each case in each routing mode, the pool case beside its exact one with its divergence
# 5. deploy/device/ds4_summary.py: the issue-21 figures from bench.json (also $OUT/$RUN_NAME/ds4_summary.md)
# Results in $OUT/$RUN_NAME/: bench_ds4.log, check_ds4.md, check_ds4.json, bench.json, bench.md, bench.png,
# bench.log, store.log, ds4_summary.md (9 files, 2 folders deep).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
TOTAL=${TOTAL:-460}
CHECK_ONLY=${CHECK_ONLY:-0}
OUT=${OUT:-$ROOT/.bench-out}
WORK=${WORK:-/var/tmp/betelgeuse-bench}
export RUN_NAME=${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)-ds4}
DEST=$OUT/$RUN_NAME
mkdir -p "$DEST" "$WORK"
LOG=$DEST/bench_ds4.log
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHON=$PY
say() { echo "[bench_ds4 $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# 1. modules
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import gguf, grpc, google.protobuf, grpc_health.v1, tokenizers, prometheus_client, triton" 2>/dev/null \
   && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { say "installing .whl/*.whl failed"; tail -5 "$LOG"; exit 2; }
  export PYTHONPATH=/tmp/site:$ROOT
fi
if [ ! -f services/pb/betelgeuse/v1/store_pb2.py ]; then
  "$PY" -m services.codegen >>"$LOG" 2>&1 || { say "services/pb is missing and cannot be generated: carry it"; exit 2; }
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; df -h "$WORK" | tail -1; } >>"$LOG" 2>&1

# 3 alone (CHECK_ONLY=1): every check, no model, no bench
if [ "$CHECK_ONLY" = 1 ]; then
  say "check_ds4.py (${CHECK_STEPS:-every step})"
  timeout $(( TOTAL - 20 )) "$PY" deploy/device/check_ds4.py --out "$DEST" --tmp "$WORK/check" \
    --only "${CHECK_STEPS:-kernel,engine,ops,decode,launches,vram}" ${CHECK_ARGS:-} >>"$LOG" 2>&1
  rc=$?
  say "check_ds4.py exit $rc"
  [ -f "$DEST/check_ds4.md" ] && cat "$DEST/check_ds4.md"
  exit $rc
fi

# 2. the model
PRESET=${PRESET:-ds4-flash}
MODEL=$WORK/$PRESET.gguf
if [ ! -f "$MODEL" ]; then
  # the disk (64 GB) holds one Flash-shaped model: other synth models in $WORK go when this one does not fit
  need=$("$PY" -c "import sys; from betelgeuse.gguf.synth import model_nbytes, spec_from_preset; print(model_nbytes(spec_from_preset(sys.argv[1])) + (1 << 30))" "$PRESET")
  if [ "$(df --output=avail -B1 "$WORK" | tail -1)" -lt "${need:-0}" ]; then
    for old in "$WORK"/*.gguf; do
      if [ -f "$old" ] && [ "$old" != "$MODEL" ]; then say "removing $old (the disk cannot hold both)"; rm -f "$old"; fi
    done
  fi
  say "writing $MODEL"
  "$PY" - "$MODEL" "$PRESET" >>"$LOG" 2>&1 <<'EOF' || { say "writing the model failed"; tail -20 "$LOG"; exit 2; }
import sys
from pathlib import Path
from services.bench.args import ensure_model
from betelgeuse.gguf.synth import spec_from_preset
r = ensure_model(Path(sys.argv[1]), spec_from_preset(sys.argv[2]), lambda m: print(m, flush=True))
print(f"model: {r['bytes'] / 1e9:.1f} GB in {r['write_s']:.1f} s = {r['write_GBps']:.2f} GB/s (fsync included)")
EOF
  grep "^model:" "$LOG" | tail -1
else
  say "reusing $MODEL"
fi

# 3. the quick correctness checks on the device (STORE_MESSAGES=1 first: one store message's host cost on this CPU,
#    deploy/device/store_messages.py, ~20 s, store_messages.md)
if [ "${STORE_MESSAGES:-0}" = 1 ]; then
  say "store_messages.py"
  timeout 120 "$PY" deploy/device/store_messages.py --out "$DEST/store_messages.md" >>"$LOG" 2>&1
  [ -f "$DEST/store_messages.md" ] && cat "$DEST/store_messages.md"
fi
if [ "${CHAIN_LATENCY:-0}" = 1 ]; then      # the store<->worker chain's host links on this CPU and disk (~10 s)
  say "chain_latency.py"
  CHAIN_TMP=$WORK timeout 120 "$PY" deploy/device/chain_latency.py --n 500 --out "$DEST/chain_latency.md" >>"$LOG" 2>&1
  [ -f "$DEST/chain_latency.md" ] && cat "$DEST/chain_latency.md"
  # and with engine.session_reads on (cpu-store61: the store link without a reader thread's wake-up; off by default)
  CHAIN_TMP=$WORK timeout 120 "$PY" deploy/device/chain_latency.py --n 500 --session-reads \
    --out "$DEST/chain_latency_reads.md" >>"$LOG" 2>&1
  [ -f "$DEST/chain_latency_reads.md" ] && cat "$DEST/chain_latency_reads.md"
fi
say "check_ds4.py"
timeout 260 "$PY" deploy/device/check_ds4.py --out "$DEST" --tmp "$WORK/check" --only "${CHECK_STEPS:-kernel,engine,vram}" \
  --vram-model "$MODEL" ${CHECK_ARGS:-} >>"$LOG" 2>&1
say "check_ds4.py exit $?"
[ -f "$DEST/check_ds4.md" ] && cat "$DEST/check_ds4.md"

# 4. the bench with the time left
BUDGET=$(( TOTAL - ($(date +%s) - T0) - 75 ))
if [ "$BUDGET" -lt 60 ]; then say "only $BUDGET s left for the bench: skipped"; exit 3; fi
say "bench.sh with BUDGET=$BUDGET"
BUDGET=$BUDGET OUT=$OUT WORK=$WORK bash deploy/device/bench.sh --model "$MODEL" --preset "$PRESET" --variant-skew none \
  --memory-max 12G --vram-budget 12GiB --routing "${ROUTING:-exact,pool}" "$@"
rc=$?
say "bench.sh exit $rc"

# 5. the issue-21 figures
[ -f "$DEST/bench.json" ] && "$PY" deploy/device/ds4_summary.py "$DEST/bench.json" --out "$DEST/ds4_summary.md" | tee -a "$LOG"
exit $rc
