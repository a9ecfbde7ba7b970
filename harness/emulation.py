"""Several NCCL ranks on the visible GPU(s), in one of two emulations (`--emulate MODE`):

* `hosts`: each rank presents itself as a host of its own.
* `single-node`: the ranks form ONE NCCL node (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1).

Emulated hosts:

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
MODES = ("hosts", "single-node")
# NCCL_MULTI_RANK_GPU_ENABLE first appears in NCCL 2.30: older NCCL ignores it and refuses
# a second rank on one GPU ("Duplicate GPU detected").
SINGLE_NODE_MIN_NCCL = (2, 30, 0)


def emulated_host_env(rank: int) -> dict[str, str]:
    """What one rank must set before its NCCL communicator is created."""
    return {"NCCL_HOSTID": f"{HOSTID_PREFIX}{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def single_node_env() -> dict[str, str]:
    """What every rank sets so that W ranks on one GPU form one NCCL node: NCCL then connects
    them through P2P on the device (CUMEM), builds the single-node rings and chain trees, and
    runs its intra-node algorithms. The algorithmic shape of one NVLink node, not its links
    (no NVLS, which stays off, nor NVLink's bandwidth)."""
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def emulation_env(mode: str, rank: int) -> dict[str, str]:
    if mode == "hosts":
        return emulated_host_env(rank)
    if mode == "single-node":
        return single_node_env()
    raise ValueError(f"unknown emulation {mode!r}; known: {', '.join(MODES)}")


def single_node_problem(version: tuple[int, int, int] | None) -> str | None:
    """Why this NCCL cannot run the single-node emulation, or None."""
    if version is not None and version >= SINGLE_NODE_MIN_NCCL:
        return None
    have = ".".join(map(str, version)) if version else "no NCCL library"
    need = ".".join(map(str, SINGLE_NODE_MIN_NCCL))
    return (f"--emulate single-node needs NCCL >= {need} (NCCL_MULTI_RANK_GPU_ENABLE), but this process runs {have}: "
            f"build NCCL >= {need} with ci/build_nccl.sh and install it with ci/use_nccl.sh (docs/gpu.md), "
            f"or use --emulate hosts")


def device_index(rank: int, visible: int) -> int:
    """Ranks go round the visible GPUs (all on cuda:0 when one is visible)."""
    return rank % max(1, visible)


@dataclass(frozen=True)
class Topology:
    """Where the ranks of a run live; part of every record and of the gate's fingerprint.

    kind: "cpu-gloo" (gloo ranks on the CPU), "emulated-hosts" (NCCL ranks sharing GPUs, one
    emulated host each), "single-node" (NCCL ranks sharing GPUs as one NCCL node), "gpus"
    (one NCCL rank per GPU).
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
        if self.kind == "single-node":
            return (f"single-node emulation: {self.ranks} ranks on {self.gpus} x {self.gpu_name} as one NCCL node, "
                    f"P2P on one device, not NVLink")
        return f"gpus: {self.ranks} ranks, one per GPU, {self.gpus} x {self.gpu_name} on {self.nodes} node(s)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "gpus": self.gpus, "nodes": self.nodes,
                "gpu_name": self.gpu_name, "describe": self.describe()}
