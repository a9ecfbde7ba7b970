"""torch.distributed.reduce_scatter with a list of uneven (possibly empty) shards.

gloo reduces each list element with its own ring all-reduce; NCCL issues one reduce per
destination, each a ring chain that ends at the destination.
"""
import torch
import torch.distributed as dist

from ep_harness.nccl import models as nccl_models
from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import offsets
from ep_harness.reference import orders


def _per_shard_gloo(x, sizes, nccl=None):
    return [
        orders.gloo_ring_all_reduce(x[:, o:o + s]) if s else x.new_empty(0)
        for o, s in zip(offsets(sizes), sizes)
    ]


@register
class NativeReduceScatterV:
    name = "reduce_scatterv_native"
    family = "collective"
    summary = "native reduce_scatter over a list of uneven shards"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        shards = list(torch.split(inp, sizes))
        dist.reduce_scatter(out, [s.contiguous() for s in shards], group=group)

    def order_model(self, backend):
        if backend == "gloo":
            return OrderModel("gloo ring all-reduce per shard", _per_shard_gloo, exact=True, elementwise=True)
        return OrderModel("NCCL reduce per destination as logged (ring model)",
                          lambda x, sizes, nccl: nccl_models.reduce_scatter(x, sizes, nccl)[0], exact=True,
                          elementwise=True)
