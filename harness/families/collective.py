"""Collective checks: a probe token's reduce-scatter output under changing placements.

Every rank contributes a partial sum for every token (its TP shard's product); the probe
token's contribution from rank r is fixed by (seed, r), filler tokens change with the
layout. A *layout* says how many rows each destination owns and which global rows hold
the probe. The compared copies of the probe are gathered from the ranks that own them:

* rank-invariance: the probe in every non-empty shard of one call; copy d vs copy 0.
* batch-invariance: the last token of the smallest batch, at every batch size (it moves
  to another destination and row as the batch grows), vs its result in the first batch.
* position-invariance: the probe first, in the middle and last in one batch size.
* run-to-run: the rank-invariance call repeated; repeat k vs repeat 0, copy by copy, on a
  process group of the check's own, so that repeat 0 is the group's first call
  (thread-invariance: each repeat on another thread count, on the launch's group).
* graph-invariance: the rank-invariance call in a CUDA graph vs eager, copy by copy.
* size-invariance: the probe at row 0 while the whole message grows (message_bytes, e.g.
  decode- to prefill-sized): NCCL picks channels, and so trees, by message size.
* prefill-decode-invariance: the probe at row 0 of the smallest message (decode) vs the
  same token at several rows of each larger message (prefill): the first and last rows and
  one row inside each of `channel_probes` equal parts, so every channel range of NCCL's
  split holds a copy. Each copy records the channel and tree (or ring chunk) it went
  through, from NCCL's log; on gloo, its ring chunk.
* reference: every output element against the float64 sum, within the summation bound.
* tp-size-invariance: one logical tensor's reduction at world sizes 1, 2, 4 (8)
  (harness/families/collective_layout.py).

As in SGLang's test, the first copy is counted in `total` (it always matches itself).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ep_harness import inputs as gen
from ep_harness import properties
from ep_harness.bits import int_view, unit_roundoff
from ep_harness.compare import compare_bitwise
from ep_harness.context import RankContext
from ep_harness.families import collective_layout
from ep_harness.families import layout as layout_size
from ep_harness.families.driver import (REPEATED, THREAD_INVARIANCE, Copy, Family, Run, against_first_run, kept,
                                        repeat_labels, require_finite, subject_call)
from ep_harness.graphs import replay_in_graph
from ep_harness.measurement import Bound, Measurement
from ep_harness.nccl import models as nccl_models
from ep_harness.nccl.models import NcclContext, NoPrediction
from ep_harness.nccl.pins import channel_pin, channel_pin_violations, escaped_paths, pin_violations
from ep_harness.params import COLLECTIVE_DATA, DTYPES_WIRE, LayoutParams, _opt, _required
from ep_harness.subject import CollectiveSubject, order_model_of
from ep_harness.tolerances import gamma
from ep_harness.reference import orders
from ep_harness.reference.collectives import reduce_scatter as reference_reduce_scatter
from ep_harness.reference.collectives import shard_offsets
from ep_harness.selftest.wrap import Wrapped

PROPERTIES = (
    "reference", "run-to-run", "thread-invariance", "batch-invariance", "position-invariance",
    "rank-invariance", "graph-invariance", "size-invariance", "prefill-decode-invariance", "tp-size-invariance",
)

@dataclass(frozen=True, kw_only=True)
class CollectiveParams(LayoutParams):
    dtype: str = _required(choices=DTYPES_WIRE)
    hidden: int = _opt(2048, minimum=1)
    rows_per_rank: int = _opt(2, minimum=1)
    # reference: a second layout with this many rows per rank (0: none). 67 = 64 + 3 runs a
    # kernel's row remainder after whole blocks of 2 to 64 rows, and holds exact zero sums
    tail_rows: int = _opt(67, minimum=0)
    batch_sizes: list[int] = _opt([1, 2, 3, 8, 32, 128], minimum=1, nonempty=True)
    position_rows: int = _opt(8, minimum=1)
    repeats: int = _opt(3, minimum=1)
    shards: str = _opt("even", choices=("even", "uneven"))
    data: str = _opt("spread", choices=COLLECTIVE_DATA)
    message_bytes: list[int] = _opt([4096, 65536, 1 << 20, 16 << 20], minimum=1, nonempty=True)
    # prefill-decode-invariance: prefill probes one row inside each of this many equal parts
    channel_probes: int = _opt(8, minimum=1)
    # NCCL: every call of the check must use one channel range (the launch's channel pin)
    channel_pin: bool = _opt(False)


@dataclass(frozen=True)
class Layout:
    sizes: tuple[int, ...]  # rows per destination rank
    probes: tuple[int, ...]  # global rows that hold the probe token
    label: str
    zero_sums: bool = False  # some filler elements sum to exactly zero over the ranks (rank_input)

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def owner(self, row: int) -> tuple[int, int]:
        """(destination rank, local row) of a global row."""
        for dest, (start, size) in enumerate(zip(shard_offsets(list(self.sizes)), self.sizes)):
            if start <= row < start + size:
                return dest, row - start
        raise IndexError(row)


def shard_pattern(shards: str, world_size: int, scale: int) -> tuple[int, ...]:
    if shards == "even":
        return (scale,) * world_size
    if shards == "uneven":  # uneven, with one empty shard: W=4 -> 1,4,2,0; W=3 -> 1,0,3
        return tuple(((3 * d + 1) % (world_size + 1)) * scale for d in range(world_size))
    raise ValueError(f"unknown shards {shards!r}; known: even, uneven")


def first_rows(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(o for o, s in zip(shard_offsets(list(sizes)), sizes) if s)


def layouts(prop: str, p: CollectiveParams, world_size: int) -> list[Layout]:
    if prop in ("rank-invariance", "reference", "graph-invariance"):
        sizes = shard_pattern(p.shards, world_size, p.rows_per_rank)
        out = [Layout(sizes, first_rows(sizes), f"rows {list(sizes)}")]
        if prop == "reference" and p.tail_rows and p.tail_rows != p.rows_per_rank:
            tail = shard_pattern(p.shards, world_size, p.tail_rows)
            out.append(Layout(tail, first_rows(tail), f"tail rows {list(tail)}", zero_sums=world_size > 1))
        return out
    if prop in REPEATED:  # thread-invariance: every row (threads given a share of a rank's rows
        # keep its first row in the first part on every count)
        sizes = shard_pattern(p.shards, world_size, p.rows_per_rank)
        probes = tuple(range(sum(sizes))) if prop == THREAD_INVARIANCE else first_rows(sizes)
        return [Layout(sizes, probes, label) for label in repeat_labels(prop, p.repeats)]
    if prop == "batch-invariance":
        batches = p.batch_sizes
        probe = sum(shard_pattern(p.shards, world_size, min(batches))) - 1  # fits every batch
        return [Layout(shard_pattern(p.shards, world_size, b), (probe,), f"batch {b}") for b in batches]
    if prop == "position-invariance":
        sizes = shard_pattern(p.shards, world_size, p.position_rows)
        total = sum(sizes)
        return [Layout(sizes, (row,), name) for row, name in
                ((0, "first"), (total // 2, "middle"), (total - 1, "last"))]
    if prop == "size-invariance":
        per_row = p.hidden * gen.dtype_of(p.dtype).itemsize * world_size
        return [Layout((max(1, size // per_row),) * world_size, (0,), f"{size:,} B") for size in p.message_bytes]
    if prop == "prefill-decode-invariance":
        return prefill_decode_layouts(p, world_size)
    raise ValueError(f"collective checks have no property {prop!r}")


def prefill_decode_layouts(p: CollectiveParams, world_size: int) -> list[Layout]:
    """message_bytes[0] is the decode message (the probe at row 0), the others prefill
    messages with the probe at their first and last rows and in the middle of each of
    `channel_probes` equal parts: NCCL deals a message out to at most that many channels in
    contiguous ranges of nearly equal size, so each range holds one of these rows."""
    row_bytes = p.hidden * gen.dtype_of(p.dtype).itemsize
    decode, *prefill = p.message_bytes
    sizes = shard_pattern(p.shards, world_size, max(1, decode // (row_bytes * world_size)))
    out = [Layout(sizes, (0,), f"decode {sum(sizes) * row_bytes:,} B")]
    for nbytes in prefill:
        sizes = shard_pattern(p.shards, world_size, max(1, nbytes // (row_bytes * world_size)))
        total, parts = sum(sizes), p.channel_probes
        rows = {0, total - 1} | {(2 * i + 1) * total // (2 * parts) for i in range(parts)}
        out.append(Layout(sizes, tuple(sorted(rows)), f"prefill {total * row_bytes:,} B"))
    return out


def rank_input(p: CollectiveParams, dtype, rank: int, layout: Layout) -> torch.Tensor:
    """Rank `rank`'s [rows, hidden] input: seeded fillers with the probe's rows overwritten.
    With `layout.zero_sums` every 7th filler element sums to exactly zero over the ranks (rank
    0 holds x, rank 1 -x, the others +0.0): +0.0 in any order of IEEE additions, and no input
    holds -0.0, so the reference can ask for the zero's sign."""
    x = gen.values((layout.rows, p.hidden), dtype, p.seed, "filler", rank, layout.sizes, data=p.data)
    if layout.zero_sums and rank > 0:
        cancel = zero_sum_elements(x.shape)
        x[cancel] = -rank_input(p, dtype, 0, layout)[cancel] if rank == 1 else 0.0
    probe = probe_values(p, dtype, rank)
    for row in layout.probes:
        x[row] = probe
    return x


def zero_sum_elements(shape) -> torch.Tensor:
    """The filler elements a `zero_sums` layout makes sum to zero: every 7th in row-major order
    (prime to every power-of-two width, so each column and vector lane gets some)."""
    return (torch.arange(shape[0] * shape[1]) % 7 == 3).view(shape)


def probe_values(p: CollectiveParams, dtype, rank: int) -> torch.Tensor:
    """Rank `rank`'s probe row [hidden], the same at every layout and world size."""
    return gen.values((p.hidden,), dtype, p.seed, "probe", rank, data=p.data)


def all_inputs(p, dtype, world_size, layout) -> torch.Tensor:
    return torch.stack([rank_input(p, dtype, r, layout) for r in range(world_size)])


def probe_rows(p, dtype, world_size, layout) -> torch.Tensor:
    """Every rank's input [world_size, rows, hidden] with the probe's rows as `rank_input` has
    them and every other row zero: what an elementwise order model (OrderModel.elementwise)
    needs to predict the probe's bits, without regenerating every rank's filler rows."""
    x = torch.zeros((world_size, layout.rows, p.hidden), dtype=dtype)
    probes = list(layout.probes)
    for r in range(world_size):
        x[r, probes] = probe_values(p, dtype, r)
    return x


def _layout_runs(prop: str, p: CollectiveParams, world_size: int) -> list[Run]:
    """The layouts as driver runs; graph-invariance runs each layout eager, then in a graph."""
    if prop in layout_size.LAYOUT_PROPERTIES:  # world sizes, not placements within one
        return layout_size.runs(prop, p, world_size)
    base = layouts(prop, p, world_size)
    graph = p.mode == "graph" or prop == "graph-invariance"
    plan = [(layout, graph and prop != "graph-invariance") for layout in base]
    if prop == "graph-invariance":
        plan += [(Layout(l.sizes, l.probes, f"graph {l.label}"), True) for l in base]
    out = []
    for layout, in_graph in plan:
        copies = tuple(Copy((layout.sizes, row), layout.owner(row)[0]) for row in layout.probes)
        out.append(Run(layout.label, copies, (layout, in_graph)))
    return out


class RankSeen(NamedTuple):
    """What one rank observed, gathered to rank 0."""

    copies: list[dict[int, torch.Tensor]]  # per run: {copy index: probe row} of the copies it owns
    outputs: list[torch.Tensor]  # reference: its whole output
    calls: list[list]  # per run: the NCCL calls it logged


def _observe(subject, ctx: RankContext, p: CollectiveParams, prop: str, runs: list[Run]) -> RankSeen:
    """On every rank: the probe copies it owns per run, its outputs for the reference, the
    NCCL calls it logged per run (the driver's subject_call checks that the input is left
    alone and the output written)."""
    if prop in layout_size.LAYOUT_PROPERTIES:
        return collective_layout.observe(subject, ctx, p, prop, runs)
    dtype = gen.dtype_of(p.dtype)
    copies, outputs, calls = [], [], []
    for run in runs:
        layout, in_graph = run.spec
        inp = rank_input(p, dtype, ctx.rank, layout).to(ctx.device)
        out = inp.new_empty((layout.sizes[ctx.rank], inp.shape[1]))

        def call(o, i):
            subject.reduce_scatter(o, i, list(layout.sizes), ctx.group)

        mark = ctx.nccl_mark()
        with subject_call({"inp": inp}, [(out, None)]):
            if in_graph:
                replay_in_graph(call, out, inp)
            else:
                call(out, inp)
        calls.append(ctx.nccl_calls_since(mark))
        mine = {}
        for copy, row in enumerate(layout.probes):
            dest, local = layout.owner(row)
            if dest == ctx.rank:
                mine[copy] = kept(out[local])
        copies.append(mine)
        if prop == "reference":
            outputs.append(kept(out))
    return RankSeen(copies, outputs, calls)


def _labels(layout: Layout) -> list[str]:
    out = []
    for row in layout.probes:
        dest, local = layout.owner(row)
        out.append(f"{layout.label}: rank {dest} row {local}")
    return out


def _nccl_record(ctx: RankContext, m: Measurement, calls: list[list], p: CollectiveParams) -> None:
    """What NCCL ran for the subject's calls, and an error when it is not what was pinned:
    another algorithm than NCCL_ALGO names, a path the pins turn off (symmetric kernels,
    NVLS, CollNet), or, under `channel_pin`, calls on different channel ranges."""
    if ctx.backend != "nccl":
        return
    flat = [c for per_run in calls for c in per_run]
    m.nccl_calls = list(dict.fromkeys(c.describe() for c in flat))[:12]
    violations = pin_violations(flat, ctx.nccl_algo) + escaped_paths(flat)
    if p.channel_pin:
        env = {**os.environ, **(ctx.nccl_topology.env if ctx.nccl_topology is not None else {})}
        pinned = channel_pin(env)
        m.detail["channel_pin"] = pinned
        comm = ctx.nccl_topology.coll_channels if ctx.nccl_topology is not None else None
        broken = channel_pin_violations(flat, pinned, comm)
        if broken:
            violations.append(broken)
    if violations:
        m.error = "; ".join(dict.fromkeys(violations))


def _measure(check, subject, ctx: RankContext, p: CollectiveParams, runs: list[Run], gathered) -> Measurement:
    world_size, prop = ctx.world_size, check.property
    if prop in layout_size.LAYOUT_PROPERTIES:
        return collective_layout.measure(check, subject, ctx, p, runs, gathered)
    dtype = gen.dtype_of(p.dtype)
    layouts_ = [r.spec[0] for r in runs]
    calls = gathered[0].calls  # rank 0 reads its own NCCL log
    if prop == "reference":
        m = _measure_reference(p, dtype, layouts_, [g.outputs for g in gathered], world_size)
        _nccl_record(ctx, m, calls, p)
        return m

    observed, labels = [], []
    for i, layout in enumerate(layouts_):
        for copy in range(len(layout.probes)):
            owner = next(r for r in range(world_size) if copy in gathered[r].copies[i])
            observed.append(gathered[owner].copies[i][copy])
        labels += _labels(layout)
    observed = torch.stack(observed)
    m = Measurement.bitwise(compare_bitwise(observed, _expected(prop, observed, layouts_), labels))

    # The prediction comes from the inputs alone: every rank's input is regenerated here.
    model = order_model_of(subject, ctx.backend)  # optional: None measures without predicting
    pred_rows = None
    if model is not None:
        try:
            pred_rows = torch.stack(_predicted_probes(model, ctx, p, dtype, layouts_, calls))
            m.predicted_mismatched = compare_bitwise(pred_rows, _expected(prop, pred_rows, layouts_)).mismatched
            m.order_model, m.order_model_exact = model.name, model.exact
        except NoPrediction as exc:
            pred_rows = None
            m.order_model, m.note = model.name, f"no order-model prediction: {exc}"

    probe = torch.stack([
        gen.values((p.hidden,), dtype, p.seed, "probe", r, data=p.data) for r in range(world_size)
    ])
    require_finite(m, observed, probe.double().sum(0))
    m.sensitivity = int(orders.order_sensitive(probe).sum())
    m.sensitivity_what = (f"of {p.hidden:,} probe elements change bits under any reordering of "
                          f"{world_size} contributions" + (" (a + b == b + a)" if world_size == 2 else ""))
    if prop == "prefill-decode-invariance":
        _record_paths(m, ctx, p, model, layouts_, calls, observed, pred_rows)
    _nccl_record(ctx, m, calls, p)
    return m


def _copy_paths(ctx: RankContext, p: CollectiveParams, model, layouts_, calls) -> list[tuple[str, tuple]]:
    """Per compared copy: what reduced its elements (NCCL: the channel and tree or ring
    chunk from the logged call and NCCL's split; gloo's ring: the chunk) and a signature
    equal for copies reduced along the same path in the same-size message."""
    hidden, size = p.hidden, gen.dtype_of(p.dtype).itemsize
    out = []
    for layout, logged in zip(layouts_, calls):
        count = layout.rows * hidden
        for row in layout.probes:
            first, last = row * hidden, (row + 1) * hidden
            if ctx.backend == "nccl":
                what, sig = nccl_models.element_path(count, size, NcclContext(ctx.nccl_topology, logged), first, last)
            elif model is not None and model.name.startswith("gloo ring"):
                chunk = orders.gloo_segments(count, ctx.world_size)
                chunks = sorted({min(e // chunk, ctx.world_size - 1) for e in (first, last - 1)})
                what = f"gloo ring chunk{'s' if len(chunks) > 1 else ''} {'..'.join(map(str, chunks))}"
                sig = ("gloo", tuple(chunks))
            else:
                what, sig = (model.name if model is not None else "no order model"), ("fixed",)
            out.append((what, (layout.rows, sig)))
    return out


def _differing(rows: torch.Tensor | None) -> list[int]:
    """Per copy, how many elements differ in bits from the first (the decode copy); [] without rows."""
    if rows is None:
        return []
    bits = int_view(rows)
    return (bits != bits[0]).sum(dim=1).tolist()


def _record_paths(m: Measurement, ctx: RankContext, p: CollectiveParams, model, layouts_, calls,
                  observed: torch.Tensor, predicted: torch.Tensor | None) -> None:
    """Every copy's path, measured and predicted differing elements next to its label;
    vacuous when every copy sat in the same-size message on the same path (the decode
    message repeated at the same channel: nothing the check compares could differ)."""
    paths = _copy_paths(ctx, p, model, layouts_, calls)
    labels = [label for layout in layouts_ for label in _labels(layout)]
    measured = _differing(observed)
    expected = _differing(predicted) or [None] * len(labels)
    m.detail["copies"] = [{"copy": label, "path": what, "measured": n, "predicted": e}
                          for label, (what, _), n, e in zip(labels, paths, measured, expected)]
    if len({sig for _, sig in paths}) == 1:
        m.vacuous_reason = (f"every compared copy was reduced in a message of the same size along the same path "
                            f"({paths[0][0]}): nothing the check compares could differ")


def _predicted_probes(model, ctx: RankContext, p, dtype, layouts_, calls) -> list[torch.Tensor]:
    """The probe copies the order model predicts, from every rank's regenerated input and
    (on NCCL) the algorithm NCCL logged for each call. An elementwise model reads the probe's
    rows alone (the filler rows were most of rank 0's time in a check)."""
    rows = []
    inputs = probe_rows if model.elementwise else all_inputs
    for layout, logged in zip(layouts_, calls):
        x = inputs(p, dtype, ctx.world_size, layout)
        hidden = x.shape[-1]
        nccl = NcclContext(ctx.nccl_topology, logged) if ctx.backend == "nccl" else None
        outs = model.predict(x.reshape(ctx.world_size, -1), [s * hidden for s in layout.sizes], nccl)
        for row in layout.probes:
            dest, local = layout.owner(row)
            rows.append(outs[dest].view(-1, hidden)[local])
    return rows


def _expected(prop, observed, layouts_):
    if properties.get(prop).compares == "repeat":  # every repeat against the first
        return against_first_run(observed, len(layouts_[0].probes))
    return observed[0]


def _measure_reference(p, dtype, layouts_, outputs, world_size) -> Measurement:
    """Every output element of every layout vs the float64 sum: |got - exact| <= gamma_{W-1} *
    sum |x_r|, and an exact zero sum +0.0 (no input holds -0.0, so no IEEE sum gives -0.0).
    `outputs`: per rank, its output per layout."""
    got, exact, magnitude = [], [], []
    for i, layout in enumerate(layouts_):
        x = all_inputs(p, dtype, world_size, layout)
        exact += reference_reduce_scatter(x, list(layout.sizes))
        magnitude += reference_reduce_scatter(x.abs(), list(layout.sizes))
        got += [per_rank[i].to(torch.float64) for per_rank in outputs]
    hops = world_size - 1
    g = gamma(hops, unit_roundoff(dtype)) if hops else 0.0
    rule = Bound(rule=f"|err| <= gamma_{hops} * sum|x_r|", terms={"gamma": g, "unit_roundoff": unit_roundoff(dtype)})
    return Measurement.within(torch.cat(got), torch.cat(exact), g * torch.cat(magnitude), rule, zero_signs=True)


# `ep-harness explore`: the parameters a search varies (st: hypothesis.strategies); it draws
# the family's searchable properties (harness/properties.py).
def _search_space(st):
    return {"hidden": st.sampled_from([64, 256, 2048]), "rows_per_rank": st.integers(1, 8),
            "batch_sizes": st.lists(st.integers(1, 64), min_size=2, max_size=4, unique=True),
            "position_rows": st.integers(1, 16), "seed": st.integers(0, 10_000),
            "dtype": st.sampled_from(["bfloat16", "float16", "float32"])}


class _Injected(Wrapped):
    """`ep-harness selftest`: the defect in reduce_scatter's output, or in the input outside
    this rank's slice."""

    def reduce_scatter(self, out, inp, sizes, group):
        import torch.distributed as dist

        self._subject.reduce_scatter(out, inp, sizes, group)
        rank = dist.get_rank(group)
        start = sum(sizes[:rank])
        self._inject(out, inp, (start, start + sizes[rank]))

    def reduce_shards(self, out, shards, sizes, group):
        """tp-size-invariance's call (ep_harness.shards.reduce_shards: the subject's own hook,
        or its reduce_scatter of the local partial); every shard is outside this rank's output."""
        from ep_harness.shards import reduce_shards

        reduce_shards(self._subject, out, shards, sizes, group)
        self._inject(out, shards.view(-1, shards.shape[-1]))


FAMILY = Family("collective", PROPERTIES, CollectiveParams, _layout_runs, _observe, _measure,
                protocol=CollectiveSubject, search_space=_search_space,
                # the family checks the input after every call: a write outside the output fails any property
                selftest_wrapper=_Injected, must_catch=frozenset({"out-of-slice"}),
                # run-to-run's repeat 0 is a new group's first call (a connection made, a buffer
                # registered on it), the later repeats are not
                own_group=frozenset({"run-to-run"}))
