#!/usr/bin/env bash
# The single-H200 verification run, as sent to the lent GPU machine (no network there):
# install the carried DeepGEMM wheels, run the h200 suite and the GPU tests, benchmark the
# fused comparison, and leave everything under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{ nvidia-smi; nvcc --version; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; \
  python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)"; } > "$OUT/machine.txt" 2>&1
python3 -m harness verify --suite "${SUITE:-cases/h200.toml}" --out /tmp/runs > "$OUT/verify.log" 2>&1
echo "verify exit $?" >> "$OUT/verify.log"
cp /tmp/runs/latest/results.jsonl /tmp/runs/latest/environment.json /tmp/runs/latest/report.html "$OUT/" 2>/dev/null
python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
python3 -m harness.bench compare --gib ${GIB:-1 4} > "$OUT/bench-compare.log" 2>&1
tar czf "$OUT/jobs.tgz" -C /tmp/runs/latest jobs 2>/dev/null
