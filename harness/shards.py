"""Virtual TP shards (the layout-size properties, docs/layout-invariance.md): how a rank's fixed
virtual shards reach a TP reduction. Shared by the layout families' runs and the composed MoE
and model subjects, so it sits below both (a subject imports no family module).
"""
from __future__ import annotations

import torch

from ep_harness.subject import hook


def local_partial(shards: torch.Tensor) -> torch.Tensor:
    """[k, ...] -> [...]: the rank's shards summed in float32 in order, rounded once (as
    ep_harness.reference.orders.block_partials)."""
    wide = torch.float64 if shards.dtype == torch.float64 else torch.float32
    acc = shards[0].to(wide)
    for s in shards[1:]:
        acc = acc + s.to(wide)
    return acc.to(shards.dtype)


def reduce_shards(subject, out: torch.Tensor, shards: torch.Tensor, sizes_: list[int], group) -> None:
    """The TP reduction of this rank's virtual shards [k, rows, H] into `out` (its rows)."""
    own = hook(subject, "reduce_shards")
    if own is not None:
        own(out, shards, sizes_, group)
    else:
        subject.reduce_scatter(out, local_partial(shards), sizes_, group)
