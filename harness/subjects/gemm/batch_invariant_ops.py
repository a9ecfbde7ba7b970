"""thinking-machines-lab's `batch_invariant_ops` matmul as a GEMM subject: the reference
design for a batch-invariant matmul (a persistent Triton kernel with one tile configuration
per dtype), measured beside this project's `triton_bi_matmul` in the cost table.

Not a dependency: where the package is importable (pip install from its source,
github.com/thinking-machines-lab/batch_invariant_ops), the subject runs; elsewhere it says so.
"""
from __future__ import annotations

import importlib

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported


def library():
    """The package's module, or ImportError with the reason."""
    return importlib.import_module("batch_invariant_ops")


@register
class BatchInvariantOpsMatmul:
    name = "batch_invariant_ops_matmul"
    family = "gemm"
    summary = "batch_invariant_ops.matmul_persistent (thinking-machines-lab; one tile shape per dtype)"
    layouts = ("dense",)
    dtypes = ("bfloat16", "float32")

    def unavailable(self, platform, params):
        reason = unsupported(self, params)
        if reason:
            return reason
        if platform.device != "cuda":
            return "needs a CUDA GPU (a Triton kernel); this run is on the CPU"
        try:
            library()
        except ImportError as exc:
            return (f"batch_invariant_ops cannot be imported ({exc}); install it from its source: "
                    "pip install git+https://github.com/thinking-machines-lab/batch_invariant_ops")
        return None

    def compiles_kernels(self, params):
        return True

    def product(self, problem):
        """The library's own call (it allocates its output): what the cost table times."""
        return library().matmul_persistent(problem.a, problem.b.t())

    def run(self, problem, out):
        out.copy_(self.product(problem))
