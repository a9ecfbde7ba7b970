"""torch.mm per expert (cuBLAS on GPUs, the CPU BLAS elsewhere); dense is one torch.mm.

cuBLAS picks its kernel, tile and split-K from the problem size, so a row's bits may
depend on how many rows share its expert: this is what batch-invariance asks.
"""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import each_expert, unsupported


@register
class TorchMm:
    name = "torch_mm"
    family = "gemm"
    summary = "torch.mm per expert (cuBLAS on GPU)"
    layouts = ("contiguous", "masked", "dense")
    dtypes = ("bfloat16", "float32")

    def unavailable(self, platform, params):
        return unsupported(self, params)

    def run(self, problem, out):
        each_expert(problem, out, lambda a, b, o: torch.mm(a, b.t(), out=o))
