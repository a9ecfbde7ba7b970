"""Float64 references for the tensor-parallel collectives.

Each rank r holds an input x[r] of shape [sum(sizes), ...]; rows
[offset(d), offset(d) + sizes[d]) of every rank's input are summed into rank d's output.
"""
from __future__ import annotations

import torch


def shard_offsets(sizes: list[int]) -> list[int]:
    """Row offset of each destination's shard: the exclusive prefix sum of `sizes`."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def even_sizes(rows: int, world_size: int) -> list[int]:
    if rows % world_size:
        raise ValueError(f"rows={rows} is not divisible by world_size={world_size}")
    return [rows // world_size] * world_size


def all_reduce(inputs: torch.Tensor) -> torch.Tensor:
    """Exact-as-float64 sum over ranks.

    inputs: [world_size, ...] in any float dtype. Returns float64 [...].
    """
    return inputs.to(torch.float64).sum(dim=0)


def reduce_scatter(inputs: torch.Tensor, sizes: list[int] | None = None) -> list[torch.Tensor]:
    """Float64 reduce-scatter (reduce-scatterv when `sizes` is uneven; empty shards allowed).

    inputs: [world_size, rows, ...]. sizes: rows per destination, summing to `rows`
    (default: even split). Returns one float64 tensor [sizes[d], ...] per destination d.
    """
    world_size, rows = inputs.shape[0], inputs.shape[1]
    sizes = even_sizes(rows, world_size) if sizes is None else sizes
    if len(sizes) != world_size or sum(sizes) != rows:
        raise ValueError(f"sizes={sizes} must have {world_size} entries summing to {rows}")
    total = all_reduce(inputs)
    return [total[o:o + s] for o, s in zip(shard_offsets(sizes), sizes)]
