"""Red-team review of the default checks (2026-12-07): planted defects that the CPU default
passed as `ok` or `vacuous`, each with the check that now catches it and its control. The
collective's partial row block and negative zero sum are in tests/test_defaults_reach.py (a
default changed there: `tail_rows`); these change what a check compares."""
import torch

from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.measurement import Bound, Measurement
from ep_harness.subjects.quant.torch_fp8 import TorchFp8Quant

BLOCK = 64  # the planted quantizers' rows per block


class ScalesPastBlock(TorchFp8Quant):
    """Right values everywhere; in a batch of more than 64 rows, the rows past the first 64
    carry row 63's scales (a scale buffer indexed per block)."""

    name = "test_scales_past_block"

    def quantize(self, x, ue8m0):
        q, s = super().quantize(x, ue8m0)
        if x.shape[0] > BLOCK:
            s = s.clone()
            s[BLOCK:] = s[BLOCK - 1]
        return q, s


class ScalesUnwrittenPastBlock(TorchFp8Quant):
    """Right values; the scales of rows past the first 64 are never written (NaN here)."""

    name = "test_scales_unwritten_past_block"

    def quantize(self, x, ue8m0):
        q, s = super().quantize(x, ue8m0)
        if x.shape[0] > BLOCK:
            s = s.clone()
            s[BLOCK:] = torch.nan
        return q, s


class ZerosMiddleRows(TorchFp8Quant):
    """Right for one block of 64 rows; in longer inputs the rows between the first block and
    the last row come out zero (a loop over blocks that stops after the first)."""

    name = "test_zeros_middle_rows"

    def quantize(self, x, ue8m0):
        q, s = super().quantize(x, ue8m0)
        if x.shape[0] > BLOCK + 1:
            q = q.clone()
            q[BLOCK:-1] = 0
        return q, s


class ClearsThePreviousInput(TorchFp8Quant):
    """Right results, but each call zeroes the input of the call before it (scratch memory
    reused lazily): every call's own input is intact when that call returns."""

    name = "test_clears_the_previous_input"

    def __init__(self):
        super().__init__()
        self.previous = None

    def quantize(self, x, ue8m0):
        if self.previous is not None:
            self.previous.zero_()
        self.previous = x
        return super().quantize(x, ue8m0)


def _run(subject, prop, one_rank, **params):
    return execute(single_check(subject, prop, {"dtype": "bfloat16", **params}), subject, one_rank)


def test_a_scale_that_moves_with_the_batch_fails_batch_invariance(one_rank):
    for ue8m0 in (False, True):  # power-of-two scales too, whose values' bits cannot move
        m = _run(ScalesPastBlock(), "batch-invariance", one_rank, ue8m0=ue8m0)
        assert not m.held and m.mismatched == m.detail["scale_mismatched"] > 0, (ue8m0, m.mismatched)
        assert m.mismatched <= len([b for b in (1, 7, 64, 1000) if b > BLOCK]) * 2048 // 128  # the probe's scales
        sound = _run(TorchFp8Quant(), "batch-invariance", one_rank, ue8m0=ue8m0)  # control
        assert sound.held and sound.mismatched == 0 and sound.detail["scale_mismatched"] == 0


def test_unwritten_scales_fail_the_invariances_though_every_copy_agrees(one_rank):
    m = _run(ScalesUnwrittenPastBlock(), "run-to-run", one_rank, rows=100)
    assert m.mismatched == 0 and "not finite where the float64 reference is" in m.extra_failure
    assert _run(ScalesUnwrittenPastBlock(), "run-to-run", one_rank, rows=BLOCK).extra_failure is None  # control


def test_the_reference_reaches_rows_past_a_whole_block(one_rank):
    m = _run(ZerosMiddleRows(), "reference", one_rank, ue8m0=True)  # power-of-two scales: one right answer
    assert m.detail["scale_mismatched"] == 0 and m.mismatched > 0 and m.extra_failure  # values, unexplained
    assert _run(ZerosMiddleRows(), "reference", one_rank, ue8m0=True, rows=BLOCK).held  # the old default: one block


def test_an_input_written_after_its_call_returned_is_a_modified_input(one_rank):
    m = _run(ClearsThePreviousInput(), "run-to-run", one_rank)
    assert m.extra_failure == "subject modified its input x (after its call returned) on ranks [0]", m.extra_failure
    assert _run(TorchFp8Quant(), "run-to-run", one_rank).extra_failure is None  # control


def test_an_exact_zero_must_keep_its_sign_where_asked():
    exact = torch.tensor([0.0, 0.0, 1e-30, 2.0], dtype=torch.float64)
    got = torch.tensor([-0.0, 0.0, -0.0, 2.0], dtype=torch.bfloat16)
    bound = torch.full_like(exact, 1e-3)
    m = Measurement.within(got, exact, bound, Bound(rule="test"), zero_signs=True)
    assert (m.mismatched, m.bit_only) == (1, {"signed_zero": 1})  # the zero of a nonzero reference is in bound
    plain = Measurement.within(got, exact, bound, Bound(rule="test"))  # control: a value comparison
    assert plain.held and plain.bit_only is None
