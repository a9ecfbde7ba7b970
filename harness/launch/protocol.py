"""What the launchers and the ranks say to each other through the run's store: every key,
and a frozen dataclass per message with its wire form (the JSON value harness/launch/channel.py
signs and stores). No other module formats a store key (tests/test_protocol.py holds it).

A value read back is checked before it is used: a rank or node that sends something else
(another ep-harness version, a bug) gets one line naming the key and what is wrong with it
(Malformed), never a KeyError deep in the launcher. The key space, under `ep-harness/<run>/`:

    current                       (at the root) the run the head serves
    launch/<k>                    Launch: the head's k-th launch, or RunOver once it is done
    node/<n>                      NodeBeat: a follower launcher is alive
    node/<n>/refused              NodeRefusal: why node n will not run the head's launches
    node/<n>/launch/<k>           NodeExit: how node n's torchrun agent of launch k ended
    node/<n>/done                 true: node n has read RunOver
    launch<k>/job                 Job: the checks, the first one to run, the launch's settings
    launch<k>/progress/<rank>     Progress: which check a rank is in, since when, where
    launch<k>/error/<rank>        RankError: a rank's exception (or a note that SIGTERM ended it)
    launch<k>/stack/<rank>        Stack: a rank's threads, when stacks-requested was counted up
    launch<k>/record/<index>      Record: rank 0's measurement of a finished check
    launch<k>/ranks               RankEnvironments: every rank's software and hardware
    launch<k>/nccl-topology       NcclTopology: the communicator's rings and trees
    launch<k>/precompile-waited   PrecompileWaited: how long rank 0 waited for the compile
    launch<k>/abort, stacks-requested   a flag (true) and a counter (TCPStore.add)
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from ep_harness.errors import HarnessError

ROOT = "ep-harness"
CURRENT = f"{ROOT}/current"

# Names inside a launch's namespace
JOB = "job"
ABORT = "abort"
STACKS_REQUESTED = "stacks-requested"
RANKS = "ranks"
NCCL_TOPOLOGY = "nccl-topology"
PRECOMPILE_WAITED = "precompile-waited"


def run_namespace(run: str) -> str:
    return f"{ROOT}/{run}"


def join(namespace: str, name: str) -> str:
    """The store key of `name` inside `namespace`."""
    return f"{namespace}/{name}"


def launch_namespace(k: int) -> str:
    """The k-th launch's namespace, under the run's."""
    return f"launch{k}"


def rdzv_id(run: str, k: int) -> str:
    """The rendezvous id of the run's k-th launch (torchrun's, on every node)."""
    return f"{run}-{k}"


def launch_key(k: int) -> str:
    return f"launch/{k}"


def node_key(node: int) -> str:
    return f"node/{node}"


def node_refused_key(node: int) -> str:
    return f"node/{node}/refused"


def node_exit_key(node: int, k: int) -> str:
    return f"node/{node}/launch/{k}"


def node_done_key(node: int) -> str:
    return f"node/{node}/done"


def progress_key(rank: int) -> str:
    return f"progress/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


def stack_key(rank: int) -> str:
    return f"stack/{rank}"


def record_key(index: int) -> str:
    return f"record/{index}"


def gather_key(group: str, call: int, rank: int) -> str:
    """A rank's part of a process group's call-th gather to its rank 0 (ep_harness.context), in
    the group's own store (torch.distributed's, outside the run's namespaces)."""
    return f"{ROOT}/gather/{group}/{call}/{rank}"


class Malformed(HarnessError):
    """A value in the run's store that is not the message its key holds."""


def _conforms(value, hint) -> bool:
    """Whether a JSON value has the type `hint` (int, float, str, bool, list[X], dict[K, V],
    X | None, Any); a float field takes an int too (a whole number may come as one)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is list or hint is list:
        return isinstance(value, list) and (not args or all(_conforms(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict) and (not args or all(_conforms(k, args[0]) and _conforms(v, args[1])
                                                            for k, v in value.items()))
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # a bool is an int to Python, never to this protocol
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _hint_text(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


@functools.cache
def _hints(cls) -> dict:
    """A message's field types, resolved once (the head reads every rank's progress 10 times a second)."""
    return typing.get_type_hints(cls)


class Message:
    """A message of the protocol: a frozen dataclass whose wire form is a JSON object of its
    fields (a field that has its default None or False is left out)."""

    KIND: ClassVar[str]

    def to_wire(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not ((f.default is None or f.default is False) and getattr(self, f.name) is f.default)}

    @classmethod
    def from_wire(cls, value, where: str = ""):
        """The message `value` carries; Malformed (one line, naming `where`) when it is not one."""
        if not isinstance(value, dict):
            raise cls._malformed(where, f"not a JSON object: {_short(value)}")
        hints = _hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise cls._malformed(where, f"unknown field(s) {', '.join(map(str, unknown))}")
        for name, f in known.items():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if name not in value:
                if required:
                    raise cls._malformed(where, f"no {name!r}")
                continue
            if not _conforms(value[name], hints[name]):
                raise cls._malformed(where, f"{name!r} is {_short(value[name])}, not {_hint_text(hints[name])}")
        return cls._checked(cls(**value), where)

    @classmethod
    def _checked(cls, message, where: str):
        """A hook for what types alone do not say."""
        return message

    @classmethod
    def _malformed(cls, where: str, problem: str) -> Malformed:
        return Malformed(f"{where or 'a value'} in the run's store is not a {cls.KIND} message ({problem}): "
                         f"every node and rank of a run must run the same ep-harness")



class Bare(Message):
    """A message whose wire form is its one field's value, not an object."""

    def to_wire(self):
        return getattr(self, dataclasses.fields(self)[0].name)

    @classmethod
    def from_wire(cls, value, where: str = ""):
        only = dataclasses.fields(cls)[0]
        hint = _hints(cls)[only.name]
        if not _conforms(value, hint):
            raise cls._malformed(where, f"{_short(value)} is not {_hint_text(hint)}")
        return cls(value)


# --- the head -> every launcher and rank ---------------------------------------------------


@dataclass(frozen=True)
class Launch(Message):
    """launch/<k>: what every node's launcher starts (its torchrun agent) for the k-th launch."""

    KIND: ClassVar[str] = "launch"
    namespace: str
    nproc: int
    rdzv_id: str
    job: str  # the launch's directory name under --out
    env: dict[str, str]
    node_local: list[str]  # pinned variables each node fills in itself (launch.NODE_LOCAL)
    identity: dict  # the head's harness and plugins (ep_harness.launch.nodes.identity)
    # The head's agents are forks of its command (harness/launch/forks.py): a follower forks its
    # own only then, never where the head starts each anew (--fresh-processes, emulation).
    forked_agents: bool = False


@dataclass(frozen=True)
class RunOver(Message):
    """launch/<k> past the last launch: the run is over."""

    KIND: ClassVar[str] = "end-of-run"
    done: bool = True

    def to_wire(self):
        return {"done": True}

    @staticmethod
    def announced_by(value) -> bool:
        return isinstance(value, dict) and bool(value.get("done"))


@dataclass(frozen=True)
class Job(Message):
    """launch<k>/job: the checks of a launch and how its ranks run them."""

    KIND: ClassVar[str] = "job"
    backend: str
    plugins: list[str]
    checks: list[dict]  # Check.to_json(), with an `inject` from `ep-harness selftest`
    start: int  # the first check this launch runs
    emulate: str | None  # how NCCL ranks beyond the visible GPUs share them (harness/emulation.py)
    nccl: str | None  # the NCCL library the run names; a rank that loads another is an error
    pinned_env: dict[str, str]  # every rank checks that it sees these
    collective_timeout_s: float
    precompile: dict | None  # ep_harness.run.precompile.Background.rank_wait, or None


# --- a rank -> the launchers -------------------------------------------------------------


@dataclass(frozen=True)
class Progress(Message):
    """launch<k>/progress/<rank>: the check a rank is in (start - 1 before the first, the
    number of checks after the last), since when, and where it runs."""

    KIND: ClassVar[str] = "progress"
    index: int
    since: float
    pid: int
    node: str
    host: str
    waiting_until: float | None = None  # waiting for the DeepGEMM compile until then: not the check's time


@dataclass(frozen=True)
class RankError(Message):
    """launch<k>/error/<rank>: the exception a check raised on a rank, or (terminated) the
    note of a rank that SIGTERM ended."""

    KIND: ClassVar[str] = "rank error"
    index: int
    check: str | None
    rank: int
    time: float
    error: str
    traceback: str
    node: str
    host: str
    pid: int | None = None
    terminated: bool = False


@dataclass(frozen=True)
class Stack(Bare):
    """launch<k>/stack/<rank>: every thread's stack of a rank (faulthandler's text)."""

    KIND: ClassVar[str] = "stack"
    text: str


@dataclass(frozen=True)
class Record(Message):
    """launch<k>/record/<index>: rank 0's measurement of check `index` of the job."""

    KIND: ClassVar[str] = "record"
    index: int
    check: str
    seconds: float
    measured: dict  # Measurement.to_json()
    warm_up_seconds: float | None = None  # untimed first pass of a JIT-compiling subject

    def measurement(self):
        from ep_harness.measurement import Measurement

        return Measurement.from_json(self.measured)

    @classmethod
    def _checked(cls, message, where: str):
        try:
            message.measurement()
        except (TypeError, ValueError, KeyError) as exc:
            raise cls._malformed(where, f"its measurement does not parse: {_short(str(exc))}") from None
        return message


@dataclass(frozen=True)
class RankEnvironments(Bare):
    """launch<k>/ranks: every rank's ep_harness.run_environment.rank_environment, by rank."""

    KIND: ClassVar[str] = "rank environments"
    ranks: list[dict]


@dataclass(frozen=True)
class NcclTopology(Bare):
    """launch<k>/nccl-topology: the communicator's topology summary (ep_harness.nccl.log)."""

    KIND: ClassVar[str] = "NCCL topology"
    summary: dict


@dataclass(frozen=True)
class PrecompileWaited(Bare):
    """launch<k>/precompile-waited: seconds rank 0 waited for the DeepGEMM compile."""

    KIND: ClassVar[str] = "precompile wait"
    seconds: float


# --- a follower launcher -> the head ----------------------------------------------------


@dataclass(frozen=True)
class NodeBeat(Message):
    """node/<n>: a follower launcher's heartbeat (every follower.NODE_BEAT_S)."""

    KIND: ClassVar[str] = "node heartbeat"
    time: float
    host: str
    pid: int


@dataclass(frozen=True)
class NodeRefusal(Message):
    """node/<n>/refused: why a follower will not run the head's launches."""

    KIND: ClassVar[str] = "node refusal"
    reason: str


@dataclass(frozen=True)
class NodeExit(Message):
    """node/<n>/launch/<k>: how a follower's torchrun agent of launch k ended."""

    KIND: ClassVar[str] = "node exit"
    exit: int | None  # the agent's return code
