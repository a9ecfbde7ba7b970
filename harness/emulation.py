"""Emulated hosts: several NCCL ranks share the visible GPU(s), each presenting itself as a
host of its own.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless
they report different hosts. With a distinct NCCL_HOSTID per rank it builds one node per
rank (nNodes = W, localRanks 1) and connects them through its NET/Socket transport on the
loopback interface, so its real inter-node algorithms (ring, PAT, double binary tree),
kernels and protocols run on a single GPU. It is not an NVLink node: no P2P, SHM or NVLS,
no single-node chain tree, and no DeepEP; records say so through `Topology`.
"""
from __future__ import annotations

from dataclasses import dataclass

HOSTID_PREFIX = "ep-harness-emulated-host-"


def emulated_host_env(rank: int) -> dict[str, str]:
    """What one rank must set before its NCCL communicator is created."""
    return {"NCCL_HOSTID": f"{HOSTID_PREFIX}{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def device_index(rank: int, visible: int) -> int:
    """Ranks go round the visible GPUs (all on cuda:0 when one is visible)."""
    return rank % max(1, visible)


@dataclass(frozen=True)
class Topology:
    """Where the ranks of a run live; part of every record and of the gate's fingerprint.

    kind: "cpu-gloo" (gloo ranks on the CPU), "emulated-hosts" (NCCL ranks sharing GPUs, one
    emulated host each), "gpus" (one NCCL rank per GPU).
    """

    kind: str
    ranks: int  # the largest world size of the run
    gpus: int  # GPUs the ranks use
    nodes: int = 1  # physical machines
    gpu_name: str | None = None

    def describe(self) -> str:
        spread = f", {self.nodes} nodes of {self.ranks // self.nodes} ranks" if self.nodes > 1 else ""
        if self.kind == "cpu-gloo":
            return f"cpu-gloo: {self.ranks} gloo ranks on the CPU{spread}"
        if self.kind == "emulated-hosts":
            return (f"emulated-hosts: {self.ranks} ranks on {self.gpus} x {self.gpu_name}{spread}, "
                    f"one NCCL host per rank, NET/Socket (not an NVLink node)")
        return f"gpus: {self.ranks} ranks, one per GPU, {self.gpus} x {self.gpu_name} on {self.nodes} node(s)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "gpus": self.gpus, "nodes": self.nodes,
                "gpu_name": self.gpu_name, "describe": self.describe()}
