#!/usr/bin/env bash
# session 23's device call (LIMIT s in all, default 585): the fold's and host60's CUDA tests, check_ds4's ops, decode
# and launches rows with the fold and gemv60 on, the ds4-flash exact bench with recycle + the fold (if those passed; else recycle alone), then
# check_cuda's batch / pool / recycle with the fold on if time is left
set -u
T0=$(date +%s); LIMIT=${LIMIT:-585}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHON=python3
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
D=$OUT/verify; mkdir -p $D/fold_cuda
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/worker/test_decode_fold.py tests/worker/test_cuda_streams.py \
  tests/worker/test_stream_points.py > $D/fold_tests.log 2>&1; FT=$?
echo "fold+points tests rc=$FT $(( $(date +%s) - T0 ))s"; grep -E "passed|failed|FAILED|Error" $D/fold_tests.log | tail -6
CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1 CHECK_DECODE_GEMV=1 timeout 170 python3 deploy/device/check_ds4.py --device cuda \
  --only ops,decode,launches --out $D/fold_ds4 > $D/fold_ds4.log 2>&1; FD=$?
echo "fold_ds4 rc=$FD $(( $(date +%s) - T0 ))s"; grep -E '^\[?(PASS|FAIL)|launches' $D/fold_ds4.log | cut -c1-150 | head -40
FOLD=--no-decode-fold; [ $FT = 0 ] && [ $FD = 0 ] && FOLD="--decode-fold --decode-gemv --stream-points"
L=$(left); T=$(( L - 25 < 250 ? L - 25 : 250 ))
if [ $T -ge 200 ]; then
  RUN_NAME=rf62 ROUTING=exact CHECK_STEPS=none TOTAL=$T bash deploy/device/bench_ds4.sh --slots auto \
    --prompts 64 --decode 64 --standard-cap 0 --group-graphs --recycle-states $FOLD > /dev/null 2>&1
  echo "bench rc=$? $FOLD TOTAL=$T $(( $(date +%s) - T0 ))s"
  (cd $OUT/rf62 && rm -f bench.png bench.md check_ds4.* store.log bench.log)
  grep -E "host µs|achieved|first token|launches / layer, dec|copy kernels|peak VRAM|disk idle|by kernel" \
    $OUT/rf62/ds4_summary.md | cut -c1-420
  tail -3 $OUT/rf62/bench_ds4.log
else echo "bench skipped: ${L}s left"; fi
L=$(left)
if [ $L -ge 60 ]; then
  CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1 OUT=$D/fold_cuda timeout $(( L - 5 )) python3 deploy/device/check_cuda.py --device cuda \
    --only batch,pool,recycle > $D/fold_cuda.log 2>&1
  echo "fold_cuda rc=$? $(( $(date +%s) - T0 ))s"; grep -E '^\[?(PASS|FAIL)' $D/fold_cuda.log | cut -c1-150 | head -20
fi
rm -rf $D/fold_cuda/trace-* $D/fold_ds4/trace-*; find $OUT -type f | sort
