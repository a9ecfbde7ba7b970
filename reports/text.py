"""Plain-text renderings of one record, in torch.testing.assert_close's words."""
from __future__ import annotations

DASH = "-"
NONFINITE_WORDS = {"nan": "NaN where the reference is finite", "+inf": "+Inf where the reference is finite",
                   "-inf": "-Inf where the reference is finite",
                   "reference_nonfinite": "finite where the reference is NaN or Inf",
                   "other_nonfinite": "another NaN or Inf than the reference's (-Inf for +Inf, NaN for Inf)"}
def nonfinite_words(key: str, property_name) -> str:
    """NONFINITE_WORDS for a record: an invariance check compares with its first copy, not a reference."""
    from ep_harness.properties import PROPERTIES

    words, prop = NONFINITE_WORDS.get(key, key), PROPERTIES.get(property_name)
    return words if prop is None or prop.needs_reference else words.replace("the reference", "the first copy")


BIT_ONLY_WORDS = {"signed_zero": "+0.0 vs -0.0", "nan_payload": "NaN vs NaN with another payload"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fmt_int(n) -> str:
    """Renderers take records as data: a value of another type is shown as it is, never trusted."""
    return DASH if n is None else f"{n:,}" if isinstance(n, int) else str(n)


def fmt_count(mismatched, total) -> str:
    if mismatched is None or total is None:
        return DASH
    if not (_number(mismatched) and _number(total)):
        return f"{mismatched} / {total}"
    pct = 100.0 * mismatched / total if total else 0.0
    return f"{mismatched:,} / {total:,} ({pct:.1f}%)"


def fmt_float(x, digits: int = 3) -> str:
    if x is None:
        return DASH
    return f"{x:.{digits}g}" if _number(x) else str(x)


def cost_text(rec: dict) -> str:
    """A GPU check's measured cost (detail.cost: harness/cost/timing.py), e.g. '769 TFLOP/s (77.7% of
    bf16 peak), 1.00x torch_mm'; '' where none was measured (the CPU), never a zero."""
    c = (rec.get("detail") or {}).get("cost")
    if not isinstance(c, dict):
        return ""
    if c.get("unavailable"):  # the calls could not be timed (detail.cost says why): no number, not a zero
        return "not timed"
    rate = f"{fmt_float(c['tflops'], 4)} TFLOP/s" if _number(c.get("tflops")) else \
        f"{fmt_float(c['gbps'], 4)} GB/s" if _number(c.get("gbps")) else ""
    if not rate:
        return ""
    peak = f" ({c['pct_of_peak']:.1f}% of {c.get('peak')} peak)" if _number(c.get("pct_of_peak")) else ""
    ratio = f", {c['time_vs_baseline']:.2f}x {c.get('baseline')}" if _number(c.get("time_vs_baseline")) else ""
    return rate + peak + ratio


def mismatch_text(rec: dict) -> str:
    """The assertion message for a record, e.g. `Mismatched elements: 2550 / 8192 (31.1%)`."""
    mismatched, total = rec.get("mismatched"), rec.get("total")
    if mismatched is None:
        return rec.get("reason") or "no measurement"
    # The comparison kind decides the words: bitwise equality, or closeness within a bound.
    bitwise = rec.get("comparison", "bounded" if rec.get("tolerance") else "bitwise") == "bitwise"
    lines = [f"Tensor-likes are {'not equal' if bitwise else 'not close'}!" if mismatched
             else f"Tensor-likes are {'equal' if bitwise else 'close'}.", ""]
    lines.append(f"Mismatched elements: {fmt_count(mismatched, total).replace(',', '')}")
    detail = rec.get("detail", {})
    if mismatched and rec.get("max_abs") is not None:
        idx = detail.get("max_abs_index")
        where = f" at index {tuple(idx)}" if idx else ""
        lines.append(f"Greatest absolute difference: {fmt_float(rec['max_abs'], 6)}{where}")
    if mismatched and rec.get("max_ulp") is not None:
        idx = detail.get("max_ulp_index")
        where = f" at index {tuple(idx)}" if idx else ""
        lines.append(f"Greatest ULP distance: {rec['max_ulp']}{where}")
    nonfinite = rec.get("nonfinite")
    if isinstance(nonfinite, dict) and nonfinite:
        lines.append("Non-finite: " + ", ".join(f"{nonfinite_words(k, rec.get('property'))}: {fmt_int(n)}" for k, n in nonfinite.items()))
    bit_only = detail.get("bit_only")
    if isinstance(bit_only, dict) and bit_only:
        lines.append("Compared as bit patterns, so these count although they compare equal as values: "
                     + ", ".join(f"{BIT_ONLY_WORDS.get(k, k)}: {fmt_int(n)}" for k, n in bit_only.items()))
    first = rec.get("first_mismatch")
    if first:
        lines.append(
            f"First mismatch: index {tuple(first['index'])} ({first['row']}): "
            f"{first['actual']} ({first['actual_bits']}) != {first['expected']} ({first['expected_bits']}), "
            f"{first['ulp']} ULP"
        )
    if rec.get("tolerance"):
        tol = rec["tolerance"]
        lines.append(f"Error vs reference (max |err| / bound): {fmt_float(rec.get('error_vs_reference'))} "
                     f"(up to {fmt_float(tol.get('allowed'))} allowed: {tol.get('rule')})")
    if rec.get("predicted_mismatched") is not None:
        lines.append(f"Order model ({detail.get('order_model', '?')}) predicted: {rec['predicted_mismatched']}")
    lines.append(f"Rerun: {rec['rerun']}")
    return "\n".join(lines)
