"""A recording fake of deep_ep's buffers for one rank (world size 1): it records what the
adapters pass (dtypes, layouts, options) and answers with what DeepEP's API returns (v1.2.1's
Buffer, v2.1.0's ElasticBuffer, read from deepseek-ai/DeepEP dd758ca), so the adapters' wiring
runs on the CPU. It stands for the GPUs absent here and is not DeepEP: no kernels (only
profiler ranges named like them), no communication."""
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


class EPHandle:
    """v2's handle, with the fields the adapter reads (deep_ep/buffers/elastic.py EPHandle)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class ElasticBuffer:
    """v2.1.0's ElasticBuffer for one rank (deep_ep/buffers/elastic.py at dd758ca), in expand
    mode: one row per (token, expert), grouped per expert in source-token order (what
    deterministic mode sorts to), each expert's segment starting at a multiple of the
    alignment; recv_topk_idx None and recv_topk_weights 1-D per row; the handle's
    recv_src_metadata [tokens received, 2 + k] (global source index, 0, then the row of each
    slot or -1). Its combine reduces as v2's kernel does with allow_multiple_reduction=False
    (reference/deepep.py expand_reduce) and, like it, takes no weights in that mode."""

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300,
                 num_gpu_timeout_secs=100, explicitly_destroy=False):
        options = dict(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                       use_fp8_dispatch=use_fp8_dispatch, deterministic=deterministic,
                       allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction,
                       explicitly_destroy=explicitly_destroy)
        CALLS.append(("ElasticBuffer", options))
        self.options = options

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None,
                 do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False):
        CALLS.append(("ElasticBuffer.dispatch", {**_describe(x), "do_expand": do_expand, "do_cpu_sync": do_cpu_sync,
                                                 "expert_alignment": expert_alignment,
                                                 "num_max_tokens_per_rank": num_max_tokens_per_rank,
                                                 "topk_idx_dtype": topk_idx.dtype}))
        assert do_expand, "the fake models expand mode only"
        assert self.options["use_fp8_dispatch"] == isinstance(x, tuple), "buffer sized for the other wire dtype"
        rows, sf = x if isinstance(x, tuple) else (x, None)
        align = expert_alignment or 1
        with kernel("void deep_ep::elastic::dispatch_impl<true, true, false, 4>"), \
                kernel("void deep_ep::elastic::dispatch_copy_epilogue_impl<true, false, false>"):
            counts = [int((topk_idx == e).sum()) for e in range(num_experts)]
            starts, total = [], 0
            for c in counts:
                starts.append(total)
                total += -(-c // align) * align
            recv_x = rows.new_zeros((total, rows.shape[1]))
            recv_sf = None if sf is None else sf.new_zeros((total, sf.shape[1]))
            recv_w = torch.full((total,), float("nan"))  # padding slots are not written
            received = (topk_idx >= 0).any(dim=1).nonzero().flatten()
            meta = torch.full((received.numel(), 2 + topk_idx.shape[1]), -1, dtype=torch.int32)
            filled = list(starts)
            for i, t in enumerate(received.tolist()):
                meta[i, 0], meta[i, 1] = t, 0  # rank 0: global index = token
                for j, e in enumerate(topk_idx[t].tolist()):
                    if e >= 0:
                        r = filled[e]
                        filled[e] += 1
                        recv_x[r], recv_w[r], meta[i, 2 + j] = rows[t], topk_weights[t, j], r
                        if sf is not None:
                            recv_sf[r] = sf[t]
            handle = EPHandle(do_expand=True, num_experts=num_experts, expert_alignment=align,
                              num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=4, topk_idx=topk_idx.clone(),
                              psum_num_recv_tokens_per_expert=torch.tensor(
                                  [s + c for s, c in zip(starts, counts)], dtype=torch.int32),
                              num_unaligned_recv_tokens_per_expert=torch.tensor(counts, dtype=torch.int32),
                              psum_num_recv_tokens_per_scaleup_rank=torch.tensor([received.numel()], dtype=torch.int32),
                              recv_src_metadata=meta)
        out = (recv_x, recv_sf) if sf is not None else recv_x
        return out, None, recv_w, handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False):
        from ep_harness.reference.deepep import expand_reduce

        CALLS.append(("ElasticBuffer.combine", {"dtype": x.dtype, "topk_weights": topk_weights}))
        assert x.dtype == torch.bfloat16
        assert topk_weights is None or self.options["allow_multiple_reduction"], \
            "expand mode with one reduction takes no weights"
        with kernel("void deep_ep::elastic::combine_impl<true, false>"), \
                kernel("void deep_ep::elastic::combine_reduce_epilogue_impl<true, false>"):
            tokens = handle.topk_idx.shape[0]
            out = torch.zeros((tokens, x.shape[1]), dtype=torch.bfloat16)
            for i, t in enumerate(handle.recv_src_metadata[:, 0].tolist()):
                slots = handle.recv_src_metadata[i, 2:].tolist()
                rows = torch.stack([x[r] if r >= 0 else torch.zeros(x.shape[1], dtype=x.dtype) for r in slots])
                out[t] = expand_reduce(rows, [r >= 0 for r in slots])
            return out, None, None

    def destroy(self):
        CALLS.append(("ElasticBuffer.destroy", {}))


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
