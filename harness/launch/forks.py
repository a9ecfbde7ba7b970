"""torchrun's agent as a fork of the command rather than a new interpreter.

A fresh agent spends most of its start importing torch and the ranks' module (1.2-2 CPU-s a
launch on the 2-core machine; 82 launches in `make test`); the command has imported torch
already. So a command that launches forks an *agent server* from itself as it starts, while
it has one thread and has loaded no plugin (the run's store, which starts threads, comes
later: a fork of a process with threads may inherit a lock held for good). The server imports
what every agent imports and forks one agent per launch. A forked agent is set up as the
interpreter `python -m ep_harness.launch.agent ...` would be: its own session, its log as
stdout and stderr, the launch's environment, the import path a fresh agent computes (the
launch's PYTHONPATH first, the command's script folder or working directory never), a console,
signal handlers and exit handlers of its own, numpy's random state drawn anew; it dies with the
server, which dies with the command (PR_SET_PDEATHSIG), and it is the child subreaper of its
launch: a process that leaves the launch is re-parented to it, so that kill_launch finds it as
a descendant (the /proc/PID/environ of a fork is the command's, without the launch's
EP_HARNESS_CHANNEL, which kill_launch also looks for).

Where the launch's environment differs from the command's in any variable but those the
launcher sets for every launch (PER_LAUNCH), the agent is a new interpreter as before; so it is
on GPUs (a fork must never follow a CUDA initialisation), under --fresh-processes or an emulated
topology, where the command has a thread by then or was started with interpreter options (-O,
-W, -X ...). On several nodes each follower (harness/launch/follower.py) forks its server
before it joins the head's store, and forks an agent only where the head's launch says the
head's are forks (protocol.Launch.forked_agents): never where the head starts each anew. The
launch pins PYTHONHASHSEED=0, which a forked process cannot change: a command started with it
(`make verify`, the tests) forks its agents, any other starts them anew. EP_HARNESS_AGENT_FORKS=0
turns the server off. A signal that ends the run waits while an agent is being forked, so
that no agent runs untracked.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import io
import json
import locale
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import types
from contextlib import contextmanager

from ep_harness.cases import FORCED_ENV
from ep_harness.launch import fork_server
from ep_harness.launch.channel import SECRET_ENV
from ep_harness.launch.processes import _die_with_parent
from ep_harness.process_exit import exit_now

# The variables in which a launch's environment may differ from the command's (every other
# difference means a new interpreter): those the launcher sets for every launch, which the agent
# and its ranks read only once they run. The path is rebuilt from PYTHONPATH below; each rank
# sets its thread count with torch.set_num_threads (ep_harness.threads.apply_in_rank); cuBLAS,
# NCCL and symmetric memory read their pins as a handle or communicator is made
# (ep_harness.environment.pinned_env). PYTHONHASHSEED is not among them: the launch pins 0, so
# a command forks its agents only if it was started so.
PER_LAUNCH = {"PYTHONPATH", "PYTHONSAFEPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "EP_HARNESS_STORE",
              "EP_HARNESS_CHANNEL", "EP_HARNESS_JOB_DIR", "EP_HARNESS_NODE", SECRET_ENV,
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUBLAS_WORKSPACE_CONFIG",
              *FORCED_ENV}
AGENT_MODULE = "ep_harness.launch.agent"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # what ends a run (processes.interruptible)
# The signals a command or the server may handle, which an agent starts with as after exec.
RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                 signal.SIGCHLD)
SWITCH = "EP_HARNESS_AGENT_FORKS"


class ForkedAgent:
    """What the launchers use of subprocess.Popen (pid, poll, wait, returncode), for an agent
    forked by the server; kill_launch ends it as a process group, as it ends a new one."""

    def __init__(self, server: AgentServer, pid: int, args: list[str]):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.drain(0)
            self.returncode = self.server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.drain(0.5 if left is None else min(left, 0.5))
        return self.returncode



def _end_group(agent: ForkedAgent) -> None:
    """A forked agent and its session's processes killed, its exit waited for."""
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    agent.wait()


class AgentServer:
    """The command's agent server (see the module's docstring); `spawn` forks an agent, or
    returns None where the agent must be a new interpreter."""

    def __init__(self):
        self.env = dict(os.environ)  # the command's, as the server was forked
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        self._buffer, self.dead, self.requests = b"", False, 0
        self.started: dict[int, int] = {}  # request id -> agent pid
        self.exits: dict[int, int] = {}  # agent pid -> exit code
        self.running: set[int] = set()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(self._requests)
                os.close(self._replies)
                code = _serve(requests_r, replies_w)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(requests_r)
        os.close(replies_w)
        self.pid = pid

    def serves(self, cmd: list[str], env: dict[str, str]) -> bool:
        """Whether `cmd` in `env` is an agent this server forks as a fresh interpreter would run
        it: `env` is the command's environment but for the variables of PER_LAUNCH."""
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return not self.dead and cmd[:3] == [sys.executable, "-m", AGENT_MODULE] and not differ - PER_LAUNCH

    def spawn(self, cmd: list[str], env: dict[str, str], log_path) -> ForkedAgent | None:
        if not self.serves(cmd, env):
            return None
        # what an exec'd agent inherits: the signals ignored here stay ignored, the others are reset
        ignored = [s.value for s in RESET_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
        self.requests += 1
        request = {"id": self.requests, "argv": cmd[3:], "env": env, "log": str(log_path), "cwd": os.getcwd(),
                   "ignored": ignored}
        # No signal may end the command between the request and its answer (the agent would run
        # untracked): they wait until the agent is known, then end it with the launch.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        agent = None
        try:
            pid = self._start(request)
            if pid is not None:
                agent = ForkedAgent(self, pid, cmd)
        finally:
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a waiting signal's handler runs here
            except BaseException:
                if agent is not None:
                    _end_group(agent)
                raise
        return agent

    def _start(self, request: dict) -> int | None:
        """The started agent's pid, or None (the server is gone or did not answer: a new
        interpreter then, and this server serves no more)."""
        data = (json.dumps(request) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._requests, data):]
        except OSError:
            self._end_server()
            return None
        deadline = time.monotonic() + 60
        while request["id"] not in self.started and not self.dead and time.monotonic() < deadline:
            self.drain(1.0)
        pid = self.started.pop(request["id"], None)
        if pid is None:
            self._end_server()
        return pid

    def drain(self, timeout: float) -> None:
        """Read the server's replies that arrive within `timeout` s: a started agent's pid, an
        agent's exit code. A server that ended has ended its agents (they die with it)."""
        if self.dead:
            return
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            return
        chunk = os.read(self._replies, 65536)
        if not chunk:
            self._lost()
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            reply = json.loads(line)
            if "started" in reply:
                self.started[reply["id"]] = reply["started"]
                self.running.add(reply["started"])
            else:
                self.running.discard(reply["pid"])
                self.exits[reply["pid"]] = reply["returncode"]

    def _end_server(self) -> None:
        """Kill a server that failed to answer (its agents die with it) and reap it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._lost()

    def _lost(self) -> None:
        """The server ended: its agents were killed with it (PR_SET_PDEATHSIG)."""
        if self.dead:
            return
        self.dead = True
        for pid in self.running:
            self.exits[pid] = -signal.SIGKILL
        self.running.clear()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def close(self) -> None:
        if self.pid is None:
            return
        try:
            os.close(self._requests)
        except OSError:
            pass
        self._lost()  # its agents have ended (kill_launch waited for each): it exits at once
        os.close(self._replies)
        self.pid = None


def start() -> AgentServer | None:
    """The agent server for a CPU run, or None (see the module's docstring)."""
    if os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux") or "torch" not in sys.modules:
        return None
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None or fork_server.threads() != 1 \
            or _interpreter_options():
        return None
    from ep_harness.console import Console

    Console.flush()  # nothing buffered for the fork to write a second time
    return AgentServer()


_current: AgentServer | None = None


def current() -> AgentServer | None:
    """The command's agent server while `serving` runs, else None."""
    return _current


@contextmanager
def serving():
    """The agent server (start()) for the block's launches, closed after them."""
    global _current
    server = start()
    before, _current = _current, server
    try:
        yield server
    finally:
        _current = before
        if server is not None:
            server.close()


def _interpreter_options() -> bool:
    """Whether this interpreter was started with options of its own (-O, -W, -X, -B, ...),
    which a fork would pass on and `python -m ep_harness.launch.agent` does not have."""
    first = sys.orig_argv[1] if len(sys.orig_argv) > 1 else ""
    return first.startswith("-") and first not in ("-m", "-c")


# --- the server process ---------------------------------------------------------------------

def _serve(requests: int, replies: int) -> int:
    """Fork an agent per request, report its pid and, once it ends, its exit code; end with
    the command (its death, or the request pipe closing)."""
    _die_with_parent()
    os.setsid()  # the command's terminal signals are the command's to pass on
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    # What every agent imports before it forks its ranks' fork server, once here.
    from ep_harness.launch.agent import _thread_pools_for_shared_cores, _imports_without_gc

    with _thread_pools_for_shared_cores(), _imports_without_gc():
        for name in ("torch.distributed.elastic.multiprocessing.errors", "torch.distributed.launcher.api",
                     "torch.distributed.run", "ep_harness.run.worker"):
            importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = os.fdopen(replies, "wb", buffering=0)
    buffer, agents = b"", set()
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [], 5.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while agents:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            agents.discard(pid)
            out.write((json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
        if requests in ready:
            chunk = os.read(requests, 1 << 20)
            if not chunk:
                return 0
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                server, request = os.getpid(), json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    os.close(wake_r)
                    os.close(wake_w)
                    out.close()
                    _agent({**request, "server": server})
                agents.add(pid)
                out.write((json.dumps({"id": request["id"], "started": pid}) + "\n").encode())


def _agent(request: dict) -> None:
    """In the forked agent: the state `python -m ep_harness.launch.agent ARGV` starts in, then
    its main, then its exit. Never returns."""
    code = 1
    try:
        os.setsid()  # as spawn's start_new_session: the launch is killed as this process group
        _die_with_parent()
        # A process of the launch that leaves it (a daemon: fork, setsid, parent exits) is
        # re-parented here, so kill_launch finds it as a descendant (a new agent's ranks carry
        # the launch's EP_HARNESS_CHANNEL in /proc/PID/environ; a fork's show the command's).
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        if os.getppid() != request["server"]:  # the server ended before the line above
            os._exit(128 + signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        for sig in RESET_SIGNALS:  # as exec leaves them, then Python's own SIGINT handler where not ignored
            signal.signal(sig, signal.SIG_IGN if sig.value in request["ignored"] else signal.SIG_DFL)
        if signal.SIGINT.value not in request["ignored"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        _fresh_path(env)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as Popen's close_fds: the command's files are its own
        _fresh_streams(env)
        _fresh_exit_handlers()
        _fresh_random_state()
        from ep_harness import console

        console._current = None
        from ep_harness.launch import agent

        _agent_as_main()
        sys.argv = [sys.modules["__main__"].__file__, *request["argv"]]
        code = agent.main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:  # the interpreter's own exit: the agent's exit handlers, multiprocessing's, the streams
        exit_now(code)


def _fresh_exit_handlers() -> None:
    """The command's exit handlers are the command's; those a new interpreter has after
    importing torch and logging are registered again (multiprocessing's first: it runs last)."""
    import logging
    import multiprocessing.util
    import weakref

    atexit._clear()
    atexit.register(multiprocessing.util._exit_function)
    atexit.register(logging.shutdown)
    weakref.finalize._registered_with_atexit = False  # registers itself again with its next finalizer


def _fresh_random_state() -> None:
    """numpy's global random state drawn from the OS, as numpy does as it loads in a new agent,
    not the command's (Python's `random` reseeds itself in a fork)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _agent_as_main() -> None:
    """`__main__` as `python -m ep_harness.launch.agent` has it (a package's __main__, which
    multiprocessing never imports again in the ranks), not the command's script, unexecuted."""
    spec = importlib.util.find_spec(f"{AGENT_MODULE}.__main__")
    main = types.ModuleType("__main__")
    main.__spec__, main.__file__, main.__package__ = spec, spec.origin, AGENT_MODULE
    sys.modules["__main__"] = main


def _fresh_path(env: dict[str, str]) -> None:
    """The import path a new interpreter in `env` starts with: PYTHONPATH's entries first,
    then this interpreter's own (the standard library, site-packages and what their .pth files
    add), less the folder of the command's script or its working directory."""
    own = sys.path if sys.flags.safe_path else sys.path[1:]
    first = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = list(dict.fromkeys([*first, *own]))
    sys.path_importer_cache.clear()


def _fresh_streams(env: dict[str, str]) -> None:
    """stdout and stderr on the log as a new interpreter opens them (unbuffered with PYTHONUNBUFFERED)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = locale.getpreferredencoding(False)
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors,
                                  line_buffering=not unbuffered and fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
