#!/usr/bin/env bash
# The emulated-hosts NCCL run on the one lent H200 (no network there): install the carried
# DeepGEMM wheels, run cases/h200-emulated.toml with 8 NCCL ranks sharing the GPU (world
# sizes 1, 3, 4, 8), and leave the records, report, terminal table and NCCL logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{ date -u; nvidia-smi; nproc; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; \
  python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)"; } > "$OUT/machine.txt" 2>&1
start=$(date +%s)
python3 -m ep_harness verify --suite "${SUITE:-cases/h200-emulated.toml}" --gpus "${RANKS:-8}" --emulate-hosts \
  --out /tmp/runs > "$OUT/verify.log" 2>&1
echo "verify exit $? after $(( $(date +%s) - start )) s" >> "$OUT/verify.log"
cp /tmp/runs/latest/results.jsonl /tmp/runs/latest/environment.json /tmp/runs/latest/report.html "$OUT/" 2>/dev/null
(cd /tmp/runs/latest && tar czf "$OUT/nccl-logs.tgz" jobs/*/nccl-rank*.log jobs/*/torchrun-*.log 2>/dev/null)
python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
