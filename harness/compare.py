"""Bitwise comparison of observed copies against an expected copy.

Detection only: `compare_bitwise` returns a `Mismatch`, a plain structure that the record
stores and every view (terminal, HTML, assertion text) renders.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from harness.bits import hex_bits, int_view, ulp_distance
from harness.kernels.bitcompare import bitwise_stats

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

    def to_dict(self) -> dict:
        return asdict(self)


def json_float(x: float) -> float | str:
    """JSON has no NaN or infinity: keep them as strings."""
    return x if math.isfinite(x) else str(x)


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
    result = Mismatch(mismatched=mismatched, total=actual.numel())
    if not mismatched:
        result.max_abs, result.max_ulp = 0.0, 0
        return result
    diff = int_view(actual) != int_view(expected)
    result.mismatch_map = _map(diff, labels)

    ulps = ulp_distance(actual, expected)
    absdiff = (actual.double() - expected.double()).abs()
    absdiff = torch.where(diff, absdiff, torch.zeros_like(absdiff))
    absdiff = torch.nan_to_num(absdiff, nan=math.inf)
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
