"""corruption-rate: the per-call bound, the exact-by-construction inputs, and real gloo
launches in which a sound dispatcher bounds its rate below 1 % per call and a dispatcher
that corrupts one row on about 1 call in 50 is caught, call by call."""
import json
import math
from pathlib import Path

import pytest
import torch

from ep_harness import rates
from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.families import dispatch as family
from ep_harness.families.moe_scenario import DispatchParams
from ep_harness.reference import deepep as ref_deepep
from ep_harness.selftest.wrap import rare_draw
from ep_harness.subjects.dispatch import deepep
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher
from tests import fake_deep_ep
from tests.conftest import REPO, run_cli
from tests.planted import rare_corruption
from tests.shared_runs import fail_run  # noqa: F401 (a fixture)
from tests.test_verify_cpu import records

SUITE = str(REPO / "tests/cases/corruption.toml")


# --- the bound ------------------------------------------------------------------------------

def test_upper_bound_is_clopper_pearson():
    assert rates.upper_bound(0, 600) == pytest.approx(1 - 0.05 ** (1 / 600), rel=1e-12)  # 0.498 %
    assert rates.upper_bound(0, 300) < 0.01 < rates.upper_bound(0, 250)  # 300 clean calls bound 1 %
    # scipy.stats.beta.ppf(0.95, k + 1, n - k), from its tables: 0.6066 (3 of 10), 0.04338 (7 of 300)
    assert rates.upper_bound(3, 10) == pytest.approx(0.606624, abs=1e-6)
    assert rates.upper_bound(7, 300) == pytest.approx(0.043379, abs=1e-6)
    for k, n in [(1, 600), (12, 600), (40, 1000)]:  # the defining equation: P(X <= k | UB) = 5 %
        assert rates.binomial_cdf(k, n, rates.upper_bound(k, n)) == pytest.approx(0.05, abs=1e-9)
        assert rates.upper_bound(k, n) > k / n
    assert rates.upper_bound(5, 5) == 1.0
    with pytest.raises(ValueError, match="need 0 <= k <= n"):
        rates.upper_bound(4, 3)


# --- the inputs -------------------------------------------------------------------------------

def _sum_in(order, y, w):
    acc = torch.zeros(y.shape[1])
    for j in order:
        acc = acc + w[j] * y[j].float()
    return acc


def test_every_order_and_grouping_of_a_call_gives_the_expected_bits():
    """Any sum order, and v1's per-rank bf16 partials, give exactly _expected_combined: one
    expectation fits every correct combine. Positive control: terms outside that construction
    (2^24, 1, -2^24) make the order and the grouping show."""
    p = DispatchParams(world_size=4, hidden=256, num_experts=16, topk=8)
    x, idx, w = family.call_inputs(p, 64, 3, 4)[1]
    want = family._expected_combined(x, idx, w).view(torch.int16)
    for t in range(x.shape[0]):
        y = torch.stack([(x[t].float() * family.call_expert_scale(int(e))).to(torch.bfloat16) for e in idx[t]])
        for order in (range(8), reversed(range(8)), [3, 1, 7, 0, 5, 2, 6, 4]):
            assert torch.equal(_sum_in(order, y, w[t]).to(torch.bfloat16).view(torch.int16), want[t])
        grouped = ref_deepep.combined_token(y, w[t], idx[t], p.num_experts // 4)  # v1: partials per rank
        assert torch.equal(grouped.view(torch.int16), want[t])
    big = torch.stack([torch.full((256,), 2.0 ** 24), torch.full((256,), -2.0 ** 24), torch.ones(256)]).bfloat16()
    ones = torch.ones(3)
    assert not torch.equal(_sum_in([0, 2, 1], big, ones).to(torch.bfloat16), _sum_in([0, 1, 2], big, ones).to(
        torch.bfloat16))
    grouped = ref_deepep.combined_token(big, ones, torch.tensor([0, 4, 1]), 4)  # (2^24 - 2^24) + 1 on rank 0, 1
    assert not torch.equal(grouped, _sum_in([0, 1, 2], big, ones).to(torch.bfloat16))


def test_inputs_that_cannot_be_exact_are_refused():
    assert family.exact_calls_possible(DispatchParams(topk=15, num_experts=16)) is None
    assert "use topk <= 15" in family.exact_calls_possible(DispatchParams(topk=16, num_experts=16))


# --- one rank, in process ---------------------------------------------------------------------

@pytest.fixture
def fake(monkeypatch):
    fake_deep_ep.CALLS.clear()
    monkeypatch.setattr(deepep._DeepEP, "module", staticmethod(lambda: fake_deep_ep))
    return fake_deep_ep.CALLS


def run_calls(subject, ctx, **params):
    return execute(single_check(subject, "corruption-rate", {"num_experts": 8, "hidden": 128, "calls": 30,
                                                              "call_tokens": [8, 24], **params}), subject, ctx)


@pytest.mark.parametrize("quant, layout", [("bf16", "contiguous"), ("fp8", "masked")])
def test_a_sound_dispatcher_has_no_corrupted_call(one_rank, quant, layout):
    m = run_calls(TorchAllToAllDispatcher(), one_rank, expert_quant=quant, layout=layout)
    rate = m.detail["corruption"]
    assert m.held and m.total > 0 and rate["corrupted"] == 0 and rate["calls"] == 60
    assert rate["per_tokens"].keys() == {"8", "24"} and rate["dispatch_unchecked"] is None
    assert rate["upper_bound"] == pytest.approx(1 - 0.05 ** (1 / 60))


class SwapsTwoReceivedRows(TorchAllToAllDispatcher):
    """Delivers two received rows in each other's place on call 4 (sources unchanged)."""

    name = "swaps_rows"
    calls = 0

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        received = super().dispatch(x, topk_idx, topk_weights, cfg, group)
        call, self.calls = self.calls, self.calls + 1
        if call == 4:
            rows = received.rows()
            rows[[0, 1]] = rows[[1, 0]].clone()
        return received


def test_a_wrong_received_row_is_a_hit_of_its_call(one_rank):
    m = run_calls(SwapsTwoReceivedRows(), one_rank, calls=10, call_tokens=[8])
    rate = m.detail["corruption"]
    assert not m.held and rate["corrupted"] == 1
    stages = {(h["call"], h["stage"]) for h in rate["hits"]}
    assert (4, "dispatch") in stages and all(call == 4 for call, _ in stages)


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_deepep_adapters_under_corruption_rate_on_the_fake(one_rank, fake, quant):
    """The fake stands for GPUs absent here: the adapters' wiring, not DeepEP's kernels."""
    for subject in (deepep.DeepEPElastic(), deepep.DeepEPNormal()):
        m = run_calls(subject, one_rank, calls=5, call_tokens=[8], expert_quant=quant)
        assert m.held and m.detail["corruption"]["dispatch_unchecked"] is None, (subject.name, m)


# --- real gloo launches -----------------------------------------------------------------------

def planted_calls(n: int, world: int, draw) -> list[tuple[int, int]]:
    return [(c, draw(c)[1]) for c in range(n) if draw(c)[0]]


@pytest.mark.slow
def test_planted_rare_corruption_is_caught_call_by_call(fail_run, smoke_run):
    """SUITE's planted case, in the shared failing run (tests/shared_runs.py), after its planted
    faults; the clean dispatcher, 300 calls of 32 tokens, is the smoke suite's dispatch-corruption
    (16 experts, corruption.toml's 8: what is bounded is the subject's per-call rate)."""
    proc, _, recs = fail_run
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [clean] = [r for r in records(smoke_run[1]) if r["case"] == "dispatch-corruption"]
    rare = recs["rare"]
    assert clean["subject"] == "torch_a2a_dispatch" and clean["params"]["calls"] == 300
    assert clean["status"] == "ok" and clean["detail"]["corruption"]["upper_bound"] < 0.01
    assert "0 of 300 calls corrupted, per-call rate <= 0.994%" in clean["reason"]
    expected = planted_calls(300, 4, lambda c: rare_corruption(c, 4))
    assert expected  # the seeded draw fires (7 times in 300 calls)
    got = rare["detail"]["corruption"]
    assert rare["status"] == "unexpected" and got["corrupted"] == len(expected)
    assert [(h["call"], h["rank"]) for h in got["hits"]] == expected
    assert all(h["stage"] == "combine" and h["elements"] == 1 for h in got["hits"])
    assert f"{len(expected)} of 300 calls corrupted" in rare["reason"]


# The selftest's clean dispatcher at 100 calls, not SUITE's 300 (which bound the rate below 1 %):
# the injection fires on 3 of them, enough to show it caught call by call, in both launches.
SELFTEST_CALLS = 100


@pytest.mark.slow
def test_selftest_rare_injection_is_caught(tmp_path):
    suite = tmp_path / "corruption.toml"
    text = Path(SUITE).read_text()
    assert text.count("calls = 300\n") == 2
    suite.write_text(text.replace("calls = 300\n", f"calls = {SELFTEST_CALLS}\n"))
    proc = run_cli("selftest", "--suite", str(suite), "--check", "a2a/*", "--injections", "rare", "--no-report",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "latest" / "selftest.json").read_text())
    assert result["blind"] == [] and result["tested"] == 1
    injected = json.loads((tmp_path / "latest" / "injected" / "rare.jsonl").read_text().splitlines()[0])
    expected = planted_calls(SELFTEST_CALLS, 4, lambda c: rare_draw(c, 50, 4))
    assert len(expected) >= 2  # the seeded draw fires (3 times in 100 calls)
    assert injected["detail"]["corruption"]["calls"] == SELFTEST_CALLS
    assert [(h["call"], h["rank"]) for h in injected["detail"]["corruption"]["hits"]] == expected
    assert math.isclose(injected["detail"]["corruption"]["rate"], len(expected) / SELFTEST_CALLS)
