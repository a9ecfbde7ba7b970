"""From a measurement to a status: ok, unexpected, vacuous (error and skipped come from
the launcher and the planner)."""
from __future__ import annotations

from ep_harness import properties
from ep_harness.measurement import Measurement


def nonfinite_text(nonfinite: dict | None, against: str = "the reference") -> str:
    """' (1 NaN, 2 +Inf where the reference is finite)' or ''. `against`: what the copies
    were compared with (an invariance check's is its first copy, not a reference)."""
    if not nonfinite:
        return ""
    names = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}
    parts = [f"{n:,} {names[k]}" for k, n in nonfinite.items() if k in names]
    text = ", ".join(parts) + f" where {against} is finite" if parts else ""
    lost = nonfinite.get("reference_nonfinite")
    if lost:
        text += ("; " if text else "") + f"{lost:,} finite where {against} is not"
    other = nonfinite.get("other_nonfinite")
    if other:
        text += ("; " if text else "") + f"{other:,} another NaN or Inf than {against}'s"
    return f" ({text})"


def kinds_text(m: Measurement) -> str:
    """What kind of difference a comparison counted: ': 2,040 in value, 8 signed zeros
    (+0.0 vs -0.0), 1 NaN payload' (non-finite ones are named by nonfinite_text), or ''. A
    bounded comparison names its kinds only where it counted signed zeros (Measurement.within's
    zero_signs), its others being beyond their bound."""
    if not m.mismatched or (m.comparison != "bitwise" and not m.bit_only):
        return ""
    bit_only, nonfinite = m.bit_only or {}, m.nonfinite or {}
    zeros, payloads = bit_only.get("signed_zero", 0), bit_only.get("nan_payload", 0)
    odd = sum(nonfinite.values())
    value = "in value" if m.comparison == "bitwise" else "beyond their bound"
    parts = [(m.mismatched - zeros - payloads - odd, value), (odd, "non-finite"),
             (zeros, "signed zeros (+0.0 vs -0.0)"), (payloads, "NaN payloads (both NaN, other bits)")]
    return ": " + ", ".join(f"{n:,} {what}" for n, what in parts if n > 0)


def vacuity_estimate(m: Measurement) -> str | None:
    """Why the check was expected to be unable to fail, when it measured a difference all the
    same (a measured difference is never vacuous: the estimate covers reorderings only)."""
    if not m.mismatched:
        return None
    return m.vacuous_reason or m.detail.get("vacuity_estimate")


def runs_text(check, m: Measurement) -> str:
    """How many of a repeating check's compared copies differ from the first: in repeats
    where each repeat is one copy, else in copies (rows are repeats x copies per repeat)."""
    repeats = getattr(getattr(check, "params", None), "repeats", None)
    if isinstance(repeats, int) and repeats > 1 and m.rows == repeats:
        return f"; {m.rows_differing} of {repeats - 1} repeats differ from the first"
    per = f" ({repeats} repeats x {m.rows // repeats} copies)" if isinstance(repeats, int) and repeats > 1 \
        and m.rows % repeats == 0 else ""
    return f"; {m.rows_differing} of {m.rows - 1} compared copies{per} differ from the first"


def compared_with(prop) -> str:
    return "the reference" if prop is None or prop.needs_reference else "the first copy"


def decide(check, m: Measurement) -> tuple[str, str]:
    """Return (status, reason) for a Check from its expectation and its measurement. A check
    that measured a difference is never vacuous, whatever its vacuity estimate said."""
    expect = check.expect
    prop = properties.PROPERTIES.get(getattr(check, "property", None))
    counts = f"{m.mismatched:,} / {m.total:,} differ{nonfinite_text(m.nonfinite, compared_with(prop))}{kinds_text(m)}"
    rate = m.detail.get("corruption") if isinstance(m.detail, dict) else None
    if rate:  # corruption-rate: k of n calls, and how rare a defect 0 of n rules out
        counts += (f"; {rate['corrupted']} of {rate['calls']} calls corrupted, per-call rate <= "
                   f"{rate['upper_bound']:.3%} ({rate['confidence']:.0%}, {rate['bound']})")
    elif prop is not None and prop.counts_runs and m.rows_differing:  # k of n: how often, not whether
        counts += runs_text(check, m)
    if m.extra_failure:
        return "unexpected", m.extra_failure + nonfinite_text(m.nonfinite, compared_with(prop))
    exact = bool(m.order_model_exact) and m.predicted_mismatched is not None
    if exact and m.predicted_mismatched != m.mismatched:
        return "unexpected", f"order model predicted {m.predicted_mismatched:,} mismatched, measured {m.mismatched:,}"
    if m.vacuous_reason and not m.mismatched:
        return "vacuous", f"could not fail: {m.vacuous_reason}"
    estimate = vacuity_estimate(m)
    if estimate:  # measured anyway: not an order effect the estimate models, so say what it ruled out
        counts += f" (measured although the vacuity estimate said none could differ: {estimate})"
    if expect == "model":  # the exact order model decides whether it holds
        if not exact:
            return "unexpected", f"expect = model needs an exact order-model prediction and none was made ({counts})"
        verdict = "holds" if m.held else "violated"
        return "ok", f"{verdict} as the order model predicts: {counts}, predicted {m.predicted_mismatched:,}"
    if expect == "measure":  # a fact about this machine's library: its count, never a failure
        found = "holds" if m.held else "does not hold"
        return "ok", f"measured, not asserted: {found} on this machine ({counts})"
    if expect == "holds":
        return ("ok", f"holds: {counts}") if m.held else ("unexpected", f"expected to hold, but {counts}")
    if expect == "violated":
        return ("ok", f"control shows the violation: {counts}") if not m.held else (
            "unexpected", f"control expected to show a violation, but {counts}"
        )
    raise ValueError(f"unknown expectation {expect!r}")
