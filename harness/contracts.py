"""What crosses between families and subjects, in one place: both sides import it from here,
neither from the other (a family never imports a subject; a subject never imports another
subject's input builder).

* `GemmProblem`: the inputs a GEMM subject multiplies, in DeepGEMM's layouts (and the
  contiguous layout's aligned segments, which dispatchers produce for the GEMM);
* `DispatchConfig`: what one dispatch call is told (a dispatcher's `cfg`);
* `Received`: what a dispatcher returns, with `native`, the backend's own handle that its
  combine needs (a subject keeps no per-call state on its registered instance: two
  dispatches before their combines each carry their own handle);
* `Served`: what a model subject returns for one batch;
* the wire-dtype rule: what crosses a dispatcher's wire follows the expert weights'
  quantization;
* `route`: the composed subjects' router, from which the moe_layer family plans the shapes
  of their expert GEMMs before a launch.

The builders of these inputs are the families' (harness/families/gemm_problem.py,
harness/families/moe_scenario.py, harness/families/model_inputs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


# --- grouped GEMM --------------------------------------------------------------------------

@dataclass
class GemmProblem:
    """Layouts follow DeepGEMM: `contiguous` (rows of all experts in one [M_sum, K] tensor,
    each expert's segment starting at a multiple of the alignment, padding rows zero with
    grouped_layout -1), `masked` ([G, max_m, K] with masked_m[g] valid rows and an
    expected_m hint) and `dense` (one [M, K] x [N, K] product)."""

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


def layout_rows(layout: str, counts: list[int], alignment: int) -> tuple[int, ...]:
    """The dims of A (and of the output) before K (N) for experts holding `counts` rows: one
    dense block, the padded segments of the contiguous layout, or one padded block per
    expert in the masked layout."""
    if layout == "dense":
        return (counts[0],)
    if layout == "contiguous":
        return (aligned_starts(counts, alignment)[1],)
    if layout == "masked":
        return (len(counts), align(max(max(counts), 1), alignment))
    raise ValueError(f"unknown GEMM layout {layout!r}; known: contiguous, masked, dense")


def contiguous_segments(counts: list[int], alignment: int, device=None) -> tuple[list[int], torch.Tensor]:
    """The contiguous layout for experts holding `counts` rows: each segment's start, and the
    grouped layout DeepGEMM reads (each row's expert, -1 on padding rows)."""
    starts, total = aligned_starts(counts, alignment)
    grouped = torch.full((total,), -1, dtype=torch.int32, device=device)
    for g, (start, c) in enumerate(zip(starts, counts)):
        grouped[start:start + c] = g
    return starts, grouped


def expected_m_hint(counts: list[int]) -> int:
    """The masked layout's expected_m when a caller names none: the mean rows per expert."""
    return max(1, sum(counts) // max(len(counts), 1))


# --- routing -------------------------------------------------------------------------------

def route(x: torch.Tensor, w_router: torch.Tensor, k: int, scoring: str = "softmax"):
    """The composed subjects' router: fp32 router logits (computed in float64, rounded once, so
    no row depends on the batch), softmax or sigmoid scores, top-k, renormalised. Returns
    (topk_idx, weights). The moe_layer family plans its expert GEMMs' shapes from it."""
    logits = (x.double() @ w_router.double().T).float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    vals, idx = torch.topk(scores, k, dim=-1, sorted=True)
    return idx, vals / vals.sum(dim=-1, keepdim=True)


# --- dispatch ------------------------------------------------------------------------------

@dataclass
class Received:
    """Rows a rank received, in the layout its grouped GEMM consumes.

    contiguous: x [M_sum, H], each local expert's rows from starts[e], padded to the
    alignment, grouped_layout[row] = local expert or -1. masked: x [E_local, max_m, H],
    masked_m[e] rows valid. src_rank / src_token / src_slot say where each row came from
    (-1 on padding), flattened in the layout's row order. `native`: the backend's own handle
    for this dispatch (DeepEP's buffer and handle), which the subject's combine reads; None
    where the subject needs none.
    """

    layout: str
    x: torch.Tensor
    scale: torch.Tensor | None
    counts: list[int]
    starts: list[int]
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    grouped_layout: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None
    native: Any = None

    def rows(self) -> torch.Tensor:
        """The received rows flattened to [rows, H] (a view)."""
        return self.x.reshape(-1, self.x.shape[-1])


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """What one dispatch call is told (a dispatcher's `cfg`): the experts and the layout to
    deliver in, the wire dtype (resolved: bf16 or fp8, by resolve_wire_dtype below),
    and the most tokens a rank sends in one call (what a buffer is sized for). `layer`: the
    model layer that dispatches (None outside a model). Built from a check's parameters by
    `of`, never read by string key."""

    num_experts: int
    topk: int
    hidden: int
    layout: str
    alignment: int
    expert_quant: str
    wire: str
    ue8m0: bool
    tokens_max: int
    layer: int | None = None

    @classmethod
    def of(cls, p, **given) -> DispatchConfig:
        """The experts, shape and layout of `p` (a check's TokenParams or ModelParams);
        `given` sets the rest."""
        return cls(num_experts=p.num_experts, topk=p.topk, hidden=p.hidden, layout=p.layout,
                   alignment=p.alignment, **given)


# The wire-dtype rule: an FP8 checkpoint dispatches FP8 values with per-token-group scales; a
# BF16 checkpoint dispatches BF16. A configuration that contradicts the checkpoint is refused,
# never silently corrected (SGLang's deepep_v2 dispatcher follows the same rule).
WIRE_DTYPES = ("bf16", "fp8")


def resolve_wire_dtype(expert_quant: str, requested: str = "auto") -> str:
    """expert_quant: "bf16" or "fp8" (the checkpoint); requested: "auto", "bf16" or "fp8"."""
    if expert_quant not in WIRE_DTYPES:
        raise ValueError(f"expert weights quantization {expert_quant!r} is unknown; use one of {WIRE_DTYPES}")
    if requested == "auto":
        return expert_quant
    if requested not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {requested!r} is unknown; use auto, bf16 or fp8")
    if requested != expert_quant:
        raise ValueError(f"wire dtype {requested} contradicts the {expert_quant} expert weights; "
                         f"use wire=auto or wire={expert_quant}")
    return requested


def wire_refusal(expert_quant: str, requested: str) -> str | None:
    """Why a case's expert_quant and wire contradict each other (a dispatcher's `unavailable`
    reason), or None."""
    try:
        resolve_wire_dtype(expert_quant, requested)
    except ValueError as exc:
        return str(exc)
    return None


def check_buffer_option(wire: str, use_fp8_dispatch: bool) -> None:
    """A DeepEP buffer sized for one wire dtype must not carry the other."""
    if use_fp8_dispatch != (wire == "fp8"):
        raise ValueError(f"use_fp8_dispatch={use_fp8_dispatch} contradicts the {wire} wire dtype; "
                         f"set use_fp8_dispatch={wire == 'fp8'}")


# --- model ---------------------------------------------------------------------------------

@dataclass
class Served:
    """One batch's results, per batch slot: log-softmax rows (float32 [rows, V]), the greedy
    tokens generated, and the experts each token chose per layer on this rank's tokens
    ({(slot, position): [[experts of layer 0], ...]})."""

    logprobs: list
    tokens: list
    routing: dict
