"""From a measurement to a status: controls, fixes, `expect = model`, and measurements taken
under conditions other than the ones pinned."""
from harness.launch import Outcome
from harness.verdict import decide
from harness.verify import finalize


def test_model_expectation_follows_an_exact_prediction():
    assert decide("model", False, 3236, 16384, predicted=3236, prediction_exact=True) == (
        "ok", "violated as the order model predicts: 3,236 / 16,384 differ, predicted 3,236")
    assert decide("model", True, 0, 8192, predicted=0, prediction_exact=True)[0] == "ok"
    # A miss is a failure, and so is an expectation that no exact model backs.
    assert decide("model", True, 0, 8192, predicted=12, prediction_exact=True)[0] == "unexpected"
    status, reason = decide("model", True, 0, 8192, predicted=None, prediction_exact=False)
    assert status == "unexpected" and "needs an exact order-model prediction" in reason
    # Vacuity still wins over a matching prediction.
    assert decide("model", True, 0, 8, vacuous_reason="two ranks", predicted=0, prediction_exact=True)[0] == "vacuous"


def test_a_check_measured_under_another_nccl_algorithm_is_an_error():
    check = {"id": "c", "case": "c", "subject": "s", "family": "collective", "property": "rank-invariance",
             "params": {}, "expect": "violated", "skip_reason": None}
    measured = {"held": False, "mismatched": 10, "total": 100, "predicted_mismatched": 10,
                "order_model_exact": True, "nccl_calls": ["ReduceScatter 8,192 B: PAT/SIMPLE, channels 0..1"],
                "error": "NCCL_ALGO=reducescatter:ring pins ReduceScatter to RING, but NCCL ran ReduceScatter "
                         "8,192 B: PAT/SIMPLE, channels 0..1"}
    rec = finalize(check, Outcome(1.0, measured=measured), "run", "rerun")
    assert rec["status"] == "error" and "pins ReduceScatter to RING" in rec["reason"]
    assert rec["nccl_calls"] == measured["nccl_calls"] and rec["mismatched"] == 10
