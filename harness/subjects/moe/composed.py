"""One MoE layer composed from chosen subjects per stage:

    TP partial sums --tp_reduce--> hidden states of this rank's tokens --router (fp32
    logits, softmax top-k)--> dispatch --gemm (gate-up) -> silu * up -> gemm (down)-->
    combine --> output of this rank's tokens

`tp_reduce` is a collective subject, `dispatch` a dispatch subject, `gemm` a GEMM subject;
the case's params name them (defaults: all_gather_fold, torch_a2a_dispatch, torch_mm).
"""
from __future__ import annotations

import torch

from ep_harness import subject as registry
from ep_harness.gemm_problem import GemmProblem
from ep_harness.subject import register

STAGES = {"tp_reduce": "all_gather_fold", "dispatch": "torch_a2a_dispatch", "gemm": "torch_mm"}
# What each stage subject is asked about when the composition is planned.
STAGE_PARAMS = {
    "tp_reduce": lambda p: {**p, "shards": "even"},
    "dispatch": lambda p: {**p, "expert_quant": "bf16"},
    "gemm": lambda p: {**p, "dtype": "bfloat16", "layout": p.get("layout", "contiguous")},
    "dense_gemm": lambda p: {**p, "dtype": "bfloat16", "layout": "dense"},
}


def stages(params: dict, defaults: dict = STAGES) -> dict:
    return {stage: registry.get(params.get(stage) or default) for stage, default in defaults.items()}


class Composed:
    """What a subject composed of stage subjects (named in params) answers for its stages:
    whether each can run here, whether any compiles kernels, the kernels they declare (so
    the composition proves its stages ran) and what each is."""

    STAGES: dict = STAGES

    def stages(self, params: dict) -> dict:
        return stages(params, self.STAGES)

    def unavailable(self, platform, params):
        try:
            chosen = self.stages(params)
        except Exception as exc:  # an unknown stage name
            return str(exc)
        for stage, subject in chosen.items():
            reason = subject.unavailable(platform, STAGE_PARAMS[stage](params))
            if reason:
                return f"{stage} stage {subject.name}: {reason}"
        return None

    def compiles_kernels(self, params):
        from ep_harness.subject import compiles_kernels

        return any(compiles_kernels(s, params) for s in self.stages(params).values())

    def kernels(self, params):
        from ep_harness.kernel_trace import declared

        return tuple(dict.fromkeys(k for s in self.stages(params).values() for k in declared(s, params)))

    def describe(self, params) -> dict:
        return {stage: {"subject": s.name, **(s.describe(params) if hasattr(s, "describe") else {})}
                for stage, s in self.stages(params).items()}


def route(x: torch.Tensor, w_router: torch.Tensor, k: int, scoring: str = "softmax"):
    """fp32 router logits (computed in float64, rounded once, so no row depends on the batch),
    softmax or sigmoid scores, top-k, renormalised. Returns (topk_idx, weights)."""
    logits = (x.double() @ w_router.double().T).float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    vals, idx = torch.topk(scores, k, dim=-1, sorted=True)
    return idx, vals / vals.sum(dim=-1, keepdim=True)


@register
class ComposedMoE(Composed):
    name = "composed_moe"
    family = "moe_layer"
    summary = "TP reduce + router + dispatch + grouped GEMMs + combine"

    def forward(self, partials, weights, params, group):
        """partials: this rank's TP partial sums for every global token [T_total, H].
        Returns (output [T_local, H] bf16, topk_idx [T_local, k])."""
        s = self.stages(params)
        world = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        local = partials.shape[0] // world
        x = partials.new_empty((local, partials.shape[1]))
        s["tp_reduce"].reduce_scatter(x, partials, [local] * world, group)
        idx, w = route(x, weights["router"], params["topk"], params.get("scoring", "softmax"))
        cfg = {**params, "expert_quant": "bf16", "wire": "bf16", "tokens_max": local}
        received = s["dispatch"].dispatch(x, idx, w, cfg, group)
        per_rank = params["num_experts"] // world
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        h = self._gemm(s["gemm"], received, received.x, weights["gate_up"][experts], params)
        inter = weights["down"].shape[-1]
        act = (torch.nn.functional.silu(h[..., :inter].float()) * h[..., inter:].float()).to(torch.bfloat16)
        y = self._gemm(s["gemm"], received, act, weights["down"][experts], params)
        return s["dispatch"].combine(y, received, w, group), idx

    @staticmethod
    def _gemm(subject, received, a, b, params):
        problem = GemmProblem(received.layout, a.contiguous(), b.contiguous(), received.counts, received.starts,
                              grouped_layout=received.grouped_layout, masked_m=received.masked_m,
                              expected_m=max(1, sum(received.counts) // max(len(received.counts), 1)))
        shape = (*a.shape[:-1], b.shape[1])
        out = torch.zeros(shape, dtype=torch.bfloat16, device=a.device)
        subject.run(problem, out)
        return out
