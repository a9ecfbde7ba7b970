"""The dispatch and MoE-layer records of the CPU default run (4 gloo ranks), and the
float64 MoE reference on its own."""
import json

import pytest
import torch

from ep_harness.subject import register
from ep_harness.subjects.moe.composed import ComposedMoE
from ep_harness.reference import moe as ref


def by_check(run_dir):
    return {json.loads(x)["check"]: json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()}


def test_route_breaks_ties_towards_the_lower_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    idx, w = ref.route(logits, 2)
    assert idx.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    idx, w = ref.route(logits, 2, scoring="sigmoid")
    assert idx.tolist() == [[1, 2]]


def test_moe_reference_is_the_weighted_sum_of_expert_ffns():
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)
    gate_up, down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g)
    out, idx = ref.moe_layer(x, logits, gate_up, down, k=2)
    _, w = ref.route(logits, 2)
    t = 1
    want = sum(w[t, j] * ref.swiglu_expert(x[t:t + 1], gate_up[e], down[e])[0] for j, e in enumerate(idx[t].tolist()))
    assert torch.allclose(out[t], want)


@pytest.mark.slow
def test_smoke_dispatch_records(smoke_run):
    _, run_dir = smoke_run
    recs = by_check(run_dir)
    lossless = [r for r in recs.values() if r["case"] == "dispatch-a2a" and r["property"] == "reference"]
    assert len(lossless) == 4 and all(r["status"] == "ok" and r["mismatched"] == 0 for r in lossless)
    fp8 = [r for r in lossless if r["params"]["expert_quant"] == "fp8"]
    assert fp8 and all(r["total"] > 0 for r in fp8)  # values and scales compared bit for bit
    inv = [r for r in recs.values() if r["family"] == "dispatch" and "invariance" in r["property"]
           and r["status"] != "skipped"]
    assert inv and all(r["status"] == "ok" and r["detail"]["order_sensitive"] > 0 for r in inv)
    deepep = [r for r in recs.values() if r["subject"] == "deepep_v2"]
    assert deepep and all(r["status"] == "skipped" and "DeepEP needs NVIDIA GPUs" in r["reason"] for r in deepep)


@pytest.mark.slow
def test_smoke_moe_layer_records(smoke_run):
    _, run_dir = smoke_run
    recs = by_check(run_dir)
    ref_rec = recs["moe/reference/world_size=4"]
    assert ref_rec["status"] == "ok" and ref_rec["detail"]["router_flips"] == 0 and ref_rec["detail"]["tokens"] == 32
    assert ref_rec["error_vs_reference"] < 1.0
    for prop in ("run-to-run", "batch-invariance", "position-invariance", "rank-invariance", "others-invariance",
                 "prefill-decode-invariance"):
        r = recs[f"moe/{prop}/world_size=4"]
        assert (r["status"], r["mismatched"]) == ("ok", 0), r["check"]
        assert r["detail"]["order_sensitive"] > 0
    for prop in ("rank-invariance", "batch-invariance", "prefill-decode-invariance"):  # the control: native TP RS
        r = recs[f"moe-native-tp/{prop}/world_size=4"]
        assert r["status"] == "ok" and r["held"] is False and r["mismatched"] > 0
    holds = recs["moe/prefill-decode-invariance/world_size=4"]
    assert holds["detail"]["rows"] == 1 + 4 * 8 + 4 * 9  # decode + 4 ranks x prefill_rows(32, 8), (256, 8)
    labels = recs["moe-native-tp/prefill-decode-invariance/world_size=4"]["detail"]["mismatch_map"]["rows"]
    assert labels[0].startswith("decode") and any(label.startswith("prefill") for label in labels)


def test_prefill_rows_hold_the_first_last_and_one_row_per_slice_on_every_residue():
    from ep_harness.families.moe_scenario import prefill_rows

    assert prefill_rows(32, 8) == [0, 5, 10, 15, 16, 21, 26, 31]  # slice i of 4 rows probed at offset i % 4
    assert {r % 4 for r in prefill_rows(32, 8)} == {0, 1, 2, 3}
    assert {r % 8 for r in prefill_rows(256, 8)} == set(range(8))
    assert prefill_rows(4, 8) == [0, 1, 2, 3]  # fewer rows than slices: every row once


@register
class LaneDependentMoE(ComposedMoE):
    """Planted (review of 2026-12-01): a layer whose rows in lane 1 of every 4-row group come
    out 1 ulp off once the batch holds more than one token: a token's bits depend on its row
    in a prefill batch."""

    name = "test_lane_dependent_moe"

    def forward(self, partials, weights, params, group):
        out, idx = super().forward(partials, weights, params, group)
        if out.shape[0] > 1:
            out = out.clone()
            out.view(torch.int16)[torch.arange(out.shape[0]) % 4 == 1] += 1  # one bf16 ulp in magnitude
        return out, idx


def test_prefill_decode_catches_a_defect_tied_to_a_row_lane(one_rank):
    """The probes of a prefill batch cover every row residue mod 4 (and 8 at 256 tokens), so
    a defect that only rows 1 mod 4 show is caught; the correct layer holds (the control)."""
    from ep_harness.check import single_check
    from ep_harness.families import execute
    from ep_harness.subject import get

    for name, held in (("composed_moe", True), ("test_lane_dependent_moe", False)):
        check = single_check(get(name), "prefill-decode-invariance", {"world_size": 1})
        m = execute(check, get(name), one_rank)
        assert m.vacuous_reason is None and m.sensitivity > 0
        assert m.held is held, name


def test_prefill_of_one_token_is_refused_and_single_routing_has_no_prefill():
    from ep_harness.check import single_check
    from ep_harness.errors import HarnessError
    from ep_harness.families.driver import vacuity
    from ep_harness.families.moe_scenario import placement_runs
    from ep_harness.subject import get

    with pytest.raises((HarnessError, ValueError), match="prefill_tokens"):
        single_check(get("composed_moe"), "prefill-decode-invariance",
                     {"world_size": 4, "num_experts": 8, "prefill_tokens": [1]})
    check = single_check(get("composed_moe"), "prefill-decode-invariance",
                         {"world_size": 4, "num_experts": 8, "routing": "single"})
    runs = placement_runs(check.property, check.params, 4)
    assert [max(r.spec.tokens) for r in runs] == [1]  # the decode alone: nothing to compare with
    assert vacuity(check.property, runs, 30, "elements") is not None
