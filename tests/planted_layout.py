"""Test-only subjects for the layout-size properties (tests/cases/layout.toml): a TP
reduction that is the fixed tree at every size but one."""
import torch.distributed as dist

from ep_harness.reference import orders
from ep_harness.subject import register
from ep_harness.subjects.collective.common import fold_in_order
from ep_harness.subjects.collective.tree_reduce import TreeReduceScatter

PLANTED_SIZE = 4


@register
class ChainAtFour(TreeReduceScatter):
    """The balanced tree over virtual shards, except that at world size 4 the destination
    adds the four subtree sums as a chain ((p0 + p1) + p2) + p3: a W-dependent reduction
    that holds at sizes 1 and 2."""

    name = "planted_chain_at_four"
    summary = "tree over virtual shards, a chain over ranks at world size 4"
    shards_order_model = None  # no prediction: the check alone must catch it

    def order_model(self, backend):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size != PLANTED_SIZE:
            return super().reduce_scatter(out, inp, sizes, group)
        mine = sizes[rank]
        received = inp.new_empty((world_size * mine, *inp.shape[1:]))
        dist.all_to_all_single(received, inp.contiguous(), output_split_sizes=[mine] * world_size,
                               input_split_sizes=list(sizes), group=group)
        out.copy_(fold_in_order(received.view(world_size, mine, *inp.shape[1:]), range(world_size)))


__all__ = ["ChainAtFour", "orders"]
