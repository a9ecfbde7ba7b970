"""Test-only subjects with planted faults. Registered through `--plugin tests.planted`
(or a suite's `plugins`), exactly as a third-party subject would be."""
import os
import signal
import time

import torch
import torch.distributed as dist

from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold
from ep_harness.subjects.collective.common import all_gather_single, fold_in_order, offsets
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher
from ep_harness.subjects.gemm.fixed_order_mm import FixedOrderMm
from ep_harness.subjects.moe.composed import ComposedMoE

FAULTY_RANK = 1


def _hang():
    while True:  # a deadlock as the other ranks see it
        time.sleep(1)


def _raise():
    raise RuntimeError("planted failure on rank 1")


def _faulty_on_one_rank(class_name: str, name: str, summary: str, fault, every_rank: bool = False) -> type:
    """The all-gather + fold, but rank FAULTY_RANK (or every rank) runs `fault()` instead of its
    reduce-scatter."""
    def reduce_scatter(self, out, inp, sizes, group):
        if every_rank or dist.get_rank(group) == FAULTY_RANK:
            fault()
        AllGatherFold.reduce_scatter(self, out, inp, sizes, group)

    return register(type(class_name, (AllGatherFold,), {"name": name, "summary": summary,
                                                        "reduce_scatter": reduce_scatter}))


RaisesOnOneRank = _faulty_on_one_rank("RaisesOnOneRank", "planted_raise_on_rank1",
                                      "all-gather + fold that raises on rank 1", _raise)
HangsOnOneRank = _faulty_on_one_rank("HangsOnOneRank", "planted_hang_on_rank1",
                                     "all-gather + fold that never returns on rank 1", _hang)
CrashesOnOneRank = _faulty_on_one_rank("CrashesOnOneRank", "planted_crash_on_rank1",
                                       "all-gather + fold whose rank 1 dies without a Python traceback",
                                       lambda: os._exit(9))
ExitsOnEveryRank = _faulty_on_one_rank("ExitsOnEveryRank", "planted_exit_on_every_rank",
                                       "all-gather + fold whose every rank ends its process with exit code 0",
                                       lambda: os._exit(0), every_rank=True)
SegfaultsOnOneRank = _faulty_on_one_rank("SegfaultsOnOneRank", "planted_segfault_on_rank1",
                                         "all-gather + fold whose rank 1 is killed by SIGSEGV (a crash in native code)",
                                         lambda: os.kill(os.getpid(), signal.SIGSEGV))


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
        self.topk_idx, self.per_rank = topk_idx, cfg.num_experts // dist.get_world_size(group)
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


# Non-finite outputs: each wraps a correct subject and writes one NaN or +Inf into its
# output (rank 1's, where there are ranks). A bounded reference must count it.
POISON_INDEX = 5


def poison(t: torch.Tensor, value: float) -> None:
    t.view(-1)[POISON_INDEX] = value


# family: (base subject, method, where its output is, whether that output is per rank)
_OUTPUTS = {
    "collective": ("all_gather_fold", "reduce_scatter", lambda args, result: args[0], True),
    "gemm": ("torch_mm", "run", lambda args, result: args[1], False),
    "quant": ("torch_fp8_quant", "quantize", lambda args, result: result[1], False),  # float32 scales (e4m3fn has no Inf)
    "dispatch": ("torch_a2a_dispatch", "combine", lambda args, result: result, True),
    "moe": ("composed_moe", "forward", lambda args, result: result[0], True),
}


def _poisoned(family_name: str, value: float):
    """A subclass of the family's correct subject, named planted_<family>_<nan|inf>, that
    writes `value` into one element of its output (rank 1's, where the output is per rank)."""
    from ep_harness import subject as registry

    base_name, method, output, per_rank = _OUTPUTS[family_name]
    base = type(registry.get(base_name))
    label = "nan" if value != value else "inf"
    original = getattr(base, method)

    def poisoned(self, *args):
        result = original(self, *args)
        if not per_rank or dist.get_rank(args[-1]) == 1:  # the group is the last argument
            poison(output(args, result), value)
        return result

    cls = type(f"Poisoned_{family_name}_{label}", (base,), {
        "name": f"planted_{family_name}_{label}", "summary": f"{base_name} with one {label} in its output",
        method: poisoned})
    return register(cls)


for _family in _OUTPUTS:
    for _value in (float("nan"), float("inf")):
        _poisoned(_family, _value)


@register
class LyingMoE(ComposedMoE):
    """Returns zeros and experts no router would choose: once 'router flips' without limit."""

    name = "planted_moe_lie"
    summary = "MoE layer returning zeros and the last k experts for every token"

    def forward(self, partials, weights, params, group):
        out, idx = super().forward(partials, weights, params, group)
        experts = params.num_experts
        wrong = torch.arange(experts - idx.shape[1], experts, device=idx.device).expand_as(idx)
        return torch.zeros_like(out), wrong.clone()


@register
class ReusedBufferCombine(TorchAllToAllDispatcher):
    """Writes every combine into one buffer it keeps, and alternates its summation order
    call by call: a harness that observes views of that buffer sees no change."""

    name = "planted_reused_buffer_combine"
    summary = "combine into one reused buffer, order alternating per call"

    def fold(self, slots, weights, group):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 2:
            slots, weights = slots.flip(1), weights.flip(1)
        acc = super().fold(slots, weights, group)
        buf = getattr(self, "buffer", None)
        if buf is None or buf.shape != acc.shape:
            buf = self.buffer = torch.empty_like(acc)
        buf.copy_(acc)
        return buf


@register
class WeightWritingGemm(SplitKPastThreshold):
    """A correct GEMM that afterwards scales its weight operand in place by 2: with the
    harness's cached weights shared, every later check (and the reference) would see them."""

    name = "planted_writes_weights"
    summary = "GEMM that doubles its weights in place after each call"

    def run(self, problem, out):
        for g, count in enumerate(problem.counts):
            s = problem.starts[g]
            out[s:s + count] = whole_k(problem.a[s:s + count], problem.b[g]).to(out.dtype)
        problem.b.mul_(2)


@register
class ReverseFold(AllGatherFold):
    """All-gather + a fold from rank 0 up: as invariant as the descending fold, with other
    bits. A baseline made with all_gather_fold must see them move (golden bits)."""

    name = "planted_reverse_fold"
    summary = "all-gather + fold in ascending rank order"

    def reduce_scatter(self, out, inp, sizes, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = inp.new_empty((world_size * inp.shape[0], *inp.shape[1:]))
        all_gather_single(gathered, inp.contiguous(), group=group)
        start = offsets(sizes)[rank]
        out.copy_(fold_in_order(gathered.view(world_size, *inp.shape)[:, start:start + sizes[rank]], range(world_size)))

    def order_model(self, backend):
        return None


@register
class ProcessDependentFold(AllGatherFold):
    """Invariant inside a launch (every rank and repeat agree), but its order changes with the
    launch: a stand-in for bits that depend on the process (an allocation, a workspace picked
    at start-up). Launches whose job directory is a first relaunch fold from rank 0 up."""

    name = "planted_process_dependent_fold"
    summary = "all-gather + fold whose order depends on the launch"

    def reduce_scatter(self, out, inp, sizes, group):
        if "-fresh1" not in os.environ.get("EP_HARNESS_JOB_DIR", ""):
            return super().reduce_scatter(out, inp, sizes, group)
        return ReverseFold.reduce_scatter(self, out, inp, sizes, group)


@register
class ScrubbingFold(AllGatherFold):
    """A correct fold that then replaces NaN and +-Inf by finite numbers (nan_to_num), as a
    kernel with a 'safe' epilogue would: given non-finite inputs it hides what the reference
    propagates."""

    name = "planted_scrubbing_fold"
    summary = "all-gather + fold whose output has NaN and Inf scrubbed"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        out.copy_(torch.nan_to_num(out))


RARE_ONE_IN = 50


def rare_corruption(call: int, world: int) -> tuple[bool, int, float]:
    """The planted defect's draw for call `call` (the same on every rank): whether it fires
    (1 in RARE_ONE_IN), on which rank, and where among that rank's rows (a fraction)."""
    import random

    r = random.Random(f"planted rare corruption, call {call}")
    return r.random() < 1.0 / RARE_ONE_IN, r.randrange(world), r.random()


@register
class RareCorruption(TorchAllToAllDispatcher):
    """The torch dispatcher whose combine, on about 1 call in 50 and on one rank, returns one
    token's row with its first element flipped in sign (DeepEP #700: one wrong row on a few
    percent of calls). Its calls are counted per instance, so a launch runs one check of it."""

    name = "planted_rare_corruption"
    summary = "combine that corrupts one row on about 1 call in 50"
    calls = 0

    def combine(self, expert_out, handle, topk_weights, group):
        out = super().combine(expert_out, handle, topk_weights, group)
        call, self.calls = self.calls, self.calls + 1
        fires, rank, where = rare_corruption(call, dist.get_world_size(group))
        if fires and rank == dist.get_rank(group) and out.shape[0]:
            out[int(where * out.shape[0]), 0] = -out[int(where * out.shape[0]), 0] - 1  # never equal to itself
        return out


@register
class SaysWhichRank(FixedOrderMm):
    """fixed_order_mm that notes which rank of its launch computes it, in one-rank-checks.txt
    beside the launch's logs: where the worker dealt a one-rank check (tests/test_verify_cpu.py)."""

    name = "planted_says_which_rank"

    def run(self, problem, out):
        with open(os.path.join(os.environ["EP_HARNESS_JOB_DIR"], "one-rank-checks.txt"), "a") as f:
            f.write(f"{os.environ['RANK']}\n")
        super().run(problem, out)
