"""All-reduce a copy of the input, then keep this rank's slice (SGLang's deterministic path).

Invariant only when the all-reduce order is the same for every element: NCCL tree with
identical trees on all channels (one NVLink node: a chain). Across nodes NCCL's double
binary tree puts different trees on even and odd channels, and the channel an element
lands in depends on its offset and the message size, so there the tree model decides.
gloo's all-reduce is a ring whose order follows the element's offset, so on gloo this path
is expected to fail the invariance checks.
"""
import torch.distributed as dist

from ep_harness.nccl import models as nccl_models
from ep_harness.subject import OrderModel, register
from ep_harness.subjects.collective.common import GLOO_ALL_REDUCE_SLICE, offsets, per_destination


@register
class AllReduceSlice:
    name = "all_reduce_slice"
    family = "collective"
    summary = "all-reduce of a clone + local slice"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        reduced = inp.clone()  # never reduce in place into the caller's buffer
        dist.all_reduce(reduced, group=group)
        rank = dist.get_rank(group)
        start = offsets(sizes)[rank]
        out.copy_(reduced[start:start + sizes[rank]])

    def order_model(self, backend):
        if backend == "gloo":
            return GLOO_ALL_REDUCE_SLICE
        return OrderModel("NCCL all-reduce as logged (tree model over the logged trees) + slice",
                          lambda x, sizes, nccl: per_destination(nccl_models.all_reduce(x, nccl)[0], sizes),
                          exact=True, elementwise=True)
