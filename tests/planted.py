"""Test-only subjects with planted faults. Registered through `--plugin tests.planted`
(or a suite's `plugins`), exactly as a third-party subject would be."""
import os
import time

import torch
import torch.distributed as dist

from harness.subject import register
from harness.subjects.collective.all_gather_fold import AllGatherFold
from harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher

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


def whole_k(a, b):
    """Rows of a @ b.T summed in float64, rounded once: the same bits whatever M is."""
    return (a.double() @ b.double().T).float()


def split_k(a, b):
    """The two K halves summed separately, each rounded to float32 before the final add."""
    half = a.shape[1] // 2
    return whole_k(a[:, :half], b[:, :half]) + whole_k(a[:, half:], b[:, half:])


@register
class SplitKPastThreshold:
    """A GEMM whose output for a row depends on how many rows share its expert: past
    SPLIT_K_ROWS it sums the two K halves separately (a split-K that kicks in with M)."""

    name = "planted_split_k"
    family = "gemm"
    summary = "GEMM that switches to split-K past 64 rows"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        for g, count in enumerate(problem.counts):
            s = problem.starts[g]
            a, b = problem.a[s:s + count], problem.b[g]
            d = split_k(a, b) if count > SPLIT_K_ROWS else whole_k(a, b)
            out[s:s + count] = d.to(out.dtype)


@register
class ArrivalOrderCombine(TorchAllToAllDispatcher):
    """The torch dispatcher, but its combine sums in arrival order: the local rank's
    expert outputs first, then the next ranks' round the ring. The order now depends on
    which rank the token sits on."""

    name = "planted_arrival_order_combine"
    summary = "combine that sums in arrival order"

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        self.topk_idx, self.per_rank = topk_idx, cfg["num_experts"] // dist.get_world_size(group)
        return super().dispatch(x, topk_idx, topk_weights, cfg, group)

    def fold(self, slots, weights, group):
        rank, world, k = dist.get_rank(group), dist.get_world_size(group), weights.shape[1]
        hops = (self.topk_idx // self.per_rank - rank) % world  # arrival: this rank first
        hops = torch.where(self.topk_idx >= 0, hops, world)
        order = torch.sort(hops * k + torch.arange(k), dim=1).indices
        reordered = torch.gather(slots, 1, order.unsqueeze(-1).expand_as(slots))
        return super().fold(reordered, torch.gather(weights, 1, order), group)


@register
class SpawnsAndHangs(AllGatherFold):
    name = "planted_spawn_and_hang"
    summary = "all-gather + fold whose ranks start a child process, then never return"

    def reduce_scatter(self, out, inp, sizes, group):
        import subprocess

        child = subprocess.Popen(["sleep", "1000"])  # a process the subject spawned
        pid_dir = os.environ.get("EP_TEST_CHILD_PIDS")
        if pid_dir:
            with open(os.path.join(pid_dir, f"child-{os.getpid()}"), "w") as f:
                f.write(str(child.pid))
        while True:
            time.sleep(1)


@register
class CountsItsSetups(AllGatherFold):
    name = "planted_setup_counter"
    summary = "all-gather + fold that records how often its per-launch setup ran"

    def setup(self, ctx):
        self.setups = getattr(self, "setups", 0) + 1
        self.group_size = dist.get_world_size(ctx.group)  # an engine would build its parallel state here

    def reduce_scatter(self, out, inp, sizes, group):
        if self.setups != 1 or self.group_size != dist.get_world_size(group):
            raise RuntimeError(f"setup ran {self.setups} times in this launch")
        super().reduce_scatter(out, inp, sizes, group)
