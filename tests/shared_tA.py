"""Shared launches and command-line runs for test_verify_cpu, test_robust_inputs,
test_reliability, test_threads, test_golden_bits, test_corruption and test_ci_outputs.

`cli_fork`: `ep-harness ARGS` for commands that start no ranks of their own (refusals, `gate`,
`report`, `baseline`), each in a process of its own, forked from one interpreter per test
process that has imported torch and the harness already (1.5-2 s of CPU a command otherwise).
What a command prints, its exit code and what it writes are its own; only the imports are
shared. Commands that launch ranks, and tests of what a fresh interpreter does (its locale,
its signals), keep run_cli.

`pass_run`: one passing run, once per test session, whose records several tests read (see
PASS_SUITE). `golden_run`: that run's suite with one subject changed, for the golden-bits gate.
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

from tests.conftest import REPO, completed, once_per_session, run_cli, shared_dir

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

    def __init__(self):
        import locale

        self.encoding = locale.getpreferredencoding(False)
        self.folder = Path(tempfile.mkdtemp(prefix="ep-cli-fork-"))
        read, write = os.pipe()
        self.log = self.folder / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(write)], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=log, stderr=log, pass_fds=(write,), text=True)
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


# --- one passing run that several tests read ----------------------------------------------------

CASES = REPO / "tests" / "cases"
# The case files whose cases the shared run holds, each test's own file: the cases as written
# there (a case renamed where two files use one name), under one [suite] with all their plugins.
PASS_SUITE = {
    "golden_a.toml": {},  # test_golden_bits: an invariant fold, the baseline's (golden_run: golden_b.toml's)
    "fresh.toml": {'name = "fold"': 'name = "fresh-fold"'},  # test_golden_bits: the one-launch control
    "threads.toml": {},  # test_threads: the pinned thread count (--threads 2 from OMP_NUM_THREADS=1)
    "unmeasured.toml": {},  # test_robust_inputs: a case of which nothing was measured
}
PASS_PLUGINS = ["tests.planted", "tests.planted_threads", "tests.planted_robust"]
# test_reliability: the run starts in a directory whose modules would shadow the standard
# library and the harness, with credentials in its environment that must not be recorded.
SECRETS = {"EP_API_TOKEN": "secret-value", "NCCL_SOCKET_KEY": "another-secret"}


def _cases_of(name: str, renames: dict) -> str:
    text = (CASES / name).read_text()
    cases = text[text.index("[[case]]"):]
    for old, new in renames.items():
        assert cases.count(old) == 1, (name, old)
        cases = cases.replace(old, new)
    return cases


def pass_suite_text(golden: str = "golden_a.toml") -> str:
    parts = [f'[suite]\nname = "shared-pass"\nplugins = {json.dumps(PASS_PLUGINS)}\n']
    for name, renames in PASS_SUITE.items():
        parts.append(f"# --- {name}\n" + _cases_of(golden if name == "golden_a.toml" else name, renames))
    return "\n".join(parts)


def pass_suite_run(folder: Path, golden: str = "golden_a.toml") -> subprocess.CompletedProcess:
    """`ep-harness verify` of pass_suite_text(golden) with --threads 2 from a shell with
    OMP_NUM_THREADS=1, started in FOLDER/work (modules that shadow `json` and a `reports`
    package there), with SECRETS in its environment; the run in FOLDER/out/latest."""
    work = folder / "work"
    (work / "reports").mkdir(parents=True)
    (work / "json.py").write_text("raise SystemExit('the working directory shadowed the standard library')\n")
    (work / "reports" / "__init__.py").write_text("raise SystemExit('the user reports package was imported')\n")
    suite = folder / "suite.toml"
    suite.write_text(pass_suite_text(golden))
    env = {**os.environ, **SECRETS, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # the plugins
    exe = shutil.which("ep-harness", path=str(Path(sys.executable).parent)) or "ep-harness"
    return subprocess.run([exe, "verify", "--suite", str(suite), "--gpus", "0", "--threads", "2", "--no-report",
                           "--out", str(folder / "out")], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="session")
def pass_run(tmp_path_factory):
    """pass_suite_run once per test session: (the process, the run directory, records by check)."""
    result = once_per_session(tmp_path_factory, "tA-pass-run", lambda folder: completed(pass_suite_run(folder)))
    run_dir = shared_dir(tmp_path_factory) / "tA-pass-run" / "out" / "latest"
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    return subprocess.CompletedProcess(**result), run_dir, {r["check"]: r for r in records}


# --- one failing run that two tests read --------------------------------------------------------

# test_verify_cpu's planted faults (each an error record, the run going on in relaunches), then
# test_corruption's clean and rarely corrupting dispatchers, in the launch after the last fault.
FAIL_SUITE = ("faults.toml", "corruption.toml")


def fail_suite_text() -> str:
    return '[suite]\nname = "shared-fail"\nplugins = ["tests.planted"]\n\n' + \
        "\n".join(f"# --- {name}\n" + _cases_of(name, {}) for name in FAIL_SUITE)


@pytest.fixture(scope="session")
def fail_run(tmp_path_factory):
    """`ep-harness verify` of fail_suite_text(), once per test session: (the process, the run
    directory, records by case)."""
    def make(folder: Path) -> dict:
        folder.mkdir(parents=True)
        suite = folder / "suite.toml"
        suite.write_text(fail_suite_text())
        return completed(run_cli("verify", "--suite", str(suite), "--gpus", "0", "--out", str(folder / "out")))

    result = once_per_session(tmp_path_factory, "tA-fail-run", make)
    run_dir = shared_dir(tmp_path_factory) / "tA-fail-run" / "out" / "latest"
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    return subprocess.CompletedProcess(**result), run_dir, {r["case"]: r for r in records}
