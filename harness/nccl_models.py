"""Which accumulation-order model predicts an NCCL call: the one for the algorithm NCCL
logged for it (RING, PAT, TREE), over the rings and trees NCCL logged for the communicator.

The prediction uses the check's inputs, the communicator's topology and the algorithm
NCCL chose; it never runs a collective. Where NCCL ran something these models do not
cover, `NoPrediction` says what, and the record carries no prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.nccl_log import Call, Topology
from reference import nccl_pat, orders


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
    topo = nccl.topology
    if algo == "RING":
        ring = _ring(topo)
        return orders.nccl_ring_reduce_scatter(inputs, sizes, ring), f"NCCL ring {call.function}, ring {ring}"
    if algo == "PAT" and call.function == "ReduceScatter":
        if topo.local_ranks != 1:
            raise NoPrediction(f"PAT with {topo.local_ranks} ranks per node is not modelled (one rank per node is)")
        return nccl_pat.pat_reduce_scatter(inputs, sizes), f"NCCL PAT reduce-scatter, {inputs.shape[0]} nodes"
    raise NoPrediction(f"no model for {call.describe()}")


def all_reduce(inputs: torch.Tensor, nccl: NcclContext | None) -> tuple[torch.Tensor, str]:
    """NCCL's all-reduce output (the same bits on every rank); returns (output, model name)."""
    algo, call = _algorithm(nccl, "AllReduce")
    topo = nccl.topology
    if algo != "TREE":
        raise NoPrediction(f"no exact model for {call.describe()} (the tree model needs TREE)")
    proto = {"SIMPLE": "Simple", "LL": "LL", "LL128": "LL128"}.get(call.protocol.upper(), call.protocol)
    try:
        max_threads = topo.max_threads["Tree"][proto]
        threshold = topo.thread_thresholds["Tree"][proto]
    except KeyError:
        raise NoPrediction("the NCCL log lacks the tree thread limits (Max NThreads / threadThresholds)") from None
    counts = orders.nccl_channel_split(inputs.shape[1], inputs.element_size(), 2, topo.coll_channels or 1,
                                       max_threads, threshold)
    lo, hi = call.channels
    if len(counts) != hi - lo + 1:
        raise NoPrediction(f"the channel split predicts {len(counts)} channels, NCCL used {lo}..{hi}")
    trees = topo.channel_trees()
    if len(trees) < hi + 1:
        raise NoPrediction(f"the NCCL log names trees for {len(trees)} channels, the call used {lo}..{hi}")
    out = orders.nccl_tree_all_reduce(inputs, trees[lo:hi + 1], counts)
    return out, f"NCCL tree all-reduce over {len(counts)} channel(s) of the logged trees"
