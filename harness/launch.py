"""Launch torchrun jobs on one node or several, and watch them through the run's store.

The launcher starts torchrun's agent (harness/agent/; with `--launcher slurm`, through srun)
and nothing else. The head node's launcher hosts the run's TCPStore (harness/channel.py); on
several nodes it sits at the rendezvous endpoint, where every torchrun agent's c10d
rendezvous uses it too, and the other nodes' launchers (`follow`) start their agents for
each launch the head publishes.

A check that raises on any rank, or does not finish within its timeout (stacks dumped
first), is recorded as an error and the job is relaunched from the next check, so one bad
subject never costs the whole run and no process outlives it. A node that dies or never
arrives makes every check it would have run an error naming it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from harness.channel import (RUN_ID, SECRET_ENV, Channel, current_run, parse_endpoint, publish_run, run_channel,
                             tcp_store)
from harness.errors import HarnessError
from harness.measurement import Measurement
from harness.nodes import START_TIMEOUT_S, Nodes, identity, identity_difference

REPO_ROOT = Path(__file__).resolve().parent.parent
# A node launcher silent this long is gone (EP_HARNESS_NODE_TIMEOUT_S; it beats every 0.5 s).
NODE_TIMEOUT_S = float(os.environ.get("EP_HARNESS_NODE_TIMEOUT_S", "6"))
NODE_BEAT_S = 0.5
POLL_S = 0.1
STACKS_TIMEOUT_S = 3.0  # how long ranks get to answer a request for their stacks
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a launch's directory: one plain path component


def _cache_dir() -> str:
    from harness.environment import deep_gemm_cache_dir

    return deep_gemm_cache_dir()


# Pinned variables that name a place on the node that sets them: never sent to another node
# (which would refuse a path from the store), each node fills in its own.
NODE_LOCAL = {"DG_JIT_CACHE_DIR": _cache_dir}


@dataclass
class Outcome:
    """What became of one check in a launch: a measurement or an error."""

    seconds: float
    warm_up_seconds: float | None = None  # untimed first pass of a JIT-compiling subject
    measured: Measurement | None = None
    error: str | None = None
    details: dict = field(default_factory=dict)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux), so a killed
    launcher never leaves its torchrun agent (whose ranks then follow: harness.worker)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def agent_command(nodes: Nodes, nproc: int, rdzv_id: str, endpoint: str | None,
                  module: str = "harness.worker", args: tuple[str, ...] = ()) -> list[str]:
    """torchrun's agent on this node (harness/agent/: torchrun's options, ranks forked); on
    several nodes, c10d rendezvous at the head's store, which the agents reach as
    clients (is_host=false); with Slurm, wrapped in one srun task per node."""
    if nodes.multi:
        rendezvous = ["--nnodes", str(nodes.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host=false,join_timeout={int(START_TIMEOUT_S)}"]
    else:  # what torchrun's --standalone means
        rendezvous = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", rdzv_id]
    agent = [sys.executable, "-m", "harness.agent", *rendezvous, "--nproc-per-node", str(nproc),
             "--max-restarts", "0", "--monitor-interval", "0.1", "-m", module, *args]
    if nodes.launcher == "slurm":
        return ["srun", f"--nodes={nodes.nnodes}", f"--ntasks={nodes.nnodes}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", "--export=ALL", *agent]
    return agent


def import_paths() -> dict[str, str]:
    """How an agent and its ranks find the harness: this checkout first, the caller's
    PYTHONPATH after it, and the working directory never before the standard library (a
    json.py there must not run inside the ranks; plugins are found at the path's end)."""
    return {"PYTHONSAFEPATH": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def child_env(env: dict[str, str], store: str, namespace: str, job_dir: Path, nodes: Nodes,
              secret: str | None = None) -> dict[str, str]:
    # Under srun every node's tasks name their node by SLURM_NODEID (harness.channel.local_node).
    node = {} if nodes.launcher == "slurm" else {"EP_HARNESS_NODE": str(nodes.node_rank)}
    # On several nodes the ranks build their own process-group store (the rendezvous store is
    # the run's); on one they share their agent's, which holds its port from the start (an
    # unshared one is a port the agent picks and frees, which another process can take first).
    store_sharing = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if nodes.multi else {}
    signing = {SECRET_ENV: secret} if secret else {}  # the ranks sign and check the store's values with it
    return {**os.environ, **env, **node, **store_sharing, "PYTHONUNBUFFERED": "1", **import_paths(),
            "EP_HARNESS_STORE": store, "EP_HARNESS_CHANNEL": namespace, "EP_HARNESS_JOB_DIR": str(job_dir), **signing}


def spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)


def kill_launch(proc: subprocess.Popen, groups=(), grace_s: float = 2.0, namespace: str | None = None) -> None:
    """End torchrun's agent (or srun), the local ranks and whatever they spawned: each is
    killed as a process group (the agent's own session, which its forked ranks share, and
    that of any local rank that left it), and so is every process that left those groups (a
    subject's child started in a session of its own, a daemon reparented to init): the
    descendants of the agent and of the groups' members, and every process of this user
    whose environment carries the launch's EP_HARNESS_CHANNEL=`namespace`. First SIGTERM
    and, after a grace period, SIGKILL."""
    groups = {proc.pid, *groups}
    groups.discard(os.getpgrp())  # never our own group
    strays: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        strays |= _strays(proc.pid, groups, namespace)  # found again: a child may appear during the grace
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in strays:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + (grace_s if sig == signal.SIGTERM else 0)
        while time.time() < deadline and (proc.poll() is None or _alive(groups, strays)):
            time.sleep(0.05)
    proc.wait()


def _carries(pid: str, marker: bytes) -> bool:
    """Whether process `pid`'s environment holds the variable `marker` (NAME=value) exactly."""
    try:
        return marker in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False


def _strays(root: int, groups: set[int], namespace: str | None) -> set[int]:
    """The live processes of a launch outside its process groups: descendants (by parent)
    of the agent and of the groups' members, and those marked with the launch's namespace.
    The launcher itself and its ancestors are never among them."""
    mine = set()
    pid = os.getpid()
    while pid > 1:  # the launcher and its ancestors
        mine.add(pid)
        found = process_state(pid)
        pid = found.parent if found else 0
    marker = f"\0EP_HARNESS_CHANNEL={namespace}\0".encode() if namespace else None
    states, found = {}, set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            state = process_state(entry.name)
            if state is not None and state.state not in ENDED_STATES:
                states[int(entry.name)] = state
                if marker is not None and _carries(entry.name, marker):
                    found.add(int(entry.name))
    tree = {root} | {p for p, s in states.items() if s.group in groups}
    children: dict[int, list[int]] = {}
    for p, s in states.items():
        children.setdefault(s.parent, []).append(p)
    todo = list(tree)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return (found | tree) - mine - {root}


ENDED_STATES = ("Z", "X")  # zombie, dead


class ProcessState(NamedTuple):
    state: str  # a letter: R running, S sleeping, Z zombie, ...
    parent: int
    group: int
    threads: int


def process_state(pid: int | str) -> ProcessState | None:
    """A process's state, parent, process group and thread count from /proc/PID/stat; None
    once it is gone."""
    try:  # the command name, in parentheses, may itself hold spaces and parentheses
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcessState(fields[0], int(fields[1]), int(fields[2]), int(fields[17]))  # stat's fields 3-5, 20
    except (OSError, ValueError, IndexError):
        return None


def _alive(groups, pids=()) -> bool:
    """Whether a process of these groups, or one of `pids`, still runs. A zombie has ended
    (only its parent's wait is missing): a rank orphaned when its fork server died waits for
    init to reap it (1.3 s on this machine, forever under an init that never reaps), and
    waiting on it would only stretch every teardown."""
    for entry in Path("/proc").iterdir():
        found = process_state(entry.name) if entry.name.isdigit() else None
        if found is not None and (found.group in groups or int(entry.name) in pids) and \
                found.state not in ENDED_STATES:
            return True
    return False


class Interrupted(BaseException):
    """A signal ended the run; `outcomes` holds what the interrupted launch had finished."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcomes: dict[str, Outcome] = {}


@contextlib.contextmanager
def interruptible():
    """While launches run, SIGINT, SIGTERM and SIGHUP (and `timeout`) raise Interrupted in
    this thread, once: the launcher then ends every process group, and the run keeps what it
    finished. Signals that arrive during that clean-up are ignored."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def handler(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _node_beat(channel: Channel, node: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            channel.put(f"node/{node}", {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid()})
        except Exception:  # the head is gone; the follower's own loop notices
            return
        stop.wait(NODE_BEAT_S)


class Head:
    """The head node's side of a run: the store, the launches it publishes, and which
    nodes are alive. Single node: a store on a free loopback port, and each launch's agent
    hosts its own rendezvous (what torchrun's --standalone does)."""

    def __init__(self, nodes: Nodes, run_id: str):
        self.nodes, self.run_id, self.launches = nodes, run_id, 0
        # Signs every value of the run's store; drawn here unless given (the other nodes need it).
        self.generated_secret = None if nodes.run_secret else secrets.token_hex(16)
        self.secret = nodes.run_secret or self.generated_secret
        if nodes.endpoint:
            host, port = parse_endpoint(nodes.endpoint)
        else:
            host, port = (socket.getfqdn() if nodes.multi else "127.0.0.1"), 0
        try:
            self.store = tcp_store(host, port, is_master=True)
        except Exception as exc:
            raise HarnessError(f"cannot host the run's store at {host}:{port} ({exc}); the head node (node rank 0) "
                               f"must own that address and the port must be free") from None
        self.endpoint = f"{host}:{self.store.port}"
        self.channel = run_channel(self.store, run_id, self.secret, strict=False)
        publish_run(self.store, run_id)
        self.identities: dict[tuple, dict] = {}
        self.lost: dict[int, str] = {}  # node -> why it is gone
        self.reported: dict[str, dict] = {}  # launch -> what its rank 0 reported (launch_results)

    def wait_for_nodes(self) -> None:
        """Every follower must have joined (torchrun launcher, several nodes) before the
        first launch; one that has not within START_TIMEOUT_S is lost."""
        if self.nodes.launcher != "torchrun":
            return
        deadline = time.time() + START_TIMEOUT_S
        for node in range(1, self.nodes.nnodes):
            while self.channel.get(f"node/{node}") is None:
                if self.channel.key(f"node/{node}") in self.channel.forged:
                    self.lost[node] = (f"node {node} joined the run at {self.endpoint} without its secret (a wrong "
                                       f"--run-secret there); it is not part of the run")
                    break
                if time.time() > deadline:
                    self.lost[node] = (f"node {node} never joined the run at {self.endpoint} within "
                                       f"{START_TIMEOUT_S:.0f} s (start `ep-harness verify ... --node-rank {node}` "
                                       f"there)")
                    break
                time.sleep(0.2)

    def silent_nodes(self) -> dict[int, str]:
        """Followers whose launcher stopped beating: gone with everything they ran."""
        if self.nodes.launcher != "torchrun":
            return {}
        gone = {}
        for node in range(1, self.nodes.nnodes):
            refused = self.channel.get(f"node/{node}/refused")
            if refused is not None:
                gone[node] = f"node {node} refused the run: {str(refused.get('reason'))[:300]}"
                continue
            beat = self.channel.get(f"node/{node}")
            if beat is not None and time.time() - beat["time"] > NODE_TIMEOUT_S:
                gone[node] = (f"node {node} (host {beat['host']}) stopped answering: its launcher has been "
                              f"silent for {time.time() - beat['time']:.0f} s")
        return gone

    def publish(self, job: dict, env: dict, nproc: int, job_name: str) -> Channel:
        k = self.launches
        self.launches += 1
        launch = self.channel.sub(f"launch{k}")
        launch.put("job", job)
        plugins = tuple(sorted(job.get("plugins") or ()))
        if plugins not in self.identities:
            self.identities[plugins] = identity(plugins)
        self.channel.put(f"launch/{k}", {
            "namespace": launch.namespace, "nproc": nproc, "rdzv_id": f"{self.run_id}-{k}", "job": job_name,
            "env": {n: v for n, v in env.items() if n not in NODE_LOCAL},
            "node_local": sorted(n for n in env if n in NODE_LOCAL), "identity": self.identities[plugins]})
        return launch

    def follower_exits(self, k: int, timeout_s: float = 30.0) -> None:
        """Wait until every live follower's agent of launch k has ended (a new rendezvous must
        not meet an old agent); a follower that does not report is lost."""
        if self.nodes.launcher != "torchrun":
            return
        deadline = time.time() + timeout_s
        for node in range(1, self.nodes.nnodes):
            while node not in self.lost and not self.channel.has(f"node/{node}/launch/{k}"):
                self.lost.update(self.silent_nodes())
                if time.time() > deadline:
                    self.lost[node] = f"node {node}'s torchrun agent did not end within {timeout_s:.0f} s"
                time.sleep(POLL_S)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers the run is over, and keep the store up until they have read it."""
        self.channel.put(f"launch/{self.launches}", {"done": True})
        if self.nodes.launcher == "torchrun":
            for node in range(1, self.nodes.nnodes):
                if node not in self.lost:
                    self.channel.wait(f"node/{node}/done", timeout_s)
        if self.channel.forged:
            print(f"# WARNING: {len(self.channel.forged)} value(s) in the run's store were not signed with its "
                  f"secret and were ignored (first: {self.channel.forged[0][:120]})", file=sys.stderr, flush=True)


def _collect(launch: Channel, checks: list, start: int, outcomes: dict) -> None:
    """The checks of this launch that rank 0 finished and recorded (read while the ranks run)."""
    for index in range(start, len(checks)):
        if checks[index].id in outcomes:
            continue
        line = launch.get(f"record/{index}")
        if line is None:
            return  # rank 0 records in plan order
        outcomes[checks[index].id] = Outcome(line["seconds"], line.get("warm_up_seconds"),
                                             measured=Measurement.from_json(line["measured"]))


def _states(launch: Channel, world_size: int) -> list[dict | None]:
    return [launch.get(f"progress/{r}") for r in range(world_size)]


def _local_groups(states, node: int) -> set[int]:
    """The process groups of the ranks on `node` (this launcher's own) that still exist."""
    groups = set()
    for r in _ranks_of(states, node):
        try:
            groups.add(os.getpgid(states[r]["pid"]))
        except OSError:
            pass
    return groups


def _dump_stacks(launch: Channel, world_size: int) -> dict[str, str]:
    """Ask every rank, wherever it runs, for all its threads' stacks (harness.worker.Watcher)."""
    launch.add("stacks-requested")
    deadline = time.time() + STACKS_TIMEOUT_S  # a rank that is gone never answers
    while time.time() < deadline and not all(launch.has(f"stack/{r}") for r in range(world_size)):
        time.sleep(POLL_S)
    return {str(r): launch.get(f"stack/{r}") for r in range(world_size) if launch.get(f"stack/{r}")}


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _ranks_of(states, node: int) -> list[int]:
    return [r for r, s in enumerate(states) if s and str(s.get("node")) == str(node)]


def _watch(head: Head, proc, launch: Channel, world_size: int, checks: list, start: int, launched: float,
           log_path: Path, on_poll=None):
    """Wait for the launch; return (failed_at, error, details) for a start-up failure, a lost
    node, or a check that outran its timeout (stacks dumped first), or (None, None, {})."""
    while proc.poll() is None:
        time.sleep(POLL_S)
        if on_poll is not None:
            on_poll()
        states = _states(launch, world_size)
        running = [s for s in states if s and start <= s["index"] < len(checks)]
        gone = head.silent_nodes()
        if gone:
            head.lost.update(gone)
            failed_at = min((s["index"] for s in running), default=start)
            node, why = next(iter(gone.items()))
            return failed_at, f"{why}; its ranks {_ranks_of(states, node) or '(unknown)'} ended with it", {}
        if not running and not any(states) and time.time() - launched > START_TIMEOUT_S:
            return start, f"ranks did not start within {START_TIMEOUT_S:.0f} s", {
                "stacks": _dump_stacks(launch, world_size), "log": _log_tail(log_path)}
        for s in running:
            if time.time() - s["since"] > checks[s["index"]].timeout_s:
                failed_at = min(x["index"] for x in running)
                stuck = [r for r, x in enumerate(states) if x and x["index"] == failed_at]
                return failed_at, (f"timed out after {checks[failed_at].timeout_s:.0f} s "
                                   f"(ranks {stuck} still inside the check); stack dumps attached"), {
                    "stacks": _dump_stacks(launch, world_size)}
    return None, None, {}


def _rank_error(launch: Channel, world_size: int, returncode: int, start: int, log_path: Path, multi: bool):
    """(failed_at, error, details) of a launch that exited non-zero: a rank's own traceback
    first, notes of ranks ended by SIGTERM after it last."""
    errors = sorted(filter(None, (launch.get(f"error/{r}") for r in range(world_size))),
                    key=lambda e: (e.get("terminated", False), e["time"]))
    if not errors:
        states = [s for s in _states(launch, world_size) if s]
        return (min((s["index"] for s in states), default=start),
                f"a rank exited with code {returncode} without a Python traceback", {"log": _log_tail(log_path)})
    first = errors[0]
    silent = [r for r in range(world_size) if r not in {e["rank"] for e in errors}]
    if first.get("terminated") and silent:
        error = (f"rank(s) {silent} exited without a Python traceback; the others were ended by "
                 f"SIGTERM: it left no traceback (exited or was killed first)")
    else:
        where = f" on node {first['node']} ({first['host']})" if multi else ""
        error = f"rank {first['rank']}{where} raised {first['error']}"
        if silent:
            error += f"; rank(s) {silent} left no traceback (exited or were killed first)"
    return first["index"], error, {"tracebacks": {str(e["rank"]): e["traceback"] for e in errors},
                                   "silent_ranks": silent}


def run_job(head: Head, job_dir: Path, world_size: int, backend: str, checks: list, env: dict[str, str],
            plugins: list[str], emulate_hosts: bool = False, on_outcome=None) -> dict[str, Outcome]:
    """Run `checks` on `world_size` ranks; return an Outcome per check id. emulate_hosts:
    NCCL ranks beyond the visible GPUs share them as emulated hosts (harness/emulation.py).
    on_outcome(check, outcome) is called for every check as soon as it is finished."""
    job_dir.mkdir(parents=True, exist_ok=True)
    nodes = head.nodes
    nproc = nodes.nproc_per_node or world_size
    longest = max(c.timeout_s for c in checks)
    outcomes: dict[str, Outcome] = {}
    reported: set[str] = set()
    launch: Channel | None = None

    def report() -> None:  # hand every newly finished check to the caller, in plan order
        if launch is not None:
            _collect(launch, checks, start, outcomes)
        for c in checks:
            if c.id in outcomes and c.id not in reported:
                reported.add(c.id)
                if on_outcome is not None:
                    on_outcome(c, outcomes[c.id])

    def lose_the_rest(why: str) -> None:
        for c in checks[start:]:
            outcomes.setdefault(c.id, Outcome(0.0, error=f"not run: {why}"))

    start, attempt = 0, 0
    while start < len(checks):
        if head.lost:
            lose_the_rest(next(iter(head.lost.values())))
            break
        launch = head.publish({
            "backend": backend, "plugins": plugins, "checks": [c.to_json() for c in checks], "start": start,
            "emulate_hosts": emulate_hosts,
            # every rank checks that it sees these (harness/worker.py); a node's own paths excepted
            "pinned_env": {n: v for n, v in env.items() if n not in NODE_LOCAL},
            # Collective timeouts sit above the launcher's: the launcher must see a hang first.
            "collective_timeout_s": longest + 60,
        }, env, nproc, job_dir.name)
        k = head.launches - 1
        log_path = job_dir / f"torchrun-{attempt}.log"
        proc = start_launch = None
        try:
            proc = spawn(agent_command(nodes, nproc, f"{head.run_id}-{k}", head.endpoint),
                         child_env(env, head.endpoint, launch.namespace, job_dir, nodes, head.secret), log_path)
            start_launch = time.time()
            failed_at, error, details = _watch(head, proc, launch, world_size, checks, start, start_launch, log_path,
                                               report)
        except Interrupted as exc:  # end the processes, then keep what was finished
            _collect(launch, checks, start, outcomes)
            exc.outcomes = outcomes
            raise
        finally:  # whatever happened, no process of this launch outlives it, on any node
            launch.put("abort", True)
            if proc is not None:
                kill_launch(proc, _local_groups(_states(launch, world_size), nodes.node_rank),
                            namespace=launch.namespace)
            head.follower_exits(k)
            head.reported[f"{job_dir.name}/launch{k}"] = launch_results(launch)
            redact_logs(job_dir)
        report()
        if error is None and proc.returncode != 0:
            failed_at, error, details = _rank_error(launch, world_size, proc.returncode, start, log_path, nodes.multi)
            if head.lost:  # a node that died takes its ranks' collectives down with it: name it first
                node, why = next(iter(head.lost.items()))
                error = f"{why}; its ranks {_ranks_of(_states(launch, world_size), node)} ended with it. {error}"
        if error is None:
            break
        seconds = round(time.time() - start_launch, 3)
        if not any(_states(launch, world_size)):  # failed before any check: all would
            reason = f"the {world_size}-rank launch failed before its first check ({error})"
            for c in checks[start:]:
                outcomes.setdefault(c.id, Outcome(seconds, error=reason, details={"log": _log_tail(log_path)}))
            break
        if failed_at is None or failed_at >= len(checks) or failed_at < start:
            failed_at = start
        outcomes[checks[failed_at].id] = Outcome(seconds, error=error, details=details)
        report()
        start = failed_at + 1
        while start < len(checks) and checks[start].id in outcomes:
            start += 1
        attempt += 1
    for c in checks:  # a job that ended early leaves no check unaccounted for
        outcomes.setdefault(c.id, Outcome(0.0, error="the launch ended before this check ran",
                                             details={"log": _log_tail(job_dir / f"torchrun-{attempt}.log")}))
    report()
    return outcomes


# NCCL's ENV subsystem (logged on every GPU run) writes each variable it reads with its value.
SET_BY_ENVIRONMENT = re.compile(r"\b(?P<name>[A-Z][A-Z0-9_]*) set by environment to (?P<value>[^\n]*)")


def redact_logs(job_dir: Path) -> None:
    """The value of every credential-named variable in a launch's NCCL logs replaced, as in
    environment.json: the logs stay in the run directory, which CI uploads."""
    from harness.environment import REDACTED, is_secret

    def hide(m):
        return f"{m['name']} set by environment to {REDACTED}" if is_secret(m["name"]) else m.group(0)

    for log in job_dir.glob("nccl-rank*.log"):
        try:
            text = log.read_text(errors="replace")
            hidden = SET_BY_ENVIRONMENT.sub(hide, text)
            if hidden != text:
                log.write_text(hidden)
        except OSError:
            pass


def launch_results(launch: Channel) -> dict:
    """What rank 0 reported about the launch: the ranks' fingerprints and NCCL's topology."""
    return {"ranks": launch.get("ranks"), "nccl_topology": launch.get("nccl-topology")}


def _validated_launch(launch, channel: Channel, run: str, k: int, nodes: Nodes, plugins) -> dict:
    """A launch as the head published it, checked before anything of it is used: its
    namespace, rendezvous id and ranks per node are this run's, its directory name is one
    plain path component, its variables are allowlisted (no LD_PRELOAD, no library or file,
    no path), and the head runs the same harness and plugins as this node."""
    from harness.environment import applicable_env

    where = f"node {nodes.node_rank}: launch {k} from the head at {nodes.endpoint}"
    if not isinstance(launch, dict):
        raise HarnessError(f"{where} is not a table; refusing it")
    difference = identity_difference(launch.get("identity"), plugins)
    if difference:
        raise HarnessError(f"node {nodes.node_rank}: refusing the head's run {run}: {difference}; run the same "
                           f"ep-harness checkout and plugins on every node")
    expected = {"namespace": channel.key(f"launch{k}"), "rdzv_id": f"{run}-{k}", "nproc": nodes.nproc_per_node}
    for key, value in expected.items():
        if launch.get(key) != value:
            raise HarnessError(f"{where}: {key} = {str(launch.get(key))[:80]!r}, expected {value!r}; refusing it")
    if not isinstance(launch.get("job"), str) or not JOB_NAME.fullmatch(launch["job"]):
        raise HarnessError(f"{where}: its directory {str(launch.get('job'))[:80]!r} is not one plain name under "
                           f"--out; refusing it")
    local = launch.get("node_local") or []
    if not isinstance(local, list) or not set(local) <= set(NODE_LOCAL):
        raise HarnessError(f"{where}: node-local variables {str(local)[:80]} are not the harness's; refusing them")
    env = applicable_env(launch.get("env"), where)
    env.update({name: NODE_LOCAL[name]() for name in local})  # this node's own cache directory
    return {**launch, "env": env}


def follow(nodes: Nodes, out_dir: Path, quiet: bool = False, plugins=()) -> int:
    """A non-head node of a torchrun-launched run: join the head's store, start this node's
    torchrun agent for every launch the head publishes, report how it ended, and stop when
    the head says done or is gone. Logs stay on this node, under out_dir.

    Nothing is taken from the store unchecked: every value must be signed with the run's
    secret (--run-secret), and every launch pass _validated_launch; anything else ends this
    node with a one-line error (and a note to the head) before it starts anything."""
    host, port = parse_endpoint(nodes.endpoint)
    try:
        store = tcp_store(host, port, is_master=False, timeout_s=START_TIMEOUT_S)
    except Exception as exc:
        raise HarnessError(f"node {nodes.node_rank}: no head at {nodes.endpoint} within {START_TIMEOUT_S:.0f} s "
                           f"({type(exc).__name__}); start node rank 0 with the same --rdzv-endpoint") from None
    deadline = time.time() + START_TIMEOUT_S
    run = None
    while run is None and time.time() < deadline:
        run = current_run(store)
        time.sleep(0.2)
    if run is None:
        raise HarnessError(f"node {nodes.node_rank}: the store at {nodes.endpoint} serves no ep-harness run")
    if not RUN_ID.fullmatch(run):
        raise HarnessError(f"node {nodes.node_rank}: the store at {nodes.endpoint} names run {run[:80]!r}, which is "
                           f"not a run id; refusing it")
    channel = run_channel(store, run, nodes.run_secret)
    stop = threading.Event()
    beat = threading.Thread(target=_node_beat, args=(channel, nodes.node_rank, stop), daemon=True)
    beat.start()
    out_dir = out_dir / f"node{nodes.node_rank}-{run}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"# node {nodes.node_rank}: joined run {run} at {nodes.endpoint}; logs in {out_dir}", flush=True)
    k, code = 0, 0
    try:
        with interruptible():
            while True:
                try:
                    launch = channel.wait(f"launch/{k}", 24 * 3600.0)
                    if launch is not None and launch.get("done"):
                        channel.put(f"node/{nodes.node_rank}/done", True)
                        break
                    if launch is not None:
                        launch = _validated_launch(launch, channel, run, k, nodes, plugins)
                except HarnessError as exc:  # forged, or not ours to run: tell the head, start nothing
                    with contextlib.suppress(Exception):
                        channel.put(f"node/{nodes.node_rank}/refused", {"reason": str(exc)})
                    raise
                except Exception:
                    raise HarnessError(f"node {nodes.node_rank}: the head at {nodes.endpoint} is gone") from None
                if launch is None:
                    channel.put(f"node/{nodes.node_rank}/done", True)
                    break
                job_dir = out_dir / launch["job"]
                job_dir.mkdir(parents=True, exist_ok=True)
                ns = channel.sub(f"launch{k}")
                proc = spawn(agent_command(nodes, launch["nproc"], launch["rdzv_id"], nodes.endpoint),
                             child_env(launch["env"], nodes.endpoint, ns.namespace, job_dir, nodes, nodes.run_secret),
                             job_dir / f"torchrun-launch{k}.log")
                try:
                    while proc.poll() is None:
                        time.sleep(POLL_S)
                        try:
                            if ns.has("abort"):
                                break
                        except Exception:
                            raise HarnessError(f"node {nodes.node_rank}: the head at {nodes.endpoint} is gone; "
                                               f"this node's ranks were ended") from None
                finally:
                    lenient = Channel(store, ns.namespace, nodes.run_secret, strict=False)  # teardown never stops
                    kill_launch(proc, _local_groups(_states(lenient, launch["nproc"] * nodes.nnodes), nodes.node_rank),
                                namespace=ns.namespace)
                redact_logs(job_dir)
                channel.put(f"node/{nodes.node_rank}/launch/{k}", {"exit": proc.returncode})
                k += 1
    except Interrupted as exc:
        code = 128 + exc.signum
    finally:
        stop.set()
        # Joined, not left to die at exit: a daemon thread killed inside a store call aborts
        # the interpreter ("terminate called without an active exception", exit -6).
        beat.join(timeout=2 * NODE_BEAT_S + 5)
    if not quiet:
        print(f"# node {nodes.node_rank}: {k} launch(es) done; the records are on the head node", flush=True)
    return code
