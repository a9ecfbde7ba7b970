"""DeepEP adapters, written against its documented Python API (deep_ep 2.x, and the v1
`Buffer` it still ships). Import-guarded: where deep_ep cannot be imported the records are
skipped with the exact import error. On this project's GPU image no sgl-deep-ep wheel
imports (they need torch 2.13/2.14 and NCCL >= 2.30); the wiring below is verified on the
CPU against a recording fake of the buffers (tests/fake_deep_ep.py).

* deepep_v2: `ElasticBuffer(..., use_fp8_dispatch, deterministic=True,
  allow_multiple_reduction=False)`, expand mode: rows grouped per local expert, padded to
  the alignment (DeepGEMM's contiguous layout); one reduction in combine, so the result
  does not depend on the EP size.
* deepep_v1: `Buffer` normal mode: per-token receive, grouped here per local expert.
* deepep_v1_ll: `Buffer` low-latency mode: the masked layout [E_local, T * R, H].
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from harness.subject import register
from harness.gemm_problem import aligned_starts
from harness.subjects.dispatch.common import Received, quantize_wire
from harness.subjects.dispatch.wire import check_buffer_option, resolve_wire_dtype

_import: dict = {}


def deep_ep():
    if "module" not in _import:
        try:
            _import["module"] = importlib.import_module("deep_ep")
        except Exception as exc:  # ABI mismatches surface as OSError/ImportError/RuntimeError
            _import["module"], _import["error"] = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    if _import["module"] is None:
        raise ImportError(_import["error"])
    return _import["module"]


class _DeepEP:
    family = "dispatch"
    module = staticmethod(deep_ep)  # tests swap in the recording fake

    def __init__(self):
        self._buffers = {}
        self._last = None  # (buffer, DeepEP handle) of the latest dispatch, for its combine

    def unavailable(self, platform, params):
        try:
            resolve_wire_dtype(params.get("expert_quant", "bf16"), params.get("wire", "auto"))
        except ValueError as exc:
            return str(exc)
        if platform.device != "cuda":
            return "DeepEP needs NVIDIA GPUs; this run is on the CPU"
        try:
            self.module()
        except ImportError as exc:
            return f"deep_ep cannot be imported ({exc}); DeepEP needs torch >= 2.13 and NCCL >= 2.30 here"
        return None

    def buffer(self, group, cfg, wire):
        key = (id(group), cfg["hidden"], cfg["topk"], wire)
        if key not in self._buffers:
            self._buffers[key] = self.make_buffer(group, cfg, wire)
        return self._buffers[key]

    @staticmethod
    def valid_rows(expert_out, handle: Received) -> torch.Tensor:
        """The expert outputs of real (not padding) rows, in the grouped order."""
        return expert_out.reshape(-1, expert_out.shape[-1])[handle.grouped_layout >= 0]

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        wire = resolve_wire_dtype(cfg["expert_quant"], cfg.get("wire", "auto"))
        buf = self.buffer(group, cfg, wire)
        payload = quantize_wire(x, cfg.get("ue8m0", True)) if wire == "fp8" else x
        received, handle = self.send(buf, payload, topk_idx, topk_weights, cfg, dist.get_world_size(group))
        self._last = (buf, handle)
        return received


def _grouped(rows, scale, local, per_rank, alignment) -> tuple[Received, torch.Tensor]:
    """Group received rows per local expert (stable), padded to `alignment`; also return the
    permutation applied (grouped row i was received row order[i]). DeepEP does not expose
    each row's source, so the source fields stay -1."""
    order = torch.sort(local, stable=True).indices
    rows, local = rows[order], local[order]
    counts = [int((local == e).sum()) for e in range(per_rank)]
    starts, total = aligned_starts(counts, alignment)
    where = torch.cat([torch.arange(starts[e], starts[e] + counts[e]) for e in range(per_rank)]).to(rows.device)
    x = rows.new_zeros((total, rows.shape[1]))
    x[where] = rows
    gl = torch.full((total,), -1, dtype=torch.int32, device=rows.device)
    gl[where] = local.to(torch.int32)
    unknown = torch.full((total,), -1, dtype=torch.int64, device=rows.device)
    sc = None
    if scale is not None:
        sc = scale.new_zeros((total, scale.shape[1]))
        sc[where] = scale[order]
    return Received("contiguous", x, sc, counts, starts, unknown, unknown.clone(), unknown.clone(),
                    grouped_layout=gl), order


@register
class DeepEPElastic(_DeepEP):
    name = "deepep_v2"
    summary = "DeepEP ElasticBuffer, expand mode, deterministic, one combine reduction"

    def make_buffer(self, group, cfg, wire):
        use_fp8 = wire == "fp8"
        check_buffer_option(wire, use_fp8)
        return self.module().ElasticBuffer(
            group, num_max_tokens_per_rank=cfg["tokens_max"], hidden=cfg["hidden"], num_topk=cfg["topk"],
            use_fp8_dispatch=use_fp8, deterministic=True, allow_multiple_reduction=False)

    def send(self, buf, payload, topk_idx, topk_weights, cfg, world):
        recv_x, recv_idx, _, handle, _ = buf.dispatch(
            payload, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=cfg["num_experts"],
            expert_alignment=cfg["alignment"], do_expand=True)
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        per_rank = cfg["num_experts"] // world
        received, self._order = _grouped(rows, scale, recv_idx.reshape(-1).to(torch.long) % per_rank, per_rank,
                                         cfg["alignment"])
        return received, handle

    def combine(self, expert_out, handle, topk_weights, group):
        buf, ep_handle = self._last
        grouped = self.valid_rows(expert_out, handle)
        rows = torch.empty_like(grouped)
        rows[self._order] = grouped  # back to the order DeepEP delivered them in
        combined, _, _ = buf.combine(rows, ep_handle, topk_weights=topk_weights)
        return combined


@register
class DeepEPNormal(_DeepEP):
    name = "deepep_v1"
    summary = "DeepEP Buffer, normal (high-throughput) mode"

    def make_buffer(self, group, cfg, wire):
        return self.module().Buffer(group, num_nvl_bytes=cfg.get("nvl_bytes", 1 << 30))

    def send(self, buf, payload, topk_idx, topk_weights, cfg, world):
        per_token, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, cfg["num_experts"])
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            payload, num_tokens_per_rank=per_token, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=cfg["alignment"])
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        tokens, slots = (recv_idx >= 0).nonzero(as_tuple=True)  # one row per (token, local expert)
        per_rank = cfg["num_experts"] // world
        received, order = _grouped(rows[tokens], None if scale is None else scale[tokens],
                                   recv_idx[tokens, slots], per_rank, cfg["alignment"])
        self._rows_of = (tokens[order], slots[order], recv_w, rows.shape[0])
        return received, handle

    def combine(self, expert_out, handle, topk_weights, group):
        """Normal-mode combine adds per-token partials without weights, so each rank first
        forms its weighted partial per received token, in slot order, in float32."""
        buf, ep_handle = self._last
        tokens, slots, recv_w, n_tokens = self._rows_of
        y = self.valid_rows(expert_out, handle).float()
        partial = y.new_zeros((n_tokens, y.shape[1]))
        for k in range(recv_w.shape[1]):
            sel = slots == k
            partial[tokens[sel]] += recv_w[tokens[sel], k].unsqueeze(1).float() * y[sel]
        combined, _, _ = buf.combine(partial.to(expert_out.dtype), ep_handle)
        return combined


@register
class DeepEPLowLatency(_DeepEP):
    name = "deepep_v1_ll"
    summary = "DeepEP Buffer, low-latency mode (masked layout)"

    def make_buffer(self, group, cfg, wire):
        return self.module().Buffer(group, num_rdma_bytes=cfg.get("rdma_bytes", 1 << 30), low_latency_mode=True,
                                    num_qps_per_rank=cfg["num_experts"] // dist.get_world_size(group))

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        wire = resolve_wire_dtype(cfg["expert_quant"], cfg.get("wire", "auto"))
        buf = self.buffer(group, cfg, wire)
        self._topk_idx = topk_idx
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            x, topk_idx, cfg["tokens_max"], cfg["num_experts"], use_fp8=wire == "fp8")  # quantizes itself
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        self._last = (buf, handle)
        counts = recv_count.tolist()
        unknown = torch.full((rows.shape[0] * rows.shape[1],), -1, dtype=torch.int64, device=rows.device)
        return Received("masked", rows, scale, counts, [0] * len(counts), unknown, unknown.clone(), unknown.clone(),
                        masked_m=recv_count.to(torch.int32))

    def combine(self, expert_out, handle, topk_weights, group):
        buf, ep_handle = self._last
        combined, _, _ = buf.low_latency_combine(expert_out, self._topk_idx, topk_weights, ep_handle)
        return combined
