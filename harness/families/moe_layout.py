"""Layout-size properties of the MoE layer: the same tokens and weights at world sizes 1,
2, 4 (8), where the world size is both the TP size (the tp_reduce stage) and the EP size
(experts e // (E / w) on rank e // (E / w), dispatch and combine), compared bitwise
(harness/families/layout.py).

* tp-size-invariance: the hidden states are the TP sum of V seeded virtual shards [T, H]
  (as the collective family's); what the TP reduction does with them decides.
* ep-size-invariance: the same hidden states x cut into V shards of disjoint support
  (shard v holds the columns c = v mod V, +0.0 elsewhere; no -0.0 in x), so that every
  order of every TP reduction gives x exactly: only what the EP size moves can differ (which
  rank holds an expert, the combine's order).

Each size's compared copy is every token's output, gathered in rank order (rank r of w
holds tokens r * T / w .. (r + 1) * T / w - 1).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ep_harness import inputs as gen
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.families import layout
from ep_harness.families.driver import Run, kept
from ep_harness.measurement import Measurement
from ep_harness.families.moe_scenario import MoeParams
from ep_harness.reference import moe as ref
from ep_harness.reference import orders


def total_tokens(p: MoeParams) -> int:
    return layout.logical_rows(p, p.tokens)


def hidden_states(p: MoeParams) -> torch.Tensor:
    """[T, H] bf16, -0.0 made +0.0 (so that x + 0.0 is x in every element)."""
    x = gen.values((total_tokens(p), p.hidden), torch.bfloat16, p.seed, "layout-hidden", data=p.data)
    return torch.where(x == 0, torch.zeros_like(x), x)


def virtual_shards(prop: str, p: MoeParams) -> torch.Tensor:
    """[V, T, H] bf16: the logical TP input, the same at every size."""
    v, shape = p.virtual_shards, (total_tokens(p), p.hidden)
    if prop == "tp-size-invariance":
        return torch.stack([gen.values(shape, torch.bfloat16, p.seed, "layout-shard", k, data=p.data) / v
                            for k in range(v)]).to(torch.bfloat16)
    x = hidden_states(p)
    owner = torch.arange(p.hidden) % v
    return torch.stack([torch.where(owner == k, x, torch.zeros_like(x)) for k in range(v)])


class LayoutSeen(NamedTuple):
    outputs: list[torch.Tensor | None]  # per run: this rank's tokens' outputs (None: outside that size)
    seconds: list[float | None]


def observe(subject, ctx: RankContext, p: MoeParams, prop: str, runs: list[Run]) -> LayoutSeen:
    from ep_harness.families.moe_layer import layer_weights

    weights = {k: v.to(ctx.device, copy=True) for k, v in layer_weights(p).items()}
    logical = virtual_shards(prop, p)
    outputs, seconds = [], []
    for run in runs:
        size, sub = run.spec, ctx.layout(run.spec)
        if sub is None:
            outputs.append(None), seconds.append(None)
            continue
        mine = logical[list(layout.block(p.virtual_shards, size, sub.rank))].to(ctx.device)
        box = {}
        seconds.append(layout.timed(lambda: box.update(out=subject.forward_shards(mine, weights, p, sub.group)[0]),
                                    ctx.device))
        outputs.append(kept(box["out"]))
    return LayoutSeen(outputs, seconds)


def _combine_sensitivity(p: MoeParams) -> int:
    """Output elements whose bits change when a token's weighted expert outputs (float64
    experts rounded to bf16, as a GEMM writes them) are added in reverse slot order instead
    of slot order, rounded to bf16 after every add (a combine that reduces on the wire, as
    DeepEP's per-rank pre-reduction does): what a combine's order could show. (In float32
    with one rounding, as the built-in combines add, another order almost never shows.)"""
    from ep_harness.families.moe_layer import layer_weights

    w = layer_weights(p)
    x = hidden_states(p).double()
    idx, wts = ref.route(x @ w["router"].double().T, p.topk, p.scoring)
    ys = torch.stack([torch.stack([ref.swiglu_expert(x[t:t + 1], w["gate_up"][e], w["down"][e])[0]
                                   for e in idx[t].tolist()]) for t in range(x.shape[0])]).to(torch.bfloat16)
    terms = (wts.float().unsqueeze(-1) * ys.float()).to(torch.bfloat16)  # [T, k, H]
    ahead = orders.chain_fold(terms.transpose(0, 1).reshape(p.topk, -1), list(range(p.topk)))
    back = orders.chain_fold(terms.transpose(0, 1).reshape(p.topk, -1), list(reversed(range(p.topk))))
    return int((ahead.view(torch.int16) != back.view(torch.int16)).sum())


def _tp_sensitivity(p: MoeParams, runs: list[Run]) -> int:
    """Hidden-state elements whose bits differ between sizes when each rank's fp32 partial is
    added in rank order (the collective family's rule)."""
    flat = virtual_shards("tp-size-invariance", p).reshape(p.virtual_shards, -1)
    bits = torch.stack([orders.chain_fold(orders.block_partials(flat, r.spec), list(range(r.spec))).view(torch.int16)
                        for r in runs])
    return int((bits != bits[0]).any(dim=0).sum())


def measure(check, subject, ctx: RankContext, p: MoeParams, runs: list[Run], gathered) -> Measurement:
    observed = torch.stack([torch.cat([gathered[r].outputs[i] for r in range(run.spec)]).reshape(-1)
                            for i, run in enumerate(runs)])
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], [r.label for r in runs]))
    if check.property == "tp-size-invariance":
        m.sensitivity = _tp_sensitivity(p, runs)
        m.sensitivity_what = "hidden-state elements change bits when the TP shards regroup by size"
    else:
        m.sensitivity = _combine_sensitivity(p)
        m.sensitivity_what = "output elements change bits when a token's expert outputs are added in another order"
    m.detail["call_seconds"] = {r.label: round(gathered[0].seconds[i], 6) for i, r in enumerate(runs)}
    m.detail["virtual_shards"] = p.virtual_shards
    return m
