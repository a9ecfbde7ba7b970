#!/usr/bin/env bash
# `--suite h200 --gpus 1` cold then warm, side by side in one device call (issue 25, item 3):
# cold = an empty DeepGEMM kernel cache (a new DG_JIT_CACHE_DIR), so every kernel is
# compiled, in parallel by harness/run/precompile.py beside the launch (the checks needing none
# run meanwhile); warm = the same cache again, where nothing is compiled. Writes
# $OUT/cold_warm.txt: each pass's exit code and wall time, its precompile and launch lines and
# the run's own timing line (how long the checks still spent warming up, i.e. compiling what
# precompile did not, and how long rank 0 waited for the compile), plus both full logs.
# SERIAL=1 adds a third pass, cold with EP_HARNESS_PRECOMPILE=0: the one-at-a-time
# compilation as before, for comparison (about 160 s more).
#   run on the device:  bash ci/h200_cold_warm.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
summary="$OUT/cold_warm.txt"
cache=$(mktemp -d /tmp/ep-harness-dg-cache-XXXXXX)
{ date -u; echo "nproc $(nproc); $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  python3 -c "import deep_gemm, torch; print('deep_gemm', deep_gemm.__version__, 'torch', torch.__version__)"; } \
  > "$summary" 2>&1

one_pass() {  # name, cache dir, extra environment (VAR=value ...)
  local name=$1 dir=$2; shift 2
  local start code wall
  start=$(date +%s.%N)
  env DG_JIT_CACHE_DIR="$dir" "$@" python3 -m ep_harness verify --suite h200 --gpus 1 \
    --out "/tmp/cold-warm-runs-$name" > "$OUT/cold_warm-$name.log" 2>&1
  code=$?
  wall=$(python3 -c "print(round($(date +%s.%N) - $start, 1))")
  { echo; echo "== $name: exit $code, $wall s wall (DG_JIT_CACHE_DIR held $(find "$dir" -name kernel.cubin | wc -l) cubins after)"
    grep -E "^# (compiling DeepGEMM kernels|DeepGEMM kernels|launching)" "$OUT/cold_warm-$name.log"
    grep -E "^# wall " "$OUT/cold_warm-$name.log"
    tail -n 1 "$OUT/cold_warm-$name.log"; } >> "$summary"
}

echo "cold cache: $cache ($(find "$cache" -type f | wc -l) files)" >> "$summary"
one_pass cold "$cache"
one_pass warm "$cache"
if [ "${SERIAL:-0}" = 1 ]; then
  one_pass serial-cold "$(mktemp -d /tmp/ep-harness-dg-cache-XXXXXX)" EP_HARNESS_PRECOMPILE=0
fi
cp /tmp/cold-warm-runs-cold/latest/precompile.log "$OUT/precompile-cold.log" 2>/dev/null
cat "$summary"
