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


def double_rounding(x, scale, q, rq) -> int:
    """Mismatches explained by rounding through float32: the subject's value is one e4m3
    step from the exact rounding, and the exact quotient lies within 2^-22 (relative) of the
    midpoint between them, where a float32 intermediate can land on the tie."""
    v = x.double() / scale.double().repeat_interleave(128, dim=1)
    got, want = q.double(), rq.double()
    differ = q.view(torch.int8) != rq.view(torch.int8)
    mid = (got + want) / 2
    near_tie = (v - mid).abs() <= mid.abs() * 2.0 ** -22
    one_step = (ref.round_to_e4m3(mid).double() == got) | (ref.round_to_e4m3(mid).double() == want)
    return int((differ & near_tie & one_step).sum())


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
        explained = double_rounding(x, rs, q.cpu(), rq)
        out["explained"] = explained
        unexplained = mq.mismatched - explained
        extra = None
        if ms.mismatched or unexplained:
            extra = (f"{unexplained:,} quantized values and {ms.mismatched:,} scales differ from the exact "
                     f"reference without a double-rounding explanation")
        return {**out, "predicted_mismatched": None, "vacuous_reason": None, "extra_failure": extra}

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
