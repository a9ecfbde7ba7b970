"""Which accumulation-order model predicts an NCCL call: `MODELS`, a table (function,
algorithm) -> model, looked up with the function and algorithm NCCL logged for the call
(RING, PAT, TREE); each model runs the pure order of reference/ over the rings and trees NCCL
logged for the communicator, with NCCL's split of the message over channels and chunks
(reference/nccl_plan.py). A new algorithm's model is one function and one table line.

Covered: reduce-scatter RING (any protocol) and PAT (one rank per node); all-reduce TREE
(Simple, LL; LL128 too, whose chunking does not change a tree's order) and RING (Simple,
LL, LL128). Everything else (NVLS, CollNet, symmetric kernels, PAT with several ranks per
node, channels carrying different rings under the reduce-scatter ring model) is a
`NoPrediction` naming what NCCL ran.

The prediction uses the check's inputs, the communicator's topology and the algorithm
NCCL chose; it never runs a collective. Where NCCL ran something these models do not
cover, `NoPrediction` says what, and the record carries no prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ep_harness.nccl.log import Call, Topology
from ep_harness.reference import nccl_pat, nccl_plan, orders


class NoPrediction(Exception):
    """The models cannot predict this call (the reason is the message)."""


@dataclass
class NcclContext:
    """What a prediction may know about one subject call besides the inputs."""

    topology: Topology | None
    calls: list[Call] = field(default_factory=list)  # what rank 0 logged during the call


def _algorithm(nccl: NcclContext | None, *functions: str) -> tuple[str, Call]:
    if nccl is None or nccl.topology is None:
        raise NoPrediction("no NCCL log was read for this run")
    calls = [c for c in nccl.calls if c.function in functions]
    if not calls:
        raise NoPrediction(f"NCCL logged no {'/'.join(functions)} call for it")
    algos = {c.algorithm.upper() for c in calls}
    if len(algos) != 1 or any(c.symmetric for c in calls):
        raise NoPrediction(f"NCCL ran {', '.join(sorted(c.describe() for c in calls))}")
    return algos.pop(), calls[0]


def _ring(topology: Topology) -> list[int]:
    ring = topology.ring()
    if ring is None:
        raise NoPrediction(f"channels carry different rings ({topology.rings}); the ring model needs one")
    return ring


def reduce_scatter(inputs: torch.Tensor, sizes: list[int], nccl: NcclContext | None) -> tuple[list, str]:
    """Per-destination outputs of NCCL's reduce-scatter (or one Reduce per destination, which
    is how torch issues a reduce-scatter of uneven shards); returns (outputs, model name)."""
    algo, call = _algorithm(nccl, "ReduceScatter", "Reduce")
    model = MODELS.get((call.function, algo))
    if model is None:
        raise NoPrediction(f"no model for {call.describe()}")
    return model(inputs, sizes, nccl.topology, call)


def _ring_reduce_scatter(inputs: torch.Tensor, sizes: list[int], topo: Topology, call: Call) -> tuple[list, str]:
    ring = _ring(topo)
    return orders.nccl_ring_reduce_scatter(inputs, sizes, ring), f"NCCL ring {call.function}, ring {ring}"


def _pat_reduce_scatter(inputs: torch.Tensor, sizes: list[int], topo: Topology, call: Call) -> tuple[list, str]:
    if topo.local_ranks != 1:
        raise NoPrediction(f"PAT with {topo.local_ranks} ranks per node is not modelled (one rank per node is)")
    return nccl_pat.pat_reduce_scatter(inputs, sizes), f"NCCL PAT reduce-scatter, {inputs.shape[0]} nodes"


def _buff_sizes(topo: Topology) -> dict[str, int]:
    """Protocol buffer sizes NCCL used: its defaults unless the log says a variable set one."""
    out = {}
    for proto, name in nccl_plan.BUFF_SIZE_VARIABLES.items():
        if name in topo.env:
            try:
                out[proto] = int(topo.env[name], 0)
            except ValueError:
                raise NoPrediction(f"{name}={topo.env[name]} is not a size the models read") from None
    return out


@dataclass(frozen=True)
class AllReducePlan:
    """How NCCL ran one all-reduce, as the models rebuild it from the log."""

    algorithm: str  # TREE or RING
    protocol: str  # LL, LL128, SIMPLE
    counts: list[int]  # elements per channel, channels lo..hi
    channels: tuple[int, int]
    chunk: int | None  # ring: elements per chunk of a channel's loop

    def channel_of(self, element: int) -> int:
        """The channel that reduces `element` of the message."""
        offset = 0
        for i, count in enumerate(self.counts):
            if element < offset + count:
                return self.channels[0] + i
            offset += count
        raise IndexError(element)


def all_reduce_plan(count: int, element_size: int, nccl: NcclContext | None) -> tuple[AllReducePlan, Call]:
    """The algorithm, protocol and channel split of the all-reduce NCCL logged for the call,
    checked against the channel range NCCL logged; NoPrediction where the models stop."""
    call = _modelled_all_reduce(nccl)
    return _plan_of(call, count, element_size, nccl.topology), call


def _modelled_all_reduce(nccl: NcclContext | None) -> Call:
    """The all-reduce NCCL logged for the call, if the table has a model for its algorithm."""
    algo, call = _algorithm(nccl, "AllReduce")
    if ("AllReduce", algo) not in MODELS:
        covered = " and ".join(a for f, a in MODELS if f == "AllReduce")
        raise NoPrediction(f"no exact model for {call.describe()} (the models cover {covered})")
    return call


def _plan_of(call: Call, count: int, element_size: int, topo: Topology) -> AllReducePlan:
    """The channel split (and ring chunk) of one logged all-reduce of `count` elements."""
    algo, proto = call.algorithm.upper(), call.protocol.upper()
    column = {"SIMPLE": "Simple", "LL": "LL", "LL128": "LL128"}.get(proto)
    name = algo.capitalize()
    try:
        max_threads = topo.max_threads[name][column]
        threshold = topo.thread_thresholds[name][column]
    except KeyError:
        raise NoPrediction(f"the NCCL log lacks the {name}/{proto} thread limits "
                           f"(Max NThreads / threadThresholds)") from None
    comm_channels = topo.coll_channels or 1
    allowed = nccl_plan.max_channels(count * element_size, comm_channels, max_threads, threshold)
    counts = nccl_plan.channel_counts(count, element_size, 2, proto, comm_channels, allowed)
    lo, hi = call.channels
    if lo != 0 or len(counts) != hi - lo + 1:
        raise NoPrediction(f"the channel split predicts channels 0..{len(counts) - 1}, NCCL used {lo}..{hi}")
    chunk = None
    if algo == "RING":
        try:
            chunk = nccl_plan.chunk_elements("RING", proto, element_size, _buff_sizes(topo))
        except ValueError as exc:
            raise NoPrediction(str(exc)) from None
    return AllReducePlan(algo, proto, counts, (lo, hi), chunk)


def all_reduce(inputs: torch.Tensor, nccl: NcclContext | None) -> tuple[torch.Tensor, str]:
    """NCCL's all-reduce output (the same bits on every rank); returns (output, model name)."""
    call = _modelled_all_reduce(nccl)
    return MODELS[("AllReduce", call.algorithm.upper())](inputs, None, nccl.topology, call)


def _tree_all_reduce(inputs: torch.Tensor, sizes: None, topo: Topology, call: Call) -> tuple[torch.Tensor, str]:
    plan = _plan_of(call, inputs.shape[1], inputs.element_size(), topo)
    lo, hi = plan.channels
    trees = topo.channel_trees()
    if len(trees) < hi + 1:
        raise NoPrediction(f"the NCCL log names trees for {len(trees)} channels, the call used {lo}..{hi}")
    out = orders.nccl_tree_all_reduce(inputs, trees[lo:hi + 1], plan.counts)
    return out, f"NCCL tree all-reduce over {len(plan.counts)} channel(s) of the logged trees"


def _ring_all_reduce(inputs: torch.Tensor, sizes: None, topo: Topology, call: Call) -> tuple[torch.Tensor, str]:
    plan = _plan_of(call, inputs.shape[1], inputs.element_size(), topo)
    lo, hi = plan.channels
    rings = [topo.rings.get(c) for c in range(lo, hi + 1)]
    if any(r is None for r in rings):
        raise NoPrediction(f"the NCCL log names rings for channels {sorted(topo.rings)}, the call used {lo}..{hi}")
    out = orders.nccl_ring_all_reduce_channels(inputs, rings, plan.counts, plan.chunk)
    return out, (f"NCCL ring all-reduce ({plan.protocol}) over {len(plan.counts)} channel(s) of the logged rings, "
                 f"chunks of {plan.chunk:,} elements")


# (NCCL function, algorithm as NCCL logs it) -> the model of its order: (inputs, sizes of the
# destinations' shards or None, the communicator, the logged call) -> (outputs, model name).
Model = Callable[[torch.Tensor, "list[int] | None", Topology, Call], tuple]
MODELS: dict[tuple[str, str], Model] = {
    ("ReduceScatter", "RING"): _ring_reduce_scatter,
    ("Reduce", "RING"): _ring_reduce_scatter,  # torch's reduce-scatter of uneven shards: one Reduce per destination
    ("ReduceScatter", "PAT"): _pat_reduce_scatter,  # one rank per node only
    ("AllReduce", "TREE"): _tree_all_reduce,
    ("AllReduce", "RING"): _ring_all_reduce,
}


def _tree_names(topo: Topology) -> dict[int, int]:
    """channel -> the lowest channel carrying the same tree (even and odd channels carry the
    two trees of the double binary tree across nodes; one node's channels may all agree)."""
    first: dict[tuple, int] = {}
    out = {}
    for channel in sorted(topo.trees):
        key = tuple(sorted((r, tuple(d), u) for r, (d, u) in topo.trees[channel].items()))
        out[channel] = first.setdefault(key, channel)
    return out


def element_path(count: int, element_size: int, nccl: NcclContext | None, first: int, last: int) -> tuple[str, tuple]:
    """Where NCCL reduced elements [first, last) of a `count`-element message in the logged
    call: a description for the record ("AllReduce TREE/SIMPLE channel 3 (tree of channel 1)")
    and a signature that is equal for two element ranges reduced along the same path."""
    try:
        plan, call = all_reduce_plan(count, element_size, nccl)
    except NoPrediction:
        calls = [] if nccl is None else nccl.calls
        logged = ", ".join(dict.fromkeys(
            f"{c.function} {c.algorithm}/{c.protocol} channels {c.channels[0]}..{c.channels[1]}" for c in calls
        )) or "no NCCL call logged"
        return logged, (logged,)
    channels = list(range(plan.channel_of(first), plan.channel_of(last - 1) + 1))
    where = f"channel {channels[0]}" if len(channels) == 1 else f"channels {channels[0]}..{channels[-1]}"
    if plan.algorithm == "TREE":
        names = _tree_names(nccl.topology)
        trees = sorted({names.get(c, c) for c in channels})
        shapes = ", ".join(f"tree of channel {t}" for t in trees)
        return f"AllReduce TREE/{plan.protocol} {where} ({shapes})", ("TREE", plan.protocol, tuple(trees))
    # A ring element's order is its chunk's: the ring index the chunk starts from.
    offset = sum(plan.counts[:channels[0] - plan.channels[0]])
    starts = set()
    for c in channels:
        ring = nccl.topology.rings[c]
        part = plan.counts[c - plan.channels[0]]
        lo, hi = max(first, offset) - offset, min(last, offset + part) - offset
        chunks = orders.nccl_ring_chunk_of(part, len(ring), plan.chunk, max(1, 16 // element_size))[lo:hi]
        starts |= {tuple(orders.ring_walk(ring, ring[k])) for k in chunks.unique().tolist()}
        offset += part
    walks = "; ".join(" ".join(map(str, w)) for w in sorted(starts))
    return f"AllReduce RING/{plan.protocol} {where} (adds {walks})", ("RING", plan.protocol, tuple(sorted(starts)))
