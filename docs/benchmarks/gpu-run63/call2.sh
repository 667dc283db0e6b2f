#!/usr/bin/env bash
# session 24's second device call: check_ds4 ops + prefix (gemv on; decode and launches passed with it in call 1) with the float64-judged float32 products, then the
# ds4-flash exact bench with recycle + fold + stream points + gemv (LIMIT s in all)
set -u
T0=$(date +%s); LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHON=python3
nvidia-smi --query-gpu=name --format=csv,noheader
D=$OUT/verify; mkdir -p $D
CHECK_DECODE_FOLD=1 CHECK_STREAM_POINTS=1 CHECK_DECODE_GEMV=1 timeout 170 python3 deploy/device/check_ds4.py --device cuda \
  --only ops,prefix --out $D/gemv_ds4 > $D/gemv_ds4.log 2>&1; G=$?
echo "gemv_ds4 rc=$G $(( $(date +%s) - T0 ))s"; grep -E '^\[?(PASS|FAIL)' $D/gemv_ds4.log | cut -c1-260 | head -40
python3 - <<'PY'
import json
r = json.load(open('/root/out/verify/gemv_ds4/check_ds4.json'))["ops"]
for shape, cases in r.items():
    for k in ("shared_ffn/float32", "linears/float32", "grouped_linear/float32"):
        print(shape, k, {x: cases[k].get(x) for x in ("max_abs", "scale", "max_abs_f64", "ref_err_f64")})
PY
rm -rf $D/gemv_ds4/trace-*
FLAGS="--decode-fold --stream-points"; [ $G = 0 ] && FLAGS="$FLAGS --decode-gemv"
L=$(left); T=$(( L - 20 < 250 ? L - 20 : 250 ))
if [ $T -ge 200 ]; then
  RUN_NAME=g63 ROUTING=exact CHECK_STEPS=none TOTAL=$T bash deploy/device/bench_ds4.sh --slots auto \
    --prompts 64 --decode 64 --standard-cap 0 --group-graphs --recycle-states $FLAGS > /dev/null 2>&1
  echo "bench rc=$? $FLAGS TOTAL=$T $(( $(date +%s) - T0 ))s"
  (cd $OUT/g63 && rm -f bench.png bench.md check_ds4.* store.log bench.log)
  grep -E "host µs|achieved|first token|launches / layer, dec|copy kernels|peak VRAM|disk idle|by kernel|tok/s" \
    $OUT/g63/ds4_summary.md | cut -c1-420 | head -30
  tail -3 $OUT/g63/bench_ds4.log
else echo "bench skipped: ${L}s left"; fi
find $OUT -type f | sort
