#!/usr/bin/env bash
# The device checks of what shipped OFF until a GPU ran it (~10 min on a warm H100: two calls, STEPS=1,2 then STEPS=3).
# Steps 1, 2 and 4 are on by default since they passed (1: gpu-run61-h100; 2, 4: gpu-run63), so the CHECK_* variables
# below restate the defaults (step 2's check_cuda rows run with gemv on too: its routing sort, qwen3moe); step 3's
# Gluon forms ship for Q8_0 and Q4_K's bf16 MMA (act_quant bf16 / auto; gpu-run63), MXFP4's stay off:
#   1. engine.recycle_states (graphs57): check_cuda --only recycle (tiny) and check_ds4 --only decode (ds4-tiny, its
#      recycle rows): a second sequence on a recycled state captures no decode graph and equals a fresh runner
#   2. engine.decode_fold (host57, lanesfold57) and engine.stream_points (host60): tests/worker/test_decode_fold.py +
#      test_cuda_streams.py + test_stream_points.py on CUDA, check_ds4 --only decode and check_cuda --only
#      batch,pool,recycle with CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1, then
#      token_split.py (docs/benchmarks/cpu-host57) on ds4-tiny and ds4-wide, the solo and the lanes form, without and
#      with --fold: replays a token, the rest's µs
#   4. engine.decode_gemv (gemv60): check_ds4 --only ops,decode,launches,prefix with CHECK_DECODE_GEMV=1,
#      gemv_bench.py --sweep
#   3. the Gluon bf16 MMA (schedule keys GL, GP): check_gluon_mmq.py, Q8_0 with gluon16r57's GP forms (--odd), then
#      Q4_K (gluonk57) and MXFP4: bits == Triton's, GB/s beside, "faster at both rows" per form
# Each step has its own timeout, so one that hangs does not eat the others'. STEPS picks some (default 1,2,3).
# DEVICE=cpu TRITON_INTERPRET=1: a dry run of the script on the CPU.
# Results in $OUT/verify/: <step>.log each and summary.txt (every PASS / FAIL line, each step's exit status).
#   pip install -q --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD PYTHON=python3
#   OUT=$OUT bash deploy/device/verify_off.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/verify-out}
D=$OUT/verify
mkdir -p "$D"
STEPS=${STEPS:-1,2,3}
PY=${PYTHON:-python3}
DEV=${DEVICE:-cuda}             # cpu: a dry run of the script here (no graphs: the recycle rows pass without them)
S=$D/summary.txt
: > "$S"

step() {            # step NAME TIMEOUT CMD...: run, log, record its status and its PASS / FAIL lines
  local name=$1 t=$2
  shift 2
  timeout "$t" "$@" > "$D/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc (timeout ${t}s)" >> "$S"
  grep -E '^\[?(PASS|FAIL)|passed|failed|error' "$D/$name.log" | cut -c1-200 | head -40 >> "$S"
  grep -oE '"(preset|host_us_per_application|other_host_ms|rest_us)": [^,]*' "$D/$name.log" | paste -sd' ' >> "$S"
}

if [[ ,$STEPS, == *,1,* ]]; then
  mkdir -p "$D/recycle_cuda"
  OUT=$D/recycle_cuda step recycle_cuda 120 "$PY" deploy/device/check_cuda.py --device "$DEV" --only recycle
  step recycle_ds4 150 "$PY" deploy/device/check_ds4.py --device "$DEV" --only decode --out "$D/recycle_ds4"
fi
if [[ ,$STEPS, == *,2,* ]]; then
  step fold_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/worker/test_decode_fold.py \
    tests/worker/test_cuda_streams.py tests/worker/test_stream_points.py      # + host60's stream points (on)
  # the fold's bits on CUDA: check_ds4's decode rows (eager == graphs, solo and lanes, pool, == the reference, batch,
  # recycle) and check_cuda's batch / pool / recycle with every engine folding (gpu-run61: only the capture test ran)
  CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1 step fold_ds4 150 "$PY" deploy/device/check_ds4.py --device "$DEV" --only decode \
    --out "$D/fold_ds4"
  mkdir -p "$D/fold_cuda"
  CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1 OUT=$D/fold_cuda step fold_cuda 150 "$PY" deploy/device/check_cuda.py --device "$DEV" \
    --only batch,pool,recycle
  for F in off on; do
    flag=(); [ "$F" = on ] && flag=(--fold)
    for FORM in solo lanes; do          # solo's logs keep their names (fold_off / fold_on)
      name=fold_$F; [ "$FORM" = lanes ] && name=fold_lanes_$F
      step "$name" 150 bash -c "for P in '--preset ds4-tiny --flex-slots 3' \
        '--preset ds4-wide --vram 49 --host 77 --flex-slots 40 --tokens 40'; do \
        $PY docs/benchmarks/cpu-host57/token_split.py \$P --form $FORM --flex on --device $DEV --split \
        --group-graphs ${flag[*]:-}; done"
    done
  done
fi
if [[ ,$STEPS, == *,4,* ]]; then
  # engine.decode_gemv (gemv60): the one-launch projections at flash shapes (rows alone == in the launch on the tensor
  # cores), decode's rows (batch graphs == solo, eager == graphs, == the reference) and launches with it on, then its
  # GB/s against cuBLAS at T = 1..16 (docs/benchmarks/cpu-gemv60); prefix: a snapshot hit == a miss with prefill
  # chunks of both kernels (inv60: a <= 64-row tail _gemv_kernel's, a full chunk the library's gemm)
  CHECK_DECODE_GEMV=1 step gemv_ds4 200 "$PY" deploy/device/check_ds4.py --device "$DEV" \
    --only ops,decode,launches,prefix --out "$D/gemv_ds4"
  step gemv_bench 120 "$PY" deploy/device/gemv_bench.py --sweep
fi
if [[ ,$STEPS, == *,3,* ]]; then
  step gluon_q8 180 "$PY" deploy/device/check_gluon_mmq.py --types Q8_0 --odd      # gluon16r57's GP forms
  step gluon_q4k 150 "$PY" deploy/device/check_gluon_mmq.py --types Q4_K,MXFP4     # gluonk57's Q4_K
fi
rm -f "$D"/*/trace-*.json
cat "$S"
