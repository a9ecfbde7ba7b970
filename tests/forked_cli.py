"""`ep-harness ARGS` for commands that start no ranks of their own (refusals, `gate`, `report`,
`baseline`, followers that refuse their head), each in a process of its own, forked from one
interpreter that has imported torch and the harness already (1.5-2 s of CPU a command otherwise).
What a command prints, its exit code and what it writes are its own; only the imports are
shared. Commands that launch ranks, and tests of what a fresh interpreter does (its locale,
its signals), keep conftest.run_cli.

`cli_fork`: a fixture, one such interpreter per test process. `cli_batch`: many command lines
in one interpreter started for them (inside once_per_session's makers).
"""
from __future__ import annotations

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

from tests.conftest import REPO, completed

# The fork server: reads one JSON request a line on stdin, forks a child per request that runs
# the console script's `sys.exit(main(argv))` in the request's directory and environment, with
# stdout and stderr in the request's files, and answers with the child's exit status.
_SERVER = r"""
import atexit, io, json, os, sys, traceback
# As the console script: the script's folder first on the path, never the working directory.
sys.path[:] = [os.path.dirname(sys.executable)] + [p for p in sys.path if p not in ("", ".")]
# numpy's OpenBLAS, which torch loads, starts a thread pool as it loads unless told otherwise
# (as ep_harness.launch.agent does before its fork server): a fork needs one thread.
blas = os.environ.get("OPENBLAS_NUM_THREADS")
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import torch  # what every command that plans checks imports
import ep_harness.cli
for name in ("ep_harness.run.verify", "ep_harness.run.plan", "ep_harness.cases", "ep_harness.subject",
             "ep_harness.regress.gate", "ep_harness.reports.render", "ep_harness.selftest.run"):
    __import__(name)
if blas is None:
    del os.environ["OPENBLAS_NUM_THREADS"]
threads = len(os.listdir("/proc/self/task"))
reply = os.fdopen(int(sys.argv[1]), "w")
reply.write(json.dumps({"threads": threads}) + "\n")
reply.flush()


def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    reply.close()
    enc = req["encoding"]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=enc)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=enc)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=enc,
                                                   errors="backslashreplace", line_buffering=True)
    sys.argv = ["ep-harness", *req["argv"]]
    try:
        code = ep_harness.cli.main(req["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        if code is None:
            code = 0
        elif not isinstance(code, int):  # sys.exit("message"): the message on stderr, status 1
            print(code, file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
"""


class ForkedCli:
    """`ep-harness ARGS` forked from a preloaded interpreter (see the module's docstring)."""

    def __init__(self, env: dict | None = None):
        """`env`: the interpreter's environment (its PYTHONPATH decides what plugins import)."""
        import locale

        self.encoding = locale.getpreferredencoding(False)
        self.folder = Path(tempfile.mkdtemp(prefix="ep-cli-fork-"))
        read, write = os.pipe()
        self.log = self.folder / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(write)], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=log, stderr=log, pass_fds=(write,), text=True, env=env)
        os.close(write)
        self.reply = os.fdopen(read, "r")
        hello = json.loads(self._line(300))
        # A fork of a process with threads may hang in the child: the preloaded imports start none.
        assert hello["threads"] == 1, hello

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.reply], [], [], timeout)
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired("ep-harness (forked)", timeout)
        line = self.reply.readline()
        if not line:
            raise RuntimeError(f"the ep-harness fork server ended (exit {self.proc.wait()}): "
                               f"{self.log.read_text(errors='replace')[-3000:]}")
        return line

    def __call__(self, *args: str, cwd=REPO, env: dict | None = None, timeout: float = 600):
        out, err = self.folder / "stdout", self.folder / "stderr"
        out.write_bytes(b"")
        err.write_bytes(b"")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in args], "cwd": str(cwd), "env": env,
                                          "stdout": str(out), "stderr": str(err), "encoding": self.encoding}) + "\n")
        self.proc.stdin.flush()
        code = json.loads(self._line(timeout))["returncode"]
        def read(path):  # as subprocess.run(text=True) reads a pipe: the locale's encoding, universal newlines
            return io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding=self.encoding).read()

        return subprocess.CompletedProcess(["ep-harness", *args], code, read(out), read(err))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self.reply.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def cli_fork():
    """`cli_fork(*args, cwd=REPO, env=None)`: as conftest.run_cli, for commands that start no
    ranks, forked from one preloaded interpreter of this test process."""
    server = ForkedCli()
    yield server
    server.close()


def cli_batch(jobs: list[tuple[list, Path]], env: dict, timeout: float = 600) -> list[dict]:
    """`ep-harness ARGS` in CWD for every (ARGS, CWD) of `jobs`, each forked from one
    interpreter started for the batch with environment `env`. Returns per job what
    conftest.completed returns for a process."""
    server = ForkedCli(env)
    try:
        return [completed(server(*map(str, args), cwd=cwd, env=env, timeout=timeout)) for args, cwd in jobs]
    finally:
        server.close()
