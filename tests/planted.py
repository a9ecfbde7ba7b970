"""Test-only subjects with planted faults. Registered through `--plugin tests.planted`
(or a suite's `plugins`), exactly as a third-party subject would be."""
import os
import time

import torch.distributed as dist

from harness.subject import register
from harness.subjects.collective.all_gather_fold import AllGatherFold

FAULTY_RANK = 1


@register
class RaisesOnOneRank(AllGatherFold):
    name = "planted_raise_on_rank1"
    summary = "all-gather + fold that raises on rank 1"

    def reduce_scatter(self, out, inp, sizes, group):
        if dist.get_rank(group) == FAULTY_RANK:
            raise RuntimeError("planted failure on rank 1")
        super().reduce_scatter(out, inp, sizes, group)


@register
class HangsOnOneRank(AllGatherFold):
    name = "planted_hang_on_rank1"
    summary = "all-gather + fold that never returns on rank 1"

    def reduce_scatter(self, out, inp, sizes, group):
        if dist.get_rank(group) == FAULTY_RANK:
            while True:  # a deadlock as the other ranks see it
                time.sleep(1)
        super().reduce_scatter(out, inp, sizes, group)


@register
class CrashesOnOneRank(AllGatherFold):
    name = "planted_crash_on_rank1"
    summary = "all-gather + fold whose rank 1 dies without a Python traceback"

    def reduce_scatter(self, out, inp, sizes, group):
        if dist.get_rank(group) == FAULTY_RANK:
            os._exit(9)
        super().reduce_scatter(out, inp, sizes, group)


SPLIT_K_ROWS = 64  # past this many rows per expert the planted GEMM splits K in two


@register
class SplitKPastThreshold:
    """A GEMM whose output for a row depends on how many rows share its expert: past
    SPLIT_K_ROWS it sums the two K halves separately (a split-K that kicks in with M)."""

    name = "planted_split_k"
    family = "gemm"
    summary = "torch GEMM that switches to split-K past 64 rows"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        half = problem.a.shape[1] // 2
        for g, count in enumerate(problem.counts):
            s = problem.starts[g]
            a, b = problem.a[s:s + count].float(), problem.b[g].float()
            if count > SPLIT_K_ROWS:
                d = a[:, :half] @ b[:, :half].T + a[:, half:] @ b[:, half:].T
            else:
                d = a @ b.T
            out[s:s + count] = d.to(out.dtype)
