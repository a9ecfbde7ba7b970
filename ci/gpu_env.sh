# Sourced by the GPU run scripts (no network on the lent machines): multicast kept off,
# the carried wheels (.whl/, e.g. DeepGEMM) installed into /tmp/site, and the repository
# on PYTHONPATH (its ep_harness/ makes `python3 -m ep_harness` import harness/: docs/namespace.md). The copied tree has no .git: pass EP_HARNESS_COMMIT=<sha> to record which
# commit ran.
OUT=${OUT:-/tmp/gpu-run-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  stamp="/tmp/site/.installed-$(ls .whl/*.whl | sha1sum | cut -c1-12)"  # once per machine, not per script
  [ -e "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch "$stamp"; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
