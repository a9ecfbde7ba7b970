"""tp-size-invariance of the model: every prompt's logprob rows (the largest batch, greedy
generation) at world sizes 1, 2, 4 (8), compared bitwise (harness/families/layout.py).

The model runs its virtual-shard forward (ModelParams.virtual_tp, harness/subjects/model/
composed.py): each TP product (q/k/v, o projection, the shared expert) once per fixed
virtual shard, so the GEMMs see the same operands at every size and only the TP reduction
of the shards (and the EP stages: which rank holds an expert, the combine) can depend on the
size. Traces name their TP parts by shard, so the first divergence between two sizes is
localised as for the other model properties.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.divergence import Tracer, localise
from ep_harness.families import layout
from ep_harness.families.driver import Run
from ep_harness.measurement import Measurement
from ep_harness.families.model_inputs import prompts, to_device, weights
from ep_harness.reference import orders

if TYPE_CHECKING:  # model.py, which declares it, imports this module
    from ep_harness.families.model import ModelParams


def observe(subject, ctx: RankContext, p: ModelParams, prop: str, runs: list[Run]) -> list:
    from ep_harness.families.model import _namer

    w, pr = to_device(weights(p), ctx.device), prompts(p)
    everyone = tuple(range(max(p.batch_sizes)))
    sharded = replace(p, virtual_tp=True)
    seen = []
    for run in runs:
        sub = ctx.layout(run.spec)
        if sub is None:
            seen.append(None)
            continue
        tracer = Tracer(sub.rank, _namer({slot: f"prompt {pid}" for slot, pid in enumerate(everyone)}))
        served = subject.generate([pr[pid] for pid in everyone], [len(pr[pid]) for pid in everyone], p.new_tokens,
                                  w, sharded, sub.group, tracer)
        rows = torch.cat([served.logprobs[slot].cpu().reshape(-1) for slot in range(len(everyone))])
        seen.append({"rows": rows if sub.rank == 0 else None, "events": tracer.events,
                     "seconds": None})
    # ship traces for the first size and the first size whose rows differ (rank 0 knows; it shares)
    first = seen[0]["rows"] if ctx.rank == 0 else None
    differs = None
    if ctx.rank == 0:
        differs = next((i for i in range(1, len(seen)) if not torch.equal(seen[i]["rows"].view(torch.int32),
                                                                        first.view(torch.int32))), None)
    differs = ctx.share_from_rank0(differs)
    for i, s in enumerate(seen):
        if s is not None and i not in (0, differs):
            s["events"] = None
    return seen


def measure(check, subject, ctx: RankContext, p: ModelParams, runs: list[Run], gathered) -> Measurement:
    observed = torch.stack([gathered[0][i]["rows"] for i in range(len(runs))])
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], [r.label for r in runs]))
    m.detail["compared"] = f"{max(p.batch_sizes)} prompts, {observed.shape[1] // p.vocab} rows of {p.vocab} logprobs"
    m.detail["virtual_shards"] = p.virtual_shards
    if m.mismatched:
        other = next(i for i in range(1, len(runs)) if gathered[0][i]["events"] is not None)
        events = lambda i: [(g[i] or {}).get("events") or {} for g in gathered]  # noqa: E731
        found = localise(events(0), events(other))
        m.detail.update(found, between=[runs[0].label, runs[other].label])
        m.note = f"{runs[0].label} vs {runs[other].label}: {found['note']}"
    m.sensitivity = _sensitivity(p, runs)
    m.sensitivity_what = "of layer 0's first-token o-projection elements change bits when its shards regroup by size"
    return m


def _sensitivity(p: ModelParams, runs: list[Run]) -> int:
    """A stand-in for the model's TP partials: seeded bf16 values of the hidden size per
    virtual shard, regrouped into fp32 rank partials added in rank order at each size."""
    from ep_harness import inputs as gen

    flat = torch.stack([gen.values((p.hidden,), torch.bfloat16, p.seed, "model-layout", v)
                        for v in range(p.virtual_shards)])
    bits = torch.stack([orders.chain_fold(orders.block_partials(flat, r.spec), list(range(r.spec))).view(torch.int16)
                        for r in runs])
    return int((bits != bits[0]).any(dim=0).sum())


def runs(prop: str, p: ModelParams, world: int) -> list[Run]:
    return layout.runs(prop, p, world)
