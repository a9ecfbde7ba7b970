"""Pieces shared by the collective subjects: shard offsets, the fixed-order fold and the
gloo order model of an all-reduce followed by a slice."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ep_harness.subject import OrderModel
from ep_harness.reference import orders
from ep_harness.reference.collectives import shard_offsets as offsets


# torch 2.13 renamed the single-tensor collectives (the old names warn FutureWarning and call
# the new ones, so the bits are the same); torch 2.4 .. 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def fold_in_order(parts: torch.Tensor, order) -> torch.Tensor:
    """Sum parts [world_size, ...] as ((p[o0] + p[o1]) + ...) + p[o_last], rounding each hop.

    float32 adds rounded to bf16/fp16 equal native adds in those formats.
    """
    order = list(order)
    wide = torch.float64 if parts.dtype == torch.float64 else torch.float32
    acc = parts[order[0]].to(wide).to(parts.dtype)
    for r in order[1:]:
        acc = (acc.to(wide) + parts[r].to(wide)).to(parts.dtype)
    return acc


def fold_descending(parts: torch.Tensor) -> torch.Tensor:
    """((p[W-1] + p[W-2]) + ...) + p[0]: the single-node NCCL tree order with the chain
    0 -> 1 -> ... -> W-1 (root 0), so a fold is bit-compatible with a pinned tree all-reduce."""
    return fold_in_order(parts, range(parts.shape[0] - 1, -1, -1))


def per_destination(flat_total: torch.Tensor, sizes_elems: list[int]) -> list[torch.Tensor]:
    """Slice a full-buffer result into per-destination pieces (for order models)."""
    return [flat_total[o:o + s] for o, s in zip(offsets(sizes_elems), sizes_elems)]


def gloo_all_reduce_slices(inputs: torch.Tensor, sizes_elems: list[int], nccl=None) -> list[torch.Tensor]:
    """gloo's ring all-reduce of the whole buffer, sliced per destination."""
    return per_destination(orders.gloo_ring_all_reduce(inputs), sizes_elems)


# gloo's reduce_scatter_tensor is a ring all-reduce plus a slice, so the native control and
# the all-reduce-then-slice path accumulate alike there.
GLOO_ALL_REDUCE_SLICE = OrderModel("gloo ring all-reduce + slice", gloo_all_reduce_slices, exact=True,
                                   elementwise=True)
