"""A recording fake of deep_ep's buffers for one rank (world size 1): it records what the
adapters pass (dtypes, layouts, options) and answers with what the documented API returns,
so the adapters' wiring runs on the CPU. It is not DeepEP: no kernels, no communication."""
from __future__ import annotations

import contextlib

import torch

from ep_harness.reference import quant

CALLS: list[tuple[str, dict]] = []
EMIT_KERNELS = True


def _describe(x):
    if isinstance(x, tuple):
        return {"wire": "fp8", "dtype": x[0].dtype, "scale_dtype": x[1].dtype, "scale_shape": tuple(x[1].shape)}
    return {"wire": "bf16", "dtype": x.dtype}


class _Handle:
    def __init__(self, tokens, slots):
        self.tokens, self.slots = tokens, slots


class ElasticBuffer:
    def __init__(self, group, **options):
        CALLS.append(("ElasticBuffer", options))

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, expert_alignment=None,
                 do_expand=False, **rest):
        CALLS.append(("ElasticBuffer.dispatch", {**_describe(x), "do_expand": do_expand,
                                                 "expert_alignment": expert_alignment, **rest}))
        tokens, slots = (topk_idx >= 0).nonzero(as_tuple=True)
        rows = (x[0][tokens], x[1][tokens]) if isinstance(x, tuple) else x[tokens]
        return rows, topk_idx[tokens, slots], topk_weights[tokens, slots], _Handle(tokens, slots), None

    def combine(self, x, handle, topk_weights=None, **rest):
        CALLS.append(("ElasticBuffer.combine", {"dtype": x.dtype}))
        out = torch.zeros((int(handle.tokens.max()) + 1 if handle.tokens.numel() else 0, x.shape[1]))
        for k in range(topk_weights.shape[1]):  # one reduction, in slot order
            sel = handle.slots == k
            out[handle.tokens[sel]] += topk_weights[handle.tokens[sel], k].unsqueeze(1) * x[sel].float()
        return out.to(x.dtype), None, None


class Config:
    def __init__(self, *fields):
        self.fields = fields

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return hidden_bytes * num_ranks * 1024


def kernel(name: str):
    """A profiler range named like the real kernel, so the harness's proof that DeepEP ran sees
    it on the CPU; with EMIT_KERNELS off the fake stands for a silent fallback."""
    return torch.profiler.record_function(f"{name} (fake)") if EMIT_KERNELS else contextlib.nullcontext()


class Buffer:
    """v1.2.1's intranode Buffer for one rank: one received row per token with a local expert,
    local expert ids (-1 elsewhere), weights zeroed off-rank, the handle's six tensors."""

    def __init__(self, group, **options):
        CALLS.append(("Buffer", options))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_tokens, hidden, num_ranks, num_experts):
        return num_max_tokens * hidden * num_ranks * 4

    def get_dispatch_layout(self, topk_idx, num_experts, **rest):
        with kernel("void deep_ep::layout::get_dispatch_layout<256, 4, 8>"):
            per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
            in_rank = (topk_idx >= 0).any(dim=1, keepdim=True)
            return in_rank.sum(0).to(torch.int32), None, per_expert.to(torch.int32), in_rank, None

    def dispatch(self, x, topk_idx=None, topk_weights=None, expert_alignment=1, config=None, **rest):
        CALLS.append(("Buffer.dispatch", {**_describe(x), "expert_alignment": expert_alignment, "config": config}))
        with kernel("void deep_ep::intranode::notify_dispatch<1>"), kernel("void deep_ep::intranode::dispatch<1, 768, 8192>"):
            held = (topk_idx >= 0).any(dim=1).nonzero().flatten()
            rows = (x[0][held], x[1][held]) if isinstance(x, tuple) else x[held]
            recv_idx = topk_idx[held]  # world size 1: local ids are the global ones
            recv_w = torch.where(recv_idx >= 0, topk_weights[held], torch.zeros_like(topk_weights[held]))
            n = held.numel()
            handle = (torch.tensor([[n]], dtype=torch.int32), None, None, held.to(torch.int32),
                      (topk_idx >= 0).any(dim=1, keepdim=True), None)
            return rows, recv_idx, recv_w, [], handle, None

    def combine(self, x, handle, topk_weights=None, config=None, **rest):
        CALLS.append(("Buffer.combine", {"dtype": x.dtype, "config": config}))
        with kernel("void deep_ep::intranode::cached_notify_combine<1>"), \
                kernel("void deep_ep::intranode::combine<__nv_bfloat16, 1, 768, 4096>"):
            out = torch.zeros((handle[4].shape[0], x.shape[1]), dtype=x.dtype)
            out[handle[3].long()] = x  # one rank: the sum of partials is the partial
            return out, None, None

    def destroy(self):
        CALLS.append(("Buffer.destroy", {}))

    def low_latency_dispatch(self, x, topk_idx, num_max_tokens, num_experts, use_fp8=True, round_scale=False,
                             use_ue8m0=False, **rest):
        CALLS.append(("Buffer.low_latency_dispatch", {"dtype": x.dtype, "use_fp8": use_fp8, "use_ue8m0": use_ue8m0,
                                                      "num_max_tokens": num_max_tokens}))
        rows = torch.zeros((num_experts, num_max_tokens, x.shape[1]), dtype=x.dtype)
        count = torch.zeros(num_experts, dtype=torch.int32)
        where = []
        for t in range(x.shape[0]):
            for k, e in enumerate(topk_idx[t].tolist()):
                if e >= 0:
                    rows[e, count[e]] = x[t]
                    where.append((t, k, e, int(count[e])))
                    count[e] += 1
        if use_fp8:
            q, s = quant.quantize_per_token_group(rows.view(-1, x.shape[1]), ue8m0=True)
            rows = (q.view(rows.shape), s.view(num_experts, num_max_tokens, -1))
        return rows, count, where, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **rest):
        CALLS.append(("Buffer.low_latency_combine", {"dtype": x.dtype}))
        out = torch.zeros((topk_idx.shape[0], x.shape[-1]))
        for t, k, e, i in sorted(handle, key=lambda w: (w[0], w[1])):
            out[t] += topk_weights[t, k] * x[e, i].float()
        return out.to(x.dtype), None, None
