"""The model probe (harness/families/model.py, harness/subjects/model/): one shared launch of
tests/cases/model.toml (4 gloo ranks, beside tests/cases/defaults.toml's cases: tests/shared_runs.py) for the fold model, the native reduce-scatter control,
a combine planted to reorder in layer 3 only and an expert GEMM planted to split K past 8
rows; and the localiser, the reference's bound
and the vacuity rule on their own."""
import copy

import pytest
import torch

from ep_harness.divergence import Op, Tracer, first_divergence, localise, merge, rows_of
from ep_harness.errors import HarnessError
from ep_harness.fingerprint import bits_fingerprint
from ep_harness.reports.analysis import FAILING
from tests.shared_runs import MODEL_SUITE, case_names, model_and_defaults_run  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def model_run(model_and_defaults_run):
    """The records of model.toml's cases, from its launch shared with tests/cases/defaults.toml
    (tests/shared_runs.py): what `verify --suite tests/cases/model.toml` exits 0 on, no record
    failing (FAILING: unexpected, error) and none interrupted."""
    proc, records = model_and_defaults_run
    mine = {check: r for check, r in records.items() if check.split("/")[0] in case_names(MODEL_SUITE)}
    assert {check.split("/")[0] for check in mine} == case_names(MODEL_SUITE), sorted(records)
    assert proc.returncode in (0, 1) and [(c, r["status"], r["reason"]) for c, r in mine.items()
                                          if r["status"] in FAILING + ("interrupted",)] == [], proc.stdout[-3000:]
    return mine


@pytest.mark.slow
def test_fold_model_is_within_its_reference_bound(model_run):
    r = model_run["fold/reference"]
    assert r["status"] == "ok" and r["comparison"] == "bounded" and r["mismatched"] == 0
    assert 0 < r["error_vs_reference"] < 0.5  # it computes something, well inside the bound
    assert r["total"] == 6 * 3 * 512  # every prompt's three generated positions, every vocabulary entry
    assert r["detail"]["router_flips"] == r["detail"]["router_flips_admitted"]


@pytest.mark.slow
def test_fold_model_holds_batch_and_prefill_decode_invariance(model_run):
    for prop in ("batch-invariance", "prefill-decode-invariance"):
        r = model_run[f"fold/{prop}"]
        assert (r["status"], r["held"], r["mismatched"]) == ("ok", True, 0), r["reason"]
        assert r["detail"]["order_sensitive"] > 0 and r["total"] > 0  # not vacuous: it could have failed
        assert "first_divergence" not in r["detail"]


@pytest.mark.slow
def test_native_reduce_scatter_violates_and_layer_0s_tp_collective_is_named(model_run):
    for prop in ("batch-invariance", "prefill-decode-invariance"):
        r = model_run[f"native-tp/{prop}"]
        assert r["status"] == "ok" and r["held"] is False and r["mismatched"] > 0
        first = r["detail"]["first_divergence"]
        assert (first["layer"], first["stage"], first["subject"], first["collective"]) == \
            (0, "attention.tp_reduce", "reduce_scatter_native", True), first
        assert 0 < first["diverged"] <= first["same_inputs"] <= first["items"]
        assert first["parts"] == ["sum"] and first["ranks"]
        assert "layer 0 attention.tp_reduce (reduce_scatter_native)" in r["reason"]


@pytest.mark.slow
def test_a_combine_planted_in_layer_3_is_named_as_such(model_run):
    r = model_run["planted-layer3/batch-invariance"]
    assert r["status"] == "ok" and r["held"] is False and r["mismatched"] > 0
    first = r["detail"]["first_divergence"]
    assert (first["layer"], first["stage"], first["subject"]) == (3, "moe.combine", "planted_layer3_combine"), first
    assert first["parts"] == ["routed"] and first["diverged"] > 0
    control = model_run["planted-nowhere/batch-invariance"]  # the same plugin, planted in no layer
    assert (control["status"], control["mismatched"]) == ("ok", 0)


@pytest.mark.slow
def test_an_expert_gemm_that_changes_with_m_is_named(model_run):
    for prop in ("batch-invariance", "prefill-decode-invariance"):
        r = model_run[f"planted-split-k/{prop}"]
        assert r["status"] == "ok" and r["held"] is False and r["mismatched"] > 0
        first = r["detail"]["first_divergence"]
        assert (first["stage"], first["subject"], first["collective"]) == \
            ("moe.gate_up", "planted_bf16_split_k", False), first
        assert all(part.startswith("slot ") for part in first["parts"])


# --- the localiser on traces built by hand


def _trace(values: dict) -> dict:
    """{(layer, stage): {item: (inputs, outputs)}} -> one rank's events."""
    t = Tracer(rank=0)
    for (layer, i, stage), items in values.items():
        op = Op((layer, i), stage, layer)
        for item, (ins, outs) in items.items():
            t.record(op, [item], "in", "x", [bits_fingerprint(torch.tensor(ins))])
            t.record(op, [item], "out", "y", [bits_fingerprint(torch.tensor(outs))])
    return t.events


def test_localiser_names_the_first_op_whose_inputs_agree_and_outputs_differ():
    a = _trace({(0, 0, "norm"): {"t0": (1, 2), "t1": (3, 4)}, (0, 1, "reduce"): {"t0": (2, 5), "t1": (4, 6)},
                (1, 0, "norm"): {"t0": (5, 7), "t1": (6, 8)}})
    b = _trace({(0, 0, "norm"): {"t0": (1, 2), "t1": (3, 4)}, (0, 1, "reduce"): {"t0": (2, 5), "t1": (4, 9)},
                (1, 0, "norm"): {"t0": (5, 7), "t1": (9, 1)}})  # layer 1 differs only because its input did
    found = first_divergence(merge([a]), merge([b]))
    assert (found.layer, found.stage, found.items, found.same_inputs, found.diverged, found.first_item) == \
        (0, "reduce", 2, 2, 1, "t1")
    assert first_divergence(merge([a]), merge([a])) is None
    assert localise([a], [a])["first_divergence"] is None


def test_localiser_skips_ops_whose_inputs_already_differ_and_merges_ranks():
    a0, a1 = Tracer(0), Tracer(1)
    b0, b1 = Tracer(0), Tracer(1)
    op = Op((0, 3), "tp_reduce", 0, "rs", True)
    for t, value in ((a0, 1.0), (a1, 2.0), (b0, 1.0), (b1, 2.0)):  # each rank's partial, the same in both runs
        t.record(op, ["tok"], "in", f"rank {t.rank}", torch.tensor([[value]]))
    a1.record(op, ["tok"], "out", "sum", torch.tensor([[3.0]]))
    b0.record(op, ["tok"], "out", "sum", torch.tensor([[3.5]]))  # the sum landed on another rank, other bits
    found = first_divergence(merge([a0.events, a1.events]), merge([b0.events, b1.events]))
    assert (found.stage, found.collective, found.ranks, found.other_ranks) == ("tp_reduce", True, [1], [0])
    b1.record(op, ["tok"], "in", "rank 1", torch.tensor([[2.5]]))  # now an input differs: not this op's fault
    assert first_divergence(merge([a0.events, a1.events]), merge([b0.events, b1.events])) is None


def test_untracked_items_are_not_recorded_and_rows_are_fingerprinted_like_fingerprint():
    t = Tracer(0)
    x = torch.randn(3, 8).to(torch.bfloat16)
    t.record(Op((0,), "s"), ["a", None, "c"], "out", "y", x)
    assert set(t.events[Op((0,), "s")]) == {"a", "c"}
    assert t.events[Op((0,), "s")]["c"]["out"]["y"] == (bits_fingerprint(x[2]), 0)
    assert rows_of(x) == [bits_fingerprint(r) for r in x]
    assert rows_of(x.flip(1))[0] != rows_of(x)[0]  # order-sensitive
    first, second = Tracer(0), Tracer(0)
    assert first.chain("k", [x[0], x[1]]) != second.chain("k", [x[1], x[0]])  # a prefix fingerprint is ordered


# --- the reference, its bound and the family's rules, on the CPU in this process


def _params(**over):
    from ep_harness import subject as registry
    from ep_harness.check import typed_params as build

    registry.load_all()
    return build("model", {"world_size": 4, **over}, registry.get("composed_model"), "test")


def test_the_bound_tells_a_model_missing_one_shared_expert_from_the_model():
    from ep_harness.families.model import logprob_bound
    from ep_harness.families.model_inputs import prompts, weights
    from ep_harness.reference import model as ref

    p = _params()
    w = weights(p)
    broken = copy.deepcopy(w)
    broken["layers"][3]["shared_down"].zero_()
    tokens = prompts(p)[0]
    good, bad = (ref.forward(v, tokens, p.heads, p.topk) for v in (w, broken))
    bound = logprob_bound(good["logits"], good["x"], w["lm_head"], p.layers)
    assert float(((bad["logprobs"] - good["logprobs"]).abs() / bound).max()) > 1
    assert torch.allclose(good["logprobs"].exp().sum(-1), torch.ones(len(tokens), dtype=torch.float64))


def test_reference_routing_follows_the_run_and_reports_its_own_choice():
    from ep_harness.families.model_inputs import prompts, weights
    from ep_harness.reference import model as ref

    p = _params()
    w, tokens = weights(p), prompts(p)[1]
    own = ref.forward(w, tokens, p.heads, p.topk)
    forced = [[[0, 1]] * p.layers for _ in tokens]
    other = ref.forward(w, tokens, p.heads, p.topk, forced)
    assert other["router"][0]["used"].tolist() == [[0, 1]] * len(tokens)
    assert torch.equal(other["router"][0]["own"], own["router"][0]["own"])
    assert not torch.equal(other["logprobs"], own["logprobs"])


def test_runs_that_move_nothing_are_vacuous():
    from ep_harness.families.driver import Copy, Run
    from ep_harness.families.model import Batch, RunSeen, _nothing_moved, _runs

    p = _params()
    tokens = {pid: [0] * p.new_tokens for pid in range(max(p.batch_sizes))}
    runs = _runs("batch-invariance", p, 4)
    assert _nothing_moved(p, runs, [[RunSeen(None, tokens, None, None)] * len(runs)]) is None
    # two runs told apart by their labels alone: the same batch, so the same rows and message sizes
    same = [Run(label, (Copy((label,)),), Batch((0, 1), (0,))) for label in ("a", "b")]
    assert "same rows of messages of the same sizes" in _nothing_moved(p, same, [[RunSeen(None, tokens, None, None)] * 2])
    moved = [Run("a", (Copy(("a",)),), Batch((0, 1), (0,))), Run("b", (Copy(("b",)),), Batch((1, 0), (0,)))]
    assert _nothing_moved(p, moved, [[RunSeen(None, tokens, None, None)] * 2]) is None


def test_bad_model_parameters_are_one_line_errors():
    with pytest.raises(HarnessError, match="heads = 6 do not split over world_size = 4"):
        _params(heads=6, hidden=384)
    with pytest.raises(HarnessError, match="prompt_lengths"):
        _params(prompt_lengths=[9, 3])
