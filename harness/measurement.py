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

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass

import torch

from ep_harness.compare import Mismatch, json_float, nonfinite_counts
from ep_harness.fingerprint import combine as combine_fingerprints
from ep_harness.fingerprint import bits_blocks, bits_fingerprint

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
    kernels: list[str] | None = None  # kernels that ran during the measured calls (GPU; harness/kernel_trace.py)
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
               valid: torch.Tensor | None = None, zero_signs: bool = False, **extra) -> Measurement:
        """Elements whose |got - exact| exceeds their own bound (float64, same shapes), counted
        over `valid` elements only.

        IEEE comparisons with NaN are false, so `err > bound` alone would pass a NaN: an element
        is also a mismatch where got and exact are not both finite and not the same non-finite
        value (NaN with NaN, or an infinity of the same sign). Such elements count as an
        infinite error in max |err| and error_vs_reference, and `nonfinite` says how many
        outputs were NaN, +Inf or -Inf where the reference was finite (and the converse, and
        another non-finite value than the reference's).

        `zero_signs`: where the reference is exactly zero, an output zero of the other sign is a
        mismatch too (counted as `bit_only["signed_zero"]`). For references whose exact zeros
        every correct kernel reproduces with their sign, such as sums of inputs without -0.0."""
        shapes = {"output": got.shape, "reference": exact.shape, "bound": bound.shape,
                  **({} if valid is None else {"valid": valid.shape})}
        if len(set(shapes.values())) > 1:  # broadcasting would compare other elements, and count fewer
            raise ValueError("bounded comparison of different shapes (" + ", ".join(
                f"{k} {tuple(v)}" for k, v in shapes.items()) + "): the subject must return the reference's shape")
        observed, got = got, got.to(exact.device, torch.float64)  # compared where the reference was computed
        valid = torch.ones_like(got, dtype=torch.bool) if valid is None else valid.to(exact.device)
        finite = torch.isfinite(got) & torch.isfinite(exact)
        same_nonfinite = ~finite & ((torch.isnan(got) & torch.isnan(exact)) | (got == exact))
        err = torch.where(finite, (got - exact).abs(), torch.full_like(got, math.inf))
        err = torch.where(same_nonfinite, torch.zeros_like(err), err)
        over = ((err > bound) | (~finite & ~same_nonfinite)) & valid
        signed_zeros = None
        if zero_signs:
            flipped = valid & (exact == 0) & (got == 0) & (torch.signbit(got) != torch.signbit(exact))
            over |= flipped
            signed_zeros = {"signed_zero": int(flipped.sum())} if bool(flipped.any()) else None
        ratio = torch.where(finite, err / bound.clamp_min(1e-300), err)
        zero = torch.zeros_like(err)
        nonfinite = nonfinite_counts(got, exact, valid)
        return cls(comparison="bounded", mismatched=int(over.sum()), total=int(valid.sum()),
                   held=not bool(over.any()), bound=rule,
                   max_abs=json_float(float(torch.where(valid, err, zero).max())) if err.numel() else 0.0,
                   error_vs_reference=json_float(float(torch.where(valid, ratio, zero).max())) if err.numel() else 0.0,
                   nonfinite=nonfinite or None, bit_only=signed_zeros, bits_fingerprint=bits_fingerprint(observed),
                   bits_blocks=bits_blocks(observed), **extra)

    def to_record(self) -> dict:
        """The record's measured fields (docs/records.md's schema): counts, comparison and bound at
        the top level, the bulky evidence under `detail`."""
        top = {"held": self.held, "mismatched": self.mismatched, "total": self.total, "comparison": self.comparison}
        for key in ("max_abs", "max_ulp", "first_mismatch", "predicted_mismatched", "error_vs_reference",
                    "nccl_calls", "nonfinite", "bits_fingerprint", "kernels"):
            if getattr(self, key) is not None:
                top[key] = getattr(self, key)
        if self.bound is not None:
            top["tolerance"] = asdict(self.bound)
        evidence = {"first_mismatches": self.first_mismatches, "ulp_histogram": self.ulp_histogram,
                    "mismatch_map": self.mismatch_map, "max_abs_index": self.max_abs_index,
                    "max_ulp_index": self.max_ulp_index, "order_model": self.order_model,
                    "order_model_exact": self.order_model_exact, "order_sensitive": self.sensitivity,
                    "bit_only": self.bit_only, "rows_differing": self.rows_differing, "rows": self.rows,
                    "bits_blocks": self.bits_blocks}
        top["detail"] = {k: v for k, v in {**evidence, **self.detail}.items() if v not in (None, [], {})}
        return top

    def to_json(self) -> dict:
        """Every field, the bound and any dataclass in `detail` (a subject's describe() may hold
        one) as dicts. The harness's own evidence is taken as it stands: asdict deep-copies
        each of its lists (0.4 s of rank 0 in a launch of model checks), and a Measurement is
        sent as it stands and not changed afterwards."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.bound is not None:
            out["bound"] = asdict(self.bound)
        out["detail"] = _plain(self.detail)
        return out

    @classmethod
    def from_json(cls, d: dict) -> Measurement:
        d = dict(d)
        if d.get("bound") is not None:
            d["bound"] = Bound(**d["bound"])
        return cls(**d)

    def combine(self, other: Measurement) -> Measurement:
        """Two bitwise comparisons counted as one (e.g. FP8 values and their scales): counts
        (mismatches, non-finite and bit-only kinds, ULP buckets) add up, the greater differences
        and the first mismatches come from either side, and the fingerprint covers both."""
        self.mismatched += other.mismatched
        self.total += other.total
        self.held = self.mismatched == 0
        for name in ("nonfinite", "bit_only", "ulp_histogram"):  # counts per kind: added up
            theirs = getattr(other, name)
            if theirs:
                merged = dict(getattr(self, name) or {})
                for key, n in theirs.items():
                    merged[key] = merged.get(key, 0) + n
                setattr(self, name, merged)
        if _magnitude(other.max_abs) > _magnitude(self.max_abs):
            self.max_abs, self.max_abs_index = other.max_abs, other.max_abs_index
        if (other.max_ulp or 0) > (self.max_ulp or 0):
            self.max_ulp, self.max_ulp_index = other.max_ulp, other.max_ulp_index
        self.first_mismatch = self.first_mismatch or other.first_mismatch
        self.first_mismatches = self.first_mismatches or other.first_mismatches  # the list first_mismatch heads
        if self.bits_fingerprint and other.bits_fingerprint:
            self.bits_fingerprint = combine_fingerprints([self.bits_fingerprint, other.bits_fingerprint])
        else:  # one side's bits unfingerprinted: no fingerprint says the whole is unchanged
            self.bits_fingerprint = None
        self.bits_blocks = None  # two tensors' blocks: the whole fingerprint still says whether bits moved
        return self


def _plain(value):
    """`value` with every dataclass in it as a dict (containers rebuilt, leaves as they are)."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple, rebuilt as asdict does
        return type(value)(*(_plain(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _magnitude(x: float | str | None) -> float:
    """A recorded difference as a number: None is 0, and JSON's strings 'inf'/'nan' are infinite."""
    if x is None:
        return 0.0
    return math.inf if isinstance(x, str) else float(x)
