"""All-to-all each destination's rows to it, then fold in a fixed order.

The same bytes cross the wire as in a reduce-scatter, but every contribution arrives
unreduced, so the order of the sum is fixed by construction.
"""
import torch.distributed as dist

from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.all_gather_fold import FOLD_MODEL
from ep_harness.subjects.collective.common import fold_descending


@register
class AllToAllFold:
    name = "all_to_all_fold"
    family = "collective"
    summary = "all-to-all + fixed-order fold"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = sizes[rank]
        received = inp.new_empty((world_size * mine, *inp.shape[1:]))
        dist.all_to_all_single(
            received, inp.contiguous(), output_split_sizes=[mine] * world_size,
            input_split_sizes=list(sizes), group=group,
        )
        out.copy_(fold_descending(received.view(world_size, mine, *inp.shape[1:])))

    def order_model(self, backend):
        return OrderModel("fixed fold W-1..0", FOLD_MODEL, exact=True, elementwise=True)
