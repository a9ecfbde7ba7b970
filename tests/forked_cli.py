"""`ep-harness ARGS`, each in a process of its own, forked from one interpreter that has imported
torch and the harness already (1.5-2 s of CPU a command otherwise). What a command prints, its
exit code, what it writes and the ranks it launches are its own; only the imports are shared,
and it ends as the console script does (`sys.exit(main())`, then the interpreter's exit steps
a command can observe, without the teardown of every object: ep_harness.process_exit).
Tests of what a fresh interpreter does (its locale, its signals, its start-up) start one of
their own; conftest.run_cli starts one where the environment differs in what is read at start-up.
Two start-up differences are reproduced in the fork instead: directories in front of the
server's PYTHONPATH, put where the interpreter puts them unless one holds a module the server
has imported (a fresh interpreter would import that one), and `python -m ep_harness` (the
working directory first on the path, the package's __main__ run as the interpreter runs it).

`shared_server`: conftest.run_cli's server (and conftest.start_cli's, whose command is
started and not waited for: ForkedRun), one per test process. `cli_fork`: a fixture, the
same server whatever the environment. `cli_batch`: many command lines forked from one
interpreter (inside once_per_session's makers).
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, command, completed, module_name

# The fork server: reads one JSON request a line on stdin, forks a child per request that runs
# the console script's `sys.exit(main(argv))` (kind "ep-harness") or `python -m pytest ARGV`
# (kind "pytest") in the request's directory and environment, with stdout and stderr in the
# request's files, and answers with the child's pid, then its exit status.
_SERVER = r"""
import io, json, os, sys
kind = sys.argv[2]
# As the console script: the script's folder first on the path, never the working directory
# (`python -m pytest` puts the working directory first: the child does, once it is there).
sys.path[:] = [os.path.dirname(sys.executable)] * (kind == "ep-harness") + [p for p in sys.path if p not in ("", ".")]
# numpy's OpenBLAS, which torch loads, starts a thread pool as it loads unless told otherwise
# (as ep_harness.launch.agent does before its fork server): a fork needs one thread.
blas = os.environ.get("OPENBLAS_NUM_THREADS")
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import gc
gc.disable()  # while the preloads import (the collector would walk all they make, finding nothing)
import torch  # what every command that plans checks imports, and the sessions' ranks and tests
if kind == "ep-harness":
    import ep_harness.cli
    for name in ("ep_harness.run.verify", "ep_harness.run.plan", "ep_harness.cases", "ep_harness.subject",
                 "ep_harness.regress.gate", "ep_harness.reports.render", "ep_harness.selftest.run"):
        __import__(name)
else:  # pytest alone: a plugin imported before pytest loads it could not have its asserts rewritten
    import pytest, pytest.__main__
if blas is None:
    del os.environ["OPENBLAS_NUM_THREADS"]
# What the preloads made lives as long as each child: out of the collector's reach, as the
# harness's agent does (a child's exit would otherwise walk all torch made: 0.3 CPU-s). A
# child collects as a new interpreter does.
gc.freeze()
gc.enable()
threads = len(os.listdir("/proc/self/task"))
reply = os.fdopen(int(sys.argv[1]), "w")
reply.write(json.dumps({"threads": threads, "modules": sorted({m.partition(".")[0] for m in sys.modules})}) + "\n")
reply.flush()


def child(req):
    if req["new_session"]:  # as Popen's start_new_session
        os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_TRUNC)):
        if fd == 2 and path == req["stdout"]:  # stderr=STDOUT: one file, one offset
            os.dup2(1, 2)
            continue
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    reply.close()
    enc, unbuffered = req["encoding"], bool(req["env"].get("PYTHONUNBUFFERED"))  # as the interpreter opens them
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=enc)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=enc,
                                                   write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=enc,
                                                   errors="backslashreplace", line_buffering=True,
                                                   write_through=unbuffered)
    sys.path[1:1] = req["path"]  # PYTHONPATH's entries the server started without: after the script's place
    if kind == "pytest":  # as `python -m pytest`, to the end (pytest/__main__.py)
        sys.argv = [pytest.__main__.__file__, *req["argv"]]
        sys.path.insert(0, os.getcwd())
        run = pytest.console_main
    elif req["code"] is not None:  # as `python -c CODE`: the working directory ('') in the script's place
        import types
        sys.path[0] = ""
        sys.argv = ["-c", *req["argv"]]
        main = sys.modules["__main__"] = types.ModuleType("__main__")  # what it defines pickles by name
        run = lambda: exec(compile(req["code"], "<string>", "exec"), main.__dict__)
    elif req["module"]:  # as `python -m MODULE`: the working directory in the script's place
        import runpy
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *req["argv"]]
        def run():  # a module that returns (not sys.exit) ends with status 0, not its globals
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:  # as the console script: `sys.exit(main())`, main reading sys.argv (and ending the process itself)
        sys.argv = ["ep-harness", *req["argv"]]
        run = ep_harness.cli.main
    try:
        code = run()
    except SystemExit as exc:
        code = exc.code
    # The interpreter's exit steps a command can observe, not the teardown of every object the
    # preloads made (0.2 CPU-s a command). An exception other than SystemExit never gets here:
    # the interpreter ends that command (traceback, status 1, KeyboardInterrupt's signal).
    from ep_harness.process_exit import exit_now
    exit_now(code)


for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
"""


class ForkedCli:
    """`ep-harness ARGS` (or `python -m pytest ARGS`: kind "pytest") forked from a preloaded
    interpreter (see the module's docstring)."""

    def __init__(self, env: dict | None = None, kind: str = "ep-harness"):
        """`env`: the interpreter's environment (its PYTHONPATH decides what plugins import)."""
        import locale

        self.env = dict(os.environ if env is None else env)
        self.kind = kind
        self.encoding = locale.getpreferredencoding(False)
        self.folder = Path(tempfile.mkdtemp(prefix="ep-cli-fork-"))
        read, write = os.pipe()
        self.log = self.folder / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(write), kind], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=log, stderr=log, pass_fds=(write,), text=True, env=self.env)
        os.close(write)
        self.reply, self._pending = read, b""  # the server's answers: a pipe, read a line at a time
        try:
            hello = json.loads(self._line(300))
        except subprocess.TimeoutExpired:
            self.close()
            raise
        # A fork of a process with threads may hang in the child: the preloaded imports start none.
        assert hello["threads"] == 1, hello
        self.modules = set(hello["modules"])  # top-level names the preloads imported
        self._running: ForkedRun | None = None  # start()'s command until its status is read
        self.started = 0

    def serves(self, env: dict) -> bool:
        """Whether a command in `env` behaves here as in a fresh interpreter (path_ahead)."""
        return self.path_ahead(env) is not None

    def path_ahead(self, env: dict) -> list[str] | None:
        """The directories `env`'s PYTHONPATH puts in front of this server's, or None where a
        command in `env` would not behave here as in a fresh interpreter: what is read as the
        interpreter starts or as the harness's modules import (PYTHON*, EP_HARNESS_*, the
        thread-count and library variables) differs from this server's in more than those
        directories, or one of them holds a module (file, package or extension) by the name
        of one the server has imported, or is a file."""
        ahead = _path_ahead(env, self.env) if self.proc.poll() is None else None
        for folder in ahead or ():  # one that does not exist holds nothing; a file (a zip) is not reproduced
            if os.path.isdir(folder):
                if {e.partition(".")[0] for e in os.listdir(folder)} & self.modules:
                    return None
            elif os.path.exists(folder):
                return None
        return ahead

    def _line(self, timeout: float) -> str:
        """The server's next answer. Read from the descriptor itself, unbuffered by Python: a
        child that ends at once sends its status right behind its pid, and a buffered reader
        would hold that second line where select() cannot see it."""
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.reply], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"{self.kind} (forked)", timeout)
            chunk = os.read(self.reply, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the {self.kind} fork server ended (exit {self.proc.wait()}): "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def __call__(self, *args: str, cwd=REPO, env: dict | None = None, timeout: float = 600,
                 module: bool | str = False, code: str | None = None):
        """`ep-harness ARGS` (`module`: `python -m ep_harness ARGS`, or that MODULE; `code`:
        `python -c CODE ARGS`) in CWD, as subprocess.run (capture_output=True, text=True) returns it."""
        out, err = self.send(args, cwd, env, module, code)
        status = self.status(timeout)
        argv = [sys.executable, "-m", "pytest"] if self.kind == "pytest" else command(module, code)
        return subprocess.CompletedProcess([*argv, *args], status, self.read(out), self.read(err))

    def start(self, *args: str, cwd=REPO, env: dict | None = None, code: str | None = None) -> "ForkedRun":
        """`ep-harness ARGS` (`code`: `python -c CODE ARGS`) in CWD, not waited for: as
        subprocess.Popen(stdout=PIPE, stderr=STDOUT, text=True, start_new_session=True) starts
        it (ForkedRun). The server makes nothing else until it has ended (the next command ends
        it first)."""
        self.started += 1  # its output a file of its own, read when the test asks (after later commands too)
        out, _ = self.send(args, cwd, env, code=code, output=f"started-{self.started}", new_session=True)
        self._running = ForkedRun(self, json.loads(self._line(60))["pid"], out)
        return self._running

    def read(self, path: Path) -> str:
        """A command's output as subprocess.run(text=True) reads a pipe: the locale's encoding,
        universal newlines."""
        return io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding=self.encoding).read()

    def send(self, args, cwd=REPO, env: dict | None = None, module: bool | str = False, code: str | None = None,
             output: str | None = None, new_session: bool = False) -> tuple[Path, Path]:
        """Ask for one command (see __call__); the files its stdout and stderr go to (`output`:
        both to that one). An environment this server does not serve (path_ahead) runs with the
        server's path."""
        if self._running is not None:  # a started command its test did not wait for (it failed first)
            self._running.end()
        out, err = (self.folder / output,) * 2 if output else (self.folder / "stdout", self.folder / "stderr")
        out.write_bytes(b"")
        err.write_bytes(b"")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in args], "cwd": str(cwd), "env": env,
                                          "path": self.path_ahead(env) or [], "module": module_name(module), "code": code,
                                          "stdout": str(out), "stderr": str(err), "encoding": self.encoding,
                                          "new_session": new_session}) + "\n")
        self.proc.stdin.flush()
        return out, err

    def status(self, timeout: float) -> int:
        """The exit status of the command asked for (its pid first, then its status)."""
        pid = None
        try:
            pid = json.loads(self._line(60))["pid"]
            return json.loads(self._line(timeout))["returncode"]
        except subprocess.TimeoutExpired:  # as subprocess.run: the command is killed (its agent dies with it)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            self.close()
            raise

    def close(self):
        if self._running is not None and self.proc.poll() is None:
            self._running.end()
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        if self.reply is not None:  # closed once, whoever closes first
            os.close(self.reply)
            self.reply = None
        shutil.rmtree(self.folder, ignore_errors=True)


class ForkedRun:
    """What a test uses of subprocess.Popen for a command ForkedCli.start started: its pid,
    poll, wait, send_signal, communicate (its output: stdout and stderr in one) and returncode."""

    def __init__(self, server: ForkedCli, pid: int, output: Path):
        self.server, self.pid, self.output, self.returncode = server, pid, output, None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None and self._ended(0) else self.returncode

    def _ended(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.server.reply], [], [], timeout)
        return bool(ready) or b"\n" in self.server._pending

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(f"ep-harness (forked, pid {self.pid})", timeout)
            self.returncode = json.loads(self.server._line(60))["returncode"]
            self.server._running = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the server (as Popen, which ignores one gone meanwhile)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.server.read(self.output), None

    def end(self) -> None:
        """Killed if still running, and waited for (a command its test did not wait for)."""
        self.kill()
        self.wait(60)


# Variables a process reads as it starts or as torch and the harness's modules import (nodes.py
# and launcher.py read their timeouts then): a command whose environment differs in one of them
# is not forked from a server started without it.
IMPORT_TIME_PREFIXES = ("PYTHON", "EP_HARNESS_", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "ATEN_", "KMP_",
                        "GOMP_", "CUDA", "NCCL_", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG")
_SESSION_ENV = dict(os.environ)  # as the test session started, before any test's monkeypatch
_SERVERS: dict[tuple, ForkedCli] = {}


def at_import(env: dict) -> dict:
    """What of `env` a process reads as it starts or as its modules import."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONUNBUFFERED"}


def _path_ahead(env: dict, start: dict) -> list[str] | None:
    """The entries `env`'s PYTHONPATH puts in front of `start`'s, or None where `env` differs
    from `start` in what is read at start-up other than those, its PYTHONPATH does not end
    with `start`'s, or an entry in front is empty (the working directory)."""
    theirs, mine = at_import(env), at_import(start)
    t, m = [p.split(os.pathsep) if p else [] for p in (theirs.pop("PYTHONPATH", ""), mine.pop("PYTHONPATH", ""))]
    ahead = t[:len(t) - len(m)]
    if theirs != mine or len(t) < len(m) or t[len(t) - len(m):] != m or "" in ahead:
        return None
    return ahead


def _server(env: dict, kind: str = "ep-harness") -> ForkedCli:
    """This test process's server of `kind` for `env`'s start-up variables (started on first
    use, ended as the process ends)."""
    key = (kind, tuple(sorted(at_import(env).items())))
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = ForkedCli(env, kind)
        atexit.register(server.close)
    return server


def _shared() -> ForkedCli:
    """This test process's server in the session's environment."""
    return _server(_SESSION_ENV)


def shared_server(env: dict) -> ForkedCli | None:
    """The server for a command in `env`, or None where `env` needs a fresh interpreter: one in
    the session's environment, or in the session's with the checkout on PYTHONPATH (the commands
    whose ranks import the tests' plugins, conftest.REPO_ON_PYTHONPATH), where `env` reads the
    same as one of those at start-up but for directories in front of its PYTHONPATH
    (ForkedCli.path_ahead)."""
    from tests.conftest import REPO_ON_PYTHONPATH

    for start in (_SESSION_ENV, {**_SESSION_ENV, **REPO_ON_PYTHONPATH}):
        if _path_ahead(env, start) is not None:  # before a server is started for it
            server = _server(start)
            if server.serves(env):
                return server
    return None


def forked_pytest(*args: str, cwd, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` in CWD with environment `env`, a process of its own forked from an
    interpreter started in `env` that has imported torch and pytest (1.1 CPU-s less a session),
    as subprocess.run(capture_output=True, text=True) returns it. For sessions whose tests or
    ranks import torch anyway; a test of what a session imports starts a new interpreter."""
    return _server(env, "pytest")(*map(str, args), cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def cli_fork():
    """`cli_fork(*args, cwd=REPO, env=None)`: as conftest.run_cli, forked from this test
    process's preloaded interpreter whatever the environment (its PYTHONPATH is the server's)."""
    return _shared()


def cli_batch(jobs: list[tuple[list, Path]], env: dict, timeout: float = 600) -> list[dict]:
    """`ep-harness ARGS` in CWD for every (ARGS, CWD) of `jobs`, each forked from one
    interpreter with environment `env`: this test process's server where it serves `env`
    (shared_server), else one started for the batch (a new interpreter costs 1.5 CPU-s).
    Returns per job what conftest.completed returns for a process."""
    shared = shared_server(env)
    server = shared or ForkedCli(env)
    try:
        return [completed(server(*map(str, args), cwd=cwd, env=env, timeout=timeout)) for args, cwd in jobs]
    finally:
        if server is not shared:
            server.close()
