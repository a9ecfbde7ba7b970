"""What a family executor gets to know about the rank it runs on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: Any  # torch.distributed.ProcessGroup

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def share_from_rank0(self, obj):
        """Rank 0's `obj` on every rank: how all ranks agree on one verdict."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
