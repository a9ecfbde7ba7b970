"""torch._grouped_mm over the contiguous layout (each expert's aligned segment is a group)."""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported


@register
class TorchGroupedMm:
    name = "torch_grouped_mm"
    family = "gemm"
    summary = "torch._grouped_mm"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)

    def unavailable(self, platform, params):
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        return unsupported(self, params)

    def run(self, problem, out):
        ends = problem.starts[1:] + [problem.a.shape[0]]
        offs = torch.tensor(ends, dtype=torch.int32, device=problem.a.device)
        out.copy_(torch._grouped_mm(problem.a, problem.b.transpose(-2, -1), offs=offs))
