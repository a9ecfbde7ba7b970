"""The launchers <-> ranks channel of a run: JSON values under one namespace of a
torch.distributed TCPStore.

The head node's launcher hosts the store (on a multi-node run, at the rendezvous endpoint,
where torchrun's c10d rendezvous uses it too); every rank and every other node's launcher
is a client. So no file crosses a host: the job, each rank's progress, errors and stack
dumps, rank 0's records, the node launchers' heartbeats and which launch each node should
start all travel through the store, and only the head node writes the run directory.

Every value is signed: an HMAC-SHA256, under the run's secret, over its key and its JSON
(EP_HARNESS_RUN_SECRET in the ranks' environment; the head draws one per run, or takes
`--run-secret`, which the other nodes must be given). The store itself is unauthenticated:
anything that reaches its port can write to it, and a value that is not signed with the
run's secret is never taken for the head's (or a rank's) word.

The keys and the messages under them: harness/launch/protocol.py.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import time

from ep_harness.launch import protocol
from ep_harness.errors import HarnessError

CONNECT_TIMEOUT_S = 300.0
SECRET_ENV = "EP_HARNESS_RUN_SECRET"
RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{4}")  # ep_harness.run.verify.new_run_id


class Forged(HarnessError):
    """A value in the store that the run's secret did not sign."""


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


def _mac(secret: str, key: str, payload: str) -> str:
    return hmac.new(secret.encode(), f"{key}\0{payload}".encode(), hashlib.sha256).hexdigest()


class Channel:
    """One namespace of the store; values are JSON, signed with `secret` where there is one.

    strict: a value the secret did not sign raises Forged (a follower, a rank: refuse the
    job); otherwise it reads as absent and its key is kept in `forged` (the head: a forged
    progress or record never counts, and the run goes on to its end). Likewise a message
    that `read` finds malformed raises protocol.Malformed, or reads as absent with its
    one-line reason kept in `malformed` (this namespace's own: the head fails the launch)."""

    def __init__(self, store, namespace: str, secret: str | None = None, strict: bool = True, forged=None):
        self.store, self.namespace, self.secret, self.strict = store, namespace, secret, strict
        self.forged: list[str] = [] if forged is None else forged
        self.malformed: dict[str, str] = {}  # key -> why it is not the message it should be

    def sub(self, name: str) -> "Channel":
        """The namespace `name` under this one, with the same secret and policy."""
        return Channel(self.store, self.key(name), self.secret, self.strict, self.forged)

    def key(self, name: str) -> str:
        return protocol.join(self.namespace, name)

    def put(self, name: str, value) -> None:
        key, payload = self.key(name), json.dumps(value)
        self.store.set(key, f"{_mac(self.secret, key, payload)}:{payload}" if self.secret else payload)

    def has(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def get(self, name: str, default=None):
        """The value, or `default` while the key does not exist (never blocks)."""
        key = self.key(name)
        if not self.store.check([key]):
            return default
        raw = self.store.get(key).decode("utf-8", errors="replace")
        if self.secret is None:
            return json.loads(raw)
        mac, _, payload = raw.partition(":")
        if hmac.compare_digest(mac, _mac(self.secret, key, payload)):
            return json.loads(payload)
        if self.strict:
            raise Forged(f"{key} in the run's store is not signed with this run's secret (another head, a wrong "
                         f"--run-secret, or a forgery); refusing it")
        if key not in self.forged:
            self.forged.append(key)
        return default

    def read(self, name: str, kind: type[protocol.Message]):
        """The message of type `kind` under `name`, or None while there is none."""
        value = self.get(name)
        if value is None:
            return None
        try:
            return kind.from_wire(value, self.key(name))
        except protocol.Malformed as exc:
            if self.strict:
                raise
            self.malformed.setdefault(self.key(name), str(exc))
            return None

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


def run_channel(store, run: str, secret: str | None = None, strict: bool = True) -> Channel:
    return Channel(store, protocol.run_namespace(run), secret, strict)


def current_run(store) -> str | None:
    """The run a head launcher is serving at this store (what a node joining it should follow)."""
    return store.get(protocol.CURRENT).decode() if store.check([protocol.CURRENT]) else None


def publish_run(store, run: str) -> None:
    store.set(protocol.CURRENT, run)


def local_node() -> str:
    """This node's name on records: the launcher's --node-rank (or Slurm's node id)."""
    return os.environ.get("EP_HARNESS_NODE") or os.environ.get("SLURM_NODEID") or "0"
