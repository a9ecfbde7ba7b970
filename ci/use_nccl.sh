#!/usr/bin/env bash
# Make torch load another NCCL: replace torch's own libnccl.so.2 (the file its libraries are
# linked against) with a build's, keeping the original beside it; `--undo` puts it back.
#
#   ci/use_nccl.sh BUILD.tar.xz | BUILD_DIR     (a ci/build_nccl.sh archive, or a dir with lib/)
#   ci/use_nccl.sh --undo
#
# Why a replacement and not LD_PRELOAD: a preloaded NCCL receives the calls, but torch's copy
# is mapped too; DeepEP v2 refuses a process with two NCCLs, and the harness records an
# `error` for ranks whose loaded NCCL is ambiguous (harness/nccl/library.py). Meant for
# throw-away machines (the lent GPU machine) or a virtual environment of its own.
set -euo pipefail
torch_nccl=$(python3 - <<'PY'
import os, torch  # noqa: F401  (maps torch's libnccl)
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if os.path.basename(path).startswith("libnccl.so"):
        print(os.path.realpath(path)); break
PY
)
[ -n "$torch_nccl" ] || { echo "use_nccl: this torch maps no libnccl (a CPU build?)" >&2; exit 2; }
if [ "${1:-}" = "--undo" ]; then
  [ -f "$torch_nccl.orig" ] || { echo "use_nccl: nothing to undo ($torch_nccl.orig missing)" >&2; exit 2; }
  mv -f "$torch_nccl.orig" "$torch_nccl"; echo "use_nccl: restored $torch_nccl"; exit 0
fi
build=${1:?usage: ci/use_nccl.sh BUILD.tar.xz|BUILD_DIR, or --undo}
if [ -f "$build" ]; then
  dir=$(mktemp -d); tar -C "$dir" -xJf "$build"; build=$dir/build
fi
lib=$(ls "$build"/lib/libnccl.so.2.* 2>/dev/null | head -n 1)
[ -n "$lib" ] || { echo "use_nccl: no lib/libnccl.so.2.* under $build" >&2; exit 2; }
[ -f "$torch_nccl.orig" ] || cp -p "$torch_nccl" "$torch_nccl.orig"
cp -f "$lib" "$torch_nccl"
echo "use_nccl: $torch_nccl is now $(basename "$lib") (original kept as $torch_nccl.orig)"
echo "NCCL_ROOT=$build"
