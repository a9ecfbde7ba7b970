"""Test-only subjects whose bits depend on their thread count: a GEMM as oneDNN's bf16 torch.mm
on an Intel Xeon with AMX (batch-variant on one thread, invariant on two: docs/threads.md),
which this AMD machine cannot show, and a fold whose rows are dealt to threads. Registered
through `--plugin tests.planted_threads`."""
import torch

from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold, shard_of_every_rank
from ep_harness.subjects.collective.common import fold_in_order
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


@register
class RowsSplitOverThreadsFold(AllGatherFold):
    """The fold, its output rows dealt to one part per intra-op thread: the first part folds the
    ranks in ascending order, the others descending. A shard's first row is in the first part
    on every count; its later rows only on one thread."""

    name = "planted_rows_split_over_threads_fold"
    summary = "all-gather + fold whose rows past the first thread's part fold the ranks in reverse"

    def order_model(self, backend):  # the verdicts come from the comparisons, not an order model
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        parts = shard_of_every_rank(inp, sizes, group)
        world_size = parts.shape[0]
        for c, rows in enumerate(torch.arange(parts.shape[1]).tensor_split(torch.get_num_threads())):
            if len(rows):
                order = range(world_size) if c == 0 else range(world_size - 1, -1, -1)
                out[rows] = fold_in_order(parts[:, rows], order)
