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
signal handlers and exit handlers of its own; it dies with the server, which dies with the
command (PR_SET_PDEATHSIG).

Where the launch's environment differs from the command's in what is read as an interpreter
starts or as torch and the harness import (IMPORT_TIME_VARIABLES), the agent is a new
interpreter as before; so it is on GPUs (a fork must never follow a CUDA initialisation), on
several nodes, and where the command has a thread by then. The launch pins PYTHONHASHSEED=0,
which a forked process cannot change: a command started with it (`make verify`, the tests)
forks its agents, any other starts them anew. EP_HARNESS_AGENT_FORKS=0 turns the server off. One difference remains: /proc/PID/environ of a forked agent, and of its ranks, is
the command's environment at its start (the kernel keeps the block the process was executed
with), so a stray that leaves the launch's process groups is found as a descendant, or by the
launch's EP_HARNESS_CHANNEL only where it executed a program (ep_harness.launch.processes.kill_launch).
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
from ep_harness.launch.channel import SECRET_ENV

# Variables a process reads as it starts or as torch and the harness import (nodes.py and
# launcher.py read their timeouts then): an agent whose environment differs from the server's
# in one of them is a new interpreter.
IMPORT_TIME_PREFIXES = ("PYTHON", "EP_HARNESS_", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "CUDA", "NCCL_", "LD_",
                        "LC_", "LANG")
# ... except those the launcher sets for every launch, which the agent and its ranks read only
# once they run: the path is rebuilt from PYTHONPATH below; each rank sets its thread count with
# torch.set_num_threads (ep_harness.threads.apply_in_rank); the pins of NCCL and symmetric memory
# are read as a communicator is made (ep_harness.environment.pinned_env). PYTHONHASHSEED is
# not among them: the launch pins 0, so a command forks its agents only if it was started so.
PER_LAUNCH = {"PYTHONPATH", "PYTHONSAFEPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "EP_HARNESS_STORE",
              "EP_HARNESS_CHANNEL", "EP_HARNESS_JOB_DIR", "EP_HARNESS_NODE", SECRET_ENV,
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", *FORCED_ENV}
AGENT_MODULE = "ep_harness.launch.agent"
# The signals a command or the server may handle, which an agent starts with as after exec.
RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                 signal.SIGCHLD)
SWITCH = "EP_HARNESS_AGENT_FORKS"


def at_import(env: dict[str, str], skip=frozenset()) -> dict[str, str]:
    """The variables of `env` read as an interpreter starts or the harness imports, less `skip`."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in skip}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ForkedAgent:
    """What the launcher uses of subprocess.Popen, for an agent forked by the server."""

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

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AgentServer:
    """The command's agent server (see the module's docstring); `spawn` forks an agent, or
    returns None where the agent must be a new interpreter."""

    def __init__(self):
        self.env = dict(os.environ)  # the command's, as the server was forked
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        self._buffer, self.exits, self.dead, self.running = b"", {}, False, set()
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
        """Whether `cmd` in `env` is an agent this server forks as a fresh interpreter would run it."""
        return (not self.dead and cmd[:3] == [sys.executable, "-m", AGENT_MODULE]
                and at_import(env, PER_LAUNCH) == at_import(self.env, PER_LAUNCH))

    def spawn(self, cmd: list[str], env: dict[str, str], log_path) -> ForkedAgent | None:
        if not self.serves(cmd, env):
            return None
        # what an exec'd agent inherits: the signals ignored here stay ignored, the others are reset
        ignored = [s.value for s in RESET_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
        request = {"argv": cmd[3:], "env": env, "log": str(log_path), "cwd": os.getcwd(), "ignored": ignored}
        try:
            os.write(self._requests, (json.dumps(request) + "\n").encode())
        except OSError:  # the server is gone: a new interpreter then
            self.dead = True
            return None
        deadline = time.monotonic() + 60
        while "started" not in self.exits and not self.dead and time.monotonic() < deadline:
            self.drain(1.0)
        started = self.exits.pop("started", None)
        if started is None:
            self.dead = True
            return None
        self.running.add(started)
        return ForkedAgent(self, started, cmd)

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
                self.exits["started"] = reply["started"]
            else:
                self.running.discard(reply["pid"])
                self.exits[reply["pid"]] = reply["returncode"]

    def _lost(self) -> None:
        """The server ended: its agents were killed with it (PR_SET_PDEATHSIG)."""
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
        if not self.dead:  # its agents have ended (kill_launch waited for each): it exits at once
            self._lost()
        os.close(self._replies)
        self.pid = None


def start() -> AgentServer | None:
    """The agent server for a single-node CPU run, or None (see the module's docstring)."""
    if os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux") or "torch" not in sys.modules:
        return None
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None or _threads() != 1:
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


# --- the server process ---------------------------------------------------------------------

def _serve(requests: int, replies: int) -> int:
    """Fork an agent per request, report its pid and, once it ends, its exit code; end with
    the command (its death, or the request pipe closing)."""
    _die_with_parent()
    os.setsid()  # the command's terminal signals are the command's to pass on
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    # What every agent imports before it forks its ranks' fork server, once here.
    from ep_harness.launch.agent import _blas_without_a_thread_pool, _imports_without_gc

    with _blas_without_a_thread_pool(), _imports_without_gc():
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
                server = os.getpid()
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    os.close(wake_r)
                    os.close(wake_w)
                    out.close()
                    _agent({**json.loads(line), "server": server})
                agents.add(pid)
                out.write((json.dumps({"started": pid}) + "\n").encode())


def _agent(request: dict) -> None:
    """In the forked agent: the state `python -m ep_harness.launch.agent ARGV` starts in, then
    its main, then its exit. Never returns."""
    code = 1
    try:
        os.setsid()  # as spawn's start_new_session: the launch is killed as this process group
        _die_with_parent()
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
        atexit._clear()  # the command's exit handlers are the command's
        from ep_harness import console

        console._current = None
        from ep_harness.launch import agent

        _agent_as_main()
        sys.argv = [sys.modules["__main__"].__file__, *request["argv"]]
        code = agent.main(request["argv"])
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
        code = 0 if code is None else code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:  # the interpreter's own exit: the agent's exit handlers, multiprocessing's, the streams
            atexit._run_exitfuncs()
            import multiprocessing.util

            multiprocessing.util._exit_function()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


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
