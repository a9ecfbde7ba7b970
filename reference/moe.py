"""Float64 references for the MoE layer: routing, dispatch as a permutation, the per-expert
SwiGLU FFN, the weighted combine (DeepEP's `utils/refs.py` is the model for this module).

Shapes: T tokens, H hidden, E experts, k experts per token, I intermediate size.
"""
from __future__ import annotations

import torch


def route(logits: torch.Tensor, k: int, scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing over fp32 router logits [T, E].

    softmax: weights are the softmax probabilities of the chosen experts, renormalised;
    sigmoid: sigmoid scores of the chosen experts, renormalised (DeepSeek-V3 style).
    Ties break towards the lower expert id. Returns (topk_idx [T, k] int64, weights [T, k] float64).
    """
    logits64 = logits.to(torch.float64)
    scores = torch.softmax(logits64, dim=-1) if scoring == "softmax" else torch.sigmoid(logits64)
    # stable top-k: sort by (-score, expert id)
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :k]
    chosen = torch.gather(scores, 1, order)
    return order, chosen / chosen.sum(dim=-1, keepdim=True)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, experts_per_rank: int) -> dict[int, torch.Tensor]:
    """Rows each rank receives, per local expert, in (source token, slot) order.

    x: [T, H]; topk_idx: [T, k] (-1 = no expert). Returns {global expert: [n_e, H]}.
    """
    out: dict[int, list] = {}
    for t in range(x.shape[0]):
        for e in topk_idx[t].tolist():
            if e >= 0:
                out.setdefault(e, []).append(x[t])
    return {e: torch.stack(rows) for e, rows in out.items()}


def swiglu_expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [n, H] @ w_gate_up [2I, H]^T -> silu(gate) * up -> @ w_down [H, I]^T, in float64."""
    h = x.to(torch.float64) @ w_gate_up.to(torch.float64).T
    inter = w_down.shape[1]
    gate, up = h[:, :inter], h[:, inter:]
    return (torch.nn.functional.silu(gate) * up) @ w_down.to(torch.float64).T


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the k slots: expert_out [T, k, H], weights [T, k] -> float64 [T, H]."""
    return (expert_out.to(torch.float64) * weights.to(torch.float64).unsqueeze(-1)).sum(dim=1)


def moe_layer(x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              k: int, scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer for tokens x [T, H]: returns (output float64 [T, H], topk_idx [T, k])."""
    idx, w = route(logits, k, scoring)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in idx.unique().tolist():
        rows, slots = (idx == e).nonzero(as_tuple=True)
        y = swiglu_expert(x[rows], w_gate_up[e], w_down[e])
        out.index_add_(0, rows, y * w[rows, slots].unsqueeze(-1))
    return out, idx
