"""From a measurement to a status: controls, fixes, `expect = model`, and measurements taken
under conditions other than the ones pinned."""
import json
from types import SimpleNamespace

from ep_harness.check import single_check
from ep_harness.launch.launcher import Outcome
from ep_harness.measurement import Measurement
from ep_harness.subjects.collective.reduce_scatter_native import NativeReduceScatter
from ep_harness.verdict import decide
from ep_harness.run.verify import finalize


def measured(mismatched, total, predicted=None, exact=False, vacuous=None, **kw):
    return Measurement(comparison="bitwise", mismatched=mismatched, total=total, held=mismatched == 0,
                       predicted_mismatched=predicted,
                       order_model_exact=exact, vacuous_reason=vacuous, **kw)


def test_model_expectation_follows_an_exact_prediction():
    model = SimpleNamespace(expect="model")
    assert decide(model, measured(3236, 16384, 3236, True)) == (
        "ok", "violated as the order model predicts: 3,236 / 16,384 differ: 3,236 in value, predicted 3,236")
    assert decide(model, measured(0, 8192, 0, True))[0] == "ok"
    # A miss is a failure, and so is an expectation that no exact model backs.
    assert decide(model, measured(0, 8192, 12, True))[0] == "unexpected"
    status, reason = decide(model, measured(0, 8192))
    assert status == "unexpected" and "needs an exact order-model prediction" in reason
    # Vacuity still wins over a matching prediction.
    assert decide(model, measured(0, 8, 0, True, vacuous="two ranks"))[0] == "vacuous"


def test_a_check_measured_under_another_nccl_algorithm_is_an_error():
    check = single_check(NativeReduceScatter(), "rank-invariance", {"dtype": "bfloat16", "world_size": 4},
                         expect="violated")
    calls = ["ReduceScatter 8,192 B: PAT/SIMPLE, channels 0..1"]
    m = measured(10, 100, 10, True, nccl_calls=calls,
                 error="NCCL_ALGO=reducescatter:ring pins ReduceScatter to RING, but NCCL ran " + calls[0])
    rec = finalize(check, Outcome(1.0, measured=m), "run", "rerun")
    assert rec["status"] == "error" and "pins ReduceScatter to RING" in rec["reason"]
    assert rec["nccl_calls"] == calls and rec["mismatched"] == 10
    assert rec["params"]["hidden"] == 2048 and rec["params"]["seed"] == 0  # every effective parameter


def test_a_measurement_travels_as_asdict_would_send_it_and_comes_back_equal():
    """to_json is shallow (no deep copy of the evidence): the same values as asdict, the bound
    as a plain dict, and from_json rebuilds an equal Measurement."""
    from dataclasses import asdict

    import torch

    from ep_harness.compare import compare_bitwise
    from ep_harness.measurement import Bound

    got = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.5, -0.0]], dtype=torch.bfloat16)
    m = Measurement.bitwise(compare_bitwise(got, got[0]), predicted_mismatched=2, detail={"copies": [{"n": 1}]})
    m.bound = Bound(rule="|err| <= u", terms={"u": 2.0 ** -8})
    sent = m.to_json()
    assert sent == asdict(m) and isinstance(sent["bound"], dict) and sent["mismatched"] == 2
    assert Measurement.from_json(sent) == m
    # a subject's describe() may hold a dataclass: it travels as a dict, as asdict sent it
    from typing import NamedTuple

    class Hit(NamedTuple):
        row: str
        where: Bound

    m.detail["subject_info"] = {"backend": Bound(rule="a kernel's own")}
    m.detail["hits"] = [Hit("token 3", Bound(rule="r"))]
    assert m.to_json() == asdict(m)
    sent = json.loads(json.dumps(m.to_json()))["detail"]
    assert sent["subject_info"] == {"backend": asdict(Bound(rule="a kernel's own"))}
    assert sent["hits"] == [["token 3", asdict(Bound(rule="r"))]]
