"""A GEMM whose every output element is summed in one fixed order: batch- and
position-invariant by construction, on any CPU, library build and thread count.

D[i, n] = sum over k = 0, 1, ..., K-1 of A[i, k] * B[n, k], accumulated in float64 from k = 0
upward (one elementwise multiply-add per k), then rounded to the output dtype. A product of
two bf16 or float32 values is exact in float64, so a fused multiply-add and a multiply then
an add round alike, and each element is one sequence of IEEE operations on its own values,
whichever vector or scalar path computes it: no other row, no batch size and no thread count
enters its bits. torch.mm gives no such promise: oneDNN's bf16 GEMM on an Intel Xeon with AMX
is batch-variant on one thread and invariant on two (docs/threads.md).

What the CPU default asserts to hold for GEMMs uses this subject; torch.mm and
torch._grouped_mm are measured there (`expect = "measure"`), a fact about this machine's
library. K passes of elementwise work: for the CPU suites' small shapes, not for speed.
"""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.common import each_expert, unsupported


def fixed_order_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = a [M, K] @ b [N, K]^T, each element summed over k in increasing order."""
    # column k of a as [M, 1] and of b as [1, N], contiguous, all K views cut in one call each
    # (the loop's own Python work was half of its time on the CPU suites' shapes)
    a_cols = a.double().t().contiguous().unsqueeze(2).unbind(0)
    b_cols = b.double().t().contiguous().unsqueeze(1).unbind(0)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for a_k, b_k in zip(a_cols, b_cols):  # k = 0, 1, ..., K-1
        acc.addcmul_(a_k, b_k)
    return acc


@register
class FixedOrderMm:
    name = "fixed_order_mm"
    family = "gemm"
    summary = "each element summed over K in one fixed order, in float64 (invariant by construction)"
    layouts = ("contiguous", "masked", "dense")
    dtypes = ("bfloat16", "float32")

    def unavailable(self, platform, params):
        return unsupported(self, params)

    def run(self, problem, out):
        each_expert(problem, out, lambda a, b, o: o.copy_(fixed_order_product(a, b)))
