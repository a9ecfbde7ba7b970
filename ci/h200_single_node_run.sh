#!/usr/bin/env bash
# The single-node NCCL run on the one lent H200 (no network there):
#   NCCL_BUILD=.nccl/nccl-2.30.7-sm90.tar.xz bash ci/h200_single_node_run.sh
# installs the carried NCCL build in place of torch's (ci/use_nccl.sh), records what NCCL
# computes for seeded inputs with the ranks as one node (ci/nccl_record.py --emulate
# single-node: the fixtures of tests/test_nccl_single_node.py), then runs
# cases/h200-single-node.toml with 8 ranks as one node and, for the side-by-side table, as
# emulated hosts. Everything lands under $OUT: machine.txt, *.tgz, run.log.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
bash ci/use_nccl.sh "${NCCL_BUILD:?set NCCL_BUILD to a ci/build_nccl.sh archive}" >> "$OUT/run.log" 2>&1 || exit 1
{ date -u; nvidia-smi; nproc; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, 'compiled NCCL', torch.cuda.nccl.version())"; \
  python3 -c "from ep_harness.nccl import library; print('loaded NCCL', library.loaded().to_dict())"; } > "$OUT/machine.txt" 2>&1
log "recording (${RECORD_CONFIGS:=pins rsring free treefree treech1})"
python3 ci/nccl_record.py /tmp/rec --emulate single-node --configs $RECORD_CONFIGS --world-sizes 4 8 >> "$OUT/run.log" 2>&1
tar -C /tmp --exclude="*.pt" -czf "$OUT/recordings.tgz" rec  # logs and digests: the fixtures need no outputs
for mode in ${MODES:-single-node hosts}; do
  mode_checks=CHECKS_${mode//-/_}; CHECKS=${!mode_checks:-}  # e.g. CHECKS_single_node="--check ar-ring-unpinned"
  log "verify --emulate $mode $CHECKS"
  start=$(date +%s)
  timeout "${VERIFY_TIMEOUT_S:-240}" python3 -m ep_harness verify --suite cases/h200-single-node.toml --gpus "${RANKS:-8}" \
    --emulate "$mode" --out "/tmp/runs-$mode" ${CHECKS:-} > "/tmp/verify-$mode.log" 2>&1
  log "verify --emulate $mode exit $? after $(( $(date +%s) - start )) s"
  latest="/tmp/runs-$mode/latest"
  cp "/tmp/verify-$mode.log" "$latest/" 2>/dev/null
  (cd "$latest" && tar czf "$OUT/$mode.tgz" results.jsonl environment.json report.html "verify-$mode.log" \
     jobs/*/nccl-rank0*.log jobs/*/torchrun-*.log 2>/dev/null) || tar -C /tmp -czf "$OUT/$mode.tgz" "verify-$mode.log"
done
log done
