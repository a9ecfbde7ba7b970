"""The GEMM family's input builder: grouped-GEMM problems (ep_harness.contracts.GemmProblem,
in DeepGEMM's layouts) built from seeded values, and their float64 operands.
"""
from __future__ import annotations

import functools

import torch

from ep_harness import inputs as gen
from ep_harness.contracts import GemmProblem, contiguous_segments, expected_m_hint, layout_rows
from ep_harness.reference import quant

FP8 = "float8_e4m3fn"


@functools.lru_cache(maxsize=4)  # a suite's GEMM cases share a few (bf16 and FP8, grouped and dense)
def weights(seed: int, groups: int, n: int, k: int, dtype: str, data: str,
            cancel: bool = False, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert weights [G, N, K] (and block scales for FP8), fixed by the seed, on `device`.
    With `cancel` columns 1 and 1 + K/2 are equal, so the probe's +-large pair cancels exactly.

    Cached (never modified by a caller): every property of a case, its warm-up and its
    measurement use the same weights, whose float64 generation costs seconds at GPU sizes.
    The values are drawn on the CPU (the seed's generator); scaling and FP8 quantization are
    exact or single IEEE roundings (ep_harness.reference.quant), so they run on `device` with
    the same bits, where a GPU does in milliseconds what takes the CPU seconds."""
    base = torch.bfloat16 if dtype == FP8 else gen.dtype_of(dtype)
    drawn = gen.values((groups, n, k), base, seed, "weights", data=data).to(device)
    w = (drawn.double() * (k ** -0.5)).to(base)
    if cancel:
        w[:, :, 1 + k // 2] = w[:, :, 1]
    if dtype != FP8:
        return w, None
    qs, scales = zip(*(quant.quantize_per_block(w[g]) for g in range(groups)))
    return torch.stack(qs), torch.stack(scales)


def build(layout: str, dtype: str, rows: dict[int, torch.Tensor], counts: list[int], b, b_scale,
          k: int, alignment: int, expected_m: int | None = None) -> GemmProblem:
    """Place each expert's rows ({group: [count, K]}) into the layout, on the weights' device
    (where the FP8 activations are then quantized)."""
    base = torch.bfloat16 if dtype == FP8 else gen.dtype_of(dtype)
    rows = {g: r.to(b.device) for g, r in rows.items()}
    if layout == "dense":
        problem = GemmProblem("dense", rows[0], b[0], counts, [0])
        b_scale = None if b_scale is None else b_scale[0]
    else:
        a = torch.zeros(*layout_rows(layout, counts, alignment), k, dtype=base, device=b.device)
        if layout == "contiguous":
            starts, grouped = contiguous_segments(counts, alignment)
            for g, c in enumerate(counts):
                a[starts[g]:starts[g] + c] = rows[g]
            problem = GemmProblem("contiguous", a, b, counts, starts, grouped_layout=grouped.to(b.device))
        else:
            for g, c in enumerate(counts):
                a[g, :c] = rows[g]
            problem = GemmProblem("masked", a, b, counts, [0] * len(counts),
                                  masked_m=torch.tensor(counts, dtype=torch.int32, device=b.device),
                                  expected_m=expected_m or expected_m_hint(counts))
    problem.b_scale = b_scale
    if dtype == FP8:
        flat = problem.a.reshape(-1, k)
        q, s = quant.quantize_per_token_group(flat)
        problem.a = q.view(problem.a.shape)
        problem.a_scale = s.view(*problem.a.shape[:-1], k // 128)
    return problem


def dequantized(problem: GemmProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 operands the reference multiplies (FP8 operands dequantized exactly)."""
    if problem.a_scale is None:
        return problem.a.to(torch.float64), problem.b.to(torch.float64)
    a = quant.dequantize_per_token_group(problem.a, problem.a_scale)
    b = quant.dequantize_per_block(problem.b, problem.b_scale)
    return a, b
