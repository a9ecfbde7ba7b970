"""Test-only subjects for the verdict rules (issue 32): measured differences that the
order-sensitivity estimate says no reordering could make, outputs never written, and inputs
overwritten. Registered through `--plugin tests.planted_verdicts` (tests/cases/verdicts.toml),
exactly as a third-party subject would be. None of them has an order model: their counts are
measured, not predicted, so only the verdict rule decides."""
import torch
import torch.distributed as dist

from ep_harness.reference import quant as ref_quant
from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher
from ep_harness.subjects.gemm.torch_mm import TorchMm
from ep_harness.subjects.quant.torch_fp8 import TorchFp8Quant

NEGATIVE_ZERO_ROWS = 8  # shards of more rows than this write their zero sums as -0.0
SCALE_BATCH = 8  # batches of more rows than this get scales twice too large


class _Unmodelled(AllGatherFold):
    def order_model(self, backend):
        return None


@register
class OneUlpOnRank1(_Unmodelled):
    """Correct fold, but rank 1 adds 1 to every output's bits: 1 ULP off, on one rank."""

    name = "planted_ulp_on_rank1"
    summary = "all-gather + fold whose rank 1 output is 1 ULP off"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        if dist.get_rank(group) == 1:
            bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32)
            bits.add_(1)


@register
class NegativeZeroInLargeShards(_Unmodelled):
    """Correct fold, but a shard of more than NEGATIVE_ZERO_ROWS rows writes its zero sums
    as -0.0: equal as values, different bits, and only once the batch is large."""

    name = "planted_negative_zero"
    summary = "all-gather + fold writing -0.0 for zero sums in large shards"

    def reduce_scatter(self, out, inp, sizes, group):
        super().reduce_scatter(out, inp, sizes, group)
        if sizes[dist.get_rank(group)] > NEGATIVE_ZERO_ROWS:
            out.copy_(torch.where(out == 0, torch.full_like(out, -0.0), out))


@register
class BatchScaledUe8m0(TorchFp8Quant):
    """A quantizer whose scales double once the batch holds more than SCALE_BATCH rows (a
    kernel switching to another amax reduction): with UE8M0 both scales are powers of two,
    so no division-vs-reciprocal path differs and the sensitivity estimate is 0."""

    name = "planted_batch_scaled_ue8m0"
    summary = "FP8 quantizer whose UE8M0 scales double past 8 rows"

    def quantize(self, x, ue8m0):
        q, s = super().quantize(x, ue8m0)
        if x.shape[0] <= SCALE_BATCH:
            return q, s
        s = s * 2
        groups = x.float().view(x.shape[0], -1, 128) / s.unsqueeze(2)
        return groups.to(torch.float8_e4m3fn).view(x.shape), s


@register
class ZeroesItsA(TorchMm):
    """torch.mm per expert, then A zeroed (an engine reusing its activation buffer)."""

    name = "planted_gemm_zeroes_a"
    summary = "torch.mm that zeroes its A operand after computing"

    def run(self, problem, out):
        super().run(problem, out)
        problem.a.zero_()


@register
class WritesRoundTripIntoX(TorchAllToAllDispatcher):
    """The torch dispatcher, but it quantizes x to FP8 in place: x holds its FP8 round trip."""

    name = "planted_dispatch_writes_x"
    summary = "dispatcher that writes its FP8 round trip back into x"

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        received = super().dispatch(x, topk_idx, topk_weights, cfg, group)
        q, s = ref_quant.quantize_per_token_group(x.cpu(), 128, ue8m0=cfg.ue8m0)
        x.copy_(ref_quant.dequantize_per_token_group(q, s).to(x.dtype))
        return received


@register
class CombineNeverWrites(TorchAllToAllDispatcher):
    """The torch dispatcher, but its combine returns a buffer it allocated and never wrote:
    under deterministic algorithms torch fills it with NaN, the same NaN in every copy."""

    name = "planted_combine_never_writes"
    summary = "combine returning an allocated, unwritten buffer"

    def combine(self, expert_out, handle, topk_weights, group):
        return torch.empty_like(super().combine(expert_out, handle, topk_weights, group))


# The README's "Adding a subject" example, as written there: its body is `...`, so it writes
# nothing (tests/test_verdict_rules.py runs it with the README's case).
@register
class MyReduceScatter:
    name, family, summary = "my_reduce_scatter", "collective", "my engine's TP reduce-scatter"

    def unavailable(self, platform, params):   # None, or why it cannot run here
        if params.shards != "even":             # params: ep_harness.params.CollectiveParams
            return "my_reduce_scatter takes equal shards only"
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        ...

    def order_model(self, backend):
        return None
