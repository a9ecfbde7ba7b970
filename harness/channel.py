"""The launchers <-> ranks channel of a run: JSON values under one namespace of a
torch.distributed TCPStore.

The head node's launcher hosts the store (on a multi-node run, at the rendezvous endpoint,
where torchrun's c10d rendezvous uses it too); every rank and every other node's launcher
is a client. So no file crosses a host: the job, each rank's progress, errors and stack
dumps, rank 0's records, the node launchers' heartbeats and which launch each node should
start all travel through the store, and only the head node writes the run directory.

Keys, under `ep-harness/<run>/`:

    current                 (at the root) the run the head serves
    launch/<k>              the head's k-th launch: its namespace, env, ranks per node (or done)
    node/<n>                a follower launcher's heartbeat and host
    node/<n>/launch/<k>     how node n's torchrun of launch k ended; node/<n>/done
    <launch ns>/job         the checks, the first one to run, and the settings of a launch
    <launch ns>/progress/<rank>, error/<rank>, stack/<rank>, record/<index>, ranks (the
    fingerprints), nccl-topology, abort, stacks-requested
"""
from __future__ import annotations

import datetime
import json
import os
import time

ROOT = "ep-harness"
CONNECT_TIMEOUT_S = 300.0


def tcp_store(host: str, port: int, is_master: bool, timeout_s: float = CONNECT_TIMEOUT_S):
    """A TCPStore server (the head's launcher) or client (ranks, other nodes' launchers)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=is_master, wait_for_workers=False, multi_tenant=is_master,
                    timeout=datetime.timedelta(seconds=timeout_s))


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT")
    return host, int(port)


class Channel:
    """One namespace of the store; values are JSON."""

    def __init__(self, store, namespace: str):
        self.store, self.namespace = store, namespace

    def key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def put(self, name: str, value) -> None:
        self.store.set(self.key(name), json.dumps(value))

    def has(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def get(self, name: str, default=None):
        """The value, or `default` while the key does not exist (never blocks)."""
        key = self.key(name)
        if not self.store.check([key]):
            return default
        return json.loads(self.store.get(key))

    def wait(self, name: str, timeout_s: float, poll_s: float = 0.2):
        """The value once the key exists; None after `timeout_s`."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = self.get(name)
            if value is not None:
                return value
            time.sleep(poll_s)
        return None

    def add(self, name: str, amount: int = 1) -> int:
        return self.store.add(self.key(name), amount)

    def count(self, name: str) -> int:
        return self.add(name, 0)


def run_channel(store, run: str) -> Channel:
    return Channel(store, f"{ROOT}/{run}")


def current_run(store) -> str | None:
    """The run a head launcher is serving at this store (what a node joining it should follow)."""
    key = f"{ROOT}/current"
    return store.get(key).decode() if store.check([key]) else None


def publish_run(store, run: str) -> None:
    store.set(f"{ROOT}/current", run)


def local_node() -> str:
    """This node's name on records: the launcher's --node-rank (or Slurm's node id)."""
    return os.environ.get("EP_HARNESS_NODE") or os.environ.get("SLURM_NODEID") or "0"
