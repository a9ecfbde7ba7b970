"""DeepEP combine orders as exact models: v1 (intranode, normal mode) and, below, v2
(ElasticBuffer, expand mode, one reduction).

DeepEP v1:

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


# --- DeepEP v2 (ElasticBuffer) -------------------------------------------------------------
#
# Read from deepseek-ai/DeepEP dd758ca (2.1.0), deep_ep/include/deep_ep/impls/
# combine_reduce_epilogue.cuh and combine_utils.cuh, for expand mode with
# allow_multiple_reduction=False (the mode the harness and SGLang use): nothing is reduced on
# the expert ranks ("Activations are never reduced before"), every top-k slot's row travels
# back, and one warp per token reduces the rows of its valid slots (expert >= 0) in ascending
# slot order (compute_topk_slots takes the mask's lowest bit first), without weights:
# * no bias and at most two valid slots: one bf16 add of slot a's and slot b's rows (a missing
#   one reads as +0.0), i.e. bf16(float32(a + b));
# * otherwise: float32 accumulators from +0.0, bias_0 and bias_1 added first, then each slot's
#   row in slot order, rounded to bf16 once.
# Unlike v1 (and v2 with allow_multiple_reduction=True, which pre-reduces per rank) the result
# does not depend on which rank holds which expert. The weights are the caller's: the
# adapter multiplies each row by its weight in float32 and rounds to bf16 before combine.


def expand_reduce(rows: torch.Tensor, valid: list[bool], bias: tuple = ()) -> torch.Tensor:
    """v2's reduction of one token: rows [k, H] bf16 (slot order), valid[j] whether slot j
    holds an expert, bias: 0, 1 or 2 bf16 [H] -> bf16 [H]."""
    slots = [j for j, v in enumerate(valid) if v]
    if not bias and len(slots) <= 2:  # the bf16-add bypass
        zero = torch.zeros(rows.shape[-1], dtype=torch.float32)
        a = rows[slots[0]].float() if slots else zero
        b = rows[slots[1]].float() if len(slots) > 1 else zero
        return (a + b).to(torch.bfloat16)
    acc = torch.zeros(rows.shape[-1], dtype=torch.float32)
    for term in [*bias, *(rows[j] for j in slots)]:
        acc = acc + term.float()
    return acc.to(torch.bfloat16)


def expand_combined_token(y: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                          experts_per_rank: int | None = None) -> torch.Tensor:
    """A token's combined output through the deepep_v2 adapter: y [k, H] bf16 expert outputs,
    w [k] float32 weights, experts [k] (-1: none). Each row is weighted in float32 and rounded
    to bf16 (the adapter), then reduced as expand_reduce does. `experts_per_rank` is accepted
    and unused: the result does not depend on where the experts live."""
    weighted = (w.float().unsqueeze(1) * y.float()).to(torch.bfloat16)
    return expand_reduce(weighted, [int(e) >= 0 for e in experts.tolist()])
