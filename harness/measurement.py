"""What a check measured, typed: the comparison it made, against which bound, and why it
could or could not have failed. Families build one; the driver adds what every family
shares (vacuity, NCCL calls); `verify.finalize` turns it into a record.

Comparison kinds:

* `bitwise`: the observed bits against the expected bits (atol = rtol = 0);
* `bounded`: every element within its own error bound of the float64 (or exact) reference.
  `error_vs_reference` is then always the same ratio: max over elements of |err| / bound,
  so 1.0 is at the bound and anything above it is a mismatch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from harness.compare import Mismatch, json_float

COMPARISONS = ("bitwise", "bounded")


@dataclass
class Bound:
    """The error bound of a `bounded` comparison: the rule per element and its parameters."""

    rule: str
    allowed: float = 1.0  # of the metric below
    metric: str = "max |err| / bound"
    terms: dict = field(default_factory=dict)  # u_out, gamma, K, ...


@dataclass(kw_only=True)
class Measurement(Mismatch):
    """A `Mismatch` (counts, greatest differences, first mismatches, map) plus what the
    verdict needs: the comparison kind and bound, the prediction, and the vacuity evidence."""

    comparison: str
    held: bool
    bound: Bound | None = None
    error_vs_reference: float | str | None = None  # bounded only: max |err| / bound
    predicted_mismatched: int | None = None
    order_model: str | None = None
    order_model_exact: bool | None = None
    sensitivity: int | None = None  # probe elements whose bits some reordering would change
    sensitivity_what: str | None = None  # what `sensitivity` counts, for the vacuity message
    vacuous_reason: str | None = None
    extra_failure: str | None = None  # a failure beside the count (input modified, unexplained bits)
    error: str | None = None  # measured, but not under the pinned conditions: status error
    note: str | None = None
    nccl_calls: list[str] | None = None
    detail: dict = field(default_factory=dict)  # family extras: router_flips, explained, calc_diff, ...

    def __post_init__(self):
        if self.comparison not in COMPARISONS:
            raise ValueError(f"comparison {self.comparison!r}; known: {COMPARISONS}")

    @classmethod
    def bitwise(cls, mismatch: Mismatch, **extra) -> Measurement:
        own = {f.name: getattr(mismatch, f.name) for f in fields(mismatch)}  # asdict's deep copy: ~6 ms a check
        return cls(comparison="bitwise", held=mismatch.mismatched == 0, **own, **extra)

    @classmethod
    def within(cls, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, rule: Bound,
               valid: torch.Tensor | None = None, **extra) -> Measurement:
        """Elements whose |got - exact| exceeds their own bound (float64, same shapes), counted
        over `valid` elements only."""
        err = (got.to(torch.float64) - exact).abs()
        valid = torch.ones_like(err, dtype=torch.bool) if valid is None else valid
        over = (err > bound) & valid
        zero = torch.zeros_like(err)
        return cls(comparison="bounded", mismatched=int(over.sum()), total=int(valid.sum()),
                   held=not bool(over.any()), bound=rule,
                   max_abs=json_float(float(torch.where(valid, err, zero).max())),
                   error_vs_reference=json_float(float(torch.where(valid, err / bound.clamp_min(1e-300), zero).max())),
                   **extra)

    def to_record(self) -> dict:
        """The record's measured fields (DESIGN.md's schema): counts, comparison and bound at
        the top level, the bulky evidence under `detail`."""
        top = {"held": self.held, "mismatched": self.mismatched, "total": self.total, "comparison": self.comparison}
        for key in ("max_abs", "max_ulp", "first_mismatch", "predicted_mismatched", "error_vs_reference",
                    "nccl_calls"):
            if getattr(self, key) is not None:
                top[key] = getattr(self, key)
        if self.bound is not None:
            top["tolerance"] = asdict(self.bound)
        evidence = {"first_mismatches": self.first_mismatches, "ulp_histogram": self.ulp_histogram,
                    "mismatch_map": self.mismatch_map, "max_abs_index": self.max_abs_index,
                    "max_ulp_index": self.max_ulp_index, "order_model": self.order_model,
                    "order_model_exact": self.order_model_exact, "order_sensitive": self.sensitivity}
        top["detail"] = {k: v for k, v in {**evidence, **self.detail}.items() if v not in (None, [], {})}
        return top

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Measurement:
        d = dict(d)
        if d.get("bound") is not None:
            d["bound"] = Bound(**d["bound"])
        return cls(**d)

    def combine(self, other: Measurement) -> Measurement:
        """Two bitwise comparisons counted as one (e.g. FP8 values and their scales)."""
        self.mismatched += other.mismatched
        self.total += other.total
        self.held = self.mismatched == 0
        return self
