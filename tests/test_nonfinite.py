"""Non-finite values never pass, in every family: IEEE comparisons with NaN are false, so a
bounded comparison must count NaN and Inf itself; bitwise comparisons compare bit patterns."""
import math

import pytest
import torch

from ep_harness.compare import compare_bitwise
from ep_harness.measurement import Bound, Measurement
from ep_harness.reports.text import mismatch_text

FAMILIES = ("collective", "gemm", "quant", "dispatch", "moe")


def test_a_nan_or_inf_is_a_bounded_mismatch_and_its_kind_is_counted():
    exact = torch.tensor([1.0, 2.0, 3.0, -math.inf, math.nan, math.inf, 4.0], dtype=torch.float64)
    got = torch.tensor([1.0, math.nan, math.inf, -math.inf, math.nan, 5.0, -math.inf], dtype=torch.float64)
    m = Measurement.within(got, exact, torch.full_like(exact, 0.5), Bound("|err| <= 0.5"))
    # NaN for 2, +Inf for 3, -Inf for 4 and a lost Inf are mismatches; -Inf == -Inf and NaN == NaN are not
    assert (m.mismatched, m.total, m.held) == (4, 7, False)
    assert m.nonfinite == {"nan": 1, "+inf": 1, "-inf": 1, "reference_nonfinite": 1}
    assert m.max_abs == "inf" and m.error_vs_reference == "inf"  # never 'nan' where a count is due


def test_finite_outputs_are_judged_by_the_bound_alone():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    m = Measurement.within(torch.tensor([1.25, 2.0], dtype=torch.bfloat16), exact, torch.full_like(exact, 0.5),
                           Bound("x"))
    assert (m.mismatched, m.nonfinite, m.max_abs) == (0, None, 0.25)


def test_bitwise_counts_signed_zero_and_nan_payload_and_says_so():
    expected = torch.tensor([0.0, math.nan, 1.0, 2.0], dtype=torch.bfloat16)
    actual = expected.clone()
    actual[0] = -0.0
    bits = actual.view(torch.int16)
    bits[1] = bits[1] | 1  # another NaN payload
    actual[3] = math.inf
    m = compare_bitwise(actual, expected)
    assert m.mismatched == 3
    assert m.bit_only == {"signed_zero": 1, "nan_payload": 1}
    assert m.nonfinite == {"+inf": 1}
    assert m.max_abs == "inf"  # an Inf stays infinite, not the largest finite float
    text = mismatch_text({**m.to_dict(), "comparison": "bitwise", "rerun": "x",
                          "detail": {"bit_only": m.bit_only}})
    assert "+0.0 vs -0.0: 1" in text and "another payload: 1" in text and "+Inf where the reference is finite: 1" in text


def test_fp8_bit_patterns_compare_with_nan_counted():
    expected = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    actual = torch.tensor([1.0, math.nan, -0.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    m = compare_bitwise(actual, expected)
    assert (m.mismatched, m.nonfinite, m.bit_only) == (2, {"nan": 1}, {"signed_zero": 1})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_poisoned_output_fails_its_reference_in_every_family(planted_run, family, value):
    """tests/planted.py writes one NaN (one +Inf) into an otherwise correct output, at each call:
    the collective's reference makes two (its layouts of rows_per_rank and tail_rows rows)."""
    (record,) = [r for check, r in planted_run.items() if check.startswith(f"nonfinite-{family}-{value}/")]
    assert record["status"] == "unexpected", record["reason"]
    kind = "nan" if value == "nan" else "+inf"
    assert record["nonfinite"] == {kind: 2 if family == "collective" else 1}
    assert ("NaN" if value == "nan" else "+Inf") + " where the reference is finite" in record["reason"]
    assert record["max_abs"] == "inf"


def test_a_lying_moe_layer_is_not_excused_as_router_flips(planted_run):
    (record,) = [r for check, r in planted_run.items() if check.startswith("moe-lie/")]
    assert record["status"] == "unexpected"
    assert "does not admit" in record["reason"]
    detail = record["detail"]
    assert detail["router_flips"] == detail["tokens"] == 32
    assert detail["tokens_compared"] == detail["tokens"]  # admitted flips are compared too, routed as chosen
    assert record["mismatched"] > 0


def test_a_combine_into_one_reused_buffer_is_caught(planted_run):
    (record,) = [r for check, r in planted_run.items() if check.startswith("reused-buffer/")]
    assert record["status"] == "unexpected" and record["mismatched"] > 0
    assert "1 of 2 repeats differ from the first" in record["reason"]  # k of n, not just whether


def test_a_subject_writing_its_weights_fails_and_cannot_corrupt_later_checks(planted_run):
    """Weights are cached per process; each subject gets its own copy, so the doubled weights
    stay in the subject's copy and the next check reads the original. The subject itself
    fails: its inputs are compared after each call (issue 32), and it changed its weights."""
    writes = {check: r for check, r in planted_run.items() if check.startswith("writes-weights/")}
    assert len(writes) == 2
    for r in writes.values():
        assert r["status"] == "unexpected" and "subject modified its input problem.b" in r["reason"], r["reason"]
    assert planted_run["after-writes-weights/reference"]["status"] == "ok"


def test_non_finite_and_subnormal_inputs_propagate_as_the_reference_does(planted_run):
    """Inputs with NaN, +-Inf (one in 64) or subnormals (one in 16) on request: the fold
    propagates them as the float64 reference does; a fold that scrubs them fails, and the
    reason says the reference was not finite there."""
    folds = {check: r for check, r in planted_run.items() if check.startswith("specials-fold/")}
    assert len(folds) == 2 and {r["status"] for r in folds.values()} == {"ok"}, folds
    (scrubbed,) = [r for check, r in planted_run.items() if check.startswith("specials-scrubbed/")]
    assert scrubbed["status"] == "unexpected"
    assert scrubbed["nonfinite"]["reference_nonfinite"] == scrubbed["mismatched"] > 0
    assert "finite where the reference is not" in scrubbed["reason"]


def test_special_inputs_are_seeded_and_hold_what_they_promise():
    from ep_harness.inputs import values

    x = values((64, 256), torch.bfloat16, 3, "k", data="nonfinite").float()
    assert torch.isnan(x).any() and (x == math.inf).any() and (x == -math.inf).any()
    assert torch.equal(x.nan_to_num(), values((64, 256), torch.bfloat16, 3, "k", data="nonfinite").float().nan_to_num())
    s = values((64, 256), torch.float32, 3, "k", data="subnormal")
    sub = (s != 0) & (s.abs() < torch.finfo(torch.float32).smallest_normal)
    assert 0.03 < sub.float().mean() < 0.1 and torch.isfinite(s).all()
