"""One MoE layer composed from chosen subjects per stage:

    TP partial sums --tp_reduce--> hidden states of this rank's tokens --router (fp32
    logits, softmax top-k)--> dispatch --gemm (gate-up) -> silu * up -> gemm (down)-->
    combine --> output of this rank's tokens

`tp_reduce` is a collective subject, `dispatch` a dispatch subject, `gemm` a GEMM subject;
the case's params name them (defaults: all_gather_fold, torch_a2a_dispatch, torch_mm).
"""
from __future__ import annotations

from dataclasses import fields

import torch

from ep_harness import families
from ep_harness import subject as registry
from ep_harness.contracts import DispatchConfig, GemmProblem, expected_m_hint, route
from ep_harness.errors import HarnessError
from ep_harness.params import CommonParams
from ep_harness.kernel_trace import declared
from ep_harness.subject import compiles_kernels, description, register

STAGES = ("tp_reduce", "dispatch", "gemm")  # each a field of the parameters naming a subject


def _stage(family: str, p: CommonParams, **given):
    """The parameters of a stage of `family`: its registered dataclass, with `p`'s common keys."""
    common = {f.name: getattr(p, f.name) for f in fields(CommonParams)}
    return families.get(family).params(**common, **given)


# What each stage subject is asked about (unavailable, kernels, describe): its own family's
# parameters as the composition runs it, bf16 throughout.
STAGE_PARAMS = {
    "tp_reduce": lambda p: _stage("collective", p, dtype="bfloat16", hidden=p.hidden, shards="even"),
    "dispatch": lambda p: _stage("dispatch", p, hidden=p.hidden, num_experts=p.num_experts, topk=p.topk,
                                 layout=p.layout, alignment=p.alignment, expert_quant="bf16", wire="bf16"),
    "gemm": lambda p: _stage("gemm", p, dtype="bfloat16", layout=p.layout, alignment=p.alignment),
    "dense_gemm": lambda p: _stage("gemm", p, dtype="bfloat16", layout="dense"),
}


def stages(params, names: tuple[str, ...] = STAGES) -> dict:
    """Each stage's subject, by the registered name its parameter field holds."""
    return {stage: registry.get(getattr(params, stage)) for stage in names}


class Composed:
    """What a subject composed of stage subjects (named in params) answers for its stages:
    whether each can run here, whether any compiles kernels, the kernels they declare (so
    the composition proves its stages ran) and what each is."""

    STAGES: tuple[str, ...] = STAGES

    def stages(self, params) -> dict:
        return stages(params, self.STAGES)

    def unavailable(self, platform, params):
        try:
            chosen = self.stages(params)
        except HarnessError as exc:  # an unknown subject named for a stage
            return str(exc)
        for stage, subject in chosen.items():
            reason = subject.unavailable(platform, STAGE_PARAMS[stage](params))
            if reason:
                return f"{stage} stage {subject.name}: {reason}"
        return None

    def compiles_kernels(self, params):
        return any(compiles_kernels(s, STAGE_PARAMS[stage](params)) for stage, s in self.stages(params).items())

    def kernels(self, params):
        return tuple(dict.fromkeys(k for stage, s in self.stages(params).items()
                                   for k in declared(s, STAGE_PARAMS[stage](params))))

    def describe(self, params) -> dict:
        return {stage: {"subject": s.name,
                        **description(s, STAGE_PARAMS[stage](params))}
                for stage, s in self.stages(params).items()}


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
        local = partials.shape[0] // world
        x = partials.new_empty((local, partials.shape[1]))
        s["tp_reduce"].reduce_scatter(x, partials, [local] * world, group)
        return self._routed(s, x, weights, params, group)

    def forward_shards(self, shards, weights, params, group):
        """shards: this rank's virtual TP shards of every global token [k, T_total, H]
        (harness/families/layout.py); the tp_reduce stage reduces them as the layout-size
        properties define. Returns what `forward` does."""
        from ep_harness.shards import reduce_shards

        s = self.stages(params)
        world = torch.distributed.get_world_size(group)
        local = shards.shape[1] // world
        x = shards.new_empty((local, shards.shape[2]))
        reduce_shards(s["tp_reduce"], x, shards, [local] * world, group)
        return self._routed(s, x, weights, params, group)

    def _routed(self, s, x, weights, params, group):
        """Router, dispatch, expert GEMMs and combine of this rank's hidden states x [T, H]."""
        world = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        local = x.shape[0]
        idx, w = route(x, weights["router"], params.topk, params.scoring)
        cfg = DispatchConfig.of(params, expert_quant="bf16", wire="bf16", ue8m0=True, tokens_max=local)
        received = s["dispatch"].dispatch(x, idx, w, cfg, group)
        per_rank = params.num_experts // world
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        h = self._gemm(s["gemm"], received, received.x, weights["gate_up"][experts])
        inter = weights["down"].shape[-1]
        act = (torch.nn.functional.silu(h[..., :inter].float()) * h[..., inter:].float()).to(torch.bfloat16)
        y = self._gemm(s["gemm"], received, act, weights["down"][experts])
        return s["dispatch"].combine(y, received, w, group), idx

    @staticmethod
    def _gemm(subject, received, a, b):
        problem = GemmProblem(received.layout, a.contiguous(), b.contiguous(), received.counts, received.starts,
                              grouped_layout=received.grouped_layout, masked_m=received.masked_m,
                              expected_m=expected_m_hint(received.counts))
        shape = (*a.shape[:-1], b.shape[1])
        out = torch.zeros(shape, dtype=torch.bfloat16, device=a.device)
        subject.run(problem, out)
        return out
