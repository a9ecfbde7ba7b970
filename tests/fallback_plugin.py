"""A silent fallback, planted: a subject that declares DeepGEMM's kernel (it inherits
`kernels()` from the real DeepGEMM subject) but computes with torch.mm. Its numbers are right;
only the proof of path can tell. Registered through `--plugin tests.fallback_plugin`.
tests/test_gpu.py runs it on a GPU, where the record must be an `error`."""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.deepgemm import DeepGemmBf16Contiguous


@register
class DeepGemmFallsBackToTorchMm(DeepGemmBf16Contiguous):
    name = "planted_deepgemm_fallback"
    summary = "declares DeepGEMM's grouped kernel, runs torch.mm per group (a silent fallback)"

    def run(self, problem, out):
        layout = problem.grouped_layout
        for group in range(problem.b.shape[0]):
            rows = layout == group
            out[rows] = torch.mm(problem.a[rows], problem.b[group].t()).to(out.dtype)
