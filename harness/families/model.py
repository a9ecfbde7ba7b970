"""A small random-weight MoE decoder end to end (harness/subjects/model/): the log-softmax
rows of every generated and rescored token, compared bit for bit, as engines judge
determinism; and when they differ, the first op whose inputs agreed and outputs did not.

Prompts (seeded lengths and tokens) are served in batches; each prompt greedily generates
`new_tokens` tokens. Compared rows: for each compared prompt, the `new_tokens` rows that
predict its generated tokens (float32 [new_tokens, vocab]).

* batch-invariance: the probe prompt (prompt 0) alone, then in the middle of batches of the
  other prompts (`batch_sizes`);
* order-invariance: the largest batch in its order and `shuffles` seeded shuffles, every
  prompt compared;
* prefill-decode-invariance: the decoded rows against one prefill of prompt + generated
  tokens (rescoring), every prompt compared;
* run-to-run: the largest batch `repeats` times; thread-invariance: the same, each time on another
  intra-op thread count (harness/threads.py varied_counts);
* reference: within tolerances.MODEL of reference/model.py (float64, teacher-forced on the
  run's tokens and router choices; flips reported apart).

Every run traces every op per tracked token on every rank (ep_harness.divergence); the traces
travel to rank 0 only for the first run and the first run whose rows differ from it (every
rank computes every row, so each can tell), and then the record names the first divergence
between them (`detail.first_divergence`: layer, stage, subject, whether a collective, the
ranks that held the differing outputs in both runs, and how many tokens diverged of those
whose inputs agreed).

Vacuity: the driver's rules, plus runs that put every compared token at the same row of
messages of the same sizes (nothing a reduction, GEMM or dispatch sees has moved), and a
probe whose layer-0 TP partials and q/k/v products no summation order could change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_harness import inputs as gen
from ep_harness import properties
from ep_harness import subject as registry
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.divergence import Tracer, localise
from ep_harness.families import model_layout
from ep_harness.families.driver import (REPEATED, Copy, Family, Precompile, Run, repeat_labels, require_finite,
                                        subject_call)
from ep_harness.families.gemm_calls import compiled_ahead
from ep_harness.families.moe_layer import router_flips, within_router_margin
from ep_harness.measurement import Bound, Measurement
from ep_harness.families.model_inputs import prompts, to_device, weights
from ep_harness.params import LayoutParams, _opt
from ep_harness.subject import ModelSubject, compiles_kernels
from ep_harness.tolerances import MODEL, model_factor
from ep_harness.reference import model as ref
from ep_harness.reference.orders import order_sensitive

PROPERTIES = ("reference", "run-to-run", "thread-invariance", "batch-invariance", "order-invariance",
              "prefill-decode-invariance", "tp-size-invariance")
PROBE = 0


@dataclass(frozen=True, kw_only=True)
class ModelParams(LayoutParams):
    """A small random-weight MoE decoder (harness/families/model.py): its shape, its
    prompts, and the stage subjects it is composed of (by registered name)."""

    dtype: str = _opt("bfloat16", choices=("bfloat16",))
    vocab: int = _opt(512, minimum=2)
    hidden: int = _opt(256, minimum=2)
    layers: int = _opt(4, minimum=1)
    heads: int = _opt(4, minimum=1)
    num_experts: int = _opt(8, minimum=1)
    topk: int = _opt(2, minimum=1)
    intermediate: int = _opt(128, minimum=1)
    shared_intermediate: int = _opt(128, minimum=1)
    prompt_lengths: list[int] = _opt([3, 12], minimum=1, nonempty=True)  # [shortest, longest], seeded between
    new_tokens: int = _opt(3, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 6], minimum=1, nonempty=True)
    shuffles: int = _opt(3, minimum=1)
    repeats: int = _opt(2, minimum=1)
    layout: str = _opt("contiguous", choices=("contiguous", "masked"))
    alignment: int = _opt(16, minimum=1)
    tp_reduce: str = _opt("all_gather_fold")  # stage subjects, by registered name
    dispatch: str = _opt("torch_a2a_dispatch")
    gemm: str = _opt("torch_mm")
    dense_gemm: str = _opt("torch_mm")
    # every TP product per virtual shard (harness/subjects/model/composed.py); the layout-size
    # properties run with it set, whatever the case says
    virtual_tp: bool = _opt(False)
    virtual_shards: int = _opt(4, minimum=1)  # one head per shard at the default 4 heads

    def validate(self, subject):
        w = self.world_size
        if self.num_experts % w:
            return f"num_experts = {self.num_experts} does not split over world_size = {w} ranks"
        if self.topk > self.num_experts:
            return f"topk = {self.topk} exceeds num_experts = {self.num_experts}"
        if self.hidden % self.heads:
            return f"hidden = {self.hidden} is not a multiple of heads = {self.heads}"
        if self.heads % w:
            return f"heads = {self.heads} do not split over world_size = {w} TP ranks; use a multiple of {w}"
        if self.shared_intermediate % w:
            return f"shared_intermediate = {self.shared_intermediate} does not split over world_size = {w} ranks"
        if len(self.prompt_lengths) != 2 or self.prompt_lengths[0] > self.prompt_lengths[1]:
            return f"prompt_lengths = {self.prompt_lengths!r}; give [shortest, longest]"
        if self.heads % self.virtual_shards or self.shared_intermediate % self.virtual_shards:
            return (f"virtual_shards = {self.virtual_shards} does not split heads = {self.heads} and "
                    f"shared_intermediate = {self.shared_intermediate}; use a divisor of both")
        for size in self.layout_sizes:
            if self.num_experts % size:
                return f"layout_sizes = {self.layout_sizes}: num_experts = {self.num_experts} does not split over {size} ranks"
        return super().validate(subject)


@dataclass(frozen=True)
class Batch:
    order: tuple[int, ...]  # the prompt in each batch slot
    compared: tuple[int, ...]  # the prompts whose rows are compared
    rescore: bool = False  # one prefill of prompt + generated tokens (of the run before it)


def _runs(prop: str, p: ModelParams, world: int) -> list[Run]:
    if prop == "tp-size-invariance":  # world sizes (harness/families/model_layout.py)
        return model_layout.runs(prop, p, world)
    everyone = tuple(range(max(p.batch_sizes)))
    if prop == "reference":
        return [Run("batch", (Copy(("batch", everyone)),), Batch(everyone, everyone))]
    if prop in REPEATED:
        return [Run(label, (Copy(("batch", everyone)),), Batch(everyone, everyone))
                for label in repeat_labels(prop, p.repeats)]
    if prop == "batch-invariance":
        out = []
        for b in p.batch_sizes:
            order = list(range(1, b))
            order.insert(b // 2, PROBE)
            out.append(Run(f"batch of {b}", (Copy(("batch", tuple(order))),), Batch(tuple(order), (PROBE,))))
        return out
    if prop == "order-invariance":
        g = gen.generator(p.seed, "model-shuffles")
        orders = [everyone] + [tuple(torch.randperm(len(everyone), generator=g).tolist()) for _ in range(p.shuffles)]
        return [Run("in order" if i == 0 else f"shuffle {i}", (Copy(("batch", o)),), Batch(o, everyone))
                for i, o in enumerate(orders)]
    if prop == "prefill-decode-invariance":
        return [Run("decode", (Copy(("decode", everyone)),), Batch(everyone, everyone)),
                Run("rescore (one prefill)", (Copy(("prefill", everyone)),), Batch(everyone, everyone, rescore=True))]
    raise ValueError(f"no runs for {prop!r}")


@dataclass
class RunSeen:
    """One run as a rank saw it, gathered to rank 0: the compared rows (rank 0's only, per
    prompt), every prompt's generated tokens, this rank's routing (reference only) and its
    trace (dropped where not needed: _ship_traces)."""

    logprobs: dict | None
    tokens: dict
    routing: dict | None
    events: dict | None


def _observe(subject, ctx: RankContext, p: ModelParams, prop: str, runs: list[Run]) -> list[RunSeen]:
    """On every rank, per run: rank 0's compared rows, every prompt's generated tokens, this
    rank's routing (for the reference) and its trace."""
    if prop == "tp-size-invariance":
        return model_layout.observe(subject, ctx, p, prop, runs)
    w = to_device(weights(p), ctx.device)
    pr = prompts(p)
    generated: dict = {}
    seen, rows = [], []
    for run in runs:
        b = run.spec
        names = {slot: f"prompt {pid}" for slot, pid in enumerate(b.order) if pid in b.compared}
        tracer = None if prop == "reference" else Tracer(ctx.rank, _namer(names))
        seqs = [pr[pid] + (generated[pid][:-1] if b.rescore else []) for pid in b.order]
        with subject_call({"weights": w}):
            served = subject.generate(seqs, [len(pr[pid]) for pid in b.order], 0 if b.rescore else p.new_tokens,
                                      w, p, ctx.group, tracer)
        if not b.rescore:
            generated = {pid: served.tokens[slot] for slot, pid in enumerate(b.order)}
        compared = {pid: served.logprobs[slot].cpu() for slot, pid in enumerate(b.order) if pid in b.compared}
        rows.append(torch.cat([compared[pid].reshape(-1) for pid in b.compared]))
        seen.append(RunSeen(
            logprobs=compared if ctx.rank == 0 else None,
            tokens=dict(generated),
            routing={(b.order[slot], pos): r for (slot, pos), r in served.routing.items()} if prop == "reference" else None,
            events=tracer.events if tracer else None,
        ))
    return _ship_traces(ctx, seen, rows)


def _ship_traces(ctx: RankContext, seen: list[RunSeen], rows: list) -> list[RunSeen]:
    """Every run was traced; the traces travel to rank 0 only for the first run and the
    first run whose rows differ from it (every rank computes every row, so each can tell;
    the ranks agree on the smallest such run)."""
    differs = next((i for i in range(1, len(rows)) if rows[i].shape != rows[0].shape
                    or not torch.equal(rows[i].view(torch.int32), rows[0].view(torch.int32))), None)
    found = [d for d in ctx.gather(differs) if d is not None]
    keep = {0, min(found)} if found else set()
    for i, run in enumerate(seen):
        if i not in keep:
            run.events = None
    return seen


def _namer(names: dict):
    """(slot, position) -> "prompt P token J", one string object per token (the gathered
    trace pickles each once)."""
    made: dict = {}

    def name(key):
        slot, pos = key
        if slot not in names:
            return None
        return made.setdefault(key, f"{names[slot]} token {pos}")
    return name


def _measure(check, subject, ctx: RankContext, p: ModelParams, runs: list[Run], gathered) -> Measurement:
    if check.property == "tp-size-invariance":
        return model_layout.measure(check, subject, ctx, p, runs, gathered)
    if check.property == "reference":
        return _measure_reference(p, runs[0].spec, gathered)
    observed = torch.stack([torch.cat([gathered[0][i].logprobs[pid].reshape(-1) for pid in run.spec.compared])
                            for i, run in enumerate(runs)])
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], [r.label for r in runs]))
    # the float64 reference of every compared logprob is finite: log-softmax of finite logits
    # (finite weights and embeddings, far from float64's range) is x - max - log(a sum >= 1)
    require_finite(m, observed, torch.zeros(observed.shape[1], dtype=torch.float64))
    rows = observed.shape[1] // p.vocab
    m.detail["compared"] = f"{len(runs[0].spec.compared)} prompt(s), {rows} rows of {p.vocab} logprobs per run"
    if m.mismatched:
        other = next((i for i in range(1, len(runs)) if gathered[0][i].events is not None), None)
        if other is None:
            m.note = "the ranks' rows differed from rank 0's view of them: no trace was shipped to localise"
        else:
            found = localise([g[0].events or {} for g in gathered], [g[other].events or {} for g in gathered])
            m.detail.update(found, between=[runs[0].label, runs[other].label])
            m.note = f"{runs[0].label} vs {runs[other].label}: {found['note']}"
    m.sensitivity, m.sensitivity_what = _sensitivity(p, ctx.world_size), \
        "of the probe's layer-0 TP partials and q/k/v products change bits under another summation order"
    if properties.get(check.property).compares != "repeat":
        m.vacuous_reason = _nothing_moved(p, runs, gathered)
    return m


def _layout(p: ModelParams, b: Batch, tokens: dict) -> dict:
    """Where each compared token sits in each forward of a run: {(prompt, position):
    (padded rows of that forward, its row)}. Prefill is one forward; decode one per step."""
    pr, w = prompts(p), p.world_size
    seqs = {pid: pr[pid] + (tokens[pid][:-1] if b.rescore else []) for pid in b.order}
    where, row = {}, 0
    total = sum(len(seqs[pid]) for pid in b.order)
    for pid in b.order:
        for pos in range(len(seqs[pid])):
            if pid in b.compared:
                where[(pid, pos)] = (-(-total // w) * w, row)
            row += 1
    if not b.rescore:
        for step in range(p.new_tokens - 1):
            for slot, pid in enumerate(b.order):
                if pid in b.compared:
                    where[(pid, len(pr[pid]) + step)] = (-(-len(b.order) // w) * w, slot)
    return where


def _nothing_moved(p: ModelParams, runs: list[Run], gathered) -> str | None:
    """Vacuous when every run puts every compared token at the same row of a message of the
    same size in every forward: the TP reductions, the projections and the LM head see the
    compared tokens exactly where and among as many rows as before (a check of the batch that
    changes nothing they see; what the experts see alone is not a reason to run it)."""
    layouts = [_layout(p, run.spec, gathered[0][i].tokens) for i, run in enumerate(runs)]
    if all(lay == layouts[0] for lay in layouts[1:]):
        return ("every run puts the compared tokens at the same rows of messages of the same sizes: no TP "
                "reduction or projection sees them elsewhere")
    return None


def _sensitivity(p: ModelParams, world: int) -> int:
    """Elements of the probe prompt's layer-0 TP partials whose sum changes bits under some
    rotation of the ranks, plus q/k/v outputs that change when K is summed in two halves."""
    w = weights(p)
    tokens = prompts(p)[PROBE]
    partials = ref.layer0_partials(w, tokens, p.heads, world)
    tp = int(order_sensitive(partials.reshape(world, -1)).sum()) if world > 2 else 0
    x = ref.rmsnorm(w["embed"].double()[torch.tensor(tokens)], w["layers"][0]["attn_norm"]).to(torch.bfloat16).float()
    b = w["layers"][0]["wqkv"].float()
    half = x.shape[1] // 2
    whole = x @ b.T
    split = x[:, :half] @ b[:, :half].T + x[:, half:] @ b[:, half:].T
    return tp + int((whole.to(torch.bfloat16) != split.to(torch.bfloat16)).sum())


def logprob_bound(logits64: torch.Tensor, x64: torch.Tensor, lm_head: torch.Tensor, layers: int) -> torch.Tensor:
    """tolerances.MODEL per logprob [rows, V]: B_v + max_u B_u."""
    per_v = MODEL["u_out"] * logits64.abs() + model_factor(layers) * MODEL["u_out"] * (x64.abs() @ lm_head.double().abs().T)
    return per_v + per_v.max(dim=-1, keepdim=True).values


def _measure_reference(p: ModelParams, b: Batch, gathered) -> Measurement:
    w, pr, seen = weights(p), prompts(p), gathered[0][0]
    routing: dict = {}
    for g in gathered:
        routing.update(g[0].routing)
    got, exact, bound, flips, admitted, choices = [], [], [], 0, 0, 0
    factor = model_factor(p.layers)
    for pid in b.compared:
        seq = pr[pid] + seen.tokens[pid][:-1]
        out = ref.forward(w, seq, p.heads, p.topk, [routing[(pid, pos)] for pos in range(len(seq))])
        first = len(pr[pid]) - 1
        lp64 = out["logprobs"][first:]
        bound.append(logprob_bound(out["logits"][first:], out["x"][first:], w["lm_head"], p.layers))
        got.append(seen.logprobs[pid].double())
        exact.append(lp64)
        for r in out["router"]:
            margin = factor * MODEL["u_out"] * r["scale"] + 8 * 2.0 ** -24 * (1 + r["logits"].abs())
            flip, ok = router_flips(r["used"], r["own"], r["logits"], margin)
            flips, admitted, choices = flips + int(flip.sum()), admitted + int((flip & ok).sum()), choices + flip.numel()
    rule = Bound(rule=MODEL["rule"], terms={"u_out": MODEL["u_out"], "factor": factor, "layers": p.layers})
    m = Measurement.within(torch.cat(got), torch.cat(exact), torch.cat(bound), rule,
                           detail={"router_flips": flips, "router_flips_admitted": admitted, "router_choices": choices},
                           note=f"{flips} of {choices} (token, layer) router choices differ from the float64 router's "
                                f"own, {admitted} of them within its rounding margin of a tie; the reference follows "
                                f"the run's choices")
    return within_router_margin(m, flips - admitted, f"{choices} (token, layer) router choices are not within the "
                                                     f"float64 router's rounding margin of a tie")


def _kernel_calls(check) -> list | None:
    """None for a model whose GEMM stages' JIT compiles ahead (harness/run/precompile.py): the
    rows each expert receives are decided inside the model's layers at run time."""
    p = check.params
    if compiles_kernels(registry.get(check.subject), p) and any(
            name in registry.load_all() and compiled_ahead(name) for name in (p.gemm, p.dense_gemm)):
        return None
    return []


FAMILY = Family("model", PROPERTIES, ModelParams, _runs, _observe, _measure,
                protocol=ModelSubject, precompile=Precompile(_kernel_calls))
