"""Quantization checks: per-token-group FP8 has one correct bit pattern (reference/quant.py).

* reference: every e4m3 byte and every float32 scale against the exact reference;
* run-to-run: the same input quantized again (thread-invariance: on another thread count each time);
* batch-invariance: the probe row quantized alone and inside batches of other rows.

The invariances compare the probe row's values and its scales: a scale that moves with the
batch is as wrong as a value that does, even where the values' bits stay put.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ep_harness import inputs as gen
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.families.driver import Copy, Family, Run, kept, repeat_labels, require_finite, subject_call
from ep_harness.measurement import Measurement
from ep_harness.params import DATA_KINDS, CommonParams, _opt
from ep_harness.subject import QuantSubject
from ep_harness.reference import quant as ref
from ep_harness.selftest.wrap import Wrapped

PROPERTIES = ("reference", "run-to-run", "thread-invariance", "batch-invariance")


@dataclass(frozen=True, kw_only=True)
class QuantParams(CommonParams):
    dtype: str = _opt("bfloat16", choices=("bfloat16",))
    # the reference's rows: 199 = 3 * 64 + 7 leaves a partial block after full ones for every
    # power-of-two row block from 2 to 128 (64 rows was one whole block)
    rows: int = _opt(199, minimum=1)
    cols: int = _opt(2048, minimum=128)
    ue8m0: bool = _opt(False)
    batch_sizes: list[int] = _opt([1, 7, 64, 1000], minimum=1, nonempty=True)
    repeats: int = _opt(3, minimum=1)
    data: str = _opt("spread", choices=DATA_KINDS)

    def validate(self, subject):
        return f"cols = {self.cols} is not a multiple of the 128-wide quantization group" if self.cols % 128 else None


def reciprocal_scales(x: torch.Tensor) -> torch.Tensor:
    """amax * float32(1 / 448): how a scalar division is often compiled (PyTorch's CUDA
    kernels multiply by the divisor's reciprocal)."""
    rows, cols = x.shape
    amax = x.abs().float().view(rows, cols // 128, 128).amax(dim=2).clamp(min=ref.AMAX_FLOOR)
    return amax * torch.tensor(1.0 / ref.E4M3_MAX, dtype=torch.float32)


def explain(x, scale, q, ref_scale, ref_q) -> dict:
    """Sort every difference from the exact reference into a known cause (or none).

    scales: `reciprocal` when the subject's scale is amax * float32(1/448).
    values: `scale` when the subject's value is the exact rounding of x / (its own scale);
    `double rounding` when it is one e4m3 step away, x / scale lies within 2^-22 (relative)
    of the midpoint, where a float32 intermediate can land on the tie, and the tie rounded to
    even is the subject's value (a tie rounded another way, toward zero say, is no double
    rounding); never where the scale is a power of two (UE8M0: x / scale is exact, nothing
    rounds before the cast). `signed_zero`: +0.0 against -0.0, named, never explained."""
    scale_differs = scale.view(torch.int32) != ref_scale.view(torch.int32)
    by_reciprocal = scale_differs & (scale.view(torch.int32) == reciprocal_scales(x).view(torch.int32))
    per_value = scale.repeat_interleave(128, dim=1)
    v = x.double() / per_value.double()
    exact_given_scale = ref.round_to_e4m3(v)
    differ = q.view(torch.int8) != ref_q.view(torch.int8)
    by_scale = differ & (q.view(torch.int8) == exact_given_scale.view(torch.int8))
    got, want = q.double(), exact_given_scale.double()
    mid = (got + want) / 2
    quotient_rounds = (per_value.view(torch.int32) & 0x7FFFFF) != 0  # a power of two divides exactly
    by_double = differ & ~by_scale & quotient_rounds & ((v - mid).abs() <= mid.abs() * 2.0 ** -22) & (
        ref.round_to_e4m3(mid).double() == got)
    signed_zero = differ & (got == 0) & (ref_q.double() == 0)
    return {
        "scales_differ": int(scale_differs.sum()), "scales_by_reciprocal": int(by_reciprocal.sum()),
        "values_differ": int(differ.sum()), "values_by_scale": int(by_scale.sum()),
        "values_by_double_rounding": int(by_double.sum()), "values_signed_zero": int(signed_zero.sum()),
    }


def _runs(prop: str, p: QuantParams, world_size: int) -> list[Run]:
    if prop == "reference":
        return [Run("reference", (Copy(("reference",)),), p.rows)]
    if prop == "batch-invariance":  # the probe is the last row, so it moves as the batch grows
        return [Run(f"batch {n}", (Copy((n,)),), n) for n in p.batch_sizes]
    return [Run(label, (Copy((p.rows,)),), p.rows) for label in repeat_labels(prop, p.repeats)]


def _batch(p: QuantParams, n: int, dtype) -> torch.Tensor:
    x = gen.values((n, p.cols), dtype, p.seed, "quant-batch", n, data=p.data)
    x[-1] = gen.values((p.cols,), dtype, p.seed, "quant-probe", data=p.data)
    return x


class Quantized(NamedTuple):
    """What a rank saw of one run: e4m3 values (as bytes) and float32 scales, of the whole
    input (reference) or of the probe row."""

    values: torch.Tensor
    scales: torch.Tensor


def _observe(subject, ctx: RankContext, p: QuantParams, prop: str, runs: list[Run]):
    """For the reference, every value and scale of the one run; else per run the probe row's
    values and scales (values as bytes: fp8 tensors do not pickle)."""
    dtype = gen.dtype_of(p.dtype)
    if prop == "reference":
        x = gen.values((p.rows, p.cols), dtype, p.seed, "quant-input", data=p.data)
        q, s = _quantize(subject, x.to(ctx.device), p.ue8m0)
        return Quantized(kept(q).view(torch.uint8), kept(s.float()))
    out = []
    for run in runs:
        q, s = _quantize(subject, _batch(p, run.spec, dtype).to(ctx.device), p.ue8m0)
        out.append(Quantized(kept(q[-1]).view(torch.uint8), kept(s[-1].float())))
    return out


def _quantize(subject, x: torch.Tensor, ue8m0: bool):
    with subject_call({"x": x}):
        return subject.quantize(x, ue8m0)


def _measure(check, subject, ctx: RankContext, p: QuantParams, runs: list[Run], gathered) -> Measurement:
    dtype = gen.dtype_of(p.dtype)
    if check.property == "reference":
        seen = gathered[0]
        return _measure_reference(p, seen.values.view(torch.float8_e4m3fn), seen.scales, dtype)
    labels = [r.label for r in runs]
    values = torch.stack([seen.values for seen in gathered[0]]).view(torch.float8_e4m3fn)
    scales = torch.stack([seen.scales for seen in gathered[0]])
    scale_m = Measurement.bitwise(compare_bitwise(scales, scales[0], [f"{label} scales" for label in labels]))
    m = Measurement.bitwise(compare_bitwise(values, values[0], labels)).combine(scale_m)
    m.detail["scale_mismatched"] = scale_m.mismatched
    probe = _batch(p, 1, dtype)
    exact_values, exact_scales = ref.quantize_per_token_group(probe, ue8m0=p.ue8m0)
    require_finite(m, values, exact_values[-1].float())
    require_finite(m, scales, exact_scales[-1])
    m.sensitivity, m.sensitivity_what = scale_path_sensitivity(probe, p.ue8m0)
    return m


def scale_path_sensitivity(row: torch.Tensor, ue8m0: bool) -> tuple[int, str]:
    """Probe values and scales whose bits differ between two quantizers a kernel may be:
    x / (amax / 448) and x * (1 / (amax * float32(1/448))) in float32. A batch- or
    run-dependent switch between such paths is what these checks can catch; where the two
    agree on every bit (UE8M0: power-of-two scales make both exact), nothing can show."""
    rq, rs = ref.quantize_per_token_group(row, ue8m0=ue8m0)
    alt_scale = reciprocal_scales(row)
    if ue8m0:
        alt_scale = torch.exp2(torch.ceil(torch.log2(alt_scale.double()))).float()
    inverse = (1.0 / alt_scale).float().repeat_interleave(128, dim=1)
    alt_q = ref.round_to_e4m3((row.float() * inverse).double())
    count = int((alt_q.view(torch.int8) != rq.view(torch.int8)).sum()) + \
        int((alt_scale.view(torch.int32) != rs.view(torch.int32)).sum())
    return count, (f"of {row.numel():,} probe values and {rs.numel()} scales differ between a dividing and a "
                   f"reciprocal-multiplying quantizer")


def _measure_reference(p: QuantParams, q: torch.Tensor, s: torch.Tensor, dtype, x=None) -> Measurement:
    """`x`: the input quantized (None: the check's own, from its seed)."""
    if x is None:
        x = gen.values((p.rows, p.cols), dtype, p.seed, "quant-input", data=p.data)
    rq, rs = ref.quantize_per_token_group(x, ue8m0=p.ue8m0)
    mq = compare_bitwise(q, rq, [f"row {r}" for r in range(p.rows)])
    ms = compare_bitwise(s.contiguous(), rs)
    m = Measurement.bitwise(mq).combine(Measurement.bitwise(ms))
    causes = explain(x, s, q, rs, rq)
    m.detail = {"scale_mismatched": ms.mismatched, "explained": causes}
    unexplained_values = causes["values_differ"] - causes["values_by_scale"] - causes["values_by_double_rounding"]
    unexplained_scales = causes["scales_differ"] - causes["scales_by_reciprocal"]
    zeros = causes["values_signed_zero"]
    signed = f" ({zeros:,} of them signed zeros: +0.0 against -0.0)" if zeros else ""
    if unexplained_values or unexplained_scales:
        m.extra_failure = (f"{unexplained_values:,} quantized values{signed} and {unexplained_scales:,} scales "
                           f"differ from the exact reference with no known cause")
    if causes["values_differ"] or causes["scales_differ"]:
        m.note = (f"explained: {causes['values_by_double_rounding']:,} values by double rounding, "
                  f"{causes['values_by_scale']:,} values by their scale, {causes['scales_by_reciprocal']:,} "
                  f"scales by reciprocal multiplication" + (f"; {zeros:,} signed zeros" if zeros else ""))
    return m


def _measure_with_cost(check, subject, ctx: RankContext, p: QuantParams, runs: list[Run], gathered) -> Measurement:
    """The verdict's measurement and, on a GPU, its price: the check's largest batch timed
    against a device copy of as many bytes (ep_harness.cost.timing). Absent on the CPU, never zero."""
    m = _measure(check, subject, ctx, p, runs, gathered)
    if ctx.device.type == "cuda":
        from ep_harness.cost import timing

        rows = max(run.spec for run in runs)
        x = _batch(p, rows, gen.dtype_of(p.dtype)).to(ctx.device)
        m.detail["cost"] = timing.cost_or_reason(lambda: timing.quant_check_cost(subject, x, p.ue8m0))
    return m


class _Injected(Wrapped):
    """`ep-harness selftest`: the defect in the quantized values, or in the input."""

    def quantize(self, x, ue8m0):
        q, s = self._subject.quantize(x, ue8m0)
        self._inject(q, x)
        return q, s


FAMILY = Family("quant", PROPERTIES, QuantParams, _runs, _observe, _measure_with_cost,
                protocol=QuantSubject, selftest_wrapper=_Injected)
