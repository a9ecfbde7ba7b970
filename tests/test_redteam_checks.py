"""Red-team review of the checks (2026-12-01): ways the new checks could be made to lie, each
with the behaviour that closes it. Every test failed before its fix."""
import re

import pytest
import torch

from ep_harness import kernel_trace
from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.families import moe_layer
from ep_harness.families.driver import compared_nothing
from ep_harness.measurement import Bound, Measurement
from ep_harness.families.moe_scenario import MoeParams
from ep_harness.subject import register
from ep_harness.subjects.gemm.torch_mm import TorchMm
from ep_harness.reports.analysis import compare_runs
from tests.test_reports import record

RULE = Bound(rule="test")


class _DeclaresAString(TorchMm):
    """Declares its kernel as a bare string, and never runs it."""

    def kernels(self, params):
        return "fast_gemm::grouped"


@register
class DeclaresAString(_DeclaresAString):
    name, summary = "test_declares_a_string", "declares 'fast_gemm::grouped' as a str, runs torch.mm"


def test_a_kernel_declared_as_a_bare_string_is_refused_not_matched_letter_by_letter(one_rank):
    """tuple('fast_gemm::grouped') is its letters, each of which some CPU event's name holds:
    with enough CPU events the proof of path passed without the kernel ever running."""
    from ep_harness import subject as registry

    subject = registry.get("test_declares_a_string")
    with pytest.raises(TypeError, match="return a tuple of non-empty kernel-name substrings"):
        kernel_trace.declared(subject, {})
    check = single_check(subject, "reference", {"dtype": "bfloat16", "layout": "contiguous"})
    with pytest.raises(TypeError):
        execute(check, subject, one_rank)


def test_an_empty_kernel_name_is_refused():
    class Empty:
        name = "empty"

        def kernels(self, params):
            return ("deep_gemm::sm90_", "")

    with pytest.raises(TypeError, match="non-empty"):
        kernel_trace.declared(Empty(), {})

    class Generated:
        name = "generated"

        def kernels(self, params):
            return (k for k in ("deep_gemm::sm90_",))

    assert kernel_trace.declared(Generated(), {}) == ("deep_gemm::sm90_",)  # read once, not emptied
    assert kernel_trace.missing(("deep_gemm::sm90_",), [{"aten::mm"}]) == ["deep_gemm::sm90_"]  # control


def test_a_fingerprint_missing_from_the_new_run_is_a_regression():
    old = record("c/x", bits_fingerprint="blake2b:" + "a" * 32)
    changes = compare_runs([record("c/x")], [old])
    assert [c["kind"] for c in changes] == ["regression"]
    assert "fingerprint is missing" in changes[0]["what"]
    # controls: the same fingerprint passes; a check skipped now is not a regression of its bits
    assert compare_runs([dict(old)], [old]) == []
    assert compare_runs([record("c/x", status="skipped", held=None, mismatched=None, total=None)],
                        [dict(old, status="vacuous")]) == []


def test_a_bounded_comparison_refuses_outputs_of_another_shape():
    """[1, H] against a [T, H] reference broadcast: T rows compared with row 0, `total` H."""
    exact = torch.ones(4, 8, dtype=torch.float64)
    bound = torch.full_like(exact, 1e-3)
    with pytest.raises(ValueError, match=r"output \(1, 8\), reference \(4, 8\)"):
        Measurement.within(torch.ones(1, 8), exact, bound, RULE)
    with pytest.raises(ValueError, match=r"valid \(8,\)"):
        Measurement.within(torch.ones(4, 8), exact, bound, RULE, torch.ones(8, dtype=torch.bool))
    assert Measurement.within(torch.ones(4, 8), exact, bound, RULE).held  # control


def test_a_comparison_of_no_element_is_vacuous_not_ok():
    exact = torch.ones(4, 8, dtype=torch.float64)
    none = torch.zeros(4, 8, dtype=torch.bool)
    m = Measurement.within(torch.full((4, 8), 5.0), exact, torch.zeros_like(exact), RULE, none)
    assert m.held and m.total == 0
    assert "0 elements were compared" in compared_nothing(m)
    some = Measurement.within(torch.full((4, 8), 5.0), exact, torch.zeros_like(exact), RULE)
    assert compared_nothing(some) is None and not some.held  # control


MOE_PARAMS = {"hidden": 2048, "intermediate": 64, "num_experts": 32, "topk": 4, "tokens": 16,
              "batch_sizes": [16]}


def _moe_outputs(world: int, lie: bool):
    """Per rank (output, experts) of a layer that returns the float64 layer rounded to bf16,
    or, with `lie`, zeros and the (k+1)-th expert instead of the k-th wherever the harness's
    own router margin admits that swap."""
    from ep_harness import subject as registry
    from ep_harness.families.moe_scenario import placements
    from ep_harness.reference import moe as ref

    p = single_check(registry.get("composed_moe"), "reference", {**MOE_PARAMS, "world_size": world}).params
    run = placements("reference", p, world)[0]
    parts = [moe_layer.partials(p, run, r, world).double() for r in range(world)]
    w = moe_layer.layer_weights(p)
    logits = sum(parts) @ w["router"].double().T
    out, idx = ref.moe_layer(sum(parts), logits, w["gate_up"], w["down"], p.topk, p.scoring)
    order = logits.argsort(dim=1, descending=True)
    swapped = torch.cat([order[:, :p.topk - 1], order[:, p.topk:p.topk + 1]], dim=1)
    _, admitted = moe_layer.router_flips(swapped, idx, logits, moe_layer.logit_margin(parts, w["router"]))
    admitted &= lie
    out = torch.where(admitted.unsqueeze(1), 0.0, out).to(torch.bfloat16)
    idx = torch.where(admitted.unsqueeze(1), swapped, idx)
    local = out.shape[0] // world
    return p, run, [moe_layer.Routed(out[r * local:(r + 1) * local], idx[r * local:(r + 1) * local])
                    for r in range(world)], admitted


def test_a_moe_layer_cannot_hide_its_output_behind_admitted_router_flips():
    """At 2 ranks the worst-case margin admits the swap for all 32 tokens; admitted tokens
    were left out of the comparison, so zeros there held (0 of 32 tokens compared, status
    ok). Admitted tokens are now compared with the float64 layer routed as they chose."""
    p, run, outputs, admitted = _moe_outputs(2, lie=True)
    assert int(admitted.sum()) >= 24  # most tokens lie, each within the margin
    m = moe_layer._measure_reference(p, run, outputs, 2)
    assert m.detail["router_flips"] == m.detail["router_flips_admitted"] == int(admitted.sum())
    assert m.extra_failure is None and not m.held and m.total == 32 * 2048
    p, run, outputs, _ = _moe_outputs(2, lie=False)  # control: the honest layer holds
    ok = moe_layer._measure_reference(p, run, outputs, 2)
    assert ok.held and ok.total == 32 * 2048 and ok.detail["router_flips"] == 0


def test_an_admitted_flip_is_held_to_the_layer_routed_as_chosen():
    """A token routed to other experts, computed exactly for them, is within its bound of
    routed_as; the reference routing's output is not (the positive control)."""
    p = MoeParams(**MOE_PARAMS, cancel=False, seed=0, scoring="softmax")  # routed_as reads intermediate, scoring
    w = moe_layer.layer_weights(p)
    x = torch.randn(3, 2048, dtype=torch.float64)
    logits = x @ w["router"].double().T
    mine = logits.argsort(dim=1, descending=True)[:, 1:5]  # not the reference's top 4
    from ep_harness.reference import moe as ref

    want, _ = ref.moe_layer(x, logits, w["gate_up"], w["down"], 4)
    got, mag = moe_layer.routed_as(x, logits, mine, w, p)
    scores = torch.softmax(logits, -1).gather(1, mine)
    for t in range(3):
        expect = sum(ref.swiglu_expert(x[t:t + 1], w["gate_up"][e], w["down"][e])[0] * scores[t, j] / scores[t].sum()
                     for j, e in enumerate(mine[t].tolist()))
        assert torch.allclose(got[t], expect, rtol=1e-12, atol=1e-12)
    assert (mag >= got.abs() - 1e-12).all()
    assert not torch.allclose(got, want)  # another routing, another output


def test_a_wrong_infinity_is_named_not_left_unexplained():
    """-Inf for +Inf and NaN for +Inf were mismatches whose `nonfinite` said nothing ({})."""
    import math

    from ep_harness.compare import compare_bitwise
    from ep_harness.verdict import nonfinite_text

    got = torch.tensor([1.0, -math.inf, math.nan, math.inf, math.nan])
    exact = torch.tensor([1.0, math.inf, math.inf, math.inf, math.nan], dtype=torch.float64)
    m = Measurement.within(got, exact, torch.zeros_like(exact), RULE)
    assert m.mismatched == 2 and m.nonfinite == {"other_nonfinite": 2}  # same Inf and NaN with NaN match
    assert "2 another NaN or Inf than the reference's" in nonfinite_text(m.nonfinite)
    b = compare_bitwise(got, exact.float())
    assert b.mismatched == 2 and b.nonfinite == {"other_nonfinite": 2}


def test_a_nan_payload_difference_is_bits_not_an_infinite_difference():
    """Both NaN, another payload: a bitwise mismatch (bit_only), but max |diff| was 'inf'."""
    from ep_harness.compare import compare_bitwise

    x = torch.tensor([math_nan := float("nan"), 1.0])
    y = x.clone()
    y.view(torch.int32)[0] = 0x7FC00001
    r = compare_bitwise(x, y)
    assert r.mismatched == 1 and r.bit_only == {"nan_payload": 1} and r.max_abs == 0.0
    z = torch.tensor([2.0, 1.0])  # control: a NaN against a number is an infinite difference
    assert compare_bitwise(x, z).max_abs == "inf" and math_nan != math_nan


def test_a_relaunch_that_fell_back_to_another_kernel_is_an_error_not_ok():
    """--fresh-processes compared only the relaunches' fingerprints: a relaunch whose declared
    kernel did not run (its measurement an error), with the same bits, left the check ok."""
    from ep_harness.run.fresh import compare_launches
    from ep_harness.launch.launcher import Outcome

    fp = "blake2b:" + "b" * 32
    first = record("c/x", bits_fingerprint=fp)

    def relaunch(error=None):
        return Outcome(0.1, measured=Measurement(comparison="bitwise", mismatched=0, total=8, held=True,
                                                 bits_fingerprint=fp, error=error))

    fell_back = compare_launches(first, [relaunch(), relaunch("deepgemm declares kernels ['deep_gemm::sm90_'] "
                                                              "but none ran during the measured calls")])
    assert fell_back["status"] == "error" and "none ran" in fell_back["reason"]
    same = compare_launches(first, [relaunch(), relaunch()])  # control
    assert same["status"] == "ok" and same["fresh_processes"]["differing"] == 0


NONFINITE_EMPTY_SLOT = {"data": "nonfinite", "routing": "empty", "num_experts": 2, "topk": 2, "world_size": 1,
                        "probe_experts": [0, 1], "tokens": 16}  # one chunk: the defect is the empty slot


def test_an_empty_slot_does_not_turn_an_infinite_input_into_a_nan_reference(one_rank):
    """routing = empty leaves a slot without expert (-1); the reference multiplied the token
    by that slot's 0 scale, 0 * Inf = NaN, so a correct combine (+-Inf there) failed: 42 of
    4,096 elements 'another NaN or Inf than the reference's'."""
    from ep_harness import subject as registry
    from ep_harness.families import dispatch
    from ep_harness.families.moe_scenario import placements

    subject = registry.get("torch_a2a_dispatch")
    check = single_check(subject, "combine-reference", NONFINITE_EMPTY_SLOT)
    m = execute(check, subject, one_rank)
    assert m.held and m.total == 4096 and m.nonfinite is None, (m.mismatched, m.nonfinite)
    # control: the same check catches a combine that turns those infinities into NaN
    p = check.params
    run = placements("combine-reference", p, 1)[0]
    (y, w), = dispatch._combine_inputs(p, run, 1)
    exact = (y * w.unsqueeze(-1)).sum(1)
    assert torch.isinf(exact).any()
    poisoned = torch.where(torch.isinf(exact), torch.nan, exact).to(torch.bfloat16)
    bad = dispatch._measure_combine(p, run, [poisoned], 1)
    assert not bad.held and bad.nonfinite == {"other_nonfinite": int(torch.isinf(exact).sum())}


@pytest.mark.parametrize("data", ["spread", "subnormal", "nonfinite"])
def test_moe_data_the_router_cannot_order_is_refused_when_planned(data):
    """The harness's own composed_moe failed its reference with data = spread (3 of 8 tokens
    'not admitted': fp32 softmax scores underflow to tied zeros), subnormal (the same values)
    and nonfinite (NaN logits): a false failure. Such data is now a one-line plan error."""
    from ep_harness import subject as registry
    from ep_harness.errors import HarnessError

    subject = registry.get("composed_moe")
    with pytest.raises(HarnessError, match=f"data = '{data}' for the MoE layer: .*; use randn, uniform or integers"):
        single_check(subject, "reference", {"data": data, "world_size": 1})
    for fine in ("randn", "uniform", "integers"):  # control: what it takes still plans
        single_check(subject, "reference", {"data": fine, "world_size": 1})


def test_one_rank_has_no_tp_rounding_to_excuse_a_router_swap():
    """One partial is the hidden state itself (no sum, no rounding), but the margin charged
    it u*|x| + gamma(1, u)*|x|: the (k+1)-th-expert swap was admitted for 15 of 16 tokens."""
    _, _, _, admitted = _moe_outputs(1, lie=True)
    assert int(admitted.sum()) == 0
    _, _, _, admitted = _moe_outputs(2, lie=True)  # control: two partials do round
    assert int(admitted.sum()) > 0


@pytest.mark.parametrize("name", ["deepep_v1_ll"])
def test_a_dispatcher_without_sources_is_an_error_not_every_row_lost(one_rank, name):
    """deepep_v1_ll leaves src_rank at -1: the reference property reported 'all (token, slot)
    rows were lost or misrouted', a failure of DeepEP it never measured. (deepep_v2 read its
    sources from the handle's recv_src_metadata since issue 34: it holds, as the control.)"""
    from tests import fake_deep_ep
    from ep_harness.subjects.dispatch import deepep

    subject = {"deepep_v2": deepep.DeepEPElastic, "deepep_v1_ll": deepep.DeepEPLowLatency}[name]()
    subject.module = staticmethod(lambda: fake_deep_ep)
    layout = "masked" if name == "deepep_v1_ll" else "contiguous"
    m = execute(single_check(subject, "reference", {"num_experts": 8, "layout": layout, "world_size": 1}),
                subject, one_rank)
    assert m.error and "received rows without their source" in m.error and "lost" not in m.error
    for control in (deepep.DeepEPNormal(), deepep.DeepEPElastic()):  # they say where each row came from
        control.module = staticmethod(lambda: fake_deep_ep)
        ok = execute(single_check(control, "reference", {"num_experts": 8, "world_size": 1}), control, one_rank)
        assert ok.error is None and ok.held and ok.total > 0, control.name


def test_an_error_that_is_fixed_is_an_improvement_not_moved_bits():
    """A baseline check that errored (its declared kernel did not run: a fallback) and now
    runs its kernel, with other bits, was a regression 'same verdict, other bits'."""
    old = record("c/x", status="error", reason="declares kernels but none ran", bits_fingerprint="blake2b:" + "a" * 32)
    new = record("c/x", bits_fingerprint="blake2b:" + "b" * 32)
    assert [c["kind"] for c in compare_runs([new], [old])] == ["improvement"]
    moved = compare_runs([new], [dict(old, status="ok", reason="holds")])  # control: ok to ok, other bits
    assert [c["kind"] for c in moved] == ["regression"] and "fingerprint moved" in moved[0]["what"]


@pytest.mark.parametrize("capability, prefix", [((9, 0), "deep_gemm::sm90_"), ((10, 0), "deep_gemm::sm100_")])
def test_deepgemm_declares_the_kernels_of_the_gpu_it_runs_on(monkeypatch, capability, prefix):
    """DeepGEMM runs on sm90 and sm100 (unavailable() takes both), but declared sm90_ kernels
    only: on a Blackwell GPU every DeepGEMM check would have been an error ('none ran')."""
    from ep_harness import subject as registry

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    subject = registry.get("deepgemm_bf16_contiguous")
    assert kernel_trace.declared(subject, {}) == (prefix,)
    ran = [{f"void {prefix}bf16_gemm_impl<...>(...)"}]
    assert kernel_trace.missing(kernel_trace.declared(subject, {}), ran) == []
    other = "deep_gemm::sm90_" if prefix != "deep_gemm::sm90_" else "deep_gemm::sm100_"
    assert kernel_trace.missing((prefix,), [{f"void {other}bf16_gemm_impl<...>(...)"}]) == [prefix]  # control


def test_combined_comparisons_keep_both_sides_evidence():
    """FP8 values + scales: the scales' bit-only kinds, ULP buckets and first mismatches were
    dropped when the values matched; a side without fingerprint left the other's standing for both."""
    from ep_harness.compare import compare_bitwise

    values = torch.tensor([1.0, 2.0])
    scales, moved = torch.tensor([0.0, 4.0]), torch.tensor([-0.0, 4.5])
    m = Measurement.bitwise(compare_bitwise(values, values)).combine(
        Measurement.bitwise(compare_bitwise(moved, scales)))
    assert m.mismatched == 2 and m.total == 4 and not m.held
    assert m.bit_only == {"signed_zero": 1} and m.ulp_histogram == compare_bitwise(moved, scales).ulp_histogram
    assert m.first_mismatches and m.first_mismatch == m.first_mismatches[0]
    whole = Measurement.bitwise(compare_bitwise(values, values))
    bare = Measurement(comparison="bitwise", mismatched=0, total=2, held=True)
    assert whole.combine(bare).bits_fingerprint is None
    both = Measurement.bitwise(compare_bitwise(values, values)).combine(
        Measurement.bitwise(compare_bitwise(scales, scales)))
    assert both.bits_fingerprint.startswith("blake2b:") and both.held  # control


@pytest.mark.parametrize("params, shown", [({"topk": 8}, "[0, 1, 4, 5]"),
                                           ({"num_experts": 4}, "[0, 0, 1, 1]")])
def test_a_probe_without_topk_distinct_experts_is_refused_when_planned(params, shown):
    """topk = 8 with the default four probe experts crashed every rank with a RuntimeError
    (rank_tokens); num_experts = 4 folded them onto [0, 1, 0, 1], a top-k with duplicates."""
    from ep_harness import subject as registry
    from ep_harness.errors import HarnessError

    subject = registry.get("torch_a2a_dispatch")
    with pytest.raises(HarnessError, match=rf"gives the probe {re.escape(shown)} .*list \d+ distinct experts"):
        single_check(subject, "rank-invariance", {"world_size": 1, "num_experts": 16, **params})
    single_check(subject, "rank-invariance", {"world_size": 1, "num_experts": 16, "topk": 8,  # control
                                              "probe_experts": [4, 5, 0, 1, 2, 3, 6, 7]})


def test_a_row_delivered_twice_is_named_not_called_zero_lost(one_rank):
    """A dispatcher that delivers one row twice failed with '0 (token, slot) rows were lost or
    misrouted': the failure said nothing happened."""
    from ep_harness import subject as registry
    from ep_harness.families import dispatch

    subject = registry.get("torch_a2a_dispatch")
    check = single_check(subject, "reference", {"world_size": 1, "num_experts": 8})
    runs = dispatch.FAMILY.runs("reference", check.params, 1)
    (keys, rows, scales), = dispatch._observe(subject, one_rank, check.params, "reference", runs).received
    twice = dispatch.ReceivedRows([*keys, keys[0]], torch.cat([rows, rows[:1]]), scales)
    m = dispatch._measure_dispatch(check.params, "bf16", runs[0].spec, [twice], 1)
    assert not m.held and m.mismatched == 1
    assert m.extra_failure == "0 (token, slot) rows were lost or misrouted, 1 delivered that were not sent once"
    control = dispatch.ReceivedRows(keys, rows, scales)
    ok = dispatch._measure_dispatch(check.params, "bf16", runs[0].spec, [control], 1)
    assert ok.held and ok.total == rows.numel()
