"""tp-size-invariance of a collective: the TP reduction of one fixed logical tensor, cut
into V virtual shards, at world sizes 1, 2, 4 (8), compared bitwise (harness/families/layout.py).

The logical tensor is V seeded shards [rows, hidden] (rows: `rows_per_rank` per destination
at the sizes' common multiple); at size w rank r holds its V / w shards and receives rows
[r * rows / w, (r + 1) * rows / w) of the sum. The compared copy of a size is the whole
[rows, hidden] output, gathered in rank order; every size is compared with the first.

Prediction (from the inputs alone, never by running a collective): a subject's
`shards_order_model` where it has one; otherwise the ranks' partials (reference/orders.py
block_partials) through the subject's own order model. Two partials add in one order only
(a + b == b + a), so sizes 1 and 2 need no log; on NCCL a larger size is predicted only
where it is the launch's whole communicator (a subgroup's rings and trees are not read):
put the largest size in a launch of its own size (cases/h200-layout.toml).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ep_harness import inputs as gen
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.families import layout
from ep_harness.families.driver import Run, kept
from ep_harness.measurement import Measurement
from ep_harness.nccl.models import NcclContext, NoPrediction
from ep_harness.reference import orders
from ep_harness.reference.collectives import shard_offsets
from ep_harness.subject import order_model_of, shards_order_model_of
from ep_harness.shards import reduce_shards

if TYPE_CHECKING:  # collective.py, which declares it, imports this module
    from ep_harness.families.collective import CollectiveParams


def per_destination(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [flat[o:o + s] for o, s in zip(shard_offsets(sizes), sizes)]


def virtual_shards(p: CollectiveParams) -> torch.Tensor:
    """[V, rows, hidden]: the logical tensor's fixed TP shards, the same at every size."""
    rows, dtype = layout.logical_rows(p, p.rows_per_rank), gen.dtype_of(p.dtype)
    return torch.stack([gen.values((rows, p.hidden), dtype, p.seed, "virtual-shard", v, data=p.data)
                        for v in range(p.virtual_shards)])


class LayoutSeen(NamedTuple):
    """What one rank observed, gathered to rank 0."""

    outputs: list[torch.Tensor | None]  # per run: its rows of the sum (None: outside that size)
    mutated: bool  # whether the subject modified its shards
    calls: list[list]  # per run: the NCCL calls rank 0 logged
    seconds: list[float | None]  # per run: the call's time on this rank


def observe(subject, ctx: RankContext, p: CollectiveParams, prop: str, runs: list[Run]) -> LayoutSeen:
    logical = virtual_shards(p)
    rows = logical.shape[1]
    outputs, mutated, calls, seconds = [], False, [], []
    for run in runs:
        size, sub = run.spec, ctx.layout(run.spec)
        if sub is None:  # this rank is not among ranks 0..size-1
            outputs.append(None), calls.append([]), seconds.append(None)
            continue
        mine = logical[list(layout.block(p.virtual_shards, size, sub.rank))].to(ctx.device)
        pristine = mine.clone()
        out = mine.new_empty((rows // size, p.hidden))
        mark = ctx.nccl_mark()
        seconds.append(layout.timed(lambda: reduce_shards(subject, out, mine, [rows // size] * size, sub.group),
                                    ctx.device))
        calls.append(ctx.nccl_calls_since(mark))
        mutated |= not torch.equal(mine.view(torch.uint8), pristine.view(torch.uint8))
        outputs.append(kept(out))
    return LayoutSeen(outputs, mutated, calls, seconds)


def _gathered_outputs(runs: list[Run], gathered: list[LayoutSeen]) -> torch.Tensor:
    """[sizes, rows * hidden]: each size's whole output, in rank order."""
    return torch.stack([torch.cat([gathered[r].outputs[i] for r in range(run.spec)]).reshape(-1)
                        for i, run in enumerate(runs)])


def predict(subject, ctx: RankContext, p: CollectiveParams, runs: list[Run], calls: list[list]):
    """(the predicted outputs [sizes, rows * hidden], the model's name) from the shards alone."""
    logical = virtual_shards(p)
    flat = logical.reshape(logical.shape[0], -1)
    model = shards_order_model_of(subject, ctx.backend)
    if model is not None:
        return torch.stack([torch.cat(model.predict(flat, [flat.shape[1] // w] * w, None)) for w in
                            (r.spec for r in runs)]), model.name
    model = order_model_of(subject, ctx.backend)
    if model is None:
        raise NoPrediction(f"{subject.name} has no order model")
    rows = []
    for run, logged in zip(runs, calls):
        w = run.spec
        partials, dests = orders.block_partials(flat, w), [flat.shape[1] // w] * w
        if w <= 2:  # one partial, or two in the one order they can be added
            outs = per_destination(orders.chain_fold(partials, list(range(w))), dests)
        elif ctx.backend != "nccl":
            outs = model.predict(partials, dests, None)
        elif ctx.nccl_topology is not None and ctx.nccl_topology.nranks == w:  # the communicator logged
            outs = model.predict(partials, dests, NcclContext(ctx.nccl_topology, logged))
        else:
            raise NoPrediction(f"size {w} ran on a subgroup communicator, whose NCCL rings and trees are not read")
        rows.append(torch.cat(outs))
    return torch.stack(rows), f"ranks' fp32 partials of their shards, then {model.name}"


def sensitivity(p: CollectiveParams, runs: list[Run]) -> int:
    """Output elements whose bits differ between some two of the sizes when each rank's fp32
    partial is added in rank order: what a W-dependent grouping could change."""
    flat = virtual_shards(p).reshape(p.virtual_shards, -1)
    bits = [orders.chain_fold(orders.block_partials(flat, r.spec), list(range(r.spec))) for r in runs]
    view = {2: torch.int16, 4: torch.int32}[bits[0].element_size()]
    stacked = torch.stack([b.view(view) for b in bits])
    return int((stacked != stacked[0]).any(dim=0).sum())


def measure(check, subject, ctx: RankContext, p: CollectiveParams, runs: list[Run], gathered) -> Measurement:
    observed = _gathered_outputs(runs, gathered)
    labels = [r.label for r in runs]
    mutated = [r for r, g in enumerate(gathered) if g.mutated]
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], labels),
                            extra_failure=f"subject modified its input on ranks {mutated}" if mutated else None)
    try:
        predicted, name = predict(subject, ctx, p, runs, gathered[0].calls)
        m.predicted_mismatched = compare_bitwise(predicted, predicted[0]).mismatched
        m.order_model, m.order_model_exact = name, True
    except NoPrediction as exc:
        m.note = f"no order-model prediction: {exc}"
    m.sensitivity = sensitivity(p, runs)
    m.sensitivity_what = (f"of {observed.shape[1]:,} output elements change bits when the {p.virtual_shards} shards "
                          f"are summed as fp32 rank partials at sizes {[r.spec for r in runs]}")
    m.detail["call_seconds"] = {r.label: round(gathered[0].seconds[i], 6) for i, r in enumerate(runs)}
    m.detail["virtual_shards"] = p.virtual_shards
    return m
