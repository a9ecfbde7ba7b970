"""All-gather every rank's input (pure copies), then fold this rank's shard in a fixed order."""
import torch.distributed as dist

from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import all_gather_single, fold_descending, offsets
from ep_harness.reference import orders


def _model(x, sizes, nccl=None):
    folded = orders.chain_fold(x, list(range(x.shape[0] - 1, -1, -1)))
    return [folded[o:o + s] for o, s in zip(offsets(sizes), sizes)]


def shard_of_every_rank(inp, sizes, group):
    """[W, sizes[rank], ...]: this rank's shard of every rank's input, all-gathered (pure copies)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = inp.new_empty((world_size * inp.shape[0], *inp.shape[1:]))
    all_gather_single(gathered, inp.contiguous(), group=group)
    start = offsets(sizes)[rank]
    return gathered.view(world_size, *inp.shape)[:, start:start + sizes[rank]]


@register
class AllGatherFold:
    name = "all_gather_fold"
    family = "collective"
    summary = "all-gather + fixed-order fold"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        out.copy_(fold_descending(shard_of_every_rank(inp, sizes, group)))

    def order_model(self, backend):
        return OrderModel("fixed fold W-1..0", _model, exact=True, elementwise=True)


FOLD_MODEL = _model
