"""Where a run's ranks live: one node, or several meeting at the head's endpoint.

Torch-free, so that the command line rejects bad node options before torch loads."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

from ep_harness.launch import settings
from ep_harness.launch.channel import parse_endpoint
from ep_harness.errors import HarnessError

# How long ranks may take to start, and other nodes to join (EP_HARNESS_START_TIMEOUT_S).
START_TIMEOUT_S = settings.seconds("EP_HARNESS_START_TIMEOUT_S")


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
    run_secret: str | None = None  # what signs the run's store (harness/launch/channel.py); never recorded

    @property
    def multi(self) -> bool:
        return self.nnodes > 1 or self.launcher == "slurm"

    @property
    def ranks(self) -> int | None:
        return self.nnodes * self.nproc_per_node if self.nproc_per_node else None

    def validate(self) -> "Nodes":
        if self.launcher not in ("torchrun", "slurm"):
            raise HarnessError(f"--launcher {self.launcher!r}: use torchrun or slurm")
        if self.nnodes < 1:
            raise HarnessError(f"--nnodes {self.nnodes}: give 1 or more nodes")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise HarnessError(f"--nproc-per-node {self.nproc_per_node}: give 1 or more ranks per node")
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
        if self.run_secret is not None and (len(self.run_secret) < 16 or not self.run_secret.isascii()
                                            or not all(c.isalnum() or c in "-_." for c in self.run_secret)):
            raise HarnessError("--run-secret must be at least 16 letters, digits, '-', '_' or '.'; "
                               "e.g. the one the head prints, or `openssl rand -hex 16`")
        if self.node_rank > 0 and self.launcher == "torchrun" and not self.run_secret:
            raise HarnessError(f"node {self.node_rank} needs --run-secret S (or EP_HARNESS_RUN_SECRET): the secret "
                               f"the head printed with the command for the other nodes, or the one it was given")
        return self

    def follower_command(self, endpoint: str, generated_secret: str | None) -> str:
        """What to run on node k of this run (the head prints it)."""
        secret = generated_secret or "<the secret given to the head>"
        return (f"ep-harness verify --nnodes {self.nnodes} --nproc-per-node {self.nproc_per_node} --rdzv-endpoint "
                f"{endpoint} --node-rank K --run-secret {secret}")


# --- what a follower must share with its head -----------------------------------------

_COMMIT: list = []


def _commit() -> str | None:
    if not _COMMIT:  # two git processes: once per launcher
        from ep_harness.environment import git_commit

        _COMMIT.append(git_commit())
    return _COMMIT[0]


def _source_hash(module: str) -> str:
    """sha256 (12 hex digits) of a plugin module's source as this node would import it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return "missing"
    with open(spec.origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def identity(plugins) -> dict:
    """What must be the same on every node of a run: the harness's version and commit, and
    the source of every plugin the run imports."""
    from ep_harness import __version__

    return {"version": __version__, "commit": _commit(), "plugins": {p: _source_hash(p) for p in sorted(plugins)}}


def identity_difference(head: dict, own_plugins=()) -> str | None:
    """One line naming how this node differs from the head's `identity`, or None."""
    if not isinstance(head, dict) or not isinstance(head.get("plugins"), dict):
        return "the head sent no identity (version, commit, plugins)"
    mine = identity([*head["plugins"], *own_plugins])
    for key, what in (("version", "harness version"), ("commit", "harness commit")):
        if head.get(key) != mine[key]:
            return f"{what} differs (here {mine[key]}, on the head {head.get(key)})"
    for plugin in sorted(mine["plugins"]):
        theirs = head["plugins"].get(plugin)
        if theirs is None:
            return f"plugin {plugin} is loaded here but not on the head"
        if theirs != mine["plugins"][plugin]:
            return f"plugin {plugin} differs (source sha256 {mine['plugins'][plugin]} here, {theirs} on the head)"
    return None
