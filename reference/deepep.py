"""DeepEP v1 (intranode, normal mode) combine, as an exact order model.

Read from DeepEP v1.2.1's intranode combine kernel and confirmed on the H200 (2, 4 and 8
ranks on one GPU, 0 differing elements against order-sensitive partials, with 20 and 8
SMs and two batch shapes): one warp reduces each token; it takes the ranks that hold a
copy in ascending rank order and adds their bf16 rows to a float32 accumulator that starts
at +0.0 (or at bias_0 + bias_1), then rounds once to bf16. Nothing else enters a token's
sum: not the number of SMs or channels, not the chunk sizes, the batch or other tokens.

Normal-mode combine adds rows without weights, so the caller (harness/subjects/dispatch/
deepep.py) first folds each rank's weighted expert outputs of a token into one partial:
float32, its local slots in ascending slot order, rounded to bf16. Shapes: k slots, H hidden.
"""
from __future__ import annotations

import torch


def rank_partial(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One rank's partial of one token: y [k_local, H] bf16 expert outputs, w [k_local]
    float32 weights, in slot order -> bf16 [H] (float32 products and sums, one rounding)."""
    acc = torch.zeros(y.shape[-1], dtype=torch.float32)
    for j in range(y.shape[0]):
        acc = acc + w[j].float() * y[j].float()
    return acc.to(torch.bfloat16)


def intranode_combine(partials: dict[int, torch.Tensor]) -> torch.Tensor:
    """The combined token from {holder rank: bf16 partial [H]}: ascending rank, float32 from +0.0."""
    acc = torch.zeros(next(iter(partials.values())).shape, dtype=torch.float32)
    for rank in sorted(partials):
        acc = acc + partials[rank].float()
    return acc.to(torch.bfloat16)


def combined_token(y: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """A token's combined output: y [k, H] bf16, w [k] float32, experts [k] (-1: none)."""
    partials = {}
    for rank in sorted({int(e) // experts_per_rank for e in experts.tolist() if e >= 0}):
        slots = [j for j, e in enumerate(experts.tolist()) if e >= 0 and e // experts_per_rank == rank]
        partials[rank] = rank_partial(y[slots], w[slots])
    if not partials:
        return torch.zeros(y.shape[-1], dtype=torch.bfloat16)
    return intranode_combine(partials)
