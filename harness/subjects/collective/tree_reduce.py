"""A TP reduction whose order does not depend on the TP size (the layout-size fix).

The logical tensor's K is cut into V fixed virtual shards whatever the world size W is
(harness/families/layout.py). Every rank adds its V / W consecutive shards as a balanced
tree (adjacent pairs, level by level, rounded to the dtype after every add), sends each
destination its rows (all-to-all: the bytes of a reduce-scatter, nothing reduced on the
wire), and the destination adds the W subtree sums as the top of the same tree. With V and
W powers of two the rank's block is an aligned subtree, so every element is the balanced
tree over the V shards in shard order, bit for bit, at any W (reference/orders.py
balanced_tree). Given one partial per rank (`reduce_scatter`) it is a balanced tree over
the ranks.
"""
import torch
import torch.distributed as dist

from ep_harness.reference import orders
from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import per_destination


def _tree_over_ranks(x, sizes, nccl=None):
    return per_destination(orders.balanced_tree(x), sizes)


def _tree_over_shards(shards, sizes, nccl=None):
    """Per-destination outputs from every virtual shard [V, N] (any W)."""
    return per_destination(orders.balanced_tree(shards), sizes)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@register
class TreeReduceScatter:
    name = "tree_reduce_scatter"
    family = "collective"
    summary = "balanced tree over fixed virtual shards (local subtree + all-to-all + top of the tree)"

    def unavailable(self, platform, params):
        if params.shards != "even":
            return "the tree's all-to-all sends equal rows to every destination; use shards = \"even\""
        if not _power_of_two(params.world_size):
            return f"a balanced tree over {params.world_size} ranks needs a power of two"
        return None

    def reduce_shards(self, out, shards, sizes, group):
        world_size = dist.get_world_size(group)
        if not (_power_of_two(shards.shape[0]) and _power_of_two(world_size)):
            raise ValueError(f"{shards.shape[0]} shards per rank at world size {world_size}: the tree needs powers "
                             f"of two (set virtual_shards and layout_sizes to powers of two)")
        self.reduce_scatter(out, orders.balanced_tree(shards), sizes, group)

    def reduce_scatter(self, out, inp, sizes, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = sizes[rank]
        received = inp.new_empty((world_size * mine, *inp.shape[1:]))
        dist.all_to_all_single(received, inp.contiguous(), output_split_sizes=[mine] * world_size,
                               input_split_sizes=list(sizes), group=group)
        out.copy_(orders.balanced_tree(received.view(world_size, mine, *inp.shape[1:])))

    def order_model(self, backend):
        return OrderModel("balanced tree over ranks", _tree_over_ranks, exact=True, elementwise=True)

    def shards_order_model(self, backend):
        return OrderModel("balanced tree over the virtual shards", _tree_over_shards, exact=True)
