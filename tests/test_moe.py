"""The dispatch and MoE-layer records of the CPU default run (4 gloo ranks), and the
float64 MoE reference on its own."""
import json

import pytest
import torch

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
    assert holds["detail"]["rows"] == 21  # decode + (first, last, 8 part middles) of 2 prefill sizes
    labels = recs["moe-native-tp/prefill-decode-invariance/world_size=4"]["detail"]["mismatch_map"]["rows"]
    assert labels[0].startswith("decode") and any(label.startswith("prefill") for label in labels)


def test_prefill_rows_hold_the_first_last_and_one_row_per_part():
    from ep_harness.moe_scenario import prefill_rows

    assert prefill_rows(128, 8) == [0, 8, 24, 40, 56, 72, 88, 104, 120, 127]
    assert prefill_rows(4, 8) == [0, 1, 2, 3]  # fewer rows than parts: every row once
