"""The local launch: start torchrun's agent for a job's checks and watch it through the run's store.

The launcher starts torchrun's agent (harness/launch/agent/; with `--launcher slurm`, through srun)
and nothing else (spawning and teardown: harness/launch/processes.py). The head node's launcher
(Head) hosts the run's TCPStore (harness/launch/channel.py); on several nodes it sits at the
rendezvous endpoint, where every torchrun agent's c10d rendezvous uses it too, and the other
nodes' launchers (harness/launch/follower.py) start their agents for each launch the head publishes.

A check that raises on any rank, or does not finish within its timeout (stacks dumped
first), is recorded as an error and the job is relaunched from the next check, so one bad
subject never costs the whole run and no process outlives it. A node that dies or never
arrives makes every check it would have run an error naming it.

While the DeepGEMM kernels compile beside a launch (harness/run/precompile.py), a rank that waits
for them says so in its progress (`waiting_until`): that time is not the check's, and is
bounded by the wait's own limit instead of the check's timeout_s.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ep_harness import console

from ep_harness.launch import forks, protocol, settings
from ep_harness.launch.channel import Channel, parse_endpoint, publish_run, run_channel, tcp_store
from ep_harness.errors import HarnessError
from ep_harness.measurement import Measurement
from ep_harness.nccl import library as nccl_library
from ep_harness.launch.nodes import START_TIMEOUT_S, Nodes, identity
from ep_harness.launch.processes import Interrupted, agent_command, child_env, kill_launch, process_groups, spawn

# A node launcher silent this long is gone (EP_HARNESS_NODE_TIMEOUT_S; it beats every 0.5 s:
# ep_harness.launch.follower.NODE_BEAT_S).
NODE_TIMEOUT_S = settings.seconds("EP_HARNESS_NODE_TIMEOUT_S")
POLL_S = 0.1
WAIT_SLACK_S = 30.0  # past a rank's own limit on waiting for the compile, the launcher ends the launch
STACKS_TIMEOUT_S = 3.0  # how long ranks get to answer a request for their stacks


def _cache_dir() -> str:
    from ep_harness.environment import deep_gemm_cache_dir

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
        self.precompile_wait_s = 0.0  # how long rank 0 waited for the DeepGEMM compile, all launches together
        self.ignored: list[str] = []  # malformed messages of launches whose every check had its outcome

    def wait_for_nodes(self) -> None:
        """Every follower must have joined (torchrun launcher, several nodes) before the
        first launch; one that has not within START_TIMEOUT_S is lost."""
        if self.nodes.launcher != "torchrun":
            return
        deadline = time.time() + START_TIMEOUT_S
        for node in range(1, self.nodes.nnodes):
            beat = self.channel.key(protocol.node_key(node))
            while self.channel.read(protocol.node_key(node), protocol.NodeBeat) is None:
                if beat in self.channel.malformed:
                    self.lost[node] = self.channel.malformed[beat]
                    break
                if beat in self.channel.forged:
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
            refused = self.channel.read(protocol.node_refused_key(node), protocol.NodeRefusal)
            if refused is not None:
                gone[node] = f"node {node} refused the run: {refused.reason[:300]}"
                continue
            beat = self.channel.read(protocol.node_key(node), protocol.NodeBeat)
            if beat is not None and time.time() - beat.time > NODE_TIMEOUT_S:
                gone[node] = (f"node {node} (host {beat.host}) stopped answering: its launcher has been "
                              f"silent for {time.time() - beat.time:.0f} s")
            why = self._malformed_from(node)
            if why is not None:
                gone[node] = why
        return gone

    def _malformed_from(self, node: int) -> str | None:
        """The one-line reason a message of node `node` was malformed, if one was."""
        keys = (protocol.node_key(node), protocol.node_refused_key(node))
        return next((self.channel.malformed[k] for k in map(self.channel.key, keys) if k in self.channel.malformed),
                    None)

    def publish(self, job: protocol.Job, env: dict, nproc: int, job_name: str) -> Channel:
        k = self.launches
        self.launches += 1
        launch = self.channel.sub(protocol.launch_namespace(k))
        launch.put(protocol.JOB, job.to_wire())
        plugins = tuple(sorted(job.plugins or ()))
        if plugins not in self.identities:
            self.identities[plugins] = identity(plugins)
        self.channel.put(protocol.launch_key(k), protocol.Launch(
            namespace=launch.namespace, nproc=nproc, rdzv_id=protocol.rdzv_id(self.run_id, k), job=job_name,
            env={n: v for n, v in env.items() if n not in NODE_LOCAL},
            node_local=sorted(n for n in env if n in NODE_LOCAL), identity=self.identities[plugins],
            forked_agents=forks.current() is not None).to_wire())
        return launch

    def follower_exits(self, k: int, timeout_s: float = 30.0) -> None:
        """Wait until every live follower's agent of launch k has ended (a new rendezvous must
        not meet an old agent); a follower that does not report is lost."""
        if self.nodes.launcher != "torchrun":
            return
        deadline = time.time() + timeout_s
        for node in range(1, self.nodes.nnodes):
            while node not in self.lost and not self.channel.has(protocol.node_exit_key(node, k)):
                self.lost.update(self.silent_nodes())
                if time.time() > deadline:
                    self.lost[node] = f"node {node}'s torchrun agent did not end within {timeout_s:.0f} s"
                time.sleep(POLL_S)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers the run is over, and keep the store up until they have read it."""
        self.channel.put(protocol.launch_key(self.launches), protocol.RunOver().to_wire())
        if self.nodes.launcher == "torchrun":
            for node in range(1, self.nodes.nnodes):
                if node not in self.lost:
                    self.channel.wait(protocol.node_done_key(node), timeout_s)
        if self.channel.forged:
            console.current().err(f"# WARNING: {len(self.channel.forged)} value(s) in the run's store were not signed "
                                  f"with its secret and were ignored (first: {self.channel.forged[0][:120]})")
        for why in self.ignored:
            console.current().err(f"# WARNING: {why}; it was ignored")


def _collect(launch: Channel, checks: list, start: int, outcomes: dict) -> None:
    """The checks of this launch that rank 0 finished and recorded (read while the ranks run)."""
    for index in range(start, len(checks)):
        if checks[index].id in outcomes:
            continue
        record = launch.read(protocol.record_key(index), protocol.Record)
        if record is None:
            return  # rank 0 records in plan order (a malformed record fails the launch: _watch)
        outcomes[checks[index].id] = Outcome(record.seconds, record.warm_up_seconds, measured=record.measurement())


def rank_states(launch: Channel, world_size: int) -> list[protocol.Progress | None]:
    """Each rank's progress through the launch's checks (ep_harness.run.worker), None before it
    starts (or when what it said is malformed: kept in launch.malformed)."""
    return [launch.read(protocol.progress_key(r), protocol.Progress) for r in range(world_size)]


def local_groups(states, node: int) -> set[int]:
    """The process groups of the ranks on `node` (this launcher's own) that still exist."""
    return process_groups(states[r].pid for r in _ranks_of(states, node))


def _dump_stacks(launch: Channel, world_size: int) -> dict[str, str]:
    """Ask every rank, wherever it runs, for all its threads' stacks (ep_harness.run.worker.Watcher)."""
    launch.add(protocol.STACKS_REQUESTED)
    deadline = time.time() + STACKS_TIMEOUT_S  # a rank that is gone never answers
    while time.time() < deadline and not all(launch.has(protocol.stack_key(r)) for r in range(world_size)):
        time.sleep(POLL_S)
    stacks = {str(r): launch.read(protocol.stack_key(r), protocol.Stack) for r in range(world_size)}
    return {r: stack.text for r, stack in stacks.items() if stack and stack.text}


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _ranks_of(states, node: int) -> list[int]:
    return [r for r, s in enumerate(states) if s and str(s.node) == str(node)]


def _watch(head: Head, proc, launch: Channel, world_size: int, checks: list, start: int, launched: float,
           log_path: Path, on_poll=None):
    """Wait for the launch; return (failed_at, error, details) for a start-up failure, a lost
    node, or a check that outran its timeout (stacks dumped first), or (None, None, {})."""
    while proc.poll() is None:
        time.sleep(POLL_S)
        if on_poll is not None:
            on_poll()
        states = rank_states(launch, world_size)
        running = [s for s in states if s and start <= s.index < len(checks)]
        if launch.malformed:  # a rank that says something else than the protocol (run_job names it)
            return start, next(iter(launch.malformed.values())), {}
        gone = head.silent_nodes()
        if gone:
            head.lost.update(gone)
            failed_at = min((s.index for s in running), default=start)
            node, why = next(iter(gone.items()))
            return failed_at, f"{why}; its ranks {_ranks_of(states, node) or '(unknown)'} ended with it", {}
        if not running and not any(states) and time.time() - launched > START_TIMEOUT_S:
            return start, f"ranks did not start within {START_TIMEOUT_S:.0f} s", {
                "stacks": _dump_stacks(launch, world_size), "log": _log_tail(log_path)}
        for s in running:
            if s.waiting_until is not None:  # waiting for the compile: not the check's time
                if time.time() > s.waiting_until + WAIT_SLACK_S:  # the rank's own limit did not end it
                    stuck = [r for r, x in enumerate(states) if x and x.waiting_until is not None]
                    return s.index, (f"ranks {stuck} still waiting for the DeepGEMM compile past its limit "
                                     f"(harness/run/precompile.py); set EP_HARNESS_PRECOMPILE=0 to compile in the "
                                     f"checks"), {"stacks": _dump_stacks(launch, world_size)}
                continue
            if time.time() - s.since > checks[s.index].timeout_s:
                failed_at = min(x.index for x in running)
                stuck = [r for r, x in enumerate(states) if x and x.index == failed_at]
                stacks = _dump_stacks(launch, world_size)
                mute = [r for r in stuck if str(r) not in stacks]  # a live rank answers within STACKS_TIMEOUT_S
                said = (f"; ranks {mute} did not answer for their stacks: they may have exited (a subject that "
                        f"ends its process?), see the launch log" if mute else "")
                return failed_at, (f"timed out after {checks[failed_at].timeout_s:.0f} s (ranks {stuck} still "
                                   f"inside the check by their last report){said}"
                                   f"{'; stack dumps attached' if stacks else ''}"), {
                    "stacks": stacks, "log": _log_tail(log_path)}
    return None, None, {}


def _rank_error(launch: Channel, world_size: int, returncode: int, start: int, log_path: Path, multi: bool):
    """(failed_at, error, details) of a launch that exited non-zero: a rank's own traceback
    first, notes of ranks ended by SIGTERM after it last."""
    errors = sorted(filter(None, (launch.read(protocol.error_key(r), protocol.RankError) for r in range(world_size))),
                    key=lambda e: (e.terminated, e.time))
    if not errors:
        states = [s for s in rank_states(launch, world_size) if s]
        return (min((s.index for s in states), default=start),
                f"a rank exited with code {returncode} without a Python traceback", {"log": _log_tail(log_path)})
    first = errors[0]
    silent = [r for r in range(world_size) if r not in {e.rank for e in errors}]
    fatal = _fatal_error(log_path) if silent else None
    # The silent rank is named first whichever way the others ended: whether they raised on a
    # closed connection or torchrun's SIGTERM reached them first is a race.
    cause = f"{fatal} in {log_path.name}: it crashed first" if fatal else "exited or was killed first"
    silent_lead = f"rank(s) {silent} left no traceback ({cause})"
    where = f" on node {first.node} ({first.host})" if multi else ""
    if first.terminated and silent:
        error = f"{silent_lead}; the others were ended by SIGTERM"
    elif fatal:  # the others' errors (a closed connection) followed the crash
        error = f"{silent_lead}; then rank {first.rank}{where} raised {first.error}"
    else:
        error = f"rank {first.rank}{where} raised {first.error}"
        if silent:
            error += f"; rank(s) {silent} left no traceback (exited or were killed first)"
    details = {"tracebacks": {str(e.rank): e.traceback for e in errors}, "silent_ranks": silent}
    if fatal:
        details["log"] = _log_tail(log_path, 40)
    return first.index, error, details


def _fatal_error(log_path: Path) -> str | None:
    """The interpreter's own report of a crash in a rank (faulthandler: 'Fatal Python error:
    Segmentation fault'), from the launch's log, or None."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"^Fatal Python error: ([^\n]+)", text, flags=re.MULTILINE)
    return f"Fatal Python error: {found[-1].strip()}" if found else None


def run_job(head: Head, job_dir: Path, world_size: int, backend: str, checks: list, env: dict[str, str],
            plugins: list[str], emulate: str | None = None, on_outcome=None,
            precompile_wait: dict | None = None) -> dict[str, Outcome]:
    """Run `checks` on `world_size` ranks; return an Outcome per check id. emulate:
    how NCCL ranks beyond the visible GPUs share them ("hosts", "single-node"; harness/emulation.py).
    on_outcome(check, outcome) is called for every check as soon as it is finished.
    precompile_wait: the marker the ranks wait for before the checks it names
    (ep_harness.run.precompile.Background.rank_wait), or None."""
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
        launch = head.publish(protocol.Job(
            backend=backend, plugins=plugins, checks=[c.to_json() for c in checks], start=start, emulate=emulate,
            # the NCCL the run names (read from the library on the head): a rank running another is an error
            nccl=nccl_library.loaded().text if backend == "nccl" else None,
            # every rank checks that it sees these (harness/run/worker.py); a node's own paths excepted
            pinned_env={n: v for n, v in env.items() if n not in NODE_LOCAL},
            # Collective timeouts sit above the launcher's: the launcher must see a hang first.
            collective_timeout_s=longest + 60,
            precompile=precompile_wait,
        ), env, nproc, job_dir.name)
        k = head.launches - 1
        log_path = job_dir / f"torchrun-{attempt}.log"
        proc = start_launch = None
        try:
            proc = spawn(agent_command(nodes, nproc, protocol.rdzv_id(head.run_id, k), head.endpoint, job_dir),
                         child_env(env, head.endpoint, launch.namespace, job_dir, nodes, head.secret), log_path)
            start_launch = time.time()
            failed_at, error, details = _watch(head, proc, launch, world_size, checks, start, start_launch, log_path,
                                               report)
        except Interrupted as exc:  # end the processes, then keep what was finished
            _collect(launch, checks, start, outcomes)
            exc.outcomes = outcomes
            raise
        finally:  # whatever happened, no process of this launch outlives it, on any node
            launch.put(protocol.ABORT, True)
            if proc is not None:
                kill_launch(proc, local_groups(rank_states(launch, world_size), nodes.node_rank),
                            namespace=launch.namespace)
            head.follower_exits(k)
            head.reported[f"{job_dir.name}/{protocol.launch_namespace(k)}"] = launch_results(launch)
            waited = launch.read(protocol.PRECOMPILE_WAITED, protocol.PrecompileWaited)
            head.precompile_wait_s += float(waited.seconds if waited else 0.0)
            redact_logs(job_dir)
        report()
        if launch.malformed:  # what a rank said was not the protocol: the launch's first unfinished check says so
            unfinished = next((i for i in range(start, len(checks)) if checks[i].id not in outcomes), None)
            if unfinished is None:  # every check has its outcome: a warning at the run's end
                head.ignored.extend(launch.malformed.values())
            else:
                failed_at, error, details = unfinished, next(iter(launch.malformed.values())), {}
        if error is None and proc.returncode != 0:
            failed_at, error, details = _rank_error(launch, world_size, proc.returncode, start, log_path, nodes.multi)
            if head.lost:  # a node that died takes its ranks' collectives down with it: name it first
                node, why = next(iter(head.lost.items()))
                error = f"{why}; its ranks {_ranks_of(rank_states(launch, world_size), node)} ended with it. {error}"
        if error is None:
            break
        seconds = round(time.time() - start_launch, 3)
        if not any(rank_states(launch, world_size)):  # failed before any check: all would
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
    from ep_harness.environment import REDACTED, is_secret

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
    """What rank 0 reported about the launch: the ranks' environments and NCCL's topology."""
    ranks = launch.read(protocol.RANKS, protocol.RankEnvironments)
    topology = launch.read(protocol.NCCL_TOPOLOGY, protocol.NcclTopology)
    return {"ranks": ranks.ranks if ranks else None, "nccl_topology": topology.summary if topology else None}
