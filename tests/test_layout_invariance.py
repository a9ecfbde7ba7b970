"""tp-size-invariance and ep-size-invariance (docs/layout-invariance.md): the orders they
rest on, their vacuity, their parameters, and the records of real gloo runs."""
import json

import pytest
import torch

import ep_harness.subjects  # noqa: F401  (the built-in subjects)
from ep_harness import inputs as gen
from ep_harness.errors import HarnessError
from ep_harness.families import driver, layout
from ep_harness.check import typed_params as build
from ep_harness.reference import orders
from ep_harness.subject import get as subject_named

pytestmark = pytest.mark.filterwarnings("ignore")


def _shards(v: int, n: int = 4096, dtype=torch.bfloat16, seed: int = 3) -> torch.Tensor:
    return torch.stack([gen.values((n,), dtype, seed, "virtual-shard", k) for k in range(v)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_ranks_block_is_a_subtree_of_the_balanced_tree_at_every_size(dtype):
    shards = _shards(8, dtype=dtype)
    whole = orders.balanced_tree(shards)
    for w in (1, 2, 4, 8):
        per = 8 // w
        subtrees = torch.stack([orders.balanced_tree(shards[r * per:(r + 1) * per]) for r in range(w)])
        assert torch.equal(orders.balanced_tree(subtrees).view(torch.uint8), whole.view(torch.uint8)), w


def test_the_ranks_fp32_partials_regroup_with_the_size():
    """The positive control of the test above: the same shards as fp32 rank partials added in
    rank order differ between sizes (so the equality above is not a property of the data)."""
    flat = _shards(8)
    by_size = [orders.chain_fold(orders.block_partials(flat, w), list(range(w))).view(torch.int16) for w in (1, 2, 4)]
    assert int((by_size[0] != by_size[1]).sum()) > 0 and int((by_size[0] != by_size[2]).sum()) > 0


def test_block_partials_round_once_and_balanced_tree_rounds_every_add():
    x = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8], [0.0]], dtype=torch.bfloat16)  # bf16's ulp at 1: 2^-7
    assert orders.block_partials(x, 1).item() == 1.0 + 2.0 ** -7  # fp32 sum of all four, rounded once
    assert orders.balanced_tree(x).item() == 1.0  # 1 + 2^-8 ties to even (1) before the other 2^-8 joins
    with pytest.raises(ValueError, match="power-of-two"):
        orders.balanced_tree(x[:3])


def _runs(sizes):
    p = type("P", (), {"layout_sizes": sizes, "world_size": 4, "virtual_shards": 8})
    return layout.runs("tp-size-invariance", p, 4)


def test_one_size_and_a_repeated_size_are_vacuous_and_two_sizes_are_not():
    assert "only one run" in driver.vacuity("tp-size-invariance", _runs([4]), 100, None)
    assert "one and the same placement" in driver.vacuity("tp-size-invariance", _runs([2, 2]), 100, None)
    assert driver.vacuity("tp-size-invariance", _runs([1, 2, 4]), 100, None) is None
    assert driver.vacuity("tp-size-invariance", _runs([1, 2, 4]), 0, "nothing regroups").startswith("0 nothing")


def test_default_sizes_are_the_powers_of_two_up_to_the_world_size():
    p = type("P", (), {"layout_sizes": [], "world_size": 8, "virtual_shards": 8})
    assert layout.sizes(p) == [1, 2, 4, 8]
    assert layout.sizes_of({"property": "rank-invariance", "params": {"world_size": 8}}) == []
    assert layout.sizes_of({"property": "ep-size-invariance", "params": {"world_size": 3}}) == [1, 2]


@pytest.mark.parametrize("raw, problem", [
    ({"layout_sizes": [1, 8]}, "8 exceeds world_size = 4"),
    ({"layout_sizes": [1, 3]}, "does not split over 3 ranks"),
])
def test_impossible_layout_sizes_are_one_line_errors(raw, problem):
    subject = subject_named("tree_reduce_scatter")
    with pytest.raises(HarnessError, match=problem):
        build("collective", {"dtype": "bfloat16", "world_size": 4, **raw}, subject, "case 'x'")



def test_layout_sizes_must_split_the_experts():
    with pytest.raises(HarnessError, match="num_experts = 6 does not split over 4 ranks"):
        build("moe_layer", {"world_size": 6, "num_experts": 6, "layout_sizes": [1, 2, 4], "virtual_shards": 4},
              subject_named("composed_moe"), "case 'y'")


def test_the_expert_order_combine_adds_by_expert_id_from_zero():
    combine = subject_named("torch_a2a_expert_order")
    idx = torch.tensor([[5, 1, 3]])
    y = torch.tensor([[[1.0], [2.0 ** 30], [-2.0 ** 30]]])  # slots: expert 5, 1, 3
    w = torch.ones(1, 3)
    combine._choices = (idx, 2)
    try:
        out = combine.fold(y, w, None)
    finally:
        del combine._choices
    # by expert id: 1 (2^30), 3 (-2^30), 5 (1.0) -> (2^30 - 2^30) + 1 = 1; slot order gives 0
    assert out.item() == 1.0
    assert subject_named("torch_a2a_dispatch").fold(y, w, None).item() == 0.0


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory):
    """tests/cases/layout.toml in one launch, once per session (shared by the xdist workers)."""
    from tests.conftest import _shared_run

    proc, out = _shared_run(tmp_path_factory, "layout-run", "--suite", "tests/cases/layout.toml", "--gpus", "0",
                            "--no-report")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # the planted defect fails the run
    lines = (out / "latest" / "results.jsonl").read_text().splitlines()
    return {r["check"]: r for r in map(json.loads, lines)}


def _case(recs, case):
    return [r for r in recs.values() if r["case"] == case]


@pytest.mark.slow
def test_controls_are_violated_as_their_order_models_predict(layout_run):
    controls = _case(layout_run, "rs-native") + _case(layout_run, "ar-slice")
    assert len(controls) == 5
    for r in controls:
        assert r["status"] == "ok" and r["held"] is False, r["reason"]
        assert r["mismatched"] > 0 and r["predicted_mismatched"] == r["mismatched"], r["check"]
        assert r["detail"]["order_model_exact"] is True and r["detail"]["order_sensitive"] > 0


@pytest.mark.slow
def test_the_tree_holds_non_vacuously_and_is_predicted_to(layout_run):
    fixes = _case(layout_run, "tree")
    assert len(fixes) == 6
    for r in fixes:
        assert r["status"] == "ok" and r["mismatched"] == 0 and r["predicted_mismatched"] == 0, r["reason"]
        assert r["total"] > 0 and r["detail"]["order_sensitive"] > 0
        assert set(r["detail"]["call_seconds"]) == {"TP 1", "TP 2", "TP 4"}


@pytest.mark.slow
def test_a_planted_size_dependent_reduction_is_caught_where_that_size_is_compared(layout_run):
    by_sizes = {tuple(r["params"]["layout_sizes"]): r for r in _case(layout_run, "planted")}
    assert by_sizes[(1, 2)]["status"] == "ok"  # the planted chain only runs at size 4
    caught = by_sizes[(1, 2, 4)]
    assert caught["status"] == "unexpected" and caught["mismatched"] > 0
    assert caught["first_mismatch"]["row"] == "TP 4"


@pytest.mark.slow
def test_one_size_is_no_comparison(layout_run):
    recs = _case(layout_run, "one-size")
    assert {r["status"] for r in recs} == {"vacuous"} and len(recs) == 2


@pytest.mark.slow
def test_a_combine_pre_reduced_per_rank_changes_with_the_ep_size(layout_run):
    (r,) = _case(layout_run, "moe-rank-reduce")
    assert r["status"] == "ok" and r["mismatched"] > 0
    assert r["first_mismatch"]["row"] in ("EP 2", "EP 4")


@pytest.mark.slow
def test_smoke_layout_records(smoke_run):
    _, run_dir = smoke_run
    recs = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    mine = {r["check"]: r for r in recs if r["property"] in layout.LAYOUT_PROPERTIES}
    assert len(mine) == 9 and all(r["status"] == "ok" for r in mine.values()), \
        [(c, r["reason"]) for c, r in mine.items() if r["status"] != "ok"]
    for r in mine.values():
        if r["expect"] == "holds":
            assert r["mismatched"] == 0
        else:
            assert r["mismatched"] > 0
        if r["family"] == "collective":
            assert r["predicted_mismatched"] == r["mismatched"]


@pytest.mark.slow
def test_the_models_logprobs_hold_across_tp_sizes_with_the_fixes_and_name_the_native_tp_reduction(layout_run):
    (fixed,) = _case(layout_run, "model-fixed")
    assert fixed["status"] == "ok" and fixed["mismatched"] == 0 and fixed["total"] > 0
    assert fixed["detail"]["order_sensitive"] > 0
    (native,) = _case(layout_run, "model-native")
    assert native["status"] == "ok" and native["mismatched"] > 0
    found = native["detail"]["first_divergence"]
    assert (found["layer"], found["stage"], found["subject"]) == (0, "attention.tp_reduce", "reduce_scatter_native")
    assert found["same_inputs"] > 0 and native["detail"]["between"][0] == "TP 1"
