"""An expert-parallel dispatcher on torch.distributed all-to-all (gloo or NCCL).

Dispatch sends every (token, slot) row to the rank that owns the slot's expert (expert e
lives on rank e // experts_per_rank), BF16 or FP8 + scales on the wire. Rows arrive in
(source rank, token, slot) order and are grouped per local expert in that order, so the
received layout does not depend on timing. Combine sends expert outputs back and forms
the top-k weighted sum in slot order in float32, rounding once. The handle keeps how many
rows this rank sent each rank, which is what the combine receives back from each: the combine
exchanges no counts (on CPU ranks an all-to-all is milliseconds of wake-ups).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ep_harness.contracts import Received, aligned_starts, layout_rows, resolve_wire_dtype, wire_refusal
from ep_harness.subject import register
from ep_harness.subjects.dispatch.common import quantize_wire


def _send_counts(dest: torch.Tensor, world: int) -> list[int]:
    """How many rows this rank sends to each rank (`dest`: every row's destination, sorted)."""
    return torch.bincount(dest, minlength=world).tolist() if dest.numel() else [0] * world


def _exchange_counts(dest: torch.Tensor, world: int, device, group) -> tuple[list[int], list[int]]:
    """How many rows this rank sends to each rank and how many it receives from each."""
    send_counts = _send_counts(dest, world)
    recv_counts = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_counts, torch.tensor(send_counts, dtype=torch.int64, device=device), group=group)
    return send_counts, recv_counts.tolist()


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all_single of rows; fp8 and other byte types travel as uint8."""
    raw = send.view(torch.uint8) if send.element_size() == 1 and send.dtype != torch.uint8 else send
    out = raw.new_empty((sum(recv_counts), *raw.shape[1:]))
    dist.all_to_all_single(out, raw.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out.view(send.dtype) if raw is not send else out


def _exchange_rows(parts: list[torch.Tensor], send_counts: list[int], recv_counts: list[int],
                   group) -> list[torch.Tensor]:
    """Several tensors' rows (the same rows: metadata, values, scales) in one all_to_all: each
    row's bytes side by side, split again on arrival (bytes copied, so bits kept). One exchange
    instead of one a tensor: on CPU ranks each all-to-all costs milliseconds of wake-ups."""
    as_bytes = [p.contiguous().view(torch.uint8).reshape(p.shape[0], math.prod(p.shape[1:]) * p.element_size())
                for p in parts]
    arrived = _exchange(torch.cat(as_bytes, dim=1), send_counts, recv_counts, group)
    out, column = [], 0
    for p, b in zip(parts, as_bytes):
        width = b.shape[1]
        out.append(arrived[:, column:column + width].contiguous().view(p.dtype).reshape(-1, *p.shape[1:]))
        column += width
    return out


@dataclasses.dataclass(frozen=True)
class _Handle:
    """Received.native of this dispatcher: the rows this rank sent each rank (the combine's
    receive counts) and, for a combine whose order reads them, the source's top-k choices
    and experts per rank."""

    sent: list[int]
    choices: tuple | None = None


@register
class TorchAllToAllDispatcher:
    name = "torch_a2a_dispatch"
    family = "dispatch"
    summary = "torch.distributed all-to-all dispatch, fixed-order combine"

    def unavailable(self, platform, params):
        return wire_refusal(params.expert_quant, params.wire)

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        """Weights stay on the source rank: this combine applies them where the token lives."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per_rank = cfg.num_experts // world
        wire = resolve_wire_dtype(cfg.expert_quant, cfg.wire)
        tokens, slots = (topk_idx >= 0).nonzero(as_tuple=True)  # row-major: (token, slot) order
        experts = topk_idx[tokens, slots]
        dest = experts // per_rank
        order = torch.sort(dest, stable=True).indices
        tokens, slots, experts, dest = tokens[order], slots[order], experts[order], dest[order]
        send_counts, recv_counts = _exchange_counts(dest, world, x.device, group)
        meta = torch.stack([torch.full_like(tokens, rank), tokens, slots, experts], dim=1)
        rows = x[tokens]
        scale = None
        if wire == "fp8":
            rows, scale = quantize_wire(rows, cfg.ue8m0)
            meta, rows, scale = _exchange_rows([meta, rows, scale], send_counts, recv_counts, group)
        else:
            meta, rows = _exchange_rows([meta, rows], send_counts, recv_counts, group)
        local = meta[:, 3] - rank * per_rank
        order = torch.sort(local, stable=True).indices  # group per expert, keep arrival order
        received = self._layout(cfg, per_rank, rows[order], None if scale is None else scale[order],
                                meta[order], local[order])
        received.native = _Handle(sent=send_counts)
        return received

    def _layout(self, cfg, per_rank, rows, scale, meta, local) -> Received:
        counts = [int((local == e).sum()) for e in range(per_rank)]
        hidden, dev = rows.shape[1], rows.device
        shape = layout_rows(cfg.layout, counts, cfg.alignment)
        if cfg.layout == "masked":
            starts = [0] * per_rank
            slot_of = [e * shape[1] + i for e in range(per_rank) for i in range(counts[e])]
        else:
            starts, _ = aligned_starts(counts, cfg.alignment)
            slot_of = [starts[e] + i for e in range(per_rank) for i in range(counts[e])]
        where = torch.tensor(slot_of, dtype=torch.long, device=dev)
        flat_rows = int(torch.tensor(shape).prod())
        x = torch.zeros((flat_rows, hidden), dtype=rows.dtype, device=dev)
        x.view(torch.uint8 if x.element_size() == 1 else x.dtype)[where] = (
            rows.view(torch.uint8) if rows.element_size() == 1 else rows)
        src = torch.full((flat_rows, 3), -1, dtype=torch.int64, device=dev)
        src[where] = meta[:, :3]
        sc = None
        if scale is not None:
            sc = torch.zeros((flat_rows, scale.shape[1]), dtype=scale.dtype, device=dev)
            sc[where] = scale
            sc = sc.view(*shape, scale.shape[1])
        received = Received(cfg.layout, x.view(*shape, hidden), sc, counts, starts,
                            src[:, 0], src[:, 1], src[:, 2])
        if cfg.layout == "masked":
            received.masked_m = torch.tensor(counts, dtype=torch.int32, device=dev)
        else:
            gl = torch.full((flat_rows,), -1, dtype=torch.int32, device=dev)
            gl[where] = local.to(torch.int32)
            received.grouped_layout = gl
        return received

    def combine(self, expert_out, handle: Received, topk_weights, group) -> torch.Tensor:
        """expert_out: bf16 in handle's layout -> [T, H] bf16 on every source rank."""
        world = dist.get_world_size(group)
        flat = expert_out.reshape(-1, expert_out.shape[-1])
        valid = (handle.src_rank >= 0).nonzero().flatten()
        back = torch.sort(handle.src_rank[valid], stable=True).indices
        valid = valid[back]
        dest = handle.src_rank[valid]
        if isinstance(handle.native, _Handle):  # each rank sends back what it received
            send_counts, recv_counts = _send_counts(dest, world), handle.native.sent
        else:  # a handle this dispatch did not make
            send_counts, recv_counts = _exchange_counts(dest, world, flat.device, group)
        sources = torch.stack([handle.src_token[valid], handle.src_slot[valid]], dim=1)
        meta, rows = _exchange_rows([sources, flat[valid]], send_counts, recv_counts, group)
        tokens, k = topk_weights.shape
        slots = torch.zeros((tokens, k, flat.shape[1]), dtype=torch.float32, device=flat.device)
        slots[meta[:, 0], meta[:, 1]] = rows.float()
        return self.fold(slots, topk_weights, group).to(expert_out.dtype)

    def fold(self, slots: torch.Tensor, weights: torch.Tensor, group) -> torch.Tensor:
        """sum_j w_j * y_j in slot order, float32 (empty slots hold zeros)."""
        acc = torch.zeros_like(slots[:, 0])
        for j in range(slots.shape[1]):
            acc = acc + weights[:, j:j + 1].float() * slots[:, j]
        return acc



class _KeepsChoices(TorchAllToAllDispatcher):
    """Keeps the source rank's top-k choices and experts per rank in the handle, for a
    combine whose order reads them."""

    def dispatch(self, x, topk_idx, topk_weights, cfg, group) -> Received:
        received = super().dispatch(x, topk_idx, topk_weights, cfg, group)
        received.native = dataclasses.replace(received.native,
                                              choices=(topk_idx, cfg.num_experts // dist.get_world_size(group)))
        return received

    def combine(self, expert_out, handle: Received, topk_weights, group) -> torch.Tensor:
        self._choices = handle.native.choices
        try:
            return super().combine(expert_out, handle, topk_weights, group)
        finally:
            del self._choices


@register
class ExpertOrderCombine(_KeepsChoices):
    """The EP-size fix stated as an order: a token's expert outputs are added by ascending
    expert id, w_j * y_j in float32 from +0.0, rounded once, on the token's own rank; which
    rank held an expert (the EP size) never enters the order."""

    name = "torch_a2a_expert_order"
    summary = "torch.distributed all-to-all dispatch, combine by ascending expert id"

    def fold(self, slots: torch.Tensor, weights: torch.Tensor, group) -> torch.Tensor:
        idx, _ = self._choices
        order = torch.sort(idx.masked_fill(idx < 0, torch.iinfo(idx.dtype).max), dim=1, stable=True).indices
        slots = torch.gather(slots, 1, order.unsqueeze(-1).expand_as(slots))
        return super().fold(slots, torch.gather(weights, 1, order), group)


@register
class RankReduceCombine(_KeepsChoices):
    """Control for ep-size-invariance: the combine order of a dispatcher that pre-reduces per
    rank (DeepEP v2's default; DeepEP v1 adds a token's copies in ascending rank order): each
    holding rank's w_j * y_j summed in float32 and rounded to bf16 on the wire, then the ranks'
    sums added in ascending rank order, rounded to bf16 after each add. Which slots share a
    rank is the EP size's doing."""

    name = "torch_a2a_rank_reduce"
    summary = "torch.distributed all-to-all dispatch, combine pre-reduced per holding rank (bf16 on the wire)"

    def fold(self, slots: torch.Tensor, weights: torch.Tensor, group) -> torch.Tensor:
        idx, per_rank = self._choices
        holder = torch.where(idx >= 0, idx // per_rank, -1)
        terms = weights.float().unsqueeze(-1) * slots  # [T, k, H]
        acc = None
        for rank in range(dist.get_world_size(group)):
            mine = (holder == rank).unsqueeze(-1)
            part = torch.where(mine, terms, torch.zeros_like(terms)).sum(1).to(torch.bfloat16)  # on the wire
            held = mine.any(dim=1)  # tokens with a copy on this rank: a rank without one adds nothing
            acc = part if acc is None else torch.where(held, (acc.float() + part.float()).to(torch.bfloat16), acc)
        return acc.float()
