#!/usr/bin/env bash
# The next device session's calls (deploy/device/NEXT.md, "The calls"), one per run-tool command:
#
#   bash deploy/device/calls.sh 1      # carry [".whl", "services/pb/betelgeuse"]; results: $OUT/call1.tgz
#   DRY=1 bash deploy/device/calls.sh 2   # print the commands only
#   bash deploy/device/calls.sh 5 ck caller thread   # named steps (step() below), results in $OUT/call5.tgz
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
case "$N" in 1|2|3|4|5|6|7|8|9) ;; *) echo "calls.sh: no call $N (1-9: the tarball's number; 1-4 run NEXT.md's calls when no steps follow)"; exit 2 ;; esac
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
T() { [ -f /var/tmp/betelgeuse-bench/ds4-flash.gguf ] && echo 255 || echo 330; }   # a fresh machine writes the model first
ds4() { run "OUT=$W ROUTING=exact CHECK_STEPS=none TOTAL=$(T) $*"; }
step() {   # one named step; a call is a list of them (the budget decides how many fit: each bench_ds4 ~255-330 s)
  case "$1" in
    ck)     run "python3 deploy/device/check_ds4.py --only decode,prefix --out $W/ck > $W/ck.log 2>&1" ;;
    cuda)   run "python3 deploy/device/check_cuda.py --only invariance,batch,recycle > $W/cuda.log 2>&1" ;;
    mmq)    run "python3 deploy/device/check_gluon_mmq.py --types MXFP4,Q4_K --forms 'gluon GP1 PK,gluon GP1 PK ST3,gluon GP1 PK ST4,gluon GP1 PK ST4 NR168,gluon GP1 PK ST4 NR128' > $W/mmq.log 2>&1" ;;
    caller) ds4 "BETELGEUSE_STORE_SESSION_READER=caller RUN_NAME=caller bash deploy/device/bench_ds4.sh $A" ;;
    thread) ds4 "RUN_NAME=thread bash deploy/device/bench_ds4.sh $A" ;;
    poll)   ds4 "BENCH_MONITOR=poll RUN_NAME=poll bash deploy/device/bench_ds4.sh $A" ;;
    early)  ds4 "RUN_NAME=u-disk-copy-early bash deploy/device/bench_ds4.sh $A --disk-copy-early" ;;
    early-caller) ds4 "BETELGEUSE_STORE_SESSION_READER=caller RUN_NAME=u-early-caller bash deploy/device/bench_ds4.sh $A --disk-copy-early" ;;
    m-off)  ds4 "RUN_NAME=m-no-disk-copy-early bash deploy/device/bench_ds4.sh $A --gpu-marks --no-disk-copy-early" ;;
    m-on)   ds4 "RUN_NAME=m-disk-copy-early bash deploy/device/bench_ds4.sh $A --gpu-marks --disk-copy-early" ;;
    *)      echo "calls.sh: no step $1"; exit 2 ;;
  esac
}
shift
if [ $# -gt 0 ]; then for s in "$@"; do step "$s"; done     # calls.sh N step... : the steps named, in order
else case "$N" in
  1) step ck; step cuda; step mmq ;;             # row 0: host65's default-path change on CUDA; row 2: the ST forms
  2) step caller; step thread; step poll ;;      # row 1 (caller reader against the thread) and gil66's monitor, no marks
  3) step m-off; step m-on ;;                    # row 3 with --gpu-marks: the copy link, achieved
  4) step thread; step early ;;                  # row 3 without marks: TG, host
esac; fi
[ -n "${DRY:-}" ] && exit 0
for f in "$W"/*.log "$W"/*/ds4_summary.md; do
  [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; }
done
pack && echo "packed: $R/call$N.tgz ($(du -h "$R/call$N.tgz" | cut -f1))"
