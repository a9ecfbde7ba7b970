"""The MoE layer end to end against the float64 reference, and the probe token's final
hidden state under batch, position, rank and other-token changes.

Every rank holds TP partial sums for every token (its shard of the attention output);
the probe token's partials are fixed by the seed. The reference sums the partials in
float64 and runs routing, experts and combine in float64 (reference/moe.py).

* reference: a token whose selected experts differ from the reference's (counted in
  `router_flips`) is admitted only where the float64 router is within its rounding margin of
  a tie between the experts swapped, and is then compared with the float64 layer routed to
  the experts it chose; any other difference is a failure. Every token must satisfy
  tolerances.MOE.
* invariances: the probe's output bits, as for dispatch.
* prefill-decode-invariance: the probe decoded alone (1 token per rank, row 0 of the TP
  reduction's smallest message) against the same token inside prefill batches, at the first
  and last rows and one row inside each of `channel_probes` equal parts of the message: the
  TP reduction sees a message of another size (another channel split on NCCL) and the
  expert GEMMs another number of rows.
* tp-size-invariance, ep-size-invariance: every token's output at world sizes 1, 2, 4 (8)
  (harness/families/moe_layout.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ep_harness import inputs as gen
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.contracts import route
from ep_harness.families import layout, moe_layout
from ep_harness.families.driver import Family, Precompile, kept, require_finite, subject_call
from ep_harness.families.gemm_calls import compiled_ahead, gemm_call
from ep_harness.measurement import Bound, Measurement
from ep_harness.families.moe_scenario import MoeParams, Placement, expected_copies, placement_runs, probe_copies
from ep_harness.subject import MoeLayerSubject
from ep_harness.tolerances import MOE, gamma
from ep_harness.reference import moe as ref
from ep_harness.reference.orders import order_sensitive
from ep_harness.selftest.wrap import Wrapped

PROPERTIES = ("reference", "run-to-run", "thread-invariance", "batch-invariance", "position-invariance",
              "rank-invariance", "others-invariance", "prefill-decode-invariance", "tp-size-invariance",
              "ep-size-invariance")
CANCEL = 2.0 ** 12


def cancel_columns(h: int) -> tuple[int, int]:
    return 1, 1 + h // 2


def layer_weights(p: MoeParams) -> dict:
    """Router [E, H] fp32, gate-up [E, 2I, H] and down [E, H, I] bf16. With `cancel`, the two
    hidden columns that carry the probe's +-CANCEL pair have equal weights everywhere, so
    the pair cancels exactly in every product but makes the K order visible (as in
    families/gemm.py); the router does not see it at all."""
    return _layer_weights(p.num_experts, p.hidden, p.intermediate, p.seed, p.cancel)


def router_weights(p: MoeParams) -> torch.Tensor:
    """The router [E, H] fp32 alone (cheap): what decides the routing, and so the experts'
    row counts (`_kernel_calls` plans the GEMM shapes from it before a launch)."""
    return _router(p.num_experts, p.hidden, p.seed, p.cancel)


@functools.lru_cache(maxsize=2)
def _router(e: int, h: int, seed: int, cancel: bool) -> torch.Tensor:
    router = gen.values((e, h), torch.float32, seed, "router", data="randn") * h ** -0.5
    if cancel:
        a, b = cancel_columns(h)
        router[:, b] = router[:, a]
    return router


@functools.lru_cache(maxsize=2)
def _layer_weights(e: int, h: int, i: int, seed: int, cancel: bool) -> dict:
    """Cached per process (never modified by a caller): the properties of a case share them."""
    router = _router(e, h, seed, cancel)
    gate_up = (gen.values((e, 2 * i, h), torch.float64, seed, "gate-up", data="randn") * h ** -0.5).to(torch.bfloat16)
    if cancel:
        a, b = cancel_columns(h)
        gate_up[:, :, b] = gate_up[:, :, a]
    return {"router": router, "gate_up": gate_up,
            "down": (gen.values((e, h, i), torch.float64, seed, "down", data="randn") * i ** -0.5).to(torch.bfloat16)}


def partials(p: MoeParams, run: Placement, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s TP partial sums for every token of the placement, bf16 [sum(tokens), H]."""
    total = sum(run.tokens)
    x = gen.values((total, p.hidden), torch.bfloat16, run.filler_seed, "partials", rank, run.tokens,
                   data=p.data) / world
    probe = gen.values((p.hidden,), torch.bfloat16, p.seed, "probe-partial", rank, data=p.data) / world
    if p.cancel:  # rank 0 carries the +-CANCEL pair, the others nothing there
        a, b = cancel_columns(p.hidden)
        probe[a], probe[b] = (CANCEL, -CANCEL) if rank == 0 else (0.0, 0.0)
    for r, pos in run.probes:
        x[sum(run.tokens[:r]) + pos] = probe
    return x.to(torch.bfloat16)


class Routed(NamedTuple):
    """A rank's MoE output for its tokens and the experts it chose for them."""

    out: torch.Tensor
    experts: torch.Tensor


class RankSeen(NamedTuple):
    """What one rank observed, gathered to rank 0."""

    copies: list[dict[int, torch.Tensor]]  # per run: {copy index: output row} of the probes it holds
    outputs: list[Routed]  # reference: its whole output and choices


def _observe(subject, ctx: RankContext, p: MoeParams, prop: str, runs: list) -> RankSeen:
    """On every rank: its probe copies per run, and for the reference its outputs and the
    experts it chose."""
    if prop in layout.LAYOUT_PROPERTIES:  # world sizes (harness/families/moe_layout.py)
        return moe_layout.observe(subject, ctx, p, prop, runs)
    weights = {k: v.to(ctx.device, copy=True) for k, v in layer_weights(p).items()}  # its own copy
    mine, outs = [], []
    for run in runs:
        part = partials(p, run.spec, ctx.rank, ctx.world_size).to(ctx.device)
        with subject_call({"partials": part, "weights": weights}):
            out, idx = subject.forward(part, weights, p, ctx.group)
        mine.append({c: kept(out[pos]) for c, (r, pos) in enumerate(run.spec.probes) if r == ctx.rank})
        if prop == "reference":
            outs.append(Routed(kept(out), kept(idx)))
    return RankSeen(mine, outs)


def _measure(check, subject, ctx: RankContext, p: MoeParams, runs: list, gathered) -> Measurement:
    if check.property in layout.LAYOUT_PROPERTIES:
        return moe_layout.measure(check, subject, ctx, p, runs, gathered)
    if check.property == "reference":
        return _measure_reference(p, runs[0].spec, [g.outputs[0] for g in gathered], ctx.world_size)
    return _measure_probe(p, check.property, runs, gathered, ctx.world_size)


def _measure_reference(p: MoeParams, run: Placement, outputs: list[Routed], world: int) -> Measurement:
    w = layer_weights(p)
    parts = [partials(p, run, r, world).double() for r in range(world)]
    exact_x = sum(parts)
    logits = (exact_x @ w["router"].double().T)
    ref_out, ref_idx = ref.moe_layer(exact_x, logits, w["gate_up"], w["down"], p.topk, p.scoring)
    got = torch.cat([o.out for o in outputs]).double()
    idx = torch.cat([o.experts for o in outputs])
    flips, admitted = router_flips(idx, ref_idx, logits, logit_margin(parts, w["router"]))
    magnitude = _magnitude(exact_x, ref_idx, w, p)
    # A near-tie flip is compared too, with the float64 layer routed as the subject chose: the
    # margin is a worst case (it admits most top-k boundary swaps at hidden 2048), so leaving
    # such tokens out would let any output through behind a claimed swap.
    own = (flips & admitted).nonzero().flatten()
    if own.numel():
        ref_out[own], magnitude[own] = routed_as(exact_x[own], logits[own], idx[own].long(), w, p)
    bound = MOE["u_out"] * ref_out.abs() + MOE["factor"] * MOE["u_out"] * magnitude
    rule = Bound(rule=MOE["rule"], terms={"u_out": MOE["u_out"], "factor": MOE["factor"]})
    n_flips, n_admitted, tokens = int(flips.sum()), int((flips & admitted).sum()), int(flips.numel())
    return within_router_margin(
        Measurement.within(got, ref_out, bound, rule,
                           detail={"router_flips": n_flips, "router_flips_admitted": n_admitted, "tokens": tokens,
                                   "tokens_compared": int(got.shape[0])},
                           note=f"{n_flips} of {tokens} tokens chose other experts than the reference, "
                                f"{n_admitted} of them within the router's rounding margin of a tie (compared "
                                f"with the float64 layer routed to the experts they chose)"),
        n_flips - n_admitted, f"{tokens} tokens chose experts the float64 router does not admit (not within the "
                              f"rounding margin of a tie)")


def logit_margin(parts: list[torch.Tensor], router: torch.Tensor) -> torch.Tensor:
    """How far each token's router logit [T, E] may move from the float64 one under the
    roundings before it: the TP sum of W bf16 partials rounded after every hop and once more
    to bf16, |dx_h| <= u*|x_h| + gamma(W, u) * sum_r |x_rh| with u = 2^-8 (0 for one partial:
    it is the hidden state itself), carried through the router, plus 8 ulp of float32 for
    the score's own rounding."""
    u = 2.0 ** -8
    x = sum(parts)
    dx = u * x.abs() + gamma(len(parts), u) * sum(q.abs() for q in parts) if len(parts) > 1 else torch.zeros_like(x)
    logits = x @ router.double().T
    return dx @ router.double().abs().T + 8 * 2.0 ** -24 * (1 + logits.abs())


def within_router_margin(m: Measurement, unadmitted: int, of: str) -> Measurement:
    """`m`, failed where `unadmitted` router choices differ from the float64 router's beyond
    its rounding margin of a tie (`of`: out of how many, and what they are)."""
    if unadmitted > 0:
        m.extra_failure = f"{unadmitted} of {of}"
    return m


def router_flips(idx: torch.Tensor, ref_idx: torch.Tensor, logits: torch.Tensor,
                 margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether the chosen experts differ from the reference's, and whether that
    difference is admissible. A subject may prefer expert b over the reference's a only if
    their float64 logits are within the sum of their margins (l_a - l_b <= m_a + m_b); a
    token with another number of experts, duplicates or an unknown expert is never admitted."""
    flips = torch.zeros(idx.shape[0], dtype=torch.bool)
    admitted = torch.ones(idx.shape[0], dtype=torch.bool)
    experts = logits.shape[1]
    for t in range(idx.shape[0]):
        mine, want = idx[t].tolist(), set(ref_idx[t].tolist())
        if set(mine) == want and len(mine) == len(want):
            continue
        flips[t] = True
        if len(set(mine)) != len(mine) or len(mine) != len(want) or not all(0 <= e < experts for e in mine):
            admitted[t] = False
            continue
        dropped, added = want - set(mine), set(mine) - want
        admitted[t] = all(logits[t, a] - logits[t, b] <= margin[t, a] + margin[t, b] for a in dropped for b in added)
    return flips, admitted


def _magnitude(x, idx, w, p: MoeParams) -> torch.Tensor:
    """sum_j w_j * (|silu(g)*u| @ |W_down|^T): the scale the down projection works at."""
    _, weights = ref.route(x @ w["router"].double().T, p.topk, p.scoring)
    out = torch.zeros_like(x)
    inter = p.intermediate
    for e in idx.unique().tolist():  # one batched product per expert, over the tokens that chose it
        tokens, slots = (idx == e).nonzero(as_tuple=True)
        h = x[tokens] @ w["gate_up"][e].double().T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).abs()
        out.index_add_(0, tokens, weights[tokens, slots].unsqueeze(1) * (act @ w["down"][e].double().abs().T))
    return out


def routed_as(x, logits, idx, w, p: MoeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 layer's output and magnitude (as _magnitude) for tokens x routed to the
    experts idx [T, k] chosen elsewhere, weighted by their float64 scores, renormalised."""
    scores = torch.softmax(logits, dim=-1) if p.scoring == "softmax" else torch.sigmoid(logits)
    chosen = torch.gather(scores, 1, idx)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    out, mag, inter = torch.zeros_like(x), torch.zeros_like(x), p.intermediate
    for e in idx.unique().tolist():
        tokens, slots = (idx == e).nonzero(as_tuple=True)
        h = x[tokens] @ w["gate_up"][e].double().T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        wt = weights[tokens, slots].unsqueeze(1)
        out.index_add_(0, tokens, wt * (act @ w["down"][e].double().T))
        mag.index_add_(0, tokens, wt * (act.abs() @ w["down"][e].double().abs().T))
    return out, mag


def _gemm_sensitivity(p: MoeParams, x: torch.Tensor) -> int:
    """Gate-up outputs of the probe (for its experts) whose bf16 bits change when K is
    summed in two halves instead of one pass (float32): could a GEMM reordering show?"""
    w = layer_weights(p)
    idx, _ = ref.route((x.double() @ w["router"].double().T).unsqueeze(0), p.topk, p.scoring)
    xf, half, count = x.float(), p.hidden // 2, 0
    for e in idx[0].tolist():
        b = w["gate_up"][e].float()
        whole = b @ xf
        split = b[:, :half] @ xf[:half] + b[:, half:] @ xf[half:]
        count += int((whole.to(torch.bfloat16) != split.to(torch.bfloat16)).sum())
    return count


def _probe_reference(p: MoeParams, probe: torch.Tensor) -> torch.Tensor:
    """The float64 layer's output [H] for the probe token, from its TP partials [W, H]."""
    w = layer_weights(p)
    x = probe.double().sum(0, keepdim=True)
    return ref.moe_layer(x, x @ w["router"].double().T, w["gate_up"], w["down"], p.topk, p.scoring)[0][0]


def _measure_probe(p: MoeParams, prop, runs, gathered, world) -> Measurement:
    observed, labels = probe_copies(runs, gathered)
    m = Measurement.bitwise(compare_bitwise(observed, expected_copies(prop, observed, runs), labels))
    first = runs[0].spec
    r0, pos0 = first.probes[0]
    probe = torch.stack([partials(p, first, r, world)[sum(first.tokens[:r0]) + pos0] for r in range(world)])
    require_finite(m, observed, _probe_reference(p, probe))
    tp_sensitive = int(order_sensitive(probe).sum()) if world > 2 else 0
    if prop == "rank-invariance":  # only the TP sum's order can depend on the rank
        m.sensitivity = tp_sensitive
        m.sensitivity_what = (f"of the probe's {p.hidden} elements change bits when its {world} TP partials "
                              f"are reordered")
    else:
        m.sensitivity = tp_sensitive + _gemm_sensitivity(p, probe.double().sum(0).to(torch.bfloat16))
        m.sensitivity_what = "probe elements change bits under another TP sum order or gate-up K order"
    return m


def _runs(prop: str, p: MoeParams, world: int) -> list:
    return layout.runs(prop, p, world) if prop in layout.LAYOUT_PROPERTIES else placement_runs(prop, p, world)


def _kernel_calls(check) -> list | None:
    """The layer's two expert GEMMs per run, when its GEMM's JIT compiles ahead
    (harness/run/precompile.py), at world size 1 with torch's dispatcher: the experts' row counts
    follow from routing the run's tokens (cheap: the router alone). None on more ranks or
    another dispatcher: the rows each rank receives are decided by the other ranks."""
    p = check.params
    if not compiled_ahead(p.gemm):
        return []
    if check.world_size != 1 or p.dispatch != "torch_a2a_dispatch":
        return None
    router, calls = router_weights(p), []
    for run in placement_runs(check.property, p, 1):
        idx, _ = route(partials(p, run.spec, 0, 1), router, p.topk, p.scoring)
        counts = [int((idx == e).sum()) for e in range(p.num_experts)]
        for n, k in ((2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)):  # gate-up, then down
            calls.append(gemm_call(p.gemm, p.layout, "bfloat16", counts, n, k, p.num_experts, p.alignment, None,
                                   check.id))
    return calls


class _Injected(Wrapped):
    """`ep-harness selftest`: the defect in forward's output, or in the partial sums."""

    def forward(self, partials, weights, params, group):
        out, experts = self._subject.forward(partials, weights, params, group)
        self._inject(out, partials)
        return out, experts

    def forward_shards(self, shards, weights, params, group):
        """The layout-size properties' call: the layer on this rank's virtual shards."""
        out, experts = self._subject.forward_shards(shards, weights, params, group)
        self._inject(out, shards)
        return out, experts


FAMILY = Family("moe_layer", PROPERTIES, MoeParams, _runs, _observe, _measure,
                protocol=MoeLayerSubject, precompile=Precompile(_kernel_calls), selftest_wrapper=_Injected)
