"""Verdicts that cannot be talked out of a measurement (issue 32): a measured difference is
never `vacuous`, an output never written never passes, a subject's inputs are compared after
each call in every family. The planted subjects are tests/planted_verdicts.py, run through a
real 4-rank gloo launch by tests/cases/verdicts.toml."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from ep_harness.compare import compare_bitwise
from ep_harness.families import driver

from ep_harness.measurement import Measurement
from ep_harness.verdict import decide
from tests.conftest import REPO_ON_PYTHONPATH, _shared_run


def measured(mismatched, total, vacuous=None, **kw):
    return Measurement(comparison="bitwise", mismatched=mismatched, total=total, held=mismatched == 0,
                       vacuous_reason=vacuous, **kw)


HOLDS, CONTROL = SimpleNamespace(expect="holds"), SimpleNamespace(expect="violated")


def test_a_measured_difference_is_never_vacuous_whatever_the_estimate():
    why = "0 of 2,048 probe elements change bits under any reordering of 2 contributions"
    status, reason = decide(HOLDS, measured(2048, 4096, vacuous=why))
    assert status == "unexpected"
    assert reason.startswith("expected to hold, but 2,048 / 4,096 differ: 2,048 in value") and why in reason
    status, reason = decide(CONTROL, measured(2048, 4096, vacuous=why))
    assert status == "ok" and "control shows the violation: 2,048 / 4,096" in reason
    # nothing differed and nothing could have: vacuous, whichever the expectation
    assert decide(HOLDS, measured(0, 4096, vacuous=why)) == ("vacuous", f"could not fail: {why}")
    assert decide(CONTROL, measured(0, 4096, vacuous=why))[0] == "vacuous"


def test_the_reason_names_the_kind_of_difference():
    m = measured(10, 100, bit_only={"signed_zero": 3, "nan_payload": 2}, nonfinite={"+inf": 1})
    status, reason = decide(HOLDS, m)
    assert status == "unexpected"
    assert ": 4 in value, 1 non-finite, 3 signed zeros (+0.0 vs -0.0), 2 NaN payloads" in reason
    assert "1 +Inf where the reference is finite" in reason


def test_the_driver_keeps_its_estimate_but_not_the_vacuous_verdict():
    runs = [driver.Run("rows [2, 2]", (driver.Copy(((2, 2), 0), 0), driver.Copy(((2, 2), 2), 1)), None)]
    m = measured(5, 10, sensitivity=0, sensitivity_what="of 8 probe elements change bits")
    driver.judge_vacuity(m, "rank-invariance", runs)
    assert m.vacuous_reason is None and m.detail["vacuity_estimate"] == "0 of 8 probe elements change bits"
    m = measured(0, 10, sensitivity=0, sensitivity_what="of 8 probe elements change bits")
    driver.judge_vacuity(m, "rank-invariance", runs)
    assert m.vacuous_reason == "0 of 8 probe elements change bits"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_subject_call_finds_unwritten_outputs_and_modified_inputs(dtype):
    log = driver.CallLog()
    token = driver._LOG.set(log)
    try:
        x, out = torch.randn(4, 6).to(dtype), torch.zeros(4, 6, dtype=dtype)
        valid = torch.ones(4, 6, dtype=torch.bool)
        valid[3] = False  # a padding row: nobody has to write it
        with driver.subject_call({"x": x, "w": {"down": [torch.ones(3)]}}, [(out, valid)]):
            out[:2] = 1.0  # rows 0 and 1 written, row 2 not, row 3 padding
            x[1, 1] = -x[1, 1] if x[1, 1] != 0 else 1.0
        assert (log.unwritten, log.outputs, log.modified) == (6, 18, ["x"])
        assert torch.isnan(out[2]).all()  # the sentinel is a NaN: a stray read of it shows as one
        assert out[3].eq(0).all()  # padding no call had to write: zeros, as the buffer was made
        with driver.subject_call({"w": {"down": [torch.ones(3)]}}, [(out, None)]):
            out.fill_(0.0)
        assert (log.unwritten, log.modified) == (6, ["x"])  # nothing more
    finally:
        driver._LOG.reset(token)


def test_agreeing_copies_that_are_not_finite_fail_where_the_reference_is():
    observed = torch.full((3, 4), math.nan, dtype=torch.bfloat16)
    m = Measurement.bitwise(compare_bitwise(observed, observed[0]))
    assert m.held and m.mismatched == 0
    driver.require_finite(m, observed, torch.zeros(4, dtype=torch.float64))
    assert not m.held and decide(HOLDS, m)[0] == "unexpected"
    assert "12 of 12 compared outputs are not finite where the float64 reference is (12 NaN)" in m.extra_failure
    m = Measurement.bitwise(compare_bitwise(observed, observed[0]))
    driver.require_finite(m, observed, torch.full((4,), math.nan, dtype=torch.float64))
    assert m.held and m.extra_failure is None  # NaN where the reference is NaN too


@pytest.fixture(scope="module")
def verdict_run(tmp_path_factory, monkeypatch_module):
    proc, out = _shared_run(tmp_path_factory, "verdicts-run", "--suite", "tests/cases/verdicts.toml", "--gpus", "0",
                            "--no-report")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["check"]: r for r in map(json.loads, (out / "latest" / "results.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in REPO_ON_PYTHONPATH.items():
            mp.setenv(k, v)  # the ranks import tests.planted_verdicts
        yield mp


@pytest.mark.parametrize("check, counted, kind", [
    ("ulp-ws2/rank-invariance", (2048, 4096), "2,048 in value"),  # a + b == b + a, but rank 1 is 1 ULP off
    ("negative-zero/batch-invariance", (138, 12288), "138 signed zeros (+0.0 vs -0.0)"),  # integer data
    # UE8M0: no scale path differs; 3,846 values and the probe's 32 scales, of 4 x (2,048 + 16)
    ("ue8m0-batch/batch-invariance", (3878, 8256), "3,878 in value"),
])
def test_measured_but_once_vacuous_checks_are_unexpected(verdict_run, check, counted, kind):
    r = verdict_run[check]
    assert r["status"] == "unexpected", r["reason"]
    assert (r["mismatched"], r["total"]) == counted
    assert kind in r["reason"] and "vacuity estimate said none could differ" in r["reason"]
    assert r["detail"]["order_sensitive"] == 0 and r["detail"]["vacuity_estimate"].startswith("0 ")


def test_a_control_that_shows_a_difference_is_not_vacuous(verdict_run):
    r = verdict_run["ulp-ws2-control/rank-invariance"]
    assert r["status"] == "ok" and r["mismatched"] == 2048, r["reason"]


def test_the_readme_example_subject_fails_every_property_naming_unwritten_output(verdict_run):
    records = [r for c, r in verdict_run.items() if c.startswith("readme-example/")]
    assert len(records) == 18 and {r["property"] for r in records} == {
        "rank-invariance", "batch-invariance", "position-invariance"}
    for r in records:
        assert r["status"] == "error", r
        assert "output elements were never written" in r["reason"]
        written, total = r["reason"].split(" output elements")[0].split(" of ")
        assert written == total  # every element: the body is `...`


@pytest.mark.parametrize("case, name", [("gemm-zeroes-a", "problem.a"), ("dispatch-writes-x", "x")])
def test_a_subject_that_overwrites_its_input_fails_every_property(verdict_run, case, name):
    records = [r for c, r in verdict_run.items() if c.startswith(f"{case}/")]
    assert len(records) >= 4
    for r in records:
        assert r["status"] == "unexpected", r
        assert f"subject modified its input {name} on ranks" in r["reason"]


def test_an_unwritten_output_torch_filled_with_nan_fails_every_property(verdict_run):
    records = [r for c, r in verdict_run.items() if c.startswith("combine-never-writes/")]
    assert len(records) == 3
    for r in records:
        assert r["status"] == "unexpected", r
    invariance = verdict_run["combine-never-writes/position-invariance"]
    assert invariance["mismatched"] == 0  # the copies agree: NaN everywhere
    assert "compared outputs are not finite where the float64 reference is" in invariance["reason"]
