"""DeepEP adapters. Import-guarded: where deep_ep cannot be imported the records are skipped
with the exact import error.

* deepep_v1: `Buffer` normal (high-throughput, intranode) mode, DeepEP v1.x. Verified on the
  lent H200 with DeepEP v1.2.1 built from source (intranode only) and 2, 4 or 8 ranks sharing
  the GPU through CUDA IPC. Received rows carry their sources (DeepEP's handle exposes them),
  grouped here per local expert (DeepGEMM's contiguous layout). The Config is built here from
  DeepEP's own defaults and recorded (its fields cannot be read back from Python). Its combine
  sums each token's per-rank partials in ascending rank order (reference/deepep.py), so it
  declares that order model, and the kernels it must launch.
* deepep_v2: `ElasticBuffer(..., deterministic=True, allow_multiple_reduction=False)`, expand
  mode (DeepEP 2.x, which needs NCCL >= 2.30.4), as SGLang uses it: written against DeepEP's
  source (dd758ca, deep_ep/buffers/elastic.py and tests/elastic/test_ep.py), verified only
  against the recording fake (tests/fake_deep_ep.py), which stands for the GPU absent here.
  Its rows carry their sources (the handle's recv_src_metadata); its combine declares the
  order model read from the kernel (reference/deepep.py), and the kernels it must launch.
* deepep_v1_ll: `Buffer` low-latency mode (the masked layout). It needs NVSHMEM with IBGDA and
  one GPU per rank; with ranks sharing a GPU it is skipped with that reason.

Every DeepEP call runs with torch's `fill_uninitialized_memory` off: under deterministic
algorithms (which the ranks enable) torch fills each new output on the compute stream while
DeepEP writes it on its own stream (DeepEP issue #589); on the H200 that combination crashed
with an illegal memory access at 4 and 8 ranks and hung at 2. The fill changes no numerics.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import torch
import torch.distributed as dist

from ep_harness.errors import first_line
from ep_harness.subject import register
from ep_harness.contracts import Received, aligned_starts, check_buffer_option, resolve_wire_dtype, wire_refusal
from ep_harness.subjects.dispatch.common import quantize_wire
from ep_harness.reference import deepep as ref_deepep

_import: dict = {}
VERSION_ENV = "EP_HARNESS_DEEPEP_VERSION"  # set by whoever built it: tag, commit, build flags

# Kernels a v1 intranode dispatch + combine must launch (substrings of their demangled names).
V1_KERNELS = ("deep_ep::layout::get_dispatch_layout", "intranode::notify_dispatch", "intranode::dispatch<",
              "intranode::cached_notify_combine", "intranode::combine<")
# DeepEP v1's own defaults (Buffer.get_dispatch_config / get_combine_config), built explicitly so
# the record can say which were used: (num_sms, nvl send chunk, nvl recv chunk, rdma send, rdma recv).
V1_CONFIGS = {2: ((20, 24, 256, 6, 128), (20, 10, 256, 6, 128)),
              4: ((20, 6, 256, 6, 128), (20, 9, 256, 6, 128)),
              8: ((20, 6, 256, 6, 128), (20, 4, 256, 6, 128))}
V1_MAX_BF16_HIDDEN = 8176  # the TMA receive path: hidden * 2 / 2 + 8 <= 8192 bytes, hidden % 16 == 0


def _defaults(world: int) -> tuple[tuple, tuple]:
    """The v1 defaults for a world size (1 only happens with the CPU fake: the 2-rank ones)."""
    return V1_CONFIGS[min(w for w in V1_CONFIGS if w >= world)]


def deep_ep():
    if "module" not in _import:
        try:
            _import["module"] = importlib.import_module("deep_ep")
        except Exception as exc:  # ABI mismatches surface as OSError/ImportError/RuntimeError
            _import["module"], _import["error"] = None, first_line(exc, None)
    if _import["module"] is None:
        raise ImportError(_import["error"])
    return _import["module"]


def version() -> str:
    """What DeepEP this is: the builder's statement, else the installed distribution."""
    stated = os.environ.get(VERSION_ENV)
    if stated:
        return stated
    try:
        from importlib.metadata import version as dist_version

        return dist_version("deep_ep")
    except Exception:
        return f"unknown (set {VERSION_ENV} when building DeepEP from source)"


@contextlib.contextmanager
def no_uninitialized_fill():
    """torch.utils.deterministic.fill_uninitialized_memory off for one DeepEP call (issue #589)."""
    import torch.utils.deterministic as det

    before = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = before


class _DeepEP:
    family = "dispatch"
    module = staticmethod(deep_ep)  # tests swap in the recording fake

    def __init__(self):
        self._buffers = {}  # one buffer per (group, shape): what a serving process keeps

    def unavailable(self, platform, params):
        if reason := wire_refusal(params.expert_quant, params.wire):
            return reason
        if platform.device != "cuda":
            return "DeepEP needs NVIDIA GPUs; this run is on the CPU"
        try:
            self.module()
        except ImportError as exc:
            return (f"deep_ep cannot be imported ({exc}); build DeepEP for this torch (docs/gpu.md) "
                    f"and put it on PYTHONPATH")
        return None

    def describe(self, params) -> dict:
        return {"deep_ep": version(), "fill_uninitialized_memory": "off around every DeepEP call (DeepEP #589)"}

    def buffer(self, group, cfg, wire):
        key = (id(group), cfg.hidden, cfg.topk, wire)
        if key not in self._buffers:
            self._buffers[key] = self.make_buffer(group, cfg, wire)
        return self._buffers[key]

    def teardown(self, ctx):
        for buf in self._buffers.values():
            if hasattr(buf, "destroy"):
                buf.destroy()  # collective: every rank of the launch calls it
        self._buffers.clear()

    @staticmethod
    def valid_rows(expert_out, handle: Received) -> torch.Tensor:
        """The expert outputs of real (not padding) rows, in the grouped order."""
        return expert_out.reshape(-1, expert_out.shape[-1])[handle.grouped_layout >= 0]

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        wire = resolve_wire_dtype(cfg.expert_quant, cfg.wire)
        buf = self.buffer(group, cfg, wire)
        payload = quantize_wire(x, cfg.ue8m0) if wire == "fp8" else x
        with no_uninitialized_fill():
            return self.send(buf, payload, topk_idx, topk_weights, cfg, group)


def _grouped(rows, scale, local, per_rank, alignment, sources=None) -> tuple[Received, torch.Tensor]:
    """Group received rows per local expert (stable), padded to `alignment`; also return the
    permutation applied (grouped row i was received row order[i]). `sources`: each received
    row's (source rank, source token, slot), or None where the backend does not say."""
    order = torch.sort(local, stable=True).indices
    rows, local = rows[order], local[order]
    counts = [int((local == e).sum()) for e in range(per_rank)]
    starts, total = aligned_starts(counts, alignment)
    where = torch.cat([torch.arange(starts[e], starts[e] + counts[e]) for e in range(per_rank)]).to(rows.device)
    x = rows.new_zeros((total, rows.shape[1]))
    x[where] = rows
    gl = torch.full((total,), -1, dtype=torch.int32, device=rows.device)
    gl[where] = local.to(torch.int32)
    src = [torch.full((total,), -1, dtype=torch.int64, device=rows.device) for _ in range(3)]
    for placed, given in zip(src, sources or ()):
        placed[where] = given[order].to(torch.int64)
    sc = None
    if scale is not None:
        sc = scale.new_zeros((total, scale.shape[1]))
        sc[where] = scale[order]
    return Received("contiguous", x, sc, counts, starts, *src, grouped_layout=gl), order


# Kernels a v2 direct (one scale-out domain) dispatch + combine must launch; hybrid mode's
# are hybrid_dispatch_impl / hybrid_combine_impl, which contain these names too.
V2_KERNELS = ("dispatch_impl<", "dispatch_copy_epilogue_impl<", "combine_impl<", "combine_reduce_epilogue_impl<")
# What the adapter sets, as SGLang's deepep_v2 dispatcher does (the record names it).
V2_OPTIONS = {"deterministic": True, "allow_multiple_reduction": False, "do_expand": True,
              "receive_sorting": "off (deterministic mode orders rows by source token)",
              "weights": "applied before combine (expand mode with one reduction takes none)"}


@register
class DeepEPElastic(_DeepEP):
    """DeepEP 2.x `ElasticBuffer` (read from deepseek-ai/DeepEP dd758ca, 2.1.0): expand mode
    delivers one row per (token, local expert), grouped per expert, each segment starting at
    a multiple of the alignment (the harness's contiguous layout as it is); its handle says
    where each came from (`recv_src_metadata[:, 0]`: src rank * num_max_tokens_per_rank +
    token; `[:, 2 + j]`: the row that holds top-k slot j, -1 off this rank). With
    allow_multiple_reduction=False combine reduces a token's rows once, unweighted, in top-k
    slot order (reference/deepep.py `expand_combined_token`), so the weights are applied here."""

    name = "deepep_v2"
    summary = "DeepEP ElasticBuffer, expand mode, deterministic, one combine reduction"
    rounds_partials = True  # each weighted row is rounded to bf16 before the reduction

    def unavailable(self, platform, params):
        reason = super().unavailable(platform, params)
        if reason is None and not hasattr(self.module(), "ElasticBuffer"):
            return (f"deep_ep {version()} has no ElasticBuffer: the v2 API is DeepEP 2.x, which needs "
                    f"NCCL >= 2.30.4")
        return reason

    def kernels(self, params):
        return V2_KERNELS

    def combine_model(self):
        return ref_deepep.expand_combined_token

    def describe(self, params) -> dict:
        return {**super().describe(params), "elastic_options": {**V2_OPTIONS, **getattr(self, "last_config", {})}}

    def make_buffer(self, group, cfg, wire):
        use_fp8 = wire == "fp8"
        check_buffer_option(wire, use_fp8)
        return self.module().ElasticBuffer(
            group, num_max_tokens_per_rank=cfg.tokens_max, hidden=cfg.hidden, num_topk=cfg.topk,
            use_fp8_dispatch=use_fp8, deterministic=True, allow_multiple_reduction=False, explicitly_destroy=True)

    def send(self, buf, payload, topk_idx, topk_weights, cfg, group):
        recv_x, _, recv_w, handle, _ = buf.dispatch(
            payload, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=cfg.num_experts,
            num_max_tokens_per_rank=cfg.tokens_max, expert_alignment=cfg.alignment, do_expand=True,
            do_cpu_sync=True)
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        counts = [int(c) for c in handle.num_unaligned_recv_tokens_per_expert.tolist()]
        ends = [int(e) for e in handle.psum_num_recv_tokens_per_expert.tolist()]  # aligned start + count
        starts = [e - c for e, c in zip(ends, counts)]
        dev, n = rows.device, rows.shape[0]
        gl = torch.full((n,), -1, dtype=torch.int32, device=dev)
        for e, (start, c) in enumerate(zip(starts, counts)):
            gl[start:start + c] = e
        meta = handle.recv_src_metadata.to(torch.int64)
        token, slot = (meta[:, 2:] >= 0).nonzero(as_tuple=True)
        where = meta[token, 2 + slot]
        src = [torch.full((n,), -1, dtype=torch.int64, device=dev) for _ in range(3)]
        for placed, given in zip(src, (meta[token, 0] // cfg.tokens_max, meta[token, 0] % cfg.tokens_max, slot)):
            placed[where] = given
        self.last_config = {"num_sms": getattr(handle, "num_sms", None), "expert_alignment": cfg.alignment,
                            "use_fp8_dispatch": scale is not None, "num_max_tokens_per_rank": cfg.tokens_max}
        return Received("contiguous", rows, scale, counts, starts, *src, grouped_layout=gl,
                        native=(buf, handle, recv_w))

    def combine(self, expert_out, handle, topk_weights, group):
        """Each row weighted here (float32 product, one bf16 rounding), then DeepEP's one
        unweighted reduction per token."""
        buf, ep_handle, recv_w = handle.native
        y = expert_out.reshape(-1, expert_out.shape[-1])
        real = (handle.grouped_layout >= 0).unsqueeze(1)  # padding rows' weights are not written
        weighted = torch.where(real, recv_w.unsqueeze(1).float() * y.float(), 0.0).to(expert_out.dtype)
        with no_uninitialized_fill():
            combined, _, _ = buf.combine(weighted, ep_handle)
        return combined


@register
class DeepEPNormal(_DeepEP):
    name = "deepep_v1"
    summary = "DeepEP Buffer, normal (high-throughput, intranode) mode"
    rounds_partials = True  # combine adds per-rank bf16 partials: one more rounding per rank

    def unavailable(self, platform, params):
        world, hidden = params.world_size, params.hidden
        if world not in V1_CONFIGS:
            return f"DeepEP's intranode kernels take 2, 4 or 8 ranks; this check has {world}"
        if hidden % 16 or hidden > V1_MAX_BF16_HIDDEN:
            return (f"hidden = {hidden}: DeepEP v1's intranode receive path takes bf16 rows up to "
                    f"{V1_MAX_BF16_HIDDEN} wide, multiples of 16")
        return super().unavailable(platform, params)

    def kernels(self, params):
        return V1_KERNELS

    def configs(self, world: int):
        dispatch, combine = _defaults(world)
        return self.module().Config(*dispatch), self.module().Config(*combine)

    def describe(self, params) -> dict:
        dispatch, combine = _defaults(params.world_size)
        fields = ("num_sms", "nvl_send_chunk", "nvl_recv_chunk", "rdma_send_chunk", "rdma_recv_chunk")
        return {**super().describe(params), "dispatch_config": dict(zip(fields, dispatch)),
                "combine_config": dict(zip(fields, combine))}

    def combine_model(self):
        """The probe's combined bits from its expert outputs, weights and experts alone."""
        return ref_deepep.combined_token

    def make_buffer(self, group, cfg, wire):
        world = dist.get_world_size(group)
        hint = max(c.get_nvl_buffer_size_hint(cfg.hidden * 2, world) for c in self.configs(world))
        return self.module().Buffer(group, num_nvl_bytes=hint, explicitly_destroy=True)

    def send(self, buf, payload, topk_idx, topk_weights, cfg, group):
        world, me = dist.get_world_size(group), dist.get_rank(group)
        dispatch_config, combine_config = self.configs(world)
        per_token, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, cfg.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            payload, num_tokens_per_rank=per_token, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=cfg.alignment, config=dispatch_config)
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        tokens, slots = (recv_idx >= 0).nonzero(as_tuple=True)  # one row per (token, local expert)
        # handle[0][s, me]: rows received from ranks 0..s (a prefix sum); handle[3]: source token
        row = torch.arange(rows.shape[0], device=rows.device)
        src_rank = torch.searchsorted(handle[0][:, me].contiguous().to(torch.int64), row, right=True)
        sources = (src_rank[tokens], handle[3].to(torch.int64)[tokens], slots)
        per_rank = cfg.num_experts // world
        received, order = _grouped(rows[tokens], None if scale is None else scale[tokens],
                                   recv_idx[tokens, slots], per_rank, cfg.alignment, sources)
        received.native = (buf, handle, combine_config, tokens[order], slots[order], recv_w, rows.shape[0])
        return received

    def combine(self, expert_out, handle, topk_weights, group):
        """Normal-mode combine adds per-token partials without weights, so each rank first
        forms its weighted partial per received token, in slot order, in float32."""
        buf, ep_handle, combine_config, tokens, slots, recv_w, n_tokens = handle.native
        y = self.valid_rows(expert_out, handle).float()
        partial = y.new_zeros((n_tokens, y.shape[1]))
        for k in range(recv_w.shape[1]):
            sel = slots == k
            partial[tokens[sel]] += recv_w[tokens[sel], k].unsqueeze(1).float() * y[sel]
        with no_uninitialized_fill():
            combined, _, _ = buf.combine(partial.to(expert_out.dtype), ep_handle, config=combine_config)
        return combined


@register
class DeepEPLowLatency(_DeepEP):
    name = "deepep_v1_ll"
    summary = "DeepEP Buffer, low-latency mode (masked layout)"

    def unavailable(self, platform, params):
        reason = super().unavailable(platform, params)
        if reason is None and platform.gpus < params.world_size:
            return (f"DeepEP's low-latency mode needs NVSHMEM with IBGDA and one GPU per rank; this run has "
                    f"{params.world_size} ranks on {platform.gpus} GPU(s)")
        return reason

    def make_buffer(self, group, cfg, wire):
        world = dist.get_world_size(group)
        rdma = self.module().Buffer.get_low_latency_rdma_size_hint(cfg.tokens_max, cfg.hidden, world,
                                                                    cfg.num_experts)
        return self.module().Buffer(group, num_rdma_bytes=rdma, low_latency_mode=True,
                                    num_qps_per_rank=cfg.num_experts // world, explicitly_destroy=True)

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        wire = resolve_wire_dtype(cfg.expert_quant, cfg.wire)
        buf = self.buffer(group, cfg, wire)
        ue8m0 = wire == "fp8" and cfg.ue8m0
        with no_uninitialized_fill():
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                x, topk_idx, cfg.tokens_max, cfg.num_experts, use_fp8=wire == "fp8",  # quantizes itself
                round_scale=ue8m0, use_ue8m0=ue8m0)
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        counts = recv_count.tolist()
        unknown = torch.full((rows.shape[0] * rows.shape[1],), -1, dtype=torch.int64, device=rows.device)
        return Received("masked", rows, scale, counts, [0] * len(counts), unknown, unknown.clone(), unknown.clone(),
                        masked_m=recv_count.to(torch.int32), native=(buf, handle, topk_idx))

    def combine(self, expert_out, handle, topk_weights, group):
        buf, ep_handle, topk_idx = handle.native
        with no_uninitialized_fill():
            combined, _, _ = buf.low_latency_combine(expert_out, topk_idx, topk_weights, ep_handle)
        return combined
