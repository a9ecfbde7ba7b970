"""From a measurement to a status: ok, unexpected, vacuous (error and skipped come from
the launcher and the planner)."""
from __future__ import annotations

STATUSES = ("ok", "unexpected", "vacuous", "error", "skipped")
FAILING = ("unexpected", "error")


def decide(
    expect: str,
    held: bool,
    mismatched: int,
    total: int,
    vacuous_reason: str | None = None,
    predicted: int | None = None,
    prediction_exact: bool = False,
    extra_failure: str | None = None,
) -> tuple[str, str]:
    """Return (status, reason) for one check."""
    counts = f"{mismatched:,} / {total:,} differ"
    if extra_failure:
        return "unexpected", extra_failure
    if prediction_exact and predicted is not None and predicted != mismatched:
        return "unexpected", f"order model predicted {predicted:,} mismatched, measured {mismatched:,}"
    if vacuous_reason:
        return "vacuous", f"could not fail: {vacuous_reason}"
    if expect == "model":  # the exact order model decides whether it holds
        if predicted is None or not prediction_exact:
            return "unexpected", f"expect = model needs an exact order-model prediction and none was made ({counts})"
        verdict = "holds" if held else "violated"
        return "ok", f"{verdict} as the order model predicts: {counts}, predicted {predicted:,}"
    if expect == "holds":
        return ("ok", f"holds: {counts}") if held else ("unexpected", f"expected to hold, but {counts}")
    if expect == "violated":
        return ("ok", f"control shows the violation: {counts}") if not held else (
            "unexpected", f"control expected to show a violation, but {counts}"
        )
    raise ValueError(f"unknown expectation {expect!r}")
