#!/usr/bin/env bash
# session 22's first device call (temporary): fold tests, the ds4 bench with recycle (+ fold if its tests pass), recycle checks
set -u
T0=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHON=python3
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
mkdir -p $OUT/verify
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/worker/test_decode_fold.py tests/worker/test_cuda_streams.py \
  > $OUT/verify/fold_tests.log 2>&1; FT=$?
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/worker/test_decode_at_hand.py tests/worker/test_sync_audit.py \
  tests/worker/test_state_recycle.py > $OUT/verify/host58_tests.log 2>&1; echo "host58 tests rc=$?"; tail -2 $OUT/verify/host58_tests.log
echo "fold tests rc=$FT $(( $(date +%s) - T0 ))s"; tail -3 $OUT/verify/fold_tests.log
FOLD=--no-decode-fold; [ $FT = 0 ] && FOLD=--decode-fold
RUN_NAME=rf58 ROUTING=exact CHECK_STEPS=none TOTAL=250 bash deploy/device/bench_ds4.sh --slots auto --prompts 64 \
  --decode 64 --standard-cap 0 --group-graphs --recycle-states $FOLD > /dev/null 2>&1
echo "bench rc=$? $FOLD $(( $(date +%s) - T0 ))s"
(cd $OUT/rf58 && rm -f bench.png bench.md check_ds4.* store.log bench.log)
grep -E "host µs|achieved|first token|launches / layer, dec|peak VRAM|disk idle" $OUT/rf58/ds4_summary.md | cut -c1-260
tail -3 $OUT/rf58/bench_ds4.log
LEFT=$(( 575 - ($(date +%s) - T0) ))
STEPS=1 timeout $LEFT bash deploy/device/verify_off.sh > /dev/null 2>&1; echo "verify rc=$? $(( $(date +%s) - T0 ))s"
cat $OUT/verify/summary.txt | cut -c1-200
rm -rf $OUT/verify/recycle_cuda $OUT/verify/recycle_ds4; find $OUT -type f | sort
