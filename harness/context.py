"""What a family executor gets to know about the rank it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: Any  # torch.distributed.ProcessGroup
    nccl_algo: str | None = None  # NCCL_ALGO as this rank's NCCL reads it
    nccl_topology: Any = None  # ep_harness.nccl.log.Topology, on rank 0 of an NCCL launch
    nccl_log: Any = None  # ep_harness.nccl.log.LogTail of rank 0's own NCCL log
    # world size -> the context of ranks 0..w-1 (None on a rank outside it), for every size
    # up to this one that the launch made: what a layout-size property runs on
    subgroups: dict = field(default_factory=dict, repr=False)
    _gathers: int = field(default=0, repr=False)  # gather_on_rank0's calls in this group so far

    def layout(self, size: int) -> "RankContext | None":
        """The context of the subgroup of ranks 0..size-1 (None on a rank outside it)."""
        if size == self.world_size:
            return self
        if size not in self.subgroups:
            raise RuntimeError(f"world size {size} has no subgroup in this launch (made: {sorted(self.subgroups)}); "
                               f"the worker makes one for every size a check's layout_sizes names")
        return self.subgroups[size]

    def nccl_mark(self) -> int | None:
        return self.nccl_log.mark() if self.nccl_log is not None else None

    def nccl_calls_since(self, mark: int | None) -> list:
        """The collectives rank 0's NCCL logged since `mark` (empty off NCCL or off rank 0)."""
        return self.nccl_log.calls_since(mark) if self.nccl_log is not None and mark is not None else []

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_on_rank0(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere): what rank 0 alone
        measures travels once, and only rank 0 unpickles it. Each other rank leaves its
        pickle in the process group's store under a key of this call (the group's name and
        how many gathers it has made, the same count on every rank), and rank 0 takes and
        deletes them: on 4 gloo ranks sharing 2 cores, 1 ms and 0.8 CPU-ms where
        gather_object's all_gather of sizes and gather took 5 ms and 7 CPU-ms (a check's
        fixed cost). Rank 0's own `obj` is not copied."""
        if self.world_size == 1:
            return [obj]
        import pickle

        import torch.distributed as dist

        from ep_harness.launch.protocol import gather_key

        self._gathers += 1
        store = dist.distributed_c10d._get_default_store()
        if self.rank != 0:
            store.set(gather_key(self.group.group_name, self._gathers, self.rank), pickle.dumps(obj))
            return None
        out = [obj]
        for r in range(1, self.world_size):
            key = gather_key(self.group.group_name, self._gathers, r)
            out.append(pickle.loads(store.get(key)))  # waits for it, as long as a collective would
            store.delete_key(key)
        return out

    def _first_global_rank(self) -> int:
        """The global rank of this group's rank 0: 0 for the world and its subgroups of ranks
        0..w-1, the rank itself for a one-rank group of its own (a dealt check's)."""
        import torch.distributed as dist

        return dist.get_global_rank(self.group, 0)

    def share_from_rank0(self, obj):
        """Rank 0's `obj` on every rank: how all ranks agree on one verdict."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._first_global_rank(), group=self.group)
        return box[0]
