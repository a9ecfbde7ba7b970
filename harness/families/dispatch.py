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
* batch-, position-, rank-, others-invariance, run-to-run, thread-invariance: the probe's combined bits.
* corruption-rate: `calls` calls at each of `call_tokens` tokens per rank, fresh inputs each
  call, every received row and every combined row checked bit for bit against its exact
  expectation on the rank that holds it; the record says how many calls of n had a wrong
  row, a 95 % upper bound on the per-call rate, and which calls, ranks and rows were hit.
  Its inputs make every correct combine exact whatever its order or grouping (small
  integers, experts +-1, weights 2^-1..2^-3: every partial sum is a bf16 value), so one
  expectation fits every dispatcher.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch

from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.contracts import DispatchConfig, Received, resolve_wire_dtype
from ep_harness.families.driver import Family, kept, require_finite, subject_call
from ep_harness import inputs as gen
from ep_harness import rates
from ep_harness.measurement import Bound, Measurement
from ep_harness.families.moe_scenario import (DispatchParams, expected_copies, expert_choice, placement_runs, placements,
                                              probe_copies, rank_tokens)
from ep_harness.subject import DispatchSubject, combine_model_of, rounds_partials
from ep_harness.tolerances import gamma
from ep_harness.reference import quant as ref_quant
from ep_harness.selftest.wrap import Wrapped

PROPERTIES = ("reference", "combine-reference", "run-to-run", "thread-invariance", "batch-invariance",
              "position-invariance", "rank-invariance", "others-invariance", "corruption-rate")
def expert_scale(e: int) -> float:
    """+-1 for experts 0, 1; +-2^8 for 2, 3; +-2^16 for 4, 5; and so on, repeating."""
    return (-1.0) ** e * 2.0 ** (8 * ((e // 2) % 3))


def run_experts(received: Received, rank: int, per_rank: int, scale_of=expert_scale) -> torch.Tensor:
    """Exact experts on the received layout -> bf16 outputs in the same layout; expert e
    multiplies by scale_of(e), a power of two."""
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
    scales = torch.tensor([scale_of(rank * per_rank + e) for e in range(per_rank)] + [0.0],
                          device=rows.device)
    y = x * scales[local].unsqueeze(1)  # padding rows (local = -1) pick the trailing 0
    return y.to(torch.bfloat16).view(*received.x.shape)


class RankSeen(NamedTuple):
    """What one rank observed, gathered to rank 0."""

    copies: list[dict[int, torch.Tensor]]  # per run: {copy index: combined row} of the probes it holds
    outputs: list[torch.Tensor]  # combine-reference: its whole combined output
    received: list  # reference: its ReceivedRows (or, from a dispatcher that names no sources, how many rows)


def _config(p: DispatchParams) -> DispatchConfig:
    return DispatchConfig.of(p, expert_quant=p.expert_quant, wire=resolve_wire_dtype(p.expert_quant, p.wire),
                             ue8m0=p.ue8m0, tokens_max=max(p.tokens, *p.batch_sizes, *p.call_tokens))


def _observe(subject, ctx: RankContext, p: DispatchParams, prop: str, runs: list):
    """On every rank: its probe copies per run, its combined outputs (combine-reference) and
    the rows it received (reference); corruption-rate: what its calls got wrong."""
    if prop == "corruption-rate":
        return _observe_calls(subject, ctx, p, runs)
    cfg = _config(p)
    per_rank = p.num_experts // ctx.world_size
    copies, mine_dispatch, outputs = [], [], []
    for run in runs:
        x, idx, w = rank_tokens(p, run.spec, ctx.rank)
        x, idx, w = x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)
        with subject_call({"x": x, "topk_idx": idx, "topk_weights": w}):
            received = subject.dispatch(x, idx, w, cfg, ctx.group)
        y = run_experts(received, ctx.rank, per_rank)
        with subject_call({"x": x, "topk_idx": idx, "topk_weights": w, "expert_out": y}, continues_run=True):
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
    if prop == "corruption-rate":
        return _measure_calls(p, runs, gathered, world)
    if prop == "reference":
        wire = resolve_wire_dtype(p.expert_quant, p.wire)
        return _measure_dispatch(p, wire, runs[0].spec, [g.received[0] for g in gathered], world)
    if prop == "combine-reference":
        return _measure_combine(p, runs[0].spec, [g.outputs[0] for g in gathered], world,
                                rounds_partials(subject))
    observed, labels = probe_copies(runs, gathered)
    m = Measurement.bitwise(compare_bitwise(observed, expected_copies(prop, observed, runs), labels))
    require_finite(m, observed, _probe_combined(p, runs[0].spec))
    m.sensitivity = order_sensitive(p)
    m.sensitivity_what = f"probe elements change bits under another order of its {p.topk} combine terms"
    model = combine_model_of(subject)
    if model is not None:  # an exact order model: the copies' bits predicted from the inputs alone
        predicted = torch.stack([_predicted_probe(model, p, run.spec, r, pos, world)
                                 for run in runs for r, pos in run.spec.probes])
        m.predicted_mismatched = compare_bitwise(predicted, expected_copies(prop, predicted, runs)).mismatched
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
    """Every rank's `_rank_combine_inputs`, in rank order."""
    return [_rank_combine_inputs(p, run, src) for src in range(world)]


def _rank_combine_inputs(p: DispatchParams, run, src: int):
    """Rank `src`'s float64 expert outputs per (token, slot) [T, k, H] and weights [T, k],
    rebuilt from inputs alone."""
    x, idx, w = rank_tokens(p, run, src)
    xd = x.double()
    if p.expert_quant == "fp8":
        q, s = ref_quant.quantize_per_token_group(x, 128, ue8m0=p.ue8m0)
        xd = ref_quant.dequantize_per_token_group(q, s)
    scales = torch.tensor([expert_scale(e) for e in range(p.num_experts)], dtype=torch.float64)
    y = xd.unsqueeze(1) * scales[idx.clamp(min=0)].unsqueeze(-1)
    y = torch.where((idx >= 0).unsqueeze(-1), y, 0.0)  # an empty slot adds nothing (not 0 * Inf = NaN)
    y = y.to(torch.bfloat16).double()  # experts write bf16 (exact here: powers of two)
    return y, w.double()


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


def _probe_combined(p: DispatchParams, run) -> torch.Tensor:
    """The probe's float64 combined output [H] (its first copy in `run`)."""
    rank, pos = run.probes[0]
    y, w = _rank_combine_inputs(p, run, rank)
    return (y[pos] * w[pos].unsqueeze(-1)).sum(0)


def order_sensitive(p: DispatchParams) -> int:
    """Probe elements whose bf16 combine result changes under some order of its k terms."""
    run = placements("position-invariance", p, 1)[0]
    y, w64 = _rank_combine_inputs(p, run, 0)
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


# --- corruption-rate ---------------------------------------------------------------------

CALL_MAGNITUDE = 7  # |x| <= 7, and every 128-wide group holds a +-7: its FP8 scale is 7/448 = 2^-6, exact
BF16_INTEGERS = 256  # bf16 holds every integer up to 2^8 exactly


def call_expert_scale(e):
    """corruption-rate's experts: +-1, alternating (every product exact); an expert number or
    a tensor of them (elementwise)."""
    return (-1.0) ** e


@functools.lru_cache(maxsize=None)
def call_weights(k: int) -> torch.Tensor:
    """Slot j's weight 2^-(1 + j mod 3): powers of two, so weighted terms stay exact (made once
    per k: callers copy it, never write it)."""
    return torch.tensor([2.0 ** -(1 + j % 3) for j in range(k)], dtype=torch.float32)


def exact_calls_possible(p: DispatchParams) -> str | None:
    """Why corruption-rate's inputs could not make every combine order exact, or None: the
    weighted sum counts in steps of 1/8 and must stay within bf16's integers."""
    steps = CALL_MAGNITUDE * 8 * float(call_weights(p.topk).sum())
    if steps > BF16_INTEGERS:
        return (f"topk = {p.topk}: the weighted sums of corruption-rate's exact inputs ({steps:.0f} steps of 1/8) "
                f"exceed bf16's exact integers ({BF16_INTEGERS}); use topk <= 15")
    return None


def call_inputs(p: DispatchParams, tokens: int, call: int, world: int) -> list[tuple]:
    """Every rank's (x [T, H] bf16 small integers, topk_idx [T, k], weights [T, k]) in one
    call, from one generator of the call: each rank makes them all (those it sends and those
    it must receive), in 4 tensor draws rather than 4 a rank."""
    g = gen.generator(p.seed, "corruption", tokens, call)
    x = torch.randint(-CALL_MAGNITUDE, CALL_MAGNITUDE + 1, (world, tokens, p.hidden), generator=g).float()
    signs = torch.randint(0, 2, (world, tokens, (p.hidden + 127) // 128), generator=g).float() * 2 - 1
    x[:, :, ::128] = CALL_MAGNITUDE * signs  # each group's amax: 7
    idx = expert_choice(g, world * tokens, p.topk, p.num_experts, "uniform", world).view(world, tokens, -1)
    x = x.to(torch.bfloat16)
    return [(x[r], idx[r], call_weights(p.topk).repeat(tokens, 1)) for r in range(world)]  # weights: each its own


def _expected_combined(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact combined rows: sum_j w_j * c_{e_j} * x, float64 (exact), one bf16 rounding.
    A zero is +0.0: every combine's sum starts at +0.0, and an exact cancellation rounds to +0.0."""
    c = call_expert_scale(idx).to(torch.float64)
    return (x.double() * (w.double() * c).sum(1, keepdim=True) + 0.0).to(torch.bfloat16)


def _key_codes(keys: torch.Tensor, world: int, tokens: int, k: int) -> torch.Tensor:
    """(expert, src rank, token, slot) rows [N, 4] as one int64 each, ordered as the tuples."""
    return ((keys[:, 0] * world + keys[:, 1]) * tokens + keys[:, 2]) * k + keys[:, 3]


def _expected_received(p: DispatchParams, sent: list, tokens: int, rank: int, world: int, wire: str):
    """What `rank` must receive in one call (`sent`: every rank's call_inputs): key codes
    (sorted), rows and scales (None on BF16)."""
    per_rank = p.num_experts // world
    keys, rows, scales = [], [], []
    for src, (x, idx, _) in enumerate(sent):
        t, slot = (idx // per_rank == rank).nonzero(as_tuple=True)
        keys.append(torch.stack([idx[t, slot], torch.full_like(t, src), t, slot], dim=1))
        q, s = ref_quant.quantize_per_token_group(x, 128, ue8m0=p.ue8m0) if wire == "fp8" else (x, None)
        rows.append(q[t])
        scales.append(None if s is None else s[t])
    codes = _key_codes(torch.cat(keys), world, tokens, p.topk)
    order = codes.argsort()
    return codes[order], torch.cat(rows)[order], None if wire != "fp8" else torch.cat(scales)[order]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


class Hit(NamedTuple):
    """One wrong row: where, in which call, and how many of its elements."""

    tokens: int
    call: int
    rank: int
    stage: str  # "dispatch" (a received row) or "combine" (a combined token)
    row: str
    elements: int


class CallsSeen(NamedTuple):
    """What one rank's calls got wrong, gathered to rank 0 (only the wrong rows travel)."""

    hits: list
    compared: int  # elements compared on this rank
    dispatch_unchecked: str | None  # why its received rows could not be matched to what was sent


def _check_dispatch(p, received, sent, tokens, call, rank, world, wire) -> tuple[list[Hit], int]:
    got = _received_rows(received, rank, p.num_experts // world)
    want_codes, want_rows, want_scales = _expected_received(p, sent, tokens, rank, world, wire)
    keys = torch.tensor(got.keys, dtype=torch.int64).view(-1, 4)
    codes = _key_codes(keys, world, tokens, p.topk)
    order = codes.argsort()
    codes, keys = codes[order], keys[order]
    rows = got.rows[order]
    rows = rows.view(torch.float8_e4m3fn) if rows.dtype == torch.uint8 else rows

    def label(key):
        return f"expert {key[0]} from rank {key[1]} token {key[2]} slot {key[3]}"

    if not torch.equal(codes, want_codes):  # rows lost, misrouted or delivered twice: each a hit
        hits = [Hit(tokens, call, rank, "dispatch", label(k) + " (never sent here)", p.hidden)
                for k in keys[~torch.isin(codes, want_codes)].tolist()]
        lost = want_codes[~torch.isin(want_codes, codes)]
        hits += [Hit(tokens, call, rank, "dispatch", f"key {int(c)} (lost)", p.hidden) for c in lost.tolist()]
        dup = int(len(codes) - len(torch.unique(codes)))
        hits += [Hit(tokens, call, rank, "dispatch", "a row delivered twice", p.hidden)] * dup
        return hits or [Hit(tokens, call, rank, "dispatch", "received keys differ", p.hidden)], 0
    bad = (_bits(rows) != _bits(want_rows)).sum(1)
    compared = want_rows.numel()
    if want_scales is not None:
        bad = bad + (_bits(got.scales[order]) != _bits(want_scales)).sum(1)
        compared += want_scales.numel()
    return [Hit(tokens, call, rank, "dispatch", label(keys[i].tolist()), int(bad[i]))
            for i in bad.nonzero().flatten().tolist()], compared


def _observe_calls(subject, ctx: RankContext, p: DispatchParams, runs: list) -> CallsSeen:
    """Every call on this rank, each checked here against its exact expectation."""
    if reason := exact_calls_possible(p):
        raise ValueError(reason)
    cfg, wire = _config(p), resolve_wire_dtype(p.expert_quant, p.wire)
    world, rank, per_rank = ctx.world_size, ctx.rank, p.num_experts // ctx.world_size
    hits, compared, unchecked = [], 0, None
    for run in runs:
        tokens = run.spec.tokens[rank]
        for call in range(p.calls):
            # every rank's tokens, made once, where the received rows are checked against them;
            # the subject gets copies, so that the expectations are the inputs as they were made
            sent = call_inputs(p, tokens, call, world)
            x, idx, w = sent[rank]
            received = subject.dispatch(*(t.to(ctx.device, copy=True) for t in (x, idx, w)), cfg, ctx.group)
            if unchecked is None:
                try:
                    found, n = _check_dispatch(p, received, sent, tokens, call, rank, world, wire)
                    hits += found
                    compared += n
                except SourcesUnknown as exc:
                    unchecked = (f"{exc.args[0]} received rows without their source: dispatch unchecked, "
                                 f"combine checked")
            y = run_experts(received, rank, per_rank, call_expert_scale)
            out = kept(subject.combine(y, received, w.to(ctx.device, copy=True), ctx.group))
            want = _expected_combined(x, idx, w)
            if out.shape != want.shape:
                hits.append(Hit(tokens, call, rank, "combine", f"output shape {tuple(out.shape)}, "
                                                               f"expected {tuple(want.shape)}", want.numel()))
                continue
            bad = (_bits(out) != _bits(want)).sum(1)
            compared += want.numel()
            hits += [Hit(tokens, call, rank, "combine", f"token {t}", int(bad[t])) for t in bad.nonzero().flatten().tolist()]
    return CallsSeen(hits, compared, unchecked)


HITS_LISTED = 20


def _measure_calls(p: DispatchParams, runs: list, gathered: list, world: int) -> Measurement:
    """k of n calls with a wrong row (on any rank, in dispatch or combine), the bound on the
    per-call rate, and where the hits were."""
    hits = sorted((h for seen in gathered for h in seen.hits), key=lambda h: (h.tokens, h.call, h.rank, h.stage))
    per_tokens = {}
    for run in runs:
        tokens = run.spec.tokens[0]
        bad = {h.call for h in hits if h.tokens == tokens}
        per_tokens[str(tokens)] = rates.rate_summary(len(bad), p.calls)
    corrupted = {(h.tokens, h.call) for h in hits}
    summary = rates.rate_summary(len(corrupted), p.calls * len(runs))
    ranks_hit = {}
    for h in hits:
        ranks_hit[str(h.rank)] = ranks_hit.get(str(h.rank), 0) + 1
    m = Measurement(comparison="bitwise", mismatched=sum(h.elements for h in hits),
                    total=sum(seen.compared for seen in gathered), held=not hits)
    m.detail["corruption"] = {**summary, "per_tokens": per_tokens, "ranks_hit": ranks_hit,
                              "rows_hit": len(hits), "hits": [h._asdict() for h in hits[:HITS_LISTED]],
                              "dispatch_unchecked": sorted({s.dispatch_unchecked for s in gathered
                                                            if s.dispatch_unchecked}) or None}
    m.rows_differing, m.rows = len(corrupted), p.calls * len(runs)
    return m


# `ep-harness explore`: the parameters a search varies (st: hypothesis.strategies); it draws
# the family's searchable properties (harness/properties.py).
def _search_space(st):
    return {"tokens": st.integers(1, 16), "routing": st.sampled_from(["uniform", "zipf", "empty", "one-rank"]),
            "seed": st.integers(0, 10_000),
            "batch_sizes": st.lists(st.integers(1, 32), min_size=2, max_size=4, unique=True)}


class _Injected(Wrapped):
    """`ep-harness selftest`'s defect: `reference` compares the dispatched rows, so it goes
    there; every other property compares combine's output: it goes there (never both, so
    that each check sees one)."""

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        received = self._subject.dispatch(x, topk_idx, topk_weights, cfg, group)
        if self._property == "reference":
            self._inject(received.x, x)
        return received

    def combine(self, expert_out, handle, topk_weights, group):
        out = self._subject.combine(expert_out, handle, topk_weights, group)
        if self._property != "reference":
            self._inject(out, expert_out)
        return out


FAMILY = Family("dispatch", PROPERTIES, DispatchParams, placement_runs, _observe, _measure,
                protocol=DispatchSubject, search_space=_search_space, selftest_wrapper=_Injected)
