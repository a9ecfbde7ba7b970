"""Dispatch: the wire-dtype contract, the DeepEP adapters' wiring against a recording fake,
real gloo dispatch checks, and the planted arrival-order combine (verify and explore)."""
import json
import shlex

import pytest
import torch

from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.families.moe_scenario import DispatchParams
from ep_harness.subjects.dispatch import deepep
from ep_harness.contracts import check_buffer_option, resolve_wire_dtype
from tests import fake_deep_ep
from tests.conftest import run_cli


@pytest.mark.parametrize("experts, wire", [("bf16", "fp8"), ("fp8", "bf16")])
def test_wire_contradicting_the_checkpoint_is_refused(experts, wire):
    with pytest.raises(ValueError, match=f"wire dtype {wire} contradicts the {experts} expert weights"):
        resolve_wire_dtype(experts, wire)


def test_wire_follows_the_checkpoint():
    assert resolve_wire_dtype("fp8") == "fp8" and resolve_wire_dtype("bf16", "auto") == "bf16"


@pytest.mark.parametrize("wire, flag", [("bf16", True), ("fp8", False)])
def test_buffer_option_against_the_wire_is_refused(wire, flag):
    with pytest.raises(ValueError, match=f"use_fp8_dispatch={flag} contradicts the {wire} wire dtype"):
        check_buffer_option(wire, flag)


@pytest.fixture
def fake(monkeypatch):
    fake_deep_ep.CALLS.clear()
    monkeypatch.setattr(deepep._DeepEP, "module", staticmethod(lambda: fake_deep_ep))
    return fake_deep_ep.CALLS


def run_check(subject, prop, ctx, **params):
    return execute(single_check(subject, prop, {"num_experts": 8, **params}), subject, ctx)


@pytest.mark.parametrize("name", ["deepep_v2", "deepep_v1", "deepep_v1_ll"])
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_deepep_wiring_against_the_recording_fake(one_rank, fake, name, quant):
    subject = {"deepep_v2": deepep.DeepEPElastic, "deepep_v1": deepep.DeepEPNormal,
               "deepep_v1_ll": deepep.DeepEPLowLatency}[name]()
    layout = "masked" if name == "deepep_v1_ll" else "contiguous"
    m = run_check(subject, "combine-reference", one_rank, expert_quant=quant, layout=layout)
    assert m.held, m
    kinds = {k: v for k, v in fake}
    dispatched = next(v for k, v in fake if k.endswith("dispatch"))
    if name == "deepep_v2":
        ctor = kinds["ElasticBuffer"]
        assert ctor["use_fp8_dispatch"] is (quant == "fp8")
        assert ctor["deterministic"] is True and ctor["allow_multiple_reduction"] is False
        assert dispatched["do_expand"] is True
    if name == "deepep_v1_ll":
        assert dispatched["dtype"] == torch.bfloat16 and dispatched["use_fp8"] is (quant == "fp8")
        assert kinds["Buffer"]["low_latency_mode"] is True
    else:
        assert dispatched["wire"] == quant
        if quant == "fp8":
            assert dispatched["dtype"] == torch.float8_e4m3fn and dispatched["scale_dtype"] == torch.float32
            assert dispatched["scale_shape"][1] == 256 // 128
        else:
            assert dispatched["dtype"] == torch.bfloat16
    assert any(k.endswith("combine") for k, _ in fake)


def test_deepep_is_skipped_with_the_import_error(monkeypatch):
    from ep_harness.subject import Platform

    deepep._import.clear()
    reason = deepep.DeepEPElastic().unavailable(Platform("nccl", "cuda", 4), DispatchParams())
    assert reason.startswith("deep_ep cannot be imported (ModuleNotFoundError: No module named 'deep_ep')")
    assert deepep.DeepEPElastic().unavailable(Platform("gloo", "cpu", 4), DispatchParams()) == \
        "DeepEP needs NVIDIA GPUs; this run is on the CPU"


@pytest.mark.slow
def test_planted_arrival_order_combine_fails_rank_invariance(planted_run):
    recs = {r["property"]: r for check, r in planted_run.items() if check.startswith("arrival-order/")}
    assert recs["rank-invariance"]["status"] == "unexpected" and recs["rank-invariance"]["mismatched"] > 0
    assert recs["rank-invariance"]["detail"]["order_sensitive"] > 0
    # As the batch grows the probe (a fixed global token) moves to another rank: caught too.
    assert recs["batch-invariance"]["status"] == "unexpected" and recs["batch-invariance"]["mismatched"] > 0


@pytest.mark.slow
def test_explore_finds_and_shrinks_the_planted_combine(tmp_path):
    store = tmp_path / "cx.jsonl"
    args = ["explore", "planted_arrival_order_combine", "--plugin", "tests.planted", "--budget", "120",
            "--store", str(store)]
    proc = run_cli(*args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [p.name.split("-")[0] for p in (tmp_path / "explore").iterdir()] == ["planted_arrival_order_combine"]
    example = json.loads(store.read_text().splitlines()[0])["example"]
    assert example["property"] == "rank-invariance"
    assert example["params"]["tokens"] * 4 <= 4  # one token per rank: at most 4 in the system
    assert "[[case]]" in proc.stdout and "# rerun: ep-harness verify --suite" in proc.stdout
    rerun = shlex.split(proc.stdout.split("# rerun: ")[1].strip())
    again = run_cli(*rerun[1:], "--no-report", "--out", str(tmp_path / "rerun"))
    assert again.returncode == 1 and "unexpected" in again.stdout
    replay = run_cli(*args)
    assert "1 known counterexample(s) replayed first" in replay.stdout and replay.returncode == 1


def test_deepep_v1_rows_carry_their_sources_and_the_config_used(one_rank, fake):
    """The dispatch reference compares every received row with the row sent, sorted by
    (expert, source rank, token, slot): with the sources filled it is not vacuous."""
    m = run_check(deepep.DeepEPNormal(), "reference", one_rank)
    assert m.held and m.total > 0, m
    dispatched = next(v for k, v in fake if k == "Buffer.dispatch")
    assert dispatched["config"].fields == deepep.V1_CONFIGS[2][0]
    assert m.detail["subject_info"]["dispatch_config"]["num_sms"] == 20
    assert m.detail["subject_info"]["fill_uninitialized_memory"].startswith("off")


def test_deepep_v1_without_its_kernels_is_an_error(one_rank, fake, monkeypatch):
    """A DeepEP check during which no DeepEP kernel ran (a silent fallback) is an error; the
    fake emits profiler ranges named like DeepEP's kernels, or none."""
    m = run_check(deepep.DeepEPNormal(), "combine-reference", one_rank)
    assert m.error is None and any("intranode::combine<" in k for k in m.kernels)
    monkeypatch.setattr(fake_deep_ep, "EMIT_KERNELS", False)
    m = run_check(deepep.DeepEPNormal(), "combine-reference", one_rank)
    assert m.held and m.error and "deepep_v1 declares kernels" in m.error and "none ran" in m.error


def test_deepep_v1_predicts_its_combine_exactly(one_rank, fake):
    m = run_check(deepep.DeepEPNormal(), "position-invariance", one_rank)
    assert m.order_model_exact and m.predicted_mismatched == m.mismatched == 0


def test_deepep_skips_say_why(fake):
    from ep_harness.subject import Platform

    gpu = Platform("nccl", "cuda", 8, gpus=1, emulation="hosts")
    assert deepep.DeepEPLowLatency().unavailable(gpu, DispatchParams(world_size=4)).startswith(
        "DeepEP's low-latency mode needs NVSHMEM with IBGDA and one GPU per rank; this run has 4 ranks on 1 GPU")
    assert "take 2, 4 or 8 ranks" in deepep.DeepEPNormal().unavailable(gpu, DispatchParams(world_size=3, hidden=256))
    assert "up to 8176 wide" in deepep.DeepEPNormal().unavailable(gpu, DispatchParams(world_size=4, hidden=8192))
    assert deepep.DeepEPNormal().unavailable(gpu, DispatchParams(world_size=4, hidden=2048)) is None


def test_deepep_v2_skips_where_deep_ep_has_no_elastic_buffer(monkeypatch):
    from ep_harness.subject import Platform

    class V1Only:
        pass

    monkeypatch.setattr(deepep._DeepEP, "module", staticmethod(lambda: V1Only))
    reason = deepep.DeepEPElastic().unavailable(Platform("nccl", "cuda", 4, gpus=4), DispatchParams())
    assert reason.startswith("deep_ep") and "has no ElasticBuffer" in reason


def test_deepep_combine_model_adds_holders_in_ascending_rank_order():
    """float32 from +0.0 in ascending rank: (2^24 + 1) rounds back to 2^24, so ranks 0, 1, 2
    holding 2^24, 1, -2^24 give 0, where rank order 2, 1, 0 would give 1 (measured on the
    H200: the model matched every element of DeepEP v1.2.1's combine)."""
    from ep_harness.reference.deepep import combined_token, intranode_combine

    bf = lambda v: torch.tensor([v], dtype=torch.bfloat16)  # noqa: E731
    assert intranode_combine({2: bf(-2.0 ** 24), 0: bf(2.0 ** 24), 1: bf(1.0)}).item() == 0.0
    assert intranode_combine({0: bf(-2.0 ** 24), 1: bf(1.0), 2: bf(2.0 ** 24)}).item() == 1.0
    assert intranode_combine({3: bf(-0.0)}).view(torch.int16).item() == 0  # +0.0: the sum starts there
    # a token's slots fold per holder rank first (experts 0, 1 on rank 0; 4 on rank 1 of 4 per rank)
    y = torch.tensor([[2.0 ** 24], [1.0], [-2.0 ** 24]], dtype=torch.bfloat16)
    w = torch.ones(3)
    assert combined_token(y, w, torch.tensor([0, 4, 1]), 4).item() == 1.0  # rank 0: 2^24 - 2^24, then + 1


def test_deepep_v2_wiring_follows_its_source_api(one_rank, fake):
    """As SGLang calls it (deep_ep/buffers/elastic.py at dd758ca): deterministic buffer, one
    reduction, expand mode with a CPU sync and int64 top-k ids, and no weights to combine
    (expand mode with allow_multiple_reduction=False takes none); the fake stands for the GPU."""
    m = run_check(deepep.DeepEPElastic(), "reference", one_rank)
    assert m.held and m.total > 0, m  # rows matched to their sources through recv_src_metadata
    calls = dict(fake)
    assert calls["ElasticBuffer"]["explicitly_destroy"] is True and calls["ElasticBuffer"]["num_topk"] == 4
    assert calls["ElasticBuffer.dispatch"]["do_cpu_sync"] is True
    assert calls["ElasticBuffer.dispatch"]["topk_idx_dtype"] == torch.int64
    assert calls["ElasticBuffer.combine"]["topk_weights"] is None
    info = m.detail["subject_info"]["elastic_options"]
    assert info["deterministic"] and not info["allow_multiple_reduction"] and info["num_sms"] == 4
    assert any("combine_reduce_epilogue_impl<" in k for k in m.kernels)


def test_deepep_v2_predicts_its_combine_exactly(one_rank, fake):
    m = run_check(deepep.DeepEPElastic(), "position-invariance", one_rank)
    assert m.order_model_exact and m.predicted_mismatched == m.mismatched == 0
    assert m.sensitivity > 0


def test_deepep_v2_combine_model_reduces_once_in_slot_order():
    """Read from combine_reduce_epilogue.cuh / combine_utils.cuh: valid slots in ascending
    order, float32 from +0.0, one rounding; at most two slots and no bias: one bf16 add.
    Constructed so that each rule shows: (2^24 + 1) - 2^24 in float32 is 0, in the other
    order 1; per-rank pre-reduction (v1) would give another answer."""
    from ep_harness.reference.deepep import combined_token, expand_combined_token, expand_reduce

    bf = lambda *v: torch.tensor([[x] for x in v], dtype=torch.bfloat16)  # noqa: E731
    rows = bf(2.0 ** 24, 1.0, -(2.0 ** 24))
    assert expand_reduce(rows, [True, True, True]).item() == 0.0  # slot order: 2^24 + 1 rounds back
    assert expand_reduce(bf(2.0 ** 24, -(2.0 ** 24), 1.0), [True, True, True]).item() == 1.0
    assert expand_reduce(rows, [True, False, True]).item() == 0.0  # an empty slot is skipped
    # the bf16 bypass: -0 + -0 stays -0 with two slots; one slot adds +0.0, so -0 becomes +0
    assert expand_reduce(bf(-0.0, -0.0), [True, True]).view(torch.int16).item() == torch.tensor(
        -0.0, dtype=torch.bfloat16).view(torch.int16).item()
    assert expand_reduce(bf(-0.0, 5.0), [True, False]).view(torch.int16).item() == 0
    # bias first, then slots: bias 2^24, rows 1 and -2^24 -> 0 (slots first would give 1)
    assert expand_reduce(bf(1.0, -(2.0 ** 24)), [True, True], (bf(2.0 ** 24)[0],)).item() == 0.0
    # experts 0 and 2 on rank 0, expert 4 on rank 1 (4 per rank): v1 pre-reduces rank 0's pair
    y, w, experts = bf(2.0 ** 24, 1.0, -(2.0 ** 24)), torch.ones(3), torch.tensor([0, 4, 2])
    assert expand_combined_token(y, w, experts).item() == 0.0
    assert combined_token(y, w, experts, 4).item() == 1.0  # v1: (2^24 - 2^24) on rank 0, then + 1
    # weights are applied per row, float32 product, one bf16 rounding each: 0.75 * 257 (bf16 256)
    # = 192, exact; 0.3 * 3 = 0.9 rounds to bf16 0.8984375 before the sum
    w3 = torch.tensor([0.75, 0.3, 0.5])
    y3 = bf(257.0, 3.0, 1.0)
    want = torch.tensor(192.0 + torch.tensor(0.3 * 3, dtype=torch.bfloat16).item() + 0.5).to(torch.bfloat16)
    assert expand_combined_token(y3, w3, torch.tensor([1, 2, 3])).item() == want.item() == 193.0
