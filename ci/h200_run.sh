#!/usr/bin/env bash
# The single-H200 verification run, as sent to the lent GPU machine (no network there):
# install the carried DeepGEMM wheels, run the h200 suite twice against one DeepGEMM kernel
# cache (empty on a fresh machine: "cold", then "warm"), run the GPU tests, and leave
# everything under $OUT. BENCH=1 also benchmarks the fused comparison.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{ date -u; nvidia-smi; nproc; nvcc --version; \
  python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; \
  python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)"; } > "$OUT/machine.txt" 2>&1
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/ep-harness-deep-gemm-cache}
echo "DG_JIT_CACHE_DIR=$DG_JIT_CACHE_DIR holds $(find "$DG_JIT_CACHE_DIR" -type f 2>/dev/null | wc -l) files before the cold pass" \
  >> "$OUT/machine.txt"
for pass in cold warm; do
  start=$(date +%s.%N)
  python3 -m ep_harness verify --suite "${SUITE:-cases/h200.toml}" --out "/tmp/runs-$pass" > "$OUT/verify-$pass.log" 2>&1
  code=$?
  echo "verify ($pass) exit $code after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s wall" >> "$OUT/verify-$pass.log"
  mkdir -p "$OUT/$pass"
  cp "/tmp/runs-$pass/latest/results.jsonl" "/tmp/runs-$pass/latest/environment.json" "$OUT/$pass/" 2>/dev/null
done
cp /tmp/runs-warm/latest/report.html "$OUT/" 2>/dev/null
python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
if [ "${BENCH:-0}" = 1 ]; then python3 -m ep_harness.cost.bench compare --gib ${GIB:-1 4} > "$OUT/bench-compare.log" 2>&1; fi
