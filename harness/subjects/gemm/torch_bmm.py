"""torch.bmm over the masked layout [G, max_m, K] x [G, K, N]: every slot, valid or not."""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported


@register
class TorchBmm:
    name = "torch_bmm"
    family = "gemm"
    summary = "torch.bmm over the masked layout"
    layouts = ("masked",)
    dtypes = ("bfloat16", "float32")

    def unavailable(self, platform, params):
        return unsupported(self, params)

    def run(self, problem, out):
        torch.bmm(problem.a, problem.b.transpose(1, 2), out=out)
