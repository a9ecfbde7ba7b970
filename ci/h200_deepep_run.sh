#!/usr/bin/env bash
# DeepEP on the lent H200 (no network there): cases/h200-deepep.toml with 8 NCCL ranks sharing
# the GPU as emulated hosts (world sizes 1, 2, 4, 8). DeepEP must already import: build it from
# its source for this torch (docs/gpu.md), put its build directory on PYTHONPATH and say
# what it is in EP_HARNESS_DEEPEP_VERSION (recorded in every record and in environment.json).
# Leaves the records, report, terminal table and NCCL logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import deep_ep" 2>/dev/null || { echo "h200_deepep_run.sh: deep_ep does not import; build DeepEP and put it on PYTHONPATH" >&2; exit 2; }
: "${EP_HARNESS_DEEPEP_VERSION:?say which DeepEP this is, e.g. EP_HARNESS_DEEPEP_VERSION='v1.2.1 (9af0e0d), intranode only'}"
export EP_HARNESS_DEEPEP_VERSION
start=$(date +%s)
python3 -m ep_harness verify --suite "${SUITE:-cases/h200-deepep.toml}" --gpus "${RANKS:-8}" --emulate-hosts \
  --out /tmp/deepep-runs > "$OUT/verify.log" 2>&1
echo "verify exit $? after $(( $(date +%s) - start )) s" >> "$OUT/verify.log"
cp /tmp/deepep-runs/latest/results.jsonl /tmp/deepep-runs/latest/environment.json /tmp/deepep-runs/latest/report.html \
  "$OUT/" 2>/dev/null
(cd /tmp/deepep-runs/latest && tar czf "$OUT/nccl-logs.tgz" jobs/*/nccl-rank0*.log jobs/*/torchrun-*.log 2>/dev/null)
