"""Token scenarios for dispatch and MoE checks: which tokens each rank holds, how they are
routed, and where the probe token sits. Everything is a function of (seed, key), so rank 0
can rebuild every rank's inputs for the references.

Routing distributions for the filler tokens: uniform, zipf (hot experts), empty (half the
experts never chosen), one-rank (every token to the experts of rank 0), single (one token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_harness import inputs as gen
from ep_harness.params import DispatchParams, MoeParams

ROUTINGS = ("uniform", "zipf", "empty", "one-rank", "single")


@dataclass(frozen=True)
class Placement:
    tokens: tuple[int, ...]  # tokens per rank
    probes: tuple[tuple[int, int], ...]  # (rank, position) of each probe copy
    filler_seed: int
    label: str


def expert_choice(g: torch.Generator, n: int, k: int, num_experts: int, routing: str, world: int) -> torch.Tensor:
    """[n, k] distinct experts per token."""
    if routing == "zipf":
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    elif routing == "empty":
        p = torch.cat([torch.ones(num_experts // 2), torch.zeros(num_experts - num_experts // 2)]).double()
    elif routing == "one-rank":
        per = num_experts // world
        p = torch.cat([torch.ones(per), torch.zeros(num_experts - per)]).double()
    else:
        p = torch.ones(num_experts, dtype=torch.float64)
    k = min(k, int((p > 0).sum()))
    return torch.multinomial(p.expand(n, -1), k, replacement=False, generator=g) if n else \
        torch.empty(0, k, dtype=torch.long)


def probe_experts(p: DispatchParams | MoeParams) -> torch.Tensor:
    """The probe's k experts: those a dispatch check names (DispatchParams.probe_experts), else
    seeded (the MoE layer's router chooses its own)."""
    if isinstance(p, DispatchParams) and p.probe_experts:
        return torch.tensor(p.probe_experts[:p.topk], dtype=torch.long) % p.num_experts
    g = gen.generator(p.seed, "probe-experts")
    return torch.randperm(p.num_experts, generator=g)[:p.topk]


def rank_tokens(p: DispatchParams | MoeParams, placement: Placement, rank: int, dtype=torch.bfloat16):
    """(x [T, H], topk_idx [T, k], topk_weights [T, k] fp32) of one rank."""
    n, k, hidden = placement.tokens[rank], p.topk, p.hidden
    g = gen.generator(placement.filler_seed, "fillers", rank, placement.tokens)
    x = gen.values((n, hidden), dtype, placement.filler_seed, "filler-x", rank, placement.tokens, data=p.data)
    idx = expert_choice(g, n, k, p.num_experts, p.routing, len(placement.tokens))
    if idx.shape[1] < k:
        idx = torch.cat([idx, torch.full((n, k - idx.shape[1]), -1, dtype=torch.long)], dim=1)
    logits = torch.randn(n, k, generator=g)
    w = torch.softmax(logits, dim=-1).float()
    probe_x = gen.values((hidden,), dtype, p.seed, "probe-x", data=p.data)
    probe_logits = torch.randn(k, generator=gen.generator(p.seed, "probe-w"))
    probe_logits[1] = probe_logits[0]  # equal weights on the first two experts (see families/dispatch.py)
    probe_w = torch.softmax(probe_logits, dim=-1).float()
    for r, pos in placement.probes:
        if r == rank:
            x[pos], idx[pos], w[pos] = probe_x, probe_experts(p), probe_w
    return x, idx, torch.where(idx >= 0, w, torch.zeros_like(w))


def placements(prop: str, p: DispatchParams | MoeParams, world: int) -> list[Placement]:
    t, seed = p.tokens, p.seed
    if p.routing == "single":
        t = 1
    if prop in ("reference", "combine-reference", "rank-invariance", "graph-invariance"):
        return [Placement((t,) * world, tuple((r, 0) for r in range(world)), seed, "every rank")]
    if prop == "run-to-run":
        return [Placement((t,) * world, ((0, 0),), seed, f"repeat {i}") for i in range(p.repeats)]
    if prop == "batch-invariance":  # a fixed global token: it changes rank as the batch grows
        g = world * min(p.batch_sizes) - 1
        return [Placement((b,) * world, (divmod(g, b),), seed, f"tokens {b}") for b in p.batch_sizes]
    if prop == "position-invariance":
        return [Placement((t,) * world, ((0, pos),), seed, name)
                for pos, name in ((0, "first"), (t // 2, "middle"), (t - 1, "last"))]
    if prop == "prefill-decode-invariance":
        decode = Placement((1,) * world, ((0, 0),), seed, "decode: 1 token per rank")
        if p.routing == "single":  # one token in the batch: no prefill to compare with (vacuous)
            return [decode]
        return [decode] + [Placement((n,) * world, tuple((r, row) for r in range(world)
                                                         for row in prefill_rows(n, p.channel_probes)),
                                     seed, f"prefill: {n} tokens per rank") for n in p.prefill_tokens]
    if prop == "corruption-rate":  # no probe: every row of every call is compared (families/dispatch.py)
        return [Placement((n,) * world, (), seed, f"{p.calls} calls at {n} tokens per rank") for n in p.call_tokens]
    if prop == "others-invariance":
        return [Placement((t,) * world, ((0, t // 2),), seed + 1000 * i, f"others drawn {i}") for i in range(4)]
    raise ValueError(f"no placements for {prop!r}")


def prefill_rows(tokens: int, parts: int) -> list[int]:
    """Rows of one rank's chunk of a prefill batch that hold the probe: the first, the last,
    and one row inside each of `parts` equal slices of the chunk (a reduce-scatter deals each
    rank's chunk over its channels), the i-th slice's row offset by i within it, so that the
    probes fall on every residue mod 2, 4, ... up to the slice length: a defect tied to a row's
    lane or offset cannot sit only where no probe is. Ascending and distinct."""
    rows = {0, tokens - 1}
    for i in range(parts):
        start, end = i * tokens // parts, (i + 1) * tokens // parts
        if end > start:
            rows.add(start + i % (end - start))
    return sorted(rows)


def placement_runs(prop: str, p: DispatchParams | MoeParams, world: int) -> list:
    """The placements as driver runs: each probe copy is placed by (tokens per rank, its rank
    and position, the fillers' seed) and held by its rank."""
    from ep_harness.families.driver import Copy, Run

    return [Run(pl.label, tuple(Copy((pl.tokens, r, pos, pl.filler_seed), r) for r, pos in pl.probes), pl)
            for pl in placements(prop, p, world)]


def probe_copies(runs: list, gathered: list) -> tuple[torch.Tensor, list[str]]:
    """Stack the probe's output copies, in run order, from every rank's gathered
    {copy: row} dicts (gathered[rank].copies[run])."""
    observed, labels = [], []
    for i, run in enumerate(runs):
        for c, (r, pos) in enumerate(run.spec.probes):
            observed.append(gathered[r].copies[i][c])
            labels.append(f"{run.label}: rank {r} token {pos}")
    return torch.stack(observed), labels
