#!/usr/bin/env bash
# Issue 37 on one H200, in one device call: tune triton_bi_matmul's tiles (bit-identity of every
# candidate first, then L2-warm and L2-cold timing against cuBLAS, DeepGEMM and
# batch_invariant_ops), the triton_bi_matmul GPU tests, the cost bench with the tiles the tuner
# chose, and the h200-cost suite's verdicts. Carry .whl (DeepGEMM and its needs) and .bio (a source snapshot
# of thinking-machines-lab/batch_invariant_ops). Everything lands in $OUT, in at most
# 8 files (the device's limit): one log, environment.txt and the steps' own outputs.
#   run on the device:  STEPS="tune tests bench verify nccl" bash ci/h200_cost_run.sh
#   one shape's tiles:  TUNE_SHAPES="2048x7168" STEPS="tune bench" bash ci/h200_cost_run.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -d .bio/batch_invariant_ops ] && export PYTHONPATH=$PWD/.bio:$PYTHONPATH
export DG_JIT_CACHE_DIR=/tmp/dg-cache
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)" 2>&1 | tail -1
  python3 -c "import batch_invariant_ops as b; print('batch_invariant_ops', b.__version__, b.__file__)" 2>&1 | tail -1
} > "$OUT/environment.txt" 2>&1
for step in ${STEPS:-tune tests bench verify}; do
  start=$(date +%s)
  case $step in
    # TUNE_SHAPES="2048x7168 ...": tune those only (the table keeps the others' entries)
    tune)  python3 -m ep_harness.cost.tune_bi_matmul --out "$OUT/tune" \
             ${TUNE_SHAPES:+$(printf -- '--shape %s ' $TUNE_SHAPES)} >> "$OUT/run.log" 2>&1
           [ -s "$OUT/tune/bi_matmul_tiles.json" ] && cp "$OUT/tune/bi_matmul_tiles.json" harness/kernels/ ;;
    bench) python3 -m ep_harness.cost.bench_gemm_cost --sections dense --budget-s "${BENCH_BUDGET:-300}" \
             --out "$OUT/cost" >> "$OUT/run.log" 2>&1 ;;
    verify) python3 -m ep_harness verify --suite cases/h200-cost.toml --out "$OUT/verify" --no-report \
             >> "$OUT/run.log" 2>&1 ;;
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_triton_matmul.py tests/test_cost.py \
             >> "$OUT/run.log" 2>&1 ;;
    # the harness itself on NCCL: smoke checks on 4 ranks sharing the GPU (emulated hosts)
    nccl)  timeout "${NCCL_BUDGET:-150}" python3 -m ep_harness verify --suite smoke --gpus 4 --emulate-hosts \
             --check 'ag-fold/*' --check 'rs-native/rank-invariance/*' --check 'dispatch-a2a/reference/*' \
             --no-report --out "$OUT/nccl" >> "$OUT/run.log" 2>&1 ;;
  esac
  echo "$step: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/environment.txt" "$OUT/run.log"
done
