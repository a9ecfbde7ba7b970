"""Float64 reference of the probe model's whole forward (harness/subjects/model/): one
sequence, every position at once, teacher-forced on the tokens given and, where asked, on
the experts the checked run chose (a router decision is discrete: following it keeps the
comparison about rounding, and tokens whose own float64 choice differs are counted apart).

Shapes: tokens [T] ints; weights as in harness/families/model_inputs.py (H hidden, V vocab,
E experts, n heads of d = H / n). Returns float64 tensors.
"""
from __future__ import annotations

import torch

from ep_harness.reference import moe as ref_moe

EPS = 1e-6


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return ref_moe.swiglu_expert(x, gate_up, down)


def attention_heads(x: torch.Tensor, wqkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal softmax attention of every head: x [T, H] -> per-head outputs [T, H] (heads
    concatenated, before the output projection)."""
    t, hidden = x.shape
    d = hidden // heads
    q, k, v = (x @ wqkv.double().T).split(hidden, dim=1)
    q, k, v = (a.reshape(t, heads, d).transpose(0, 1) for a in (q, k, v))  # [n, T, d]
    scores = q @ k.transpose(1, 2) * d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (p @ v).transpose(0, 1).reshape(t, hidden)


def forced_route(logits: torch.Tensor, k: int, chosen: torch.Tensor | None):
    """(experts [T, k], weights [T, k], own [T, k]): `chosen` where given, else the float64
    router's own top-k (`own`), with softmax weights renormalised over the experts used."""
    own, _ = ref_moe.route(logits, k)
    idx = own if chosen is None else chosen
    probs = torch.softmax(logits.double(), dim=-1).gather(1, idx)
    return idx, probs / probs.sum(-1, keepdim=True), own


def forward(w: dict, tokens: list[int], heads: int, topk: int, routing: list | None = None) -> dict:
    """The whole model over one sequence. routing: per position, per layer, the experts to
    use (None: the reference's own). Returns logprobs [T, V], logits [T, V], the final
    normed hidden states x [T, H], and per layer the router's view: its float64 logits
    [T, E], their scale |x| @ |W_router|^T [T, E], its own top-k and the experts used [T, k]."""
    h = w["embed"].double()[torch.tensor(tokens)]
    router = []
    for layer, L in enumerate(w["layers"]):
        x = rmsnorm(h, L["attn_norm"])
        h = h + attention_heads(x, L["wqkv"], heads) @ L["wo"].double().T
        x = rmsnorm(h, L["moe_norm"])
        chosen = None if routing is None else torch.tensor([r[layer] for r in routing])
        logits = x @ L["router"].double().T
        idx, wts, own = forced_route(logits, topk, chosen)
        router.append({"logits": logits, "scale": x.abs() @ L["router"].double().abs().T, "own": own, "used": idx})
        routed = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slots = (idx == e).nonzero(as_tuple=True)
            routed.index_add_(0, rows, wts[rows, slots].unsqueeze(1) * swiglu(x[rows], L["gate_up"][e], L["down"][e]))
        h = h + routed + swiglu(x, L["shared_gate_up"], L["shared_down"])
    x = rmsnorm(h, w["final_norm"])
    logits = x @ w["lm_head"].double().T
    return {"logprobs": torch.log_softmax(logits, dim=-1), "logits": logits, "x": x, "router": router}


def layer0_partials(w: dict, tokens: list[int], heads: int, world: int) -> torch.Tensor:
    """The TP partial sums of layer 0's attention (rank r: its heads through its columns of
    wo), each rounded once to bf16: [world, T, H]. What the first TP reduction sums."""
    x = rmsnorm(w["embed"].double()[torch.tensor(tokens)], w["layers"][0]["attn_norm"])
    o = attention_heads(x, w["layers"][0]["wqkv"], heads)
    wo = w["layers"][0]["wo"].double()
    share = o.shape[1] // world
    return torch.stack([(o[:, r * share:(r + 1) * share] @ wo[:, r * share:(r + 1) * share].T).to(torch.bfloat16)
                        for r in range(world)])
