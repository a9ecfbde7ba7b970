"""torch.mm per expert (cuBLAS on GPUs, the CPU BLAS elsewhere); dense is one torch.mm.

cuBLAS picks its kernel, tile and split-K from the problem size, so a row's bits may
depend on how many rows share its expert: this is what batch-invariance asks.
"""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported


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
        if problem.layout == "dense":
            torch.mm(problem.a, problem.b.t(), out=out)
            return
        for g, count in enumerate(problem.counts):
            if count == 0:
                continue
            if problem.layout == "contiguous":
                s = problem.starts[g]
                torch.mm(problem.a[s:s + count], problem.b[g].t(), out=out[s:s + count])
            else:
                torch.mm(problem.a[g, :count], problem.b[g].t(), out=out[g, :count])
