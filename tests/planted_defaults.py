"""Test-only subjects, one per defect class that the old defaults never reached (issue 32,
"defaults that reach each class"; tests/test_defaults_reach.py). Each is correct, bit for
bit or within its bound, everywhere the old defaults looked, and wrong only where the new
ones look: the top of fp16's and bf16's range, a hidden size with a remainder, a partial
tail tile after full ones, an expert whose rows start past row 0, a second 128-token chunk, a
partial block of a shard's rows after full ones, a sum that is exactly zero, N and K that are
not multiples of 64, rows past 1,024, a corruption on one call in 50, a process group's first call.
Registered through `--plugin tests.planted_defaults`, as a third-party subject would be."""
import torch
import torch.distributed as dist

from ep_harness.inputs import TOP_HEADROOM_BITS
from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold, shard_of_every_rank
from ep_harness.subjects.collective.common import fold_in_order
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher
from tests.planted import split_k, whole_k

VECTOR = 128  # the fold's "vector" width: a kernel walking hidden in blocks of this many
ROW_BLOCK = 16  # the fold's rows per block: a kernel walking a shard's rows in blocks of this many
TILE = 64  # the GEMM's tile height, width and K step
CHUNK = 128  # the dispatcher copies each rank's tokens in chunks of this many
ROW_INDEX = 1024  # the planted GEMM's row index wraps here (10 bits)
RARE = 50  # the planted rare fold corrupts one call in this many


class _Unmodelled(AllGatherFold):
    def order_model(self, backend):  # the verdicts come from the references, not an order model
        return None


@register
class HalfAccumulatorFold(_Unmodelled):
    """The fold, but 16-bit operands are carried in fp16 (a half-precision accumulator):
    exact for bf16 values within fp16's range and a little more precise than bf16 per hop,
    so inside the bound there; bf16 values above 65504 become Inf."""

    name = "planted_fp16_accumulator"
    summary = "all-gather + fold accumulating 16-bit data in fp16"

    def reduce_scatter(self, out, inp, sizes, group):
        if inp.dtype != torch.bfloat16:
            return super().reduce_scatter(out, inp, sizes, group)
        half = torch.empty(out.shape, dtype=torch.float16, device=out.device)
        super().reduce_scatter(half, inp.to(torch.float16), sizes, group)
        out.copy_(half)


@register
class ScaleBeforeSumFold(_Unmodelled):
    """The fold, with a power-of-two scale on the wrong side of the sum: x * 2^4 before the
    add, / 2^4 after (a pre-divide factor applied as a multiplier). Power-of-two scaling is
    exact, so nothing changes unless a scaled value leaves the wire dtype's range."""

    name = "planted_scale_before_sum"
    summary = "all-gather + fold scaling by 16 before the sum and back after it"
    factor = 2.0 ** TOP_HEADROOM_BITS

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp * self.factor, sizes, group)
        out.div_(self.factor)


@register
class RemainderLoopFold(_Unmodelled):
    """The fold, but its remainder loop (the hidden % 128 columns after the last full block)
    rewrites the previous block's last columns there: an index off by one block."""

    name = "planted_remainder_loop"
    summary = "all-gather + fold whose hidden % 128 remainder copies the previous block"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        hidden = out.shape[-1]
        full, rest = hidden // VECTOR * VECTOR, hidden % VECTOR
        if full and rest:
            out[..., full:] = out[..., full - rest:full].clone()


@register
class RowRemainderFold(_Unmodelled):
    """The fold, but a shard's rows go in blocks of 16 and the partial block after full ones
    leaves out rank 0's contribution (a shard of 2 rows, one partial block, is right)."""

    name = "planted_row_remainder"
    summary = "all-gather + fold whose partial 16-row block after full ones drops rank 0"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        if not any(s > ROW_BLOCK and s % ROW_BLOCK for s in sizes):  # the same on every rank: all call or none
            return
        others = inp if torch.distributed.get_rank(group) else torch.zeros_like(inp)
        without_rank_0 = torch.empty_like(out)
        super().reduce_scatter(without_rank_0, others, sizes, group)
        full = out.shape[0] // ROW_BLOCK * ROW_BLOCK
        if full and full < out.shape[0]:
            out[full:] = without_rank_0[full:]


@register
class NegativeZeroFold(_Unmodelled):
    """The fold, but every sum that comes out zero is written as -0.0 (a result negated twice
    on its way out): equal to the right +0.0 as a value, not in its bits."""

    name = "planted_negative_zero_sum"
    summary = "all-gather + fold writing -0.0 for a zero sum"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        out.copy_(torch.where(out == 0, torch.full_like(out, -0.0), out))


@register
class RareRowFlip(_Unmodelled):
    """The fold, but every RARE-th call of rank 1 (counted in its process) adds 1 to the bits
    of its output's last row: a race lost on 2 % of calls. Three repeats seldom reach one."""

    name = "planted_rare_fold"
    summary = "all-gather + fold whose rank 1 output row is 1 ULP off on one call in 50"

    def __init__(self):
        self.calls = 0

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        self.calls += 1
        if dist.get_rank(group) == 1 and self.calls % RARE == 0 and out.shape[0]:
            out[-1].view(torch.int16 if out.element_size() == 2 else torch.int32).add_(1)


@register
class FirstCallOnAGroup(_Unmodelled):
    """The fold, but the first call on each process group (a connection made on it) folds the
    ranks in ascending order, every later call in descending order: within any bound, and the
    same bits call after call on a group that has been used before."""

    name = "planted_first_call_fold"
    summary = "all-gather + fold in another order on a process group's first call"

    def __init__(self):
        self.groups = set()

    def reduce_scatter(self, out, inp, sizes, group):
        parts = shard_of_every_rank(inp, sizes, group)
        world_size = parts.shape[0]
        first = group.group_name not in self.groups
        self.groups.add(group.group_name)
        out.copy_(fold_in_order(parts, range(world_size) if first else range(world_size - 1, -1, -1)))


class _PerExpertRows:
    """A contiguous-layout bf16 GEMM that computes each expert's rows itself."""

    family = "gemm"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        for g, count in enumerate(problem.counts):
            s = problem.starts[g]
            out[s:s + count] = self.rows(problem.a[s:s + count], problem.b[g], s).to(out.dtype)


@register
class TailTileDropsK(_PerExpertRows):
    """Right for every full 64-row tile and for an expert of fewer than 64 rows (one partial
    tile), but a partial tile after full ones leaves out the last 64 K products."""

    name = "planted_gemm_tail_tile"
    summary = "GEMM whose partial tail tile after full tiles drops the last 64 of K"

    def rows(self, a, b, start):
        d = whole_k(a, b)
        full = a.shape[0] // TILE * TILE
        if full and full < a.shape[0]:
            d[full:] = whole_k(a[full:, :-64], b[:, :-64])
        return d


@register
class SplitKPastRowZero(_PerExpertRows):
    """Right to float32 rounding everywhere, but an expert whose rows start past row 0 of A
    sums its two K halves separately: its bits depend on how many rows the experts before
    it hold."""

    name = "planted_gemm_offset_split_k"
    summary = "GEMM that splits K for experts whose rows start past row 0"

    def rows(self, a, b, start):
        return split_k(a, b) if start > 0 else whole_k(a, b)


@register
class SecondChunkOffByOne(TorchAllToAllDispatcher):
    """The torch dispatcher, but each rank's tokens past the first 128 are sent one row late:
    token t of the second chunk carries token t - 1's hidden state."""

    name = "planted_dispatch_second_chunk"
    summary = "dispatcher whose second 128-token chunk is read one row late"

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        sent = x.clone()
        sent[CHUNK:] = x[CHUNK - 1:-1]
        return super().dispatch(sent, topk_idx, topk_weights, cfg, group)


@register
class ColumnTailDropsK(_PerExpertRows):
    """Right for every whole block of 64 columns of N; the columns past the last whole block
    (none where N is a multiple of 64) leave out the last 64 K products."""

    name = "planted_gemm_column_tail"
    summary = "GEMM whose columns past the last whole 64-column block drop the last 64 of K"

    def rows(self, a, b, start):
        d = whole_k(a, b)
        full = b.shape[0] // TILE * TILE
        if full < b.shape[0]:
            d[:, full:] = whole_k(a[:, :-64], b[full:, :-64])
        return d


@register
class PartialKStepDropped(_PerExpertRows):
    """Walks K in steps of 64 and never takes a last, partial step (none where K is a
    multiple of 64)."""

    name = "planted_gemm_k_tail"
    summary = "GEMM that drops the K products past the last whole step of 64"

    def rows(self, a, b, start):
        whole = a.shape[1] // TILE * TILE
        return whole_k(a[:, :whole], b[:, :whole])


@register
class RowIndexWraps(_PerExpertRows):
    """A row index of 10 bits: a row at 1,024 or past in A is computed from the row 1,024
    before it (no output of 1,024 rows or fewer shows it)."""

    name = "planted_gemm_row_index_wraps"
    summary = "GEMM whose rows from 1,024 on read A's row 1,024 before them"

    def run(self, problem, out):
        super().run(problem, out)
        for g, count in enumerate(problem.counts):
            for row in range(max(problem.starts[g], ROW_INDEX), problem.starts[g] + count):
                out[row] = whole_k(problem.a[row - ROW_INDEX:row - ROW_INDEX + 1], problem.b[g])[0].to(out.dtype)

    def rows(self, a, b, start):
        return whole_k(a, b)
