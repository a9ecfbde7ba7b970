#!/usr/bin/env bash
# Build NCCL from a source snapshot for the visible GPU's architecture, and pack the build.
#
#   ci/build_nccl.sh SRC_DIR OUT.tar.xz [SM]
#
# SRC_DIR: a checkout or snapshot of NVIDIA/nccl (e.g. tag v2.30.7); SM: the compute capability
# without the dot (default: the first visible GPU's, from nvidia-smi). Packs build/lib
# (libnccl.so.2.X.Y and its links) and build/include into OUT.tar.xz, which ci/use_nccl.sh
# installs. On the H200 machine (16 cores) it takes about 4 minutes for one architecture.
set -euo pipefail
src=${1:?usage: ci/build_nccl.sh SRC_DIR OUT.tar.xz [SM]}
out=${2:?usage: ci/build_nccl.sh SRC_DIR OUT.tar.xz [SM]}
sm=${3:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.[:space:]')}
[ -f "$src/makefiles/version.mk" ] || { echo "build_nccl: $src is not an NCCL source tree (no makefiles/version.mk)" >&2; exit 2; }
[[ "$sm" =~ ^[0-9]+[a-z]?$ ]] || { echo "build_nccl: no GPU architecture (got '$sm'); pass it, e.g. 90" >&2; exit 2; }
start=$(date +%s)
make -C "$src" -j"$(nproc)" src.build NVCC_GENCODE="-gencode=arch=compute_${sm},code=sm_${sm}" >"${out%.tar.xz}.build.log" 2>&1 \
  || { tail -n 30 "${out%.tar.xz}.build.log" >&2; exit 1; }
tar -C "$src" -cJf "$out" build/lib build/include
echo "build_nccl: $(ls "$src"/build/lib/libnccl.so.2.*) for sm_${sm} in $(( $(date +%s) - start )) s -> $out"
