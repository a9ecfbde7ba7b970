"""Test-only stage subjects with a divergence planted at one layer, for the model probe's
localiser. Registered through a suite's `plugins`, as a third-party subject would be."""
import torch
import torch.distributed as dist

from ep_harness.subject import register
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher


@register
class CombineReordersInOneLayer(TorchAllToAllDispatcher):
    """The torch dispatcher whose combine, in layer 3 only, sums the top-k slots in arrival
    order (this rank's experts first, then round the ring) rounding to bf16 after each slot,
    as a combine reducing in the wire dtype as rows arrive would: the order follows the
    token's rank, which follows the batch. Every other layer combines in slot order. The
    model names the layer in the dispatch config."""

    name = "planted_layer3_combine"
    summary = "combine that sums in arrival order in layer 3 only"
    planted_layer = 3

    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        self.layer, self.topk_idx = cfg.layer, topk_idx
        self.per_rank = cfg.num_experts // dist.get_world_size(group)
        return super().dispatch(x, topk_idx, topk_weights, cfg, group)

    def fold(self, slots, weights, group):
        if self.layer != self.planted_layer:
            return super().fold(slots, weights, group)
        rank, world, k = dist.get_rank(group), dist.get_world_size(group), weights.shape[1]
        hops = torch.where(self.topk_idx >= 0, (self.topk_idx // self.per_rank - rank) % world, world)
        order = torch.sort(hops * k + torch.arange(k, device=hops.device), dim=1).indices
        acc = torch.zeros_like(slots[:, 0])
        for j in range(k):
            pick = order[:, j]
            term = weights.gather(1, pick.unsqueeze(1)).float() * slots[torch.arange(slots.shape[0]), pick]
            acc = (acc + term).to(torch.bfloat16).float()
        return acc


@register
class CombineReordersInNoLayer(CombineReordersInOneLayer):
    """The same subject planted in a layer the model does not have: the control that the
    planted order, not the plugin's wiring, makes the difference."""

    name = "planted_no_layer_combine"
    summary = "the layer-3 planted combine, planted nowhere"
    planted_layer = None


def _rounded(a, b):
    """a @ b.T summed in float64 and rounded once to bf16: the same bits whatever M is."""
    return (a.double() @ b.double().T).to(torch.bfloat16)


@register
class Bf16SplitKPastFewRows:
    """An expert GEMM whose output for a row depends on how many rows share its expert: past
    `rows` it sums the two K halves as separate bf16 products (a split-K with bf16 partials
    that kicks in with M), as a library choosing its kernel by M might."""

    name = "planted_bf16_split_k"
    family = "gemm"
    summary = "expert GEMM that splits K into bf16 halves past 8 rows"
    layouts = ("contiguous",)
    dtypes = ("bfloat16",)
    rows = 8

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        half = problem.a.shape[1] // 2
        for g, count in enumerate(problem.counts):
            s = problem.starts[g]
            a, b = problem.a[s:s + count], problem.b[g]
            if count > self.rows:
                d = (_rounded(a[:, :half], b[:, :half]).float() + _rounded(a[:, half:], b[:, half:]).float())
                out[s:s + count] = d.to(torch.bfloat16)
            else:
                out[s:s + count] = _rounded(a, b)
