"""This project's batch-invariant dense matmul (harness/kernels/bi_matmul.py) as a GEMM subject.

The fix for cuBLAS's batch variance on the dense projections that are not grouped GEMMs
(attention, shared experts, LM head): K walked in one fixed order for every output element at
every M (a split-K count, where there is one, fixed by N and K); the tiles follow M (a tuned
table) without changing that order. The table may hand an M of an unsplit walk to DeepGEMM's
BF16 dense GEMM, whose kernel walks K the same way (measured bit-identical before it is used).
"""
import importlib

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported


@register
class TritonBiMatmul:
    name = "triton_bi_matmul"
    family = "gemm"
    summary = ("batch-invariant Triton matmul (one K walk per N, K, dtype, split-K fixed by N and K; tiles by M; "
               "DeepGEMM's kernel where the table routes an M and its bits match)")
    layouts = ("dense",)
    dtypes = ("bfloat16", "float32")

    def unavailable(self, platform, params):
        reason = unsupported(self, params)
        if reason:
            return reason
        if platform.device != "cuda":
            return ("needs a CUDA GPU; this run is on the CPU (Triton's interpreter computes bf16 "
                    "wrongly and truncates fp32 -> bf16, so it is no stand-in)")
        if _kernel().triton is None:
            return "triton cannot be imported; pip install 'ep-harness[gpu]'"
        return None

    def compiles_kernels(self, params):  # Triton compiles one kernel per (N, K, dtype) on first use
        return True

    def run(self, problem, out):
        _kernel().bi_matmul(problem.a, problem.b, out=out)


def _kernel():
    """harness/kernels/bi_matmul.py, imported where a check may run it (a GPU): it imports
    triton (0.25 CPU-s), which a CPU run never needs, in every process that registers this
    subject (the command and each launch's agent)."""
    return importlib.import_module("ep_harness.kernels.bi_matmul")
