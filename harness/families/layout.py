"""What the layout-size properties share (tp-size-invariance, ep-size-invariance): the
same logical inputs through several world sizes, on subgroups of one launch, compared
bitwise (docs/layout-invariance.md).

A run is one world size w: the ranks 0..w-1 of the check's ranks (ep_harness.context
RankContext.layout) hold the logical input cut for w, the others sit the run out. Its one
compared copy is placed by w, so the driver's vacuity rules read a single size as "only one
run" and a size named twice as "one and the same placement".

The TP input is V fixed *virtual shards* (the logical tensor's K split V ways, whatever w
is); rank r of w holds shards r*V/w .. (r+1)*V/w - 1. A subject with `reduce_shards(out,
shards, sizes, group)` reduces them itself (the fix: harness/subjects/collective/tree_reduce.py);
any other collective subject gets what a tensor-parallel linear layer hands its reduction:
the rank's fp32 sum of its shards rounded once (one GEMM over its K slice), then its own
`reduce_scatter`. Both orders are in reference/orders.py.
"""
from __future__ import annotations

import math
import time

import torch

from ep_harness.families.driver import Copy, Run

LAYOUT_PROPERTIES = ("tp-size-invariance", "ep-size-invariance")
KIND = {"tp-size-invariance": "TP", "ep-size-invariance": "EP"}


def sizes(p) -> list[int]:
    """The world sizes a layout check compares, in order: `layout_sizes`, or every power of
    two up to min(world_size, virtual_shards)."""
    if p.layout_sizes:
        return list(p.layout_sizes)
    top = min(p.world_size, p.virtual_shards)
    return [1 << k for k in range(top.bit_length()) if 1 << k <= top]


def sizes_of(check: dict) -> list[int]:
    """The sizes a check's JSON form runs through (none for another property): the worker
    makes a subgroup for each before the first check."""
    if check.get("property") not in LAYOUT_PROPERTIES:
        return []
    params = check["params"]
    return sizes(type("P", (), {"layout_sizes": params.get("layout_sizes") or [],
                                "world_size": params["world_size"],
                                "virtual_shards": params.get("virtual_shards", 8)}))


def logical_rows(p, per_rank: int) -> int:
    """Rows of the logical tensor: `per_rank` rows per destination at the largest common size."""
    return per_rank * math.lcm(*sizes(p))


def runs(prop: str, p, world_size: int) -> list[Run]:
    kind = KIND[prop]
    return [Run(f"{kind} {w}", (Copy((w,), 0),), w) for w in sizes(p)]


def block(shards: int, world_size: int, rank: int) -> range:
    """The virtual shards rank `rank` of `world_size` holds."""
    per = shards // world_size
    return range(rank * per, (rank + 1) * per)


def timed(fn, device: torch.device) -> float:
    """Seconds of one call (the device synchronised around it): the cost next to a verdict,
    never asserted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began
