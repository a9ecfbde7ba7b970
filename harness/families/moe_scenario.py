"""Token scenarios for dispatch and MoE checks: which tokens each rank holds, how they are
routed, and where the probe token sits. Everything is a function of (seed, key), so rank 0
can rebuild every rank's inputs for the references.

Routing distributions for the filler tokens: uniform, zipf (hot experts), empty (half the
experts never chosen), one-rank (every token to the experts of rank 0), single (one token).

The two families' parameters are declared here too: what they share (TokenParams), and
each one's own (DispatchParams, MoeParams).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_harness import inputs as gen
from ep_harness import threads
from ep_harness.families.driver import REPEATED, THREAD_INVARIANCE, against_first_run, repeat_labels
from ep_harness.params import DATA_KINDS, LayoutParams, _opt

ROUTINGS = ("uniform", "zipf", "empty", "one-rank", "single")


@dataclass(frozen=True, kw_only=True)
class TokenParams(LayoutParams):
    """What dispatch and the MoE layer share: tokens, experts and routing."""

    tokens: int = _opt(16, minimum=1)
    hidden: int = _opt(256, minimum=2)
    num_experts: int = _opt(16, minimum=1)
    topk: int = _opt(4, minimum=1)
    routing: str = _opt("uniform", choices=ROUTINGS)
    layout: str = _opt("contiguous", choices=("contiguous", "masked"))
    alignment: int = _opt(16, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 16, 64], minimum=1, nonempty=True)
    repeats: int = _opt(3, minimum=1)

    def validate(self, subject):
        if self.num_experts % self.world_size:
            return f"num_experts = {self.num_experts} does not split over world_size = {self.world_size} ranks"
        if self.topk > self.num_experts:
            return f"topk = {self.topk} exceeds num_experts = {self.num_experts}"
        for size in self.layout_sizes:
            if self.num_experts % size:
                return f"layout_sizes = {self.layout_sizes}: num_experts = {self.num_experts} does not split over {size} ranks"
        return super().validate(subject)


@dataclass(frozen=True, kw_only=True)
class DispatchParams(TokenParams):
    # 136 = 128 + 8 tokens per rank: every check crosses into a second 128-token chunk (the
    # unit DeepEP-style kernels walk tokens in), with a partial one
    tokens: int = _opt(136, minimum=1)
    expert_quant: str = _opt("bf16", choices=("bf16", "fp8"))
    wire: str = _opt("auto", choices=("auto", "bf16", "fp8"))
    ue8m0: bool = _opt(True)
    data: str = _opt("spread", choices=DATA_KINDS)
    probe_experts: list[int] = _opt([4, 5, 0, 1], minimum=0, nonempty=True)
    # corruption-rate: this many calls at each token count per rank (600 clean calls bound the
    # per-call rate below 0.5 % at 95 %; DeepEP #700 corrupted 1.5-3.3 % of calls at 256 tokens)
    calls: int = _opt(600, minimum=1)
    call_tokens: list[int] = _opt([256], minimum=1, nonempty=True)

    def validate(self, subject):
        if self.hidden % 128 and self.expert_quant == "fp8":
            return f"hidden = {self.hidden} is not a multiple of 128, which FP8 dispatch needs"
        probe = [e % self.num_experts for e in self.probe_experts[:self.topk]]
        if self.topk <= self.num_experts and len(set(probe)) < self.topk:  # the probe token's own top-k
            return (f"probe_experts = {self.probe_experts} gives the probe {sorted(probe)} (mod num_experts = "
                    f"{self.num_experts}), not topk = {self.topk} distinct experts; list {self.topk} distinct experts")
        return super().validate(subject)


@dataclass(frozen=True, kw_only=True)
class MoeParams(TokenParams):
    tokens: int = _opt(8, minimum=1)
    intermediate: int = _opt(128, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 8, 32], minimum=1, nonempty=True)
    # prefill-decode-invariance: the probe decoded alone (1 token per rank) against the same
    # token inside prefill batches of these many tokens per rank (2 or more: one is a decode),
    # on every rank at its chunk's first and last rows and one row in each of `channel_probes`
    # equal slices (harness/families/moe_scenario.py prefill_rows)
    prefill_tokens: list[int] = _opt([32, 256], minimum=2, nonempty=True)
    channel_probes: int = _opt(8, minimum=1)
    data: str = _opt("randn", choices=DATA_KINDS)
    cancel: bool = _opt(True)
    scoring: str = _opt("softmax", choices=("softmax", "sigmoid"))
    tp_reduce: str = _opt("all_gather_fold")  # stage subjects, by registered name
    dispatch: str = _opt("torch_a2a_dispatch")
    gemm: str = _opt("torch_mm")

    def validate(self, subject):
        # The router's fp32 scores must order the experts as its float64 logits do, up to the
        # rounding margin (families/moe_layer.py): spread values (subnormal builds on them) give
        # logits of 100s whose fp32 softmax underflows to tied zeros; NaN and Inf leave no order.
        if self.data in ("spread", "subnormal", "nonfinite"):
            why = ("NaN and Inf in the hidden state leave the router's top-k undefined" if self.data == "nonfinite"
                   else "spread values give router logits of 100s, whose fp32 scores underflow to tied zeros "
                        "that the float64 router tells apart (a correct layer fails)")
            return f"data = {self.data!r} for the MoE layer: {why}; use randn, uniform or integers"
        return super().validate(subject)


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
    if prop == THREAD_INVARIANCE:  # a row in every part of the tokens split over the most threads
        parts = max(threads.varied_counts(torch.get_num_threads(), p.repeats))
        probes = tuple((r, row) for r in range(world) for row in prefill_rows(t, parts))
        return [Placement((t,) * world, probes, seed, label) for label in repeat_labels(prop, p.repeats)]
    if prop in REPEATED:
        return [Placement((t,) * world, ((0, 0),), seed, label) for label in repeat_labels(prop, p.repeats)]
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


def expected_copies(prop: str, observed: torch.Tensor, runs: list) -> torch.Tensor:
    """What each probe copy of probe_copies is compared with: under a property that repeats one
    placement (REPEATED), the same probe's copy in the first run (its rows are not compared with
    each other: that is position-invariance); otherwise the first copy."""
    if prop in REPEATED:
        return against_first_run(observed, len(runs[0].spec.probes))
    return observed[0]


def probe_copies(runs: list, gathered: list) -> tuple[torch.Tensor, list[str]]:
    """Stack the probe's output copies, in run order, from every rank's gathered
    {copy: row} dicts (gathered[rank].copies[run])."""
    observed, labels = [], []
    for i, run in enumerate(runs):
        for c, (r, pos) in enumerate(run.spec.probes):
            observed.append(gathered[r].copies[i][c])
            labels.append(f"{run.label}: rank {r} token {pos}")
    return torch.stack(observed), labels
