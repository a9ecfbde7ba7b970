"""The MoE layer end to end against the float64 reference, and the probe token's final
hidden state under batch, position, rank and other-token changes.

Every rank holds TP partial sums for every token (its shard of the attention output);
the probe token's partials are fixed by the seed. The reference sums the partials in
float64 and runs routing, experts and combine in float64 (reference/moe.py).

* reference: tokens whose selected experts differ from the reference's are counted apart
  (`router_flips`); the others must satisfy tolerances.MOE.
* invariances: the probe's output bits, as for dispatch.
"""
from __future__ import annotations

import functools

import torch

from harness import inputs as gen
from harness.compare import compare_bitwise
from harness.context import RankContext
from harness.families.driver import Family
from harness.measurement import Bound, Measurement
from harness.moe_scenario import Placement, placement_runs, probe_copies
from harness.params import MoeParams
from harness.tolerances import MOE
from reference import moe as ref
from reference.orders import order_sensitive

PROPERTIES = ("reference", "run-to-run", "batch-invariance", "position-invariance", "rank-invariance",
              "others-invariance")
CANCEL = 2.0 ** 12


def cancel_columns(h: int) -> tuple[int, int]:
    return 1, 1 + h // 2


def layer_weights(p: dict) -> dict:
    """Router [E, H] fp32, gate-up [E, 2I, H] and down [E, H, I] bf16. With `cancel`, the two
    hidden columns that carry the probe's +-CANCEL pair have equal weights everywhere, so
    the pair cancels exactly in every product but makes the K order visible (as in
    families/gemm.py); the router does not see it at all."""
    return _layer_weights(p["num_experts"], p["hidden"], p["intermediate"], p["seed"], p["cancel"])


@functools.lru_cache(maxsize=2)
def _layer_weights(e: int, h: int, i: int, seed: int, cancel: bool) -> dict:
    """Cached per process (never modified by a caller): the properties of a case share them."""
    router = gen.values((e, h), torch.float32, seed, "router", data="randn") * h ** -0.5
    gate_up = (gen.values((e, 2 * i, h), torch.float64, seed, "gate-up", data="randn") * h ** -0.5).to(torch.bfloat16)
    if cancel:
        a, b = cancel_columns(h)
        router[:, b], gate_up[:, :, b] = router[:, a], gate_up[:, :, a]
    return {"router": router, "gate_up": gate_up,
            "down": (gen.values((e, h, i), torch.float64, seed, "down", data="randn") * i ** -0.5).to(torch.bfloat16)}


def partials(p: dict, run: Placement, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s TP partial sums for every token of the placement, bf16 [sum(tokens), H]."""
    total = sum(run.tokens)
    x = gen.values((total, p["hidden"]), torch.bfloat16, run.filler_seed, "partials", rank, run.tokens,
                   data=p["data"]) / world
    probe = gen.values((p["hidden"],), torch.bfloat16, p["seed"], "probe-partial", rank, data=p["data"]) / world
    if p["cancel"]:  # rank 0 carries the +-CANCEL pair, the others nothing there
        a, b = cancel_columns(p["hidden"])
        probe[a], probe[b] = (CANCEL, -CANCEL) if rank == 0 else (0.0, 0.0)
    for r, pos in run.probes:
        x[sum(run.tokens[:r]) + pos] = probe
    return x.to(torch.bfloat16)


def _observe(subject, ctx: RankContext, p: dict, prop: str, runs: list):
    """On every rank: its probe copies per run, and for the reference its outputs and the
    experts it chose."""
    weights = {k: v.to(ctx.device) for k, v in layer_weights(p).items()}
    mine, outs = [], []
    for run in runs:
        part = partials(p, run.spec, ctx.rank, ctx.world_size).to(ctx.device)
        out, idx = subject.forward(part, weights, p, ctx.group)
        mine.append({c: out[pos].cpu() for c, (r, pos) in enumerate(run.spec.probes) if r == ctx.rank})
        if prop == "reference":
            outs.append((out.cpu(), idx.cpu()))
    return mine, outs


def _measure(check, subject, ctx: RankContext, p: dict, runs: list, gathered) -> Measurement:
    if check.property == "reference":
        return _measure_reference(p, runs[0].spec, [g[1][0] for g in gathered], ctx.world_size)
    return _measure_probe(p, check.property, runs, gathered, ctx.world_size)


def _measure_reference(p, run, outputs, world) -> Measurement:
    w = layer_weights(p)
    exact_x = sum(partials(p, run, r, world).double() for r in range(world))
    logits = (exact_x @ w["router"].double().T)
    ref_out, ref_idx = ref.moe_layer(exact_x, logits, w["gate_up"], w["down"], p["topk"], p["scoring"])
    got = torch.cat([o for o, _ in outputs]).double()
    idx = torch.cat([i for _, i in outputs])
    flips = torch.tensor([set(a.tolist()) != set(b.tolist()) for a, b in zip(idx, ref_idx)])
    magnitude = _magnitude(exact_x, ref_idx, w, p)
    bound = MOE["u_out"] * ref_out.abs() + MOE["factor"] * MOE["u_out"] * magnitude
    keep = ~flips.unsqueeze(1).expand_as(got)
    rule = Bound(rule=MOE["rule"], terms={"u_out": MOE["u_out"], "factor": MOE["factor"]})
    return Measurement.within(got, ref_out, bound, rule, keep,
                              detail={"router_flips": int(flips.sum()), "tokens": int(flips.numel())},
                              note=f"{int(flips.sum())} of {flips.numel()} tokens chose other experts than the reference")


def _magnitude(x, idx, w, p) -> torch.Tensor:
    """sum_j w_j * (|silu(g)*u| @ |W_down|^T): the scale the down projection works at."""
    _, weights = ref.route(x @ w["router"].double().T, p["topk"], p["scoring"])
    out = torch.zeros_like(x)
    inter = p["intermediate"]
    for e in idx.unique().tolist():  # one batched product per expert, over the tokens that chose it
        tokens, slots = (idx == e).nonzero(as_tuple=True)
        h = x[tokens] @ w["gate_up"][e].double().T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).abs()
        out.index_add_(0, tokens, weights[tokens, slots].unsqueeze(1) * (act @ w["down"][e].double().abs().T))
    return out


def _gemm_sensitivity(p: dict, x: torch.Tensor) -> int:
    """Gate-up outputs of the probe (for its experts) whose bf16 bits change when K is
    summed in two halves instead of one pass (float32): could a GEMM reordering show?"""
    w = layer_weights(p)
    idx, _ = ref.route((x.double() @ w["router"].double().T).unsqueeze(0), p["topk"], p["scoring"])
    xf, half, count = x.float(), p["hidden"] // 2, 0
    for e in idx[0].tolist():
        b = w["gate_up"][e].float()
        whole = b @ xf
        split = b[:, :half] @ xf[:half] + b[:, half:] @ xf[half:]
        count += int((whole.to(torch.bfloat16) != split.to(torch.bfloat16)).sum())
    return count


def _measure_probe(p, prop, runs, gathered, world) -> Measurement:
    observed, labels = probe_copies(runs, gathered)
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], labels))
    first = runs[0].spec
    r0, pos0 = first.probes[0]
    probe = torch.stack([partials(p, first, r, world)[sum(first.tokens[:r0]) + pos0] for r in range(world)])
    tp_sensitive = int(order_sensitive(probe).sum()) if world > 2 else 0
    if prop == "rank-invariance":  # only the TP sum's order can depend on the rank
        m.sensitivity = tp_sensitive
        m.sensitivity_what = f"of the probe's {p['hidden']} elements change bits when its {world} TP partials are reordered"
    else:
        m.sensitivity = tp_sensitive + _gemm_sensitivity(p, probe.double().sum(0).to(torch.bfloat16))
        m.sensitivity_what = "probe elements change bits under another TP sum order or gate-up K order"
    return m


FAMILY = Family("moe_layer", PROPERTIES, MoeParams, placement_runs, _observe, _measure)
