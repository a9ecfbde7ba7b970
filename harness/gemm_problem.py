"""Grouped-GEMM problems: the inputs a gemm subject receives, built from seeded values.

Layouts follow DeepGEMM: `contiguous` (rows of all experts in one [M_sum, K] tensor, each
expert's segment starting at a multiple of `align`, padding rows zero with grouped_layout
-1), `masked` ([G, max_m, K] with masked_m[g] valid rows and an expected_m hint) and
`dense` (one [M, K] x [N, K] product).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from ep_harness import inputs as gen
from ep_harness.reference import quant

FP8 = "float8_e4m3fn"


@dataclass
class GemmProblem:
    layout: str
    a: torch.Tensor  # bf16/fp32, or fp8 when a_scale is set
    b: torch.Tensor  # [G, N, K] ([N, K] for dense)
    counts: list[int]  # valid rows per expert
    starts: list[int]  # first row of each expert (contiguous) ; 0 for masked
    grouped_layout: torch.Tensor | None = None  # contiguous: int32 [M_sum]
    masked_m: torch.Tensor | None = None  # masked: int32 [G]
    expected_m: int | None = None
    a_scale: torch.Tensor | None = None  # fp8: float32 [rows, K // 128]
    b_scale: torch.Tensor | None = None  # fp8: float32 [G, N // 128, K // 128]

    def row_index(self, group: int, row: int):
        """Where row `row` of expert `group` sits in the output."""
        return (self.starts[group] + row,) if self.layout in ("contiguous", "dense") else (group, row)

    def to(self, device) -> "GemmProblem":
        """A copy on `device`, always: the subject gets tensors of its own, so one that writes
        into its operands cannot change the cached weights that later checks and the
        reference read (on the CPU `.to` alone would hand over the cached tensors)."""
        moved = {k: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return GemmProblem(**moved)


def align(x: int, to: int) -> int:
    return -(-x // to) * to


def aligned_starts(counts: list[int], alignment: int) -> tuple[list[int], int]:
    """Contiguous layout: where each expert's segment starts, and the padded total rows."""
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += align(max(c, 0), alignment)
    return starts, total


@functools.lru_cache(maxsize=2)
def weights(seed: int, groups: int, n: int, k: int, dtype: str, data: str,
            cancel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert weights [G, N, K] (and block scales for FP8), fixed by the seed. With `cancel`
    columns 1 and 1 + K/2 are equal, so the probe's +-large pair cancels exactly.

    Cached (never modified by a caller): every property of a case, its warm-up and its
    measurement use the same weights, whose float64 generation costs seconds at GPU sizes."""
    base = torch.bfloat16 if dtype == FP8 else gen.dtype_of(dtype)
    w = (gen.values((groups, n, k), base, seed, "weights", data=data).double() * (k ** -0.5)).to(base)
    if cancel:
        w[:, :, 1 + k // 2] = w[:, :, 1]
    if dtype != FP8:
        return w, None
    qs, scales = zip(*(quant.quantize_per_block(w[g]) for g in range(groups)))
    return torch.stack(qs), torch.stack(scales)


def build(layout: str, dtype: str, rows: dict[int, torch.Tensor], counts: list[int], b, b_scale,
          k: int, alignment: int, expected_m: int | None = None) -> GemmProblem:
    """Place each expert's rows ({group: [count, K]}) into the layout."""
    base = torch.bfloat16 if dtype == FP8 else gen.dtype_of(dtype)
    groups = len(counts)
    if layout == "dense":
        problem = GemmProblem("dense", rows[0], b[0], counts, [0])
        b_scale = None if b_scale is None else b_scale[0]
    elif layout == "contiguous":
        starts, total = aligned_starts(counts, alignment)
        a = torch.zeros(total, k, dtype=base)
        grouped = torch.full((total,), -1, dtype=torch.int32)
        for g, c in enumerate(counts):
            a[starts[g]:starts[g] + c] = rows[g]
            grouped[starts[g]:starts[g] + c] = g
        problem = GemmProblem("contiguous", a, b, counts, starts, grouped_layout=grouped)
    elif layout == "masked":
        max_m = align(max(max(counts), 1), alignment)
        a = torch.zeros(groups, max_m, k, dtype=base)
        for g, c in enumerate(counts):
            a[g, :c] = rows[g]
        problem = GemmProblem("masked", a, b, counts, [0] * groups,
                              masked_m=torch.tensor(counts, dtype=torch.int32),
                              expected_m=expected_m or max(1, sum(counts) // groups))
    else:
        raise ValueError(f"unknown GEMM layout {layout!r}; known: contiguous, masked, dense")
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
