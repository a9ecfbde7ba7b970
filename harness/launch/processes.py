"""Process plumbing shared by every launcher (harness/launch/launcher.py, harness/launch/follower.py,
harness/run/explore.py): torchrun's agent command and environment, spawning it in a session of
its own that dies with its launcher, the processes' state (psutil), and teardown (every
process group and stray process of a launch ended, SIGTERM then SIGKILL). Signals that end a
run raise Interrupted while launches run.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import psutil

from ep_harness.errors import Interrupted  # noqa: F401 (raised here; imported from here by the launcher)
from ep_harness.launch.channel import SECRET_ENV
from ep_harness.launch.nodes import START_TIMEOUT_S, Nodes

REPO_ROOT = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux), so a killed
    launcher never leaves its torchrun agent (whose ranks then follow: ep_harness.run.worker)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def agent_command(nodes: Nodes, nproc: int, rdzv_id: str, endpoint: str | None, job_dir: Path,
                  module: str = "ep_harness.run.worker", args: tuple[str, ...] = ()) -> list[str]:
    """torchrun's agent on this node (harness/launch/agent/: torchrun's options, ranks forked); on
    several nodes, c10d rendezvous at the head's store, which the agents reach as
    clients (is_host=false); with Slurm, wrapped in one srun task per node. torchrun's own
    log directory goes under `job_dir` (its default is a new /tmp/torchelastic_* per launch,
    left behind)."""
    if nodes.multi:
        rendezvous = ["--nnodes", str(nodes.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host=false,join_timeout={int(START_TIMEOUT_S)}"]
    else:  # what torchrun's --standalone means
        rendezvous = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", rdzv_id]
    agent = [sys.executable, "-m", "ep_harness.launch.agent", *rendezvous, "--nproc-per-node", str(nproc),
             "--max-restarts", "0", "--monitor-interval", "0.1", "--log-dir", str(Path(job_dir) / "torchelastic"),
             "-m", module, *args]
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
    # Under srun every node's tasks name their node by SLURM_NODEID (ep_harness.launch.channel.local_node).
    node = {} if nodes.launcher == "slurm" else {"EP_HARNESS_NODE": str(nodes.node_rank)}
    # On several nodes the ranks build their own process-group store (the rendezvous store is
    # the run's); on one they share their agent's, which holds its port from the start (an
    # unshared one is a port the agent picks and frees, which another process can take first).
    store_sharing = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if nodes.multi else {}
    signing = {SECRET_ENV: secret} if secret else {}  # the ranks sign and check the store's values with it
    return {**os.environ, **env, **node, **store_sharing, "PYTHONUNBUFFERED": "1", **import_paths(),
            "EP_HARNESS_STORE": store, "EP_HARNESS_CHANNEL": namespace, "EP_HARNESS_JOB_DIR": str(job_dir), **signing}


def spawn(cmd: list[str], env: dict, log_path: Path, fork: bool = True):
    """torchrun's agent (or srun) in a session of its own, its output in `log_path`: forked by
    the command's agent server where one serves it and `fork` allows it (harness/launch/forks.py),
    else a new process."""
    from ep_harness.launch import forks

    server = forks.current() if fork else None
    forked = server.spawn(cmd, env, log_path) if server is not None else None
    if forked is not None:
        return forked
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


def _carries(pid: int, namespace: str) -> bool:
    """Whether process `pid`'s environment holds EP_HARNESS_CHANNEL=`namespace` exactly."""
    if not PROC_STAT:
        try:
            return psutil.Process(pid).environ().get("EP_HARNESS_CHANNEL") == namespace
        except (psutil.Error, OSError):  # gone, or another user's
            return False
    try:  # the raw block (what psutil parses): one read, no dict (every process is asked, twice a launch)
        with open(f"/proc/{pid}/environ", "rb") as f:
            block = f.read()
    except OSError:  # gone, or another user's
        return False
    # psutil keeps the last of a repeated name (a dict); so does this
    found = [v for v in block.split(b"\0") if v.startswith(b"EP_HARNESS_CHANNEL=")]
    return bool(found) and found[-1] == b"EP_HARNESS_CHANNEL=" + namespace.encode()


def _pids() -> list[int]:
    if PROC_STAT:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return psutil.pids()


def _live() -> dict[int, ProcessState]:
    """Every process that has not ended, by pid."""
    states = {}
    for pid in _pids():
        state = process_state(pid)
        if state is not None and state.state not in ENDED_STATES:
            states[pid] = state
    return states


def _strays(root: int, groups: set[int], namespace: str | None) -> set[int]:
    """The live processes of a launch outside its process groups: descendants (by parent)
    of the agent and of the groups' members, and those marked with the launch's namespace.
    The launcher itself and its ancestors are never among them."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # the launcher and its ancestors
    states = _live()
    found = {p for p in states if _carries(p, namespace)} if namespace is not None else set()
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
# psutil's status words as the one-letter states of ps(1) and /proc/PID/stat.
_LETTERS = {psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
            psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
            psutil.STATUS_DEAD: "X", psutil.STATUS_WAKING: "W", psutil.STATUS_IDLE: "I",
            psutil.STATUS_PARKED: "P"}


class ProcessState(NamedTuple):
    state: str  # a letter: R running, S sleeping, Z zombie, ...
    parent: int
    group: int
    threads: int


# Linux: a process's state, parent, group and thread count are one read of /proc/PID/stat
# (psutil reads it and /proc/PID/status, through several objects: a launch's teardown asks
# every process of the machine, 3x the CPU on a busy one). Elsewhere, psutil.
PROC_STAT = os.path.exists(f"/proc/{os.getpid()}/stat")


def process_state(pid: int | str) -> ProcessState | None:
    """A process's state, parent, process group and thread count; None once it is gone."""
    if PROC_STAT:
        try:
            with open(f"/proc/{int(pid)}/stat", "rb") as f:
                stat = f.read()
            # pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
            # utime stime cutime cstime priority nice num_threads ...: comm may hold ") ", so after the last ")"
            fields = stat[stat.rindex(b")") + 2:].split()
            return ProcessState(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[17]))
        except (OSError, ValueError, IndexError):
            return None
    try:
        proc = psutil.Process(int(pid))
        with proc.oneshot():
            status, parent, threads = proc.status(), proc.ppid(), proc.num_threads()
        return ProcessState(_LETTERS.get(status, "?"), parent, os.getpgid(proc.pid), threads)
    except (psutil.Error, OSError, ValueError):
        return None


def _alive(groups, pids=()) -> bool:
    """Whether a process of these groups, or one of `pids`, still runs. A zombie has ended
    (only its parent's wait is missing): a rank orphaned when its fork server died waits for
    init to reap it (1.3 s on this machine, forever under an init that never reaps), and
    waiting on it would only stretch every teardown."""
    return any(s.group in groups or p in pids for p, s in _live().items())


def process_groups(pids) -> set[int]:
    """The process groups of those of `pids` that still exist."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    return groups


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
