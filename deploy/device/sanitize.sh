#!/usr/bin/env bash
# The CUDA checks under compute-sanitizer's memcheck: every out-of-bounds or misaligned device access, named by
# kernel and source line (gpu-run47 found _decode_attn_kernel reading past the entries this way: on the device it
# had shown only as "an illegal memory access" in whichever check ran after a layout that left nothing mapped there).
# The worker's VRAM budget check is lifted (CHECK_VRAM_BUDGET: memcheck's own device memory is not the worker's).
# memcheck slows kernels ~40x: check_ds4 --only kernel,engine,decode takes ~3 minutes on an H100, check_cuda more
# than 5. Exit 1 if memcheck reports an error or a check fails.
#   bash deploy/device/sanitize.sh [check_ds4.py args ...]      (default: --only kernel,engine,decode)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--only kernel,engine,decode)
export CHECK_VRAM_BUDGET=${CHECK_VRAM_BUDGET:-70000000000}
compute-sanitizer --tool memcheck --print-limit 8 --show-backtrace device --log-file "$OUT/memcheck.txt" \
  python3 deploy/device/check_ds4.py "${args[@]}" > "$OUT/sanitize_checks.txt" 2>&1
rc=$?
errors=$(grep -c 'Invalid __global__\|Invalid __shared__\|Misaligned' "$OUT/memcheck.txt" || true)
grep '^\[' "$OUT/sanitize_checks.txt" | cut -c1-140
echo "sanitize: check rc=$rc, memcheck access errors: $errors ($OUT/memcheck.txt)"
grep -m 8 -A3 'Invalid __global__\|Invalid __shared__\|Misaligned' "$OUT/memcheck.txt"
[ "$rc" -eq 0 ] && [ "$errors" -eq 0 ]
