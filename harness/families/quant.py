"""Quantization checks: per-token-group FP8 has one correct bit pattern (reference/quant.py).

* reference: every e4m3 byte and every float32 scale against the exact reference;
* run-to-run: the same input quantized again;
* batch-invariance: the probe row quantized alone and inside batches of other rows.
"""
from __future__ import annotations

import torch

from harness import inputs as gen
from harness.compare import compare_bitwise
from harness.context import RankContext
from reference import quant as ref

PROPERTIES = ("reference", "run-to-run", "batch-invariance")
DEFAULTS = {"rows": 64, "cols": 2048, "ue8m0": False, "batch_sizes": [1, 7, 64, 1000], "repeats": 3,
            "seed": 0, "data": "spread"}


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
    `double rounding` when it is one e4m3 step away and x / scale lies within 2^-22
    (relative) of the midpoint, where a float32 intermediate can land on the tie."""
    scale_differs = scale.view(torch.int32) != ref_scale.view(torch.int32)
    by_reciprocal = scale_differs & (scale.view(torch.int32) == reciprocal_scales(x).view(torch.int32))
    v = x.double() / scale.double().repeat_interleave(128, dim=1)
    exact_given_scale = ref.round_to_e4m3(v)
    differ = q.view(torch.int8) != ref_q.view(torch.int8)
    by_scale = differ & (q.view(torch.int8) == exact_given_scale.view(torch.int8))
    got, want = q.double(), exact_given_scale.double()
    mid = (got + want) / 2
    by_double = differ & ~by_scale & ((v - mid).abs() <= mid.abs() * 2.0 ** -22) & (
        (ref.round_to_e4m3(mid).double() == got) | (ref.round_to_e4m3(mid).double() == want))
    return {
        "scales_differ": int(scale_differs.sum()), "scales_by_reciprocal": int(by_reciprocal.sum()),
        "values_differ": int(differ.sum()), "values_by_scale": int(by_scale.sum()),
        "values_by_double_rounding": int(by_double.sum()),
    }


def execute(check: dict, subject, ctx: RankContext) -> dict:
    p = {**DEFAULTS, **check["params"]}
    prop = check["property"]
    dtype = gen.dtype_of(p.get("dtype", "bfloat16"))
    if prop == "reference":
        x = gen.values((p["rows"], p["cols"]), dtype, p["seed"], "quant-input", data=p["data"])
        q, s = subject.quantize(x.to(ctx.device), p["ue8m0"])
        rq, rs = ref.quantize_per_token_group(x, ue8m0=p["ue8m0"])
        mq = compare_bitwise(q, rq.to(q.device), [f"row {r}" for r in range(p["rows"])])
        ms = compare_bitwise(s.float().contiguous(), rs.to(s.device))
        out = mq.to_dict()
        out.update(mismatched=mq.mismatched + ms.mismatched, total=mq.total + ms.total,
                   held=mq.mismatched + ms.mismatched == 0)
        out["scale_mismatched"] = ms.mismatched
        causes = explain(x, s.float().cpu(), q.cpu(), rs, rq)
        out["explained"] = causes
        unexplained_values = causes["values_differ"] - causes["values_by_scale"] - causes["values_by_double_rounding"]
        unexplained_scales = causes["scales_differ"] - causes["scales_by_reciprocal"]
        extra = None
        if unexplained_values or unexplained_scales:
            extra = (f"{unexplained_values:,} quantized values and {unexplained_scales:,} scales differ from the "
                     f"exact reference with no known cause")
        note = None
        if causes["values_differ"] or causes["scales_differ"]:
            note = (f"explained: {causes['values_by_double_rounding']:,} values by double rounding, "
                    f"{causes['values_by_scale']:,} values by their scale, {causes['scales_by_reciprocal']:,} "
                    f"scales by reciprocal multiplication")
        return {**out, "predicted_mismatched": None, "vacuous_reason": None, "extra_failure": extra, "note": note}

    probe = gen.values((p["cols"],), dtype, p["seed"], "quant-probe", data=p["data"])
    sizes = p["batch_sizes"] if prop == "batch-invariance" else [p["rows"]] * p["repeats"]
    copies, labels = [], []
    for i, n in enumerate(sizes):
        x = gen.values((n, p["cols"]), dtype, p["seed"], "quant-batch", n, data=p["data"])
        x[-1] = probe  # the probe is the last row, so it moves as the batch grows
        q, _ = subject.quantize(x.to(ctx.device), p["ue8m0"])
        copies.append(q[-1])
        labels.append(f"batch {n}" if prop == "batch-invariance" else f"repeat {i}")
    observed = torch.stack(copies)
    m = compare_bitwise(observed, observed[0], labels)
    return {**m.to_dict(), "held": m.mismatched == 0, "predicted_mismatched": None,
            "vacuous_reason": None, "extra_failure": None}
