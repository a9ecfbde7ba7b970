"""Dispatch + combine checks.

Experts here are exact: expert e multiplies its rows by c_e = +-2^(8j) (a power of two,
alternating in sign), so expert outputs carry no rounding and the combine's top-k sum is
the only place an order can change bits. The probe goes to experts 4, 5 (+-2^16) and 0, 1
(+-1) with equal weights on the first two: the large pair cancels exactly when added
together, but a small term added between them is rounded away, so the order shows.

* reference: BF16 dispatch is lossless (every received row bitwise equal to the row sent,
  compared after sorting by expert, source rank and token); FP8 dispatch equals the exact
  reference quantization, values and scales.
* combine-reference: combined output vs the float64 weighted sum, within tolerances.
* batch-, position-, rank-, others-invariance, run-to-run: the probe's combined bits.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.contracts import DispatchConfig, Received, resolve_wire_dtype
from ep_harness.families.driver import Family, kept, require_finite, subject_call
from ep_harness.measurement import Bound, Measurement
from ep_harness.moe_scenario import placement_runs, placements, probe_copies, rank_tokens
from ep_harness.params import DispatchParams
from ep_harness.subject import DispatchSubject
from ep_harness.tolerances import gamma
from ep_harness.reference import quant as ref_quant

PROPERTIES = ("reference", "combine-reference", "run-to-run", "batch-invariance", "position-invariance",
              "rank-invariance", "others-invariance")
def expert_scale(e: int) -> float:
    """+-1 for experts 0, 1; +-2^8 for 2, 3; +-2^16 for 4, 5; and so on, repeating."""
    return (-1.0) ** e * 2.0 ** (8 * ((e // 2) % 3))


def run_experts(received: Received, rank: int, per_rank: int) -> torch.Tensor:
    """Exact experts on the received layout -> bf16 outputs in the same layout."""
    rows = received.rows()
    if received.scale is not None:
        x = rows.float() * received.scale.reshape(-1, received.scale.shape[-1]).repeat_interleave(128, dim=1)
    else:
        x = rows.float()
    local = torch.full((rows.shape[0],), -1, dtype=torch.long, device=rows.device)
    if received.layout == "masked":
        max_m = received.x.shape[1]
        for e, c in enumerate(received.counts):
            local[e * max_m:e * max_m + c] = e
    else:
        local = received.grouped_layout.long()
    scales = torch.tensor([expert_scale(rank * per_rank + e) for e in range(per_rank)] + [0.0],
                          device=rows.device)
    y = x * scales[local].unsqueeze(1)  # padding rows (local = -1) pick the trailing 0
    return y.to(torch.bfloat16).view(*received.x.shape)


class RankSeen(NamedTuple):
    """What one rank observed, gathered to rank 0."""

    copies: list[dict[int, torch.Tensor]]  # per run: {copy index: combined row} of the probes it holds
    outputs: list[torch.Tensor]  # combine-reference: its whole combined output
    received: list  # reference: its ReceivedRows (or, from a dispatcher that names no sources, how many rows)


def _observe(subject, ctx: RankContext, p: DispatchParams, prop: str, runs: list) -> RankSeen:
    """On every rank: its probe copies per run, its combined outputs (combine-reference) and
    the rows it received (reference)."""
    cfg = DispatchConfig.of(p, expert_quant=p.expert_quant, wire=resolve_wire_dtype(p.expert_quant, p.wire),
                            ue8m0=p.ue8m0, tokens_max=max(p.tokens, *p.batch_sizes))
    per_rank = p.num_experts // ctx.world_size
    copies, mine_dispatch, outputs = [], [], []
    for run in runs:
        x, idx, w = rank_tokens(p, run.spec, ctx.rank)
        x, idx, w = x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)
        with subject_call({"x": x, "topk_idx": idx, "topk_weights": w}):
            received = subject.dispatch(x, idx, w, cfg, ctx.group)
        y = run_experts(received, ctx.rank, per_rank)
        with subject_call({"x": x, "topk_idx": idx, "topk_weights": w, "expert_out": y}):
            out = subject.combine(y, received, w, ctx.group)
        copies.append({i: kept(out[pos]) for i, (r, pos) in enumerate(run.spec.probes) if r == ctx.rank})
        if prop == "combine-reference":
            outputs.append(kept(out))
        if prop == "reference":
            try:
                mine_dispatch.append(_received_rows(received, ctx.rank, per_rank))
            except SourcesUnknown as exc:
                mine_dispatch.append(exc.args[0])  # how many rows: rank 0 reports it
    return RankSeen(copies, outputs, mine_dispatch)


def _measure(check, subject, ctx: RankContext, p: DispatchParams, runs: list, gathered) -> Measurement:
    prop, world = check.property, ctx.world_size
    if prop == "reference":
        wire = resolve_wire_dtype(p.expert_quant, p.wire)
        return _measure_dispatch(p, wire, runs[0].spec, [g.received[0] for g in gathered], world)
    if prop == "combine-reference":
        return _measure_combine(p, runs[0].spec, [g.outputs[0] for g in gathered], world,
                                getattr(subject, "rounds_partials", False))
    observed, labels = probe_copies(runs, gathered)
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], labels))
    require_finite(m, observed, _probe_combined(p, runs[0].spec, world))
    m.sensitivity = order_sensitive(p)
    m.sensitivity_what = f"probe elements change bits under another order of its {p.topk} combine terms"
    model = getattr(subject, "combine_model", None)
    if model is not None:  # an exact order model: the copies' bits predicted from the inputs alone
        predicted = torch.stack([_predicted_probe(model(), p, run.spec, r, pos, world)
                                 for run in runs for r, pos in run.spec.probes])
        m.predicted_mismatched = compare_bitwise(predicted, predicted[0]).mismatched
        m.order_model, m.order_model_exact = f"{subject.name} combine order", True
    return m


def _expert_outputs(p: DispatchParams, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """One token's expert outputs [k, H] bf16, computed as run_experts does (float32)."""
    if p.expert_quant == "fp8":
        q, s = ref_quant.quantize_per_token_group(x.unsqueeze(0), 128, ue8m0=p.ue8m0)
        rows = q.float() * s.repeat_interleave(128, dim=1)
    else:
        rows = x.unsqueeze(0).float()
    scale = torch.tensor([expert_scale(int(e)) if e >= 0 else 0.0 for e in experts.tolist()], dtype=torch.float32)
    return (rows * scale.unsqueeze(1)).to(torch.bfloat16)


def _predicted_probe(model, p: DispatchParams, run, rank: int, pos: int, world: int) -> torch.Tensor:
    x, idx, w = rank_tokens(p, run, rank)
    return model(_expert_outputs(p, x[pos], idx[pos]), w[pos], idx[pos], p.num_experts // world)


class ReceivedRows(NamedTuple):
    """Every valid row a rank received: its (expert, src rank, token, slot), the rows (fp8 as
    bytes) and their scales (None on a BF16 wire)."""

    keys: list[tuple]
    rows: torch.Tensor
    scales: torch.Tensor | None


class SourcesUnknown(Exception):
    """A dispatcher that does not say where its received rows came from (src_rank -1)."""


def _received_rows(received: Received, rank: int, per_rank: int) -> ReceivedRows:
    """Every valid received row: its (expert, src rank, token, slot), the rows themselves as
    one contiguous CPU tensor (fp8 as bytes: fp8 storages do not survive all_gather_object's
    pickling) and their scales. One selection and one copy per tensor: a per-row view would
    pickle the whole received buffer once per row, and a per-element read syncs the GPU."""
    valid = (received.src_rank >= 0).nonzero().flatten()
    if received.layout == "masked":
        local = torch.arange(received.x.shape[0], device=valid.device).repeat_interleave(received.x.shape[1])
        slot = torch.arange(received.x.shape[1], device=valid.device).repeat(received.x.shape[0])
        real = slot < torch.tensor(received.counts, device=valid.device).repeat_interleave(received.x.shape[1])
    else:
        local = received.grouped_layout.to(valid.device).long()
        real = local >= 0
    unknown = int((real & (received.src_rank.to(valid.device) < 0)).sum())
    if unknown:  # rows without a source cannot be matched to what was sent: not a loss
        raise SourcesUnknown(unknown)
    keys = torch.stack([rank * per_rank + local[valid], received.src_rank[valid], received.src_token[valid],
                        received.src_slot[valid]], dim=1).cpu().tolist()
    rows = received.rows()[valid].cpu()
    if rows.element_size() == 1:
        rows = rows.view(torch.uint8)
    scales = None if received.scale is None else received.scale.reshape(-1, received.scale.shape[-1])[valid].cpu()
    return ReceivedRows([tuple(k) for k in keys], rows, scales)


def _measure_dispatch(p: DispatchParams, wire: str, run, per_rank_rows: list, world: int) -> Measurement:
    unknown = [(r, n) for r, n in enumerate(per_rank_rows) if isinstance(n, int)]
    if unknown:
        where = ", ".join(f"{n} on rank {r}" for r, n in unknown)
        return Measurement(comparison="bitwise", mismatched=0, total=0, held=False,
                           error=f"received rows without their source (src_rank -1: {where}): the dispatch reference "
                                 f"matches rows to what was sent by source; this subject can be checked by "
                                 f"combine-reference and the invariances")
    keys = [k for seen in per_rank_rows for k in seen.keys]
    rows = torch.cat([seen.rows for seen in per_rank_rows])
    order = sorted(range(len(keys)), key=keys.__getitem__)
    got = [keys[i] for i in order]
    want, sent = [], []
    for src in range(world):
        x, idx, _ = rank_tokens(p, run, src)
        for t in range(x.shape[0]):
            for slot, e in enumerate(idx[t].tolist()):
                if e >= 0:
                    want.append((e, src, t, slot))
                    sent.append(x[t])
    by_key = sorted(range(len(want)), key=want.__getitem__)
    if got != [want[i] for i in by_key]:
        missing = len(set(want) - set(got))
        extra = len(got) - len(set(got)) + len(set(got) - set(want))  # delivered twice, or never sent
        return Measurement(comparison="bitwise", mismatched=max(missing + extra, 1), total=len(want), held=False,
                           extra_failure=f"{missing} (token, slot) rows were lost or misrouted"
                                         + (f", {extra} delivered that were not sent once" if extra else ""))
    actual = rows[order]
    if actual.dtype == torch.uint8:
        actual = actual.view(torch.float8_e4m3fn)
    expected = torch.stack([sent[i] for i in by_key])
    labels = [f"expert {k[0]} from rank {k[1]} token {k[2]}" for k in got]
    if wire == "fp8":
        q, s = ref_quant.quantize_per_token_group(expected, 128, ue8m0=p.ue8m0)
        values = Measurement.bitwise(compare_bitwise(actual, q, labels))
        scales = torch.cat([seen.scales for seen in per_rank_rows])[order]
        return values.combine(Measurement.bitwise(compare_bitwise(scales.contiguous(), s)))
    return Measurement.bitwise(compare_bitwise(actual, expected, labels))


def _combine_inputs(p: DispatchParams, run, world: int):
    """float64 expert outputs per (token, slot) and weights, rebuilt from inputs alone."""
    outs = []
    for src in range(world):
        x, idx, w = rank_tokens(p, run, src)
        xd = x.double()
        if p.expert_quant == "fp8":
            q, s = ref_quant.quantize_per_token_group(x, 128, ue8m0=p.ue8m0)
            xd = ref_quant.dequantize_per_token_group(q, s)
        scale = torch.tensor([expert_scale(int(e)) if e >= 0 else 0.0 for e in idx.flatten()], dtype=torch.float64)
        y = xd.unsqueeze(1) * scale.view(idx.shape).unsqueeze(-1)
        y = torch.where((idx >= 0).unsqueeze(-1), y, 0.0)  # an empty slot adds nothing (not 0 * Inf = NaN)
        y = y.to(torch.bfloat16).double()  # experts write bf16 (exact here: powers of two)
        outs.append((y, w.double()))
    return outs


def _measure_combine(p: DispatchParams, run, outputs, world: int, rounds_partials: bool = False) -> Measurement:
    """Within u_out*|exact| + gamma(k, 2^-24)*sum_j w_j|y_j|; a combine that sums per-rank
    partials rounded to bf16 (DeepEP v1's normal mode) adds one bf16 rounding per partial,
    at most 2^-8 (bf16's unit roundoff) of each, so 2^-8*sum_j w_j|y_j| more."""
    got, exact, magnitude = [], [], []
    for (y, w), out in zip(_combine_inputs(p, run, world), outputs):
        exact.append((y * w.unsqueeze(-1)).sum(1))
        magnitude.append((y.abs() * w.unsqueeze(-1)).sum(1))
        got.append(out.double())
    got, exact, magnitude = torch.cat(got), torch.cat(exact), torch.cat(magnitude)
    u_out, g = 2.0 ** -8, gamma(p.topk, 2.0 ** -24)
    u_partial = 2.0 ** -8 if rounds_partials else 0.0
    bound = u_out * exact.abs() + (g + u_partial) * magnitude
    rule = Bound(rule="|err| <= 2^-8*|exact| + (gamma(k, 2^-24) + u_partial)*sum_j w_j|y_j|",
                 terms={"u_out": u_out, "gamma": g, "u_partial": u_partial})
    return Measurement.within(got, exact, bound, rule)


def _probe_combined(p: DispatchParams, run, world: int) -> torch.Tensor:
    """The probe's float64 combined output [H] (its first copy in `run`)."""
    rank, pos = run.probes[0]
    y, w = _combine_inputs(p, run, world)[rank]
    return (y[pos] * w[pos].unsqueeze(-1)).sum(0)


def order_sensitive(p: DispatchParams) -> int:
    """Probe elements whose bf16 combine result changes under some order of its k terms."""
    run = placements("position-invariance", p, 1)[0]
    y, w64 = _combine_inputs(p, run, 1)[0]
    terms = (y[0] * w64[0].unsqueeze(-1)).float()  # [k, H] as float32 products
    first = None
    sensitive = torch.zeros(terms.shape[1], dtype=torch.bool)
    for perm in itertools.islice(itertools.permutations(range(terms.shape[0])), 24):
        acc = torch.zeros(terms.shape[1])
        for j in perm:
            acc = acc + terms[j]
        bits = acc.to(torch.bfloat16).view(torch.int16)
        first = bits if first is None else first
        sensitive |= bits != first
    return int(sensitive.sum())


FAMILY = Family("dispatch", PROPERTIES, DispatchParams, placement_runs, _observe, _measure,
                protocol=DispatchSubject)
