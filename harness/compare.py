"""Bitwise comparison of observed copies against an expected copy.

Detection only: `compare_bitwise` returns a `Mismatch`, a plain structure that the record
stores and every view (terminal, HTML, assertion text) renders.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ep_harness.bits import hex_bits, int_view, ulp_distance
from ep_harness.fingerprint import bits_blocks, bits_fingerprint
from ep_harness.kernels.bitcompare import bitwise_stats

MAP_COLUMNS = 64
FIRST_MISMATCHES = 8
ULP_BUCKETS = ("1", "2", "3-4", "5-16", "17-256", ">256")


@dataclass
class Mismatch:
    mismatched: int
    total: int
    max_abs: float | None = None
    max_abs_index: list[int] | None = None
    max_ulp: int | None = None
    max_ulp_index: list[int] | None = None
    first_mismatch: dict | None = None
    first_mismatches: list[dict] = field(default_factory=list)
    ulp_histogram: dict[str, int] = field(default_factory=dict)
    mismatch_map: dict | None = None
    nonfinite: dict | None = None  # {"nan": n, "+inf": n, "-inf": n, "reference_nonfinite": n, "other_nonfinite": n}
    bit_only: dict | None = None  # differences no value comparison sees: {"signed_zero": n, "nan_payload": n}
    rows_differing: int | None = None  # observed copies (runs, repeats) with any differing element
    rows: int | None = None
    bits_fingerprint: str | None = None  # order-sensitive digest of every compared element (golden bits)
    bits_blocks: dict | None = None  # the same per block of elements: where bits moved between runs

    def to_dict(self) -> dict:
        return asdict(self)


def json_float(x: float) -> float | str:
    """JSON has no NaN or infinity: keep them as strings."""
    return x if math.isfinite(x) else str(x)


def _widened(t: torch.Tensor) -> torch.Tensor:
    """FP8 as float32 (exact, NaN and signs kept): torch has no isfinite/isnan for FP8."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def nonfinite_counts(actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None) -> dict:
    """How many elements of `actual` are NaN, +Inf or -Inf where `expected` is finite, how
    many are finite where `expected` is not (a non-finite value lost), and how many are
    another non-finite value than `expected`'s (-Inf for +Inf, NaN for an infinity): only
    the non-zero counts, so an all-finite comparison gives {}."""
    actual, expected = _widened(actual), _widened(expected)
    a_finite, e_finite = torch.isfinite(actual), torch.isfinite(expected)
    where = torch.ones_like(a_finite) if where is None else where
    new = ~a_finite & e_finite & where
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    counts = {"nan": int((new & torch.isnan(actual)).sum()),
              "+inf": int((new & (actual == math.inf)).sum()),
              "-inf": int((new & (actual == -math.inf)).sum()),
              "reference_nonfinite": int((a_finite & ~e_finite & where).sum()),
              "other_nonfinite": int((~a_finite & ~e_finite & ~both_nan & (actual != expected) & where).sum())}
    return {k: n for k, n in counts.items() if n}


def _bit_only(actual: torch.Tensor, expected: torch.Tensor, diff: torch.Tensor) -> dict:
    """Differing bit patterns that compare equal as values (+0.0 vs -0.0) or are both NaN
    (another payload): a bitwise check counts them, and the report says why."""
    if not actual.is_floating_point():
        return {}
    actual, expected = _widened(actual), _widened(expected)
    counts = {"signed_zero": int((diff & (actual == 0) & (expected == 0)).sum()),
              "nan_payload": int((diff & torch.isnan(actual) & torch.isnan(expected)).sum())}
    return {k: n for k, n in counts.items() if n}


def _bucket(ulps: torch.Tensor) -> dict[str, int]:
    edges = [(1, 1), (2, 2), (3, 4), (5, 16), (17, 256), (257, None)]
    out = {}
    for name, (lo, hi) in zip(ULP_BUCKETS, edges):
        sel = ulps >= lo if hi is None else (ulps >= lo) & (ulps <= hi)
        out[name] = int(sel.sum())
    return out


def _map(diff: torch.Tensor, row_labels: list[str]) -> dict:
    """Fraction of differing elements per (row, column bin): a small heat map, built on the
    tensors' device by a reshape-and-sum (deterministic; no atomics) and one small transfer."""
    rows, n = diff.shape
    bins = min(MAP_COLUMNS, n)
    width = -(-n // bins)
    bins = -(-n // width)
    padded = torch.nn.functional.pad(diff.to(torch.int32), (0, bins * width - n))
    counts = padded.view(rows, bins, width).sum(dim=2)
    widths = torch.full((bins,), width, dtype=torch.float64, device=diff.device)
    widths[-1] = n - width * (bins - 1)
    fraction = (counts.double() / widths).round(decimals=4).cpu().tolist()
    return {"rows": row_labels, "columns": n, "bins": bins, "fraction": fraction}


def compare_bitwise(
    actual: torch.Tensor, expected: torch.Tensor, row_labels: list[str] | None = None
) -> Mismatch:
    """Compare `actual` [R, N] with `expected` ([R, N] or [N]) bit for bit.

    Rows are the observed copies (a destination rank, a batch size, a repeat); labels
    name them in the first-mismatch detail and in the map. NaNs with equal bits match.
    """
    if actual.dim() == 1:
        actual = actual.unsqueeze(0)
    expected = expected.expand_as(actual) if expected.dim() == 1 else expected
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        raise ValueError(
            f"cannot compare {tuple(actual.shape)} {actual.dtype} with {tuple(expected.shape)} {expected.dtype}"
        )
    actual, expected = actual.detach(), expected.detach()
    labels = row_labels or [str(r) for r in range(actual.shape[0])]
    mismatched, _, _ = bitwise_stats(actual, expected.contiguous())  # fused on CUDA
    result = Mismatch(mismatched=mismatched, total=actual.numel(), rows=actual.shape[0],
                      bits_fingerprint=bits_fingerprint(actual), bits_blocks=bits_blocks(actual))
    if not mismatched:
        result.max_abs, result.max_ulp, result.rows_differing = 0.0, 0, 0
        return result
    diff = int_view(actual) != int_view(expected)
    result.rows_differing = int(diff.any(dim=1).sum())
    result.mismatch_map = _map(diff, labels)
    if actual.is_floating_point():
        result.nonfinite = nonfinite_counts(actual, expected, diff) or None
        result.bit_only = _bit_only(actual, expected, diff) or None

    ulps = ulp_distance(actual, expected)
    absdiff = (actual.double() - expected.double()).abs()
    both_nan = torch.isnan(actual.double()) & torch.isnan(expected.double())  # another payload: bits, not value
    absdiff = torch.where(diff & ~both_nan, absdiff, torch.zeros_like(absdiff))
    absdiff = torch.nan_to_num(absdiff, nan=math.inf, posinf=math.inf)  # keep Inf: not the largest float
    flat_abs = int(absdiff.reshape(-1).argmax())
    ulps_masked = torch.where(diff, ulps, torch.zeros_like(ulps))
    flat_ulp = int(ulps_masked.reshape(-1).argmax())
    n = actual.shape[1]
    result.max_abs = json_float(float(absdiff.reshape(-1)[flat_abs]))
    result.max_abs_index = [flat_abs // n, flat_abs % n]
    result.max_ulp = int(ulps_masked.reshape(-1)[flat_ulp])
    result.max_ulp_index = [flat_ulp // n, flat_ulp % n]
    result.ulp_histogram = _bucket(ulps[diff])  # mismatching elements only: small

    where = diff.reshape(-1).nonzero().flatten()[:FIRST_MISMATCHES]
    for flat in where.tolist():
        r, e = flat // n, flat % n
        a, x = actual[r, e], expected[r, e]
        result.first_mismatches.append({
            "index": [r, e],
            "row": labels[r],
            "actual": json_float(float(a)),
            "expected": json_float(float(x)),
            "actual_bits": hex_bits(a),
            "expected_bits": hex_bits(x),
            "ulp": int(ulps[r, e]),
        })
    result.first_mismatch = result.first_mismatches[0]
    return result
