#!/usr/bin/env bash
# Same bits and speed as an older tree, side by side in one run on the GPU machine (issue 20: the house moved, the
# engine must not have changed).
#
#   bash deploy/device/compare_old.sh OLD_DIR [bits|speed|all]     (results under $OUT)
#
# OLD_DIR holds an older checkout with its generated services/pb (e.g. `git archive 7499059 | tar -x -C .old`,
# then services/pb/betelgeuse copied in; carry it). bits: `logits` of one 270-token sequence through both
# processes on CUDA, 5+15 slots and all-VRAM, old vs new vs the reference model (bit-identical expected). speed:
# each tree's `bench` on the same 8-layer bench-geometry model (auto slots, 512-token prompt, 64 decoded tokens),
# one after the other on the same disk and GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OLD=$(cd "$1" && pwd)
what=${2:-all}
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/var/tmp/betelgeuse-compare}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import gguf, grpc" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
fi
SITE=/tmp/site
new() { (cd "$ROOT" && PYTHONPATH=$SITE:$ROOT python3 -m services.cli "$@"); }
old() { (cd "$OLD" && PYTHONPATH=$SITE:$OLD python3 -m betelgeuse.cli "$@"); }

if [ "$what" = bits ] || [ "$what" = all ]; then
  M=$WORK/small.gguf
  [ -f "$M" ] || new synth "$M" --preset small --no-progress >/dev/null || exit 3
  ids=$(python3 -c "import random;r=random.Random(3);print(','.join(str(r.randrange(10,500)) for _ in range(270)))")
  new logits "$M" --device cuda --dtype bfloat16 --engine reference --token-ids "$ids" -o "$WORK/ref.npy" >/dev/null
  for slots in "5 15" "64 0"; do
    set -- $slots
    tag=v$1h$2
    new logits "$M" --device cuda --dtype bfloat16 --vram-slots "$1" --host-slots "$2" --token-ids "$ids" \
      -o "$WORK/new-$tag.npy" >/dev/null 2>"$WORK/new-$tag.err" || { echo "new logits $tag failed"; tail -3 "$WORK/new-$tag.err"; }
    old logits "$M" --device cuda --dtype bfloat16 --vram-slots "$1" --host-slots "$2" --token-ids "$ids" \
      -o "$WORK/old-$tag.npy" >/dev/null 2>"$WORK/old-$tag.err" || { echo "old logits $tag failed"; tail -3 "$WORK/old-$tag.err"; }
  done
  python3 - "$WORK" <<'EOF' | tee "$OUT/compare_bits.txt"
import sys, numpy as np, pathlib
w = pathlib.Path(sys.argv[1]); ref = np.load(w / "ref.npy")
for tag in ("v5h15", "v64h0"):
    for who in ("new", "old"):
        p = w / f"{who}-{tag}.npy"
        if not p.exists():
            print(f"{who} {tag}: missing"); continue
        a = np.load(p)
        print(f"{who} {tag}: bit-identical to the reference: {np.array_equal(a, ref)} (max |diff| {np.abs(a - ref).max():.3g})")
    if (w / f"new-{tag}.npy").exists() and (w / f"old-{tag}.npy").exists():
        print(f"new == old {tag}: {np.array_equal(np.load(w / f'new-{tag}.npy'), np.load(w / f'old-{tag}.npy'))}")
EOF
fi

if [ "$what" = speed ] || [ "$what" = all ]; then
  args=(--preset bench --layers 8 --slots auto --prompts 512 --decode 64 --time-budget 100 --work-dir "$WORK")
  for who in new old; do
    echo "== $who bench ${args[*]}"
    if [ $who = new ]; then
      (cd "$ROOT" && PYTHONPATH=$SITE:$ROOT timeout 200 python3 -m services.bench.cli "${args[@]}" --out "$OUT/$who" \
        --run-name $who >"$WORK/$who-bench.log" 2>&1)
    else
      (cd "$OLD" && PYTHONPATH=$SITE:$OLD timeout 200 python3 -m betelgeuse.bench.cli "${args[@]}" --out "$OUT/$who" \
        --run-name $who >"$WORK/$who-bench.log" 2>&1)
    fi
    echo "exit $?"; tail -n 4 "$WORK/$who-bench.log"
    cat "$OUT/$who/$who/bench.md" 2>/dev/null | head -30
  done
fi
