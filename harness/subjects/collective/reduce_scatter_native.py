"""torch.distributed.reduce_scatter_tensor: the backend's own reduce-scatter (the control).

NCCL's ring sums the chunk that ends on rank d starting at d's ring successor, and PAT (its
choice for small messages at one rank per node) sums along a tree rooted at d: either way
a token's bits depend on its destination rank. gloo implements it as a ring all-reduce plus
a slice.
"""
import torch.distributed as dist

from ep_harness.nccl import models as nccl_models
from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import GLOO_ALL_REDUCE_SLICE, reduce_scatter_single


@register
class NativeReduceScatter:
    name = "reduce_scatter_native"
    family = "collective"
    summary = "native reduce_scatter_tensor"

    def unavailable(self, platform, params):
        if params.shards != "even":
            return "reduce_scatter_tensor needs equal shards; uneven shards are reduce_scatterv_native"
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        reduce_scatter_single(out, inp, group=group)

    def order_model(self, backend):
        if backend == "gloo":
            return GLOO_ALL_REDUCE_SLICE
        return OrderModel("NCCL reduce-scatter as logged (ring or PAT model)",
                          lambda x, sizes, nccl: nccl_models.reduce_scatter(x, sizes, nccl)[0], exact=True,
                          elementwise=True)
