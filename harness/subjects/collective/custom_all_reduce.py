"""An inference engine's custom all-reduce, as the control that shows why the TP reduction
is pinned to NCCL with custom all-reduce disabled.

Engines (SGLang, vLLM) ship their own TP all-reduce kernels: up to a size threshold a
one-shot kernel in which every rank reads every peer's buffer and sums in rank order, above
it a two-shot kernel (reduce-scatter, then all-gather). The summation order, and so a
token's bits, change when the message crosses the threshold. This subject does the same
over torch.distributed: one-shot = all-gather + fold in rank order 0..W-1; two-shot = the
backend's reduce-scatter + all-gather; then this rank's slice.
"""
import torch
import torch.distributed as dist

from ep_harness.nccl import models as nccl_models
from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import all_gather_single, fold_in_order, offsets, per_destination, reduce_scatter_single
from ep_harness.reference import orders

ONE_SHOT_MAX_BYTES = 256 << 10  # per-rank message size up to which the one-shot path runs


def one_shot(nbytes: int) -> bool:
    return nbytes <= ONE_SHOT_MAX_BYTES


def _padded(flat: torch.Tensor, world_size: int) -> torch.Tensor:
    """[.., N] zero-padded to a multiple of world_size (two-shot splits the buffer evenly)."""
    pad = -flat.shape[-1] % world_size
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def _predict(x: torch.Tensor, sizes: list[int], nccl) -> list[torch.Tensor]:
    world_size, n = x.shape
    if one_shot(n * x.element_size()):
        total = orders.chain_fold(x, list(range(world_size)))
    else:
        padded = _padded(x, world_size)
        chunk = padded.shape[1] // world_size
        if nccl is None:  # gloo's reduce-scatter is its ring all-reduce + slice
            total = orders.gloo_ring_all_reduce(padded)[:n]
        else:
            total = torch.cat(nccl_models.reduce_scatter(padded, [chunk] * world_size, nccl)[0])[:n]
    return per_destination(total, sizes)


@register
class CustomAllReduce:
    name = "custom_all_reduce"
    family = "collective"
    summary = f"engine-style custom all-reduce (one-shot up to {ONE_SHOT_MAX_BYTES >> 10} KiB, two-shot above) + slice"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        flat = inp.contiguous().view(-1)
        if one_shot(flat.numel() * flat.element_size()):
            gathered = flat.new_empty(world_size * flat.numel())
            all_gather_single(gathered, flat, group=group)
            total = fold_in_order(gathered.view(world_size, -1), range(world_size))
        else:
            padded = _padded(flat, world_size)
            mine = padded.new_empty(padded.numel() // world_size)
            reduce_scatter_single(mine, padded, group=group)
            total = padded.new_empty(padded.numel())
            all_gather_single(total, mine, group=group)
            total = total[:flat.numel()]
        start = offsets(sizes)[rank]
        out.copy_(total.view(inp.shape)[start:start + sizes[rank]])

    def order_model(self, backend):
        return OrderModel("one-shot fold 0..W-1 / two-shot reduce-scatter model, by message size", _predict,
                          exact=True, elementwise=True)
