"""Where a run's ranks live: one node, or several meeting at the head's endpoint.

Torch-free, so that the command line rejects bad node options before torch loads."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from harness.channel import parse_endpoint
from harness.errors import HarnessError

# How long ranks may take to start, and other nodes to join (EP_HARNESS_START_TIMEOUT_S).
START_TIMEOUT_S = float(os.environ.get("EP_HARNESS_START_TIMEOUT_S", "180"))


@dataclass(frozen=True)
class Nodes:
    """Where a run's ranks live. One node by default (the job's world size on it); several:
    nnodes x nproc_per_node ranks meeting at the head's `endpoint` (torchrun's c10d
    rendezvous), started by one launcher per node (`torchrun`) or by srun (`slurm`)."""

    nnodes: int = 1
    nproc_per_node: int | None = None
    endpoint: str | None = None
    node_rank: int = 0
    launcher: str = "torchrun"

    @property
    def multi(self) -> bool:
        return self.nnodes > 1 or self.launcher == "slurm"

    @property
    def ranks(self) -> int | None:
        return self.nnodes * self.nproc_per_node if self.nproc_per_node else None

    def validate(self) -> "Nodes":
        if self.launcher not in ("torchrun", "slurm"):
            raise HarnessError(f"--launcher {self.launcher!r}: use torchrun or slurm")
        if self.nnodes < 1 or (self.nproc_per_node is not None and self.nproc_per_node < 1):
            raise HarnessError(f"--nnodes {self.nnodes} --nproc-per-node {self.nproc_per_node}: both must be >= 1")
        if self.launcher == "slurm" and shutil.which("srun") is None:
            raise HarnessError("--launcher slurm needs srun on PATH: run it inside a Slurm allocation "
                               "(ci/slurm/ep-harness.sbatch), or use --launcher torchrun")
        if self.multi and self.nproc_per_node is None:
            raise HarnessError("a multi-node run needs --nproc-per-node P (ranks per node); world size = NNODES x P")
        if self.nnodes > 1 and self.launcher == "torchrun" and not self.endpoint:
            raise HarnessError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the head node, node rank 0, "
                               f"hosts it; every node passes the same one)")
        if not 0 <= self.node_rank < self.nnodes:
            raise HarnessError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} for --nnodes {self.nnodes}")
        if self.endpoint:
            try:
                parse_endpoint(self.endpoint)
            except ValueError as exc:
                raise HarnessError(f"--rdzv-endpoint: {exc}; e.g. --rdzv-endpoint node0.example:29400") from None
        return self
