#!/usr/bin/env bash
# The next device session's calls (deploy/device/NEXT.md, "The calls"), one per run-tool command:
#
#   bash deploy/device/calls.sh 1      # carry [".whl", "services/pb/betelgeuse"]; results: $OUT/call1.tgz
#   DRY=1 bash deploy/device/calls.sh 2   # print the commands only
#   bash deploy/device/calls.sh 5 ck caller thread   # named steps (step() below), results in $OUT/call5.tgz
#
# Each call installs the wheels where this Python lacks them (as bench_ds4.sh), runs its steps with every output under
# /tmp/calls/N, prints the logs' and summaries' tails, and packs the folder into ONE file, $OUT/callN.tgz: the run tool
# brings back at most 8 files a call, and the benches alone write 9 each. The machine keeps /var/tmp's ds4-flash model
# between calls while it stays warm (the first bench step writes it; the later ones reuse it).
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:?"usage: calls.sh N [step...] (1-4 with no steps: deploy/device/NEXT.md's calls)"}
R=${OUT:-$PWD/.bench-out}             # where the tarball goes (the run tool's $OUT)
W=/tmp/calls/$N
case "$N" in 1|2|3|4|5|6|7|8|9) ;; *) echo "calls.sh: no call $N (1-9: the tarball's number; 1-4 run NEXT.md's calls when no steps follow)"; exit 2 ;; esac
mkdir -p "$W" "$R"
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
# a step named twice in one call gets its own folder (caller, caller-2, ...): gpu-run68's second caller run overwrote
# its first
USED=" "
ds4() {
  local base=$1 n=$1 i=2; shift
  while [ -e "$W/$n" ] || [[ $USED == *" $n "* ]]; do n=$base-$i; i=$((i + 1)); done
  USED="$USED$n "
  run "OUT=$W ROUTING=exact CHECK_STEPS=none TOTAL=$(T) RUN_NAME=$n $*"
}
step() {   # one named step; a call is a list of them (the budget decides how many fit: each bench_ds4 ~255-330 s).
  # `step NAME check` runs nothing: it only refuses a name that is not a step (every name is checked before any step
  # runs: a typo at the end must not cost the steps before it). n: a bench_ds4 step's folder; c: the command
  local n="" c
  case "$1" in
    ck)     c="python3 deploy/device/check_ds4.py --only decode,prefix --out $W/ck > $W/ck.log 2>&1" ;;
    cuda)   c="python3 deploy/device/check_cuda.py --only invariance,batch,recycle > $W/cuda.log 2>&1" ;;
    mmq)    c="python3 deploy/device/check_gluon_mmq.py --types MXFP4,Q4_K --forms 'gluon GP1 PK,gluon GP1 PK ST3,gluon GP1 PK ST4,gluon GP1 PK ST4 NR168,gluon GP1 PK ST4 NR128' > $W/mmq.log 2>&1" ;;
    h2d)    c="python3 deploy/device/h2d_call.py --reps 40 --idle none,sleep:5,spin:5 --slots 13369344 > $W/h2d.log 2>&1" ;;
    sys)    c="python3 deploy/device/hold_latency.py --show > $W/sys.log 2>&1" ;;
    # the same under a 0 µs PM QoS request (hold_latency.py): every core kept out of deep idle while it runs
    h2d-lat) c="python3 deploy/device/hold_latency.py --log $W/h2d-lat.log -- python3 deploy/device/h2d_call.py --reps 40 --idle none,sleep:5,spin:5 --slots 13369344 >> $W/h2d-lat.log 2>&1" ;;
    lat)    n=lat c="python3 deploy/device/hold_latency.py --log $W/lat.log -- bash deploy/device/bench_ds4.sh $A" ;;
    caller) n=caller c="BETELGEUSE_STORE_SESSION_READER=caller bash deploy/device/bench_ds4.sh $A" ;;
    spin)   n=spin c="BETELGEUSE_STORE_SESSION_READER=spin bash deploy/device/bench_ds4.sh $A" ;;
    thread) n=thread c="bash deploy/device/bench_ds4.sh $A" ;;
    poll)   n=poll c="BENCH_MONITOR=poll bash deploy/device/bench_ds4.sh $A" ;;
    early)  n=u-disk-copy-early c="bash deploy/device/bench_ds4.sh $A --disk-copy-early" ;;
    m-off)  n=m-no-disk-copy-early c="bash deploy/device/bench_ds4.sh $A --gpu-marks --no-disk-copy-early" ;;
    m-on)   n=m-disk-copy-early c="bash deploy/device/bench_ds4.sh $A --gpu-marks --disk-copy-early" ;;
    aq)     n=act-quant-auto c="bash deploy/device/bench_ds4.sh $A --act-quant auto" ;;
    *)      echo "calls.sh: no step $1 (the steps: step() in deploy/device/calls.sh)"; exit 2 ;;
  esac
  [ "${2:-}" = check ] && return 0
  if [ -n "$n" ]; then ds4 "$n" "$c"; else run "$c"; fi
}
shift
for s in "$@"; do step "$s" check; done
if [ $# -gt 0 ]; then for s in "$@"; do step "$s"; done     # calls.sh N step... : the steps named, in order
else case "$N" in
  1) step sys; step h2d; step h2d-lat; step thread; step lat ;;   # the cold-wake question (gpu-run68): a copy call
  2) step spin; step thread; step lat; step spin ;;   # after a sleep / a spin, with and without the cores held out of
                                                      #   deep idle; the spinning reader and the held cores against thread
  3) step poll; step thread ;;                   # gil66's monitor: the old polling thread against the NVML child
  4) step aq; step thread ;;                     # row 10: ds4-flash with MXFP4's Gluon MMA (act_quant auto)
esac; fi
[ -n "${DRY:-}" ] && exit 0
for f in "$W"/*.log "$W"/*/ds4_summary.md; do
  [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; }
done
pack && echo "packed: $R/call$N.tgz ($(du -h "$R/call$N.tgz" | cut -f1))"
