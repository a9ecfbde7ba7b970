"""A test-only GEMM whose bits depend on its thread count, as oneDNN's bf16 torch.mm does on
an Intel Xeon with AMX (batch-variant on one thread, invariant on two: docs/threads.md),
which this AMD machine cannot show. Registered through `--plugin tests.planted_threads`."""
import torch

from ep_harness.subject import register
from ep_harness.subjects.gemm.fixed_order_mm import fixed_order_product
from tests.planted import split_k

ROWS = 128  # from this many rows per expert, on one thread, the K halves are summed apart


@register
class ThreadVariantMm:
    """Fixed-order sums (invariant) on two or more threads; on one thread an expert of ROWS
    rows or more is summed as two K halves, so a row's bits depend on its expert's size."""

    name = "planted_thread_variant_mm"
    family = "gemm"
    summary = "GEMM batch-variant on one thread only (a oneDNN AMX stand-in)"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        one_thread = torch.get_num_threads() == 1
        for g, count in enumerate(problem.counts):
            if count == 0:
                continue
            s = problem.starts[g]
            a, b = problem.a[s:s + count], problem.b[g]
            out[s:s + count].copy_(split_k(a, b) if one_thread and count >= ROWS else fixed_order_product(a, b))
