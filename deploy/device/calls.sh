#!/usr/bin/env bash
# The next device session's calls (deploy/device/NEXT.md, "The calls"), one per run-tool command:
#
#   bash deploy/device/calls.sh 1      # carry [".whl", "services/pb/betelgeuse"]; results: $OUT/call1.tgz
#   DRY=1 bash deploy/device/calls.sh 2   # print the commands only
#
# Each call installs the wheels where this Python lacks them (as bench_ds4.sh), runs its rows with every output under
# /tmp/calls/N, prints the logs' and summaries' tails, and packs the folder into ONE file, $OUT/callN.tgz: the run tool
# brings back at most 8 files a call, and the benches alone write 9 each. The machine keeps /var/tmp's ds4-flash model
# between calls while it stays warm (call 2 writes it; calls 3-4 reuse it).
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:?"usage: calls.sh N (1-4: deploy/device/NEXT.md's calls)"}
R=${OUT:-$PWD/.bench-out}             # where the tarball goes (the run tool's $OUT)
W=/tmp/calls/$N
mkdir -p "$W" "$R"
case "$N" in 1|2|3|4) ;; *) echo "calls.sh: no call $N (1-4: deploy/device/NEXT.md)"; exit 2 ;; esac
if [ -n "${DRY:-}" ]; then :
elif ! python3 -c "import gguf, grpc, google.protobuf, grpc_health.v1, prometheus_client" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$W/pip.log" 2>&1 || { echo "installing .whl/*.whl failed:"; tail -5 "$W/pip.log"; exit 2; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHON=python3 PYTHONUNBUFFERED=1
# each step's results packed as soon as it ends (the tarball rewritten): a call the run tool stops at its limit still
# brings back every step that finished (bench_ds4's TOTAL is a budget: three of them can outrun 600 s)
pack() { tar czf "$R/call$N.tgz.part" -C "$W" . && mv "$R/call$N.tgz.part" "$R/call$N.tgz"; }
run() { echo "+ $*"; [ -n "${DRY:-}" ] || { eval "$@"; pack; }; }

A="--slots auto --prompts 64 --decode 64 --standard-cap 0 --group-graphs"
case "$N" in
  1)  # row 0: host65's default-path change in _direct_group on CUDA; row 2: mxtma65's ST forms, bits and GB/s
      run "python3 deploy/device/check_ds4.py --only decode,prefix --out $W/ck > $W/ck.log 2>&1"
      run "python3 deploy/device/check_cuda.py --only invariance,batch,recycle > $W/cuda.log 2>&1"
      run "python3 deploy/device/check_gluon_mmq.py --types MXFP4,Q4_K --forms 'gluon GP1 PK,gluon GP1 PK ST3,gluon GP1 PK ST4,gluon GP1 PK ST4 NR168,gluon GP1 PK ST4 NR128' > $W/mmq.log 2>&1"
      ;;
  2)  # row 1 (host65's caller reader against the thread) and gil66's monitor (the old polling thread), no marks
      run "OUT=$W ROUTING=exact CHECK_STEPS=none BETELGEUSE_STORE_SESSION_READER=caller TOTAL=330 RUN_NAME=caller bash deploy/device/bench_ds4.sh $A"
      run "OUT=$W ROUTING=exact CHECK_STEPS=none TOTAL=255 RUN_NAME=thread bash deploy/device/bench_ds4.sh $A"
      run "OUT=$W ROUTING=exact CHECK_STEPS=none BENCH_MONITOR=poll TOTAL=255 RUN_NAME=poll bash deploy/device/bench_ds4.sh $A"
      ;;
  3|4)  # row 3: copy65's early disk copies against off; 3 with --gpu-marks (the copy link, achieved), 4 without (TG, host)
      M=""; P=u; [ "$N" = 3 ] && { M="--gpu-marks"; P=m; }
      for F in no-disk-copy-early disk-copy-early; do
        run "OUT=$W ROUTING=exact CHECK_STEPS=none TOTAL=$([ -f /var/tmp/betelgeuse-bench/ds4-flash.gguf ] && echo 255 || echo 330) RUN_NAME=$P-$F bash deploy/device/bench_ds4.sh $A $M --$F"
      done
      ;;
  *)  echo "calls.sh: no call $N (1-4: deploy/device/NEXT.md)"; exit 2 ;;
esac
[ -n "${DRY:-}" ] && exit 0
for f in "$W"/*.log "$W"/*/ds4_summary.md; do
  [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; }
done
pack && echo "packed: $R/call$N.tgz ($(du -h "$R/call$N.tgz" | cut -f1))"
