#!/usr/bin/env bash
# DeepEP v2 (ElasticBuffer) on the one lent H200, with its ranks as one NCCL node:
#   NCCL_BUILD=.nccl/nccl-2.30.7-sm90.tar.xz DEEPEP_SRC=.deepep bash ci/h200_deepep_v2_run.sh
# DEEPEP_SRC holds source snapshots (carried: no network there): DeepEP-<commit>.tar.gz
# (deepseek-ai/DeepEP, top folder DeepEP/) and fmt-<commit>.tar.gz (fmtlib/fmt as
# DeepEP/third-party/fmt/, the submodule a plain snapshot lacks). Installs the NCCL build in
# place of torch's (DeepEP v2 needs NCCL >= 2.30.4 and one NCCL in the process), builds
# DeepEP from its snapshot against that NCCL (its kernels are JIT-compiled at run time), then
# runs the deepep-v2 checks of cases/h200-corruption.toml with 4 ranks as one node. Logs,
# records and DeepEP's JIT/buffer debug output land under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
nccl_root=$(bash ci/use_nccl.sh "${NCCL_BUILD:?set NCCL_BUILD}" | tee -a "$OUT/run.log" | sed -n 's/^NCCL_ROOT=//p')
[ -n "$nccl_root" ] || exit 1
src=${DEEPEP_SRC:?set DEEPEP_SRC}; mkdir -p /tmp/src
for t in "$src"/DeepEP-*.tar.gz "$src"/fmt-*.tar.gz; do tar -C /tmp/src -xzf "$t"; done
log "building DeepEP against $nccl_root"
(cd /tmp/src/DeepEP && EP_NCCL_ROOT_DIR=$nccl_root TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc) \
   python3 setup.py build_ext --inplace) > "$OUT/build.log" 2>&1
log "build exit $?"
# At run time too: the JIT compiles its kernels with this NCCL's device headers (without it,
# DeepEP falls back to torch's nvidia-nccl headers, another NCCL than the one loaded).
export PYTHONPATH=/tmp/src/DeepEP:$PYTHONPATH EP_NCCL_ROOT_DIR=$nccl_root EP_DISABLE_GIN=1 EP_JIT_DEBUG=1 EP_BUFFER_DEBUG=1
export EP_HARNESS_DEEPEP_VERSION="${EP_HARNESS_DEEPEP_VERSION:-$(ls "$src"/DeepEP-*.tar.gz | sed 's/.*DeepEP-//; s/.tar.gz//') built from source against NCCL $(basename "$(ls "$nccl_root"/lib/libnccl.so.2.*)" | sed 's/libnccl.so.//'), EP_DISABLE_GIN=1}"
python3 -c "import deep_ep; print('deep_ep', deep_ep.__file__, hasattr(deep_ep, 'ElasticBuffer'))" >> "$OUT/run.log" 2>&1
log "verify deepep-v2"
timeout "${VERIFY_TIMEOUT_S:-240}" python3 -m ep_harness verify --suite cases/h200-corruption.toml --gpus 4 \
  --emulate single-node --check "${CHECK:-deepep-v2/*}" --out /tmp/v2runs > "$OUT/verify.log" 2>&1
log "verify exit $?"
(cd /tmp/v2runs/latest 2>/dev/null && tar czf "$OUT/v2-run.tgz" results.jsonl environment.json jobs/*/torchrun-*.log \
   jobs/*/nccl-rank0*.log 2>/dev/null)
