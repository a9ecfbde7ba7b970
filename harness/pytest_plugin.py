"""pytest integration (entry point `pytest11: ep_harness`).

* `@pytest.mark.gpus(n)`: skipped with the reason where fewer than n GPUs are visible.
* `ep_world`: a factory fixture; `ep_world(4).run(fn, *args)` runs `fn(rank, world_size,
  *args)` on 4 ranks with an initialized process group (gloo on CPU, NCCL on GPUs) and
  returns every rank's result; an exception on any rank is raised here, unchanged.
* `assert_bitwise_equal` / `assert_invariant`: the harness's comparison and mismatch text.
* `pytest --ep-suite smoke`: one pytest item per check of a suite, all measured by one verify
  run of every collected check (one launch on gloo), shared by pytest-xdist's workers through
  a private directory (mkdtemp, 0700) that the session's controller makes and names to its
  workers, never a guessable one: records found anywhere else, or not stamped with the
  session's nonce, are never read.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
import traceback
from pathlib import Path

import pytest

# --- assertions ---------------------------------------------------------------------


def assert_bitwise_equal(actual, expected, labels=None, what: str = "rank-invariance") -> dict:
    """Raise AssertionError with the harness's mismatch text unless every bit matches.

    `expected` is one copy ([...]) compared with every row of `actual` ([n, ...]), or a tensor
    of actual's shape. A shape or dtype mismatch is an AssertionError too, as in
    torch.testing.assert_close."""
    from ep_harness.compare import compare_bitwise
    from ep_harness.reports.text import mismatch_text

    if actual.dtype != expected.dtype:
        raise AssertionError(f"The values for attribute 'dtype' do not match: {actual.dtype} != {expected.dtype}.")
    if tuple(expected.shape) not in (tuple(actual.shape), tuple(actual.shape[1:])):
        raise AssertionError(f"The values for attribute 'shape' do not match: {tuple(actual.shape)} != "
                             f"{tuple(expected.shape)}.")

    m = compare_bitwise(actual, expected, labels)
    record = {"property": what, "rerun": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], **m.to_dict()}
    record["detail"] = {"max_abs_index": m.max_abs_index, "max_ulp_index": m.max_ulp_index}
    if m.mismatched:
        raise AssertionError(mismatch_text(record))
    return record


def assert_invariant(copies, labels=None, what: str = "rank-invariance") -> dict:
    """Every copy of a result (one per placement) must equal the first, bit for bit."""
    import torch

    stacked = torch.stack(list(copies)) if not isinstance(copies, torch.Tensor) else copies
    return assert_bitwise_equal(stacked, stacked[0], labels, what)


# --- multi-rank world ---------------------------------------------------------------


def _store(rank: int, result_dir: Path, timeout_s: float):
    """The process group's TCPStore. Rank 0 binds a port the OS picks and writes it down for
    the others: a port chosen in the parent and freed could be taken, before rank 0 binds
    it, by another test's ranks (seen under pytest-xdist: gloo's connectFullMesh then fails)."""
    from ep_harness.launch.channel import tcp_store

    port_file = result_dir / "store-port"
    if rank == 0:
        store = tcp_store("127.0.0.1", 0, is_master=True, timeout_s=timeout_s)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        port_file.with_suffix(".tmp").rename(port_file)  # whole or absent
        return store
    deadline = time.time() + timeout_s
    while not port_file.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank 0 did not start its store within {timeout_s:.0f} s")
        time.sleep(0.02)
    return tcp_store("127.0.0.1", int(port_file.read_text()), is_master=False, timeout_s=timeout_s)


def _rank_main(rank, world_size, backend, fn, args, result_dir, timeout_s, environ):
    import faulthandler
    import pickle
    import signal

    import torch
    import torch.distributed as dist

    os.environ.clear()  # the test's environment now, not the fork server's when it started
    os.environ.update(environ)
    result_dir = Path(result_dir)
    stacks = open(result_dir / f"stack-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # dumped when the call times out
    (result_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
    store = _store(rank, result_dir, timeout_s + 60)  # the caller's timeout comes first
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    # Every rank finishes connecting before any can leave: a rank whose fn raises at once and
    # exits would otherwise close its gloo pairs under peers still in connectFullMesh
    # ("Connection closed by peer", seen under pytest-xdist).
    dist.barrier()
    try:
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # carried back to the test process, with where it happened
        outcome = ("raised", type(exc).__name__, str(exc), traceback.format_exc(), isinstance(exc, AssertionError))
    finally:
        dist.destroy_process_group()
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # an unpicklable return value is the test's error, named
        data = pickle.dumps(("raised", "TypeError", f"rank {rank}'s return value cannot be sent back: {exc}", "",
                             False))
    (result_dir / f"rank{rank}.pkl").write_bytes(data)


class RankFailed(Exception):
    """A rank of an ep_world call raised; the message names it and carries its traceback."""


def _by_reference(fn) -> None:
    """Spawned ranks import fn by its qualified name: lambdas and closures cannot travel."""
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname or not hasattr(fn, "__module__"):
        raise TypeError(f"ep_world cannot send {qualname or fn!r} to spawned ranks: pass a module-level function "
                        f"and give it its data through run(fn, *args)")


class World:
    """`world_size` ranks in spawned processes, like torch.multiprocessing.spawn, plus: the
    failing rank's number and remote traceback, a per-call timeout with every rank's stack,
    and never a silent change of backend (NCCL needs a GPU per rank, or the test skips)."""

    def __init__(self, world_size: int, backend: str | None = None, timeout_s: float = 300.0, node=None):
        import torch

        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.backend = backend or ("nccl" if self.gpus else "gloo")
        if self.backend == "nccl" and self.gpus < world_size:
            pytest.skip(f"needs {world_size} GPUs for {world_size} NCCL ranks, found {self.gpus}")
        self.world_size, self.timeout_s, self.node = world_size, timeout_s, node

    def run(self, fn, *args) -> list:
        """fn(rank, world_size, *args) on every rank; returns every rank's result."""
        import multiprocessing
        import pickle

        import torch.multiprocessing as mp

        _by_reference(fn)
        if self.node is not None:
            self.node.user_properties.append(("ep_world", f"{self.backend} x{self.world_size}"))
        # Ranks are forked from a fork server that imported torch once (single-threaded, never
        # touching CUDA), not each started as a new interpreter: a fork of this session, which
        # has imported torch, where the machine has no GPU and the session one thread (a
        # session with numpy's BLAS pool has two), else started anew.
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
        if self.gpus == 0:
            from ep_harness.launch import fork_server

            fork_server.start_forked()
        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.start_processes(_rank_main, nprocs=self.world_size, join=False, start_method="forkserver",
                                     args=(self.world_size, self.backend, fn, args, tmp, self.timeout_s,
                                           dict(os.environ)))
            deadline = time.time() + self.timeout_s
            while not ctx.join(timeout=0.5):
                if time.time() > deadline:
                    self._time_out(ctx, Path(tmp))
            outcomes = [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(self.world_size)]
        for rank, outcome in enumerate(outcomes):
            if outcome[0] == "raised":
                _, name, message, remote, is_assertion = outcome
                where = f"raised on rank {rank} of {self.world_size} ({self.backend}); remote traceback:\n{remote}"
                if is_assertion:  # keeps the mismatch text first, as pytest shows assertion failures
                    raise AssertionError(f"{message}\n\n{where}")
                raise RankFailed(f"rank {rank} raised {name}: {message}\n\n{where}")
        return [o[1] for o in outcomes]

    def _time_out(self, ctx, tmp: Path) -> None:
        import signal

        for pid_file in tmp.glob("pid-rank*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGUSR1)
            except (OSError, ValueError):
                pass
        time.sleep(1.0)
        stacks = "\n".join(f"--- rank {p.stem[len('stack-rank'):]} ---\n{p.read_text()}"
                           for p in sorted(tmp.glob("stack-rank*.txt")))
        for process in ctx.processes:
            process.kill()
        pytest.fail(f"ep_world({self.world_size}) did not finish within {self.timeout_s:.0f} s; every rank's "
                    f"stack:\n{stacks}", pytrace=False)


@pytest.fixture
def ep_world(request):
    """ep_world(n, backend=None, timeout_s=300) -> World; World.run(fn, *args)."""
    return lambda world_size, backend=None, timeout_s=300.0: World(world_size, backend, timeout_s, request.node)


# --- markers and suite items --------------------------------------------------------


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def pytest_addoption(parser):
    group = parser.getgroup("ep-harness")
    group.addoption("--ep-suite", default=None, help="run a suite's checks as pytest items (e.g. smoke)")
    group.addoption("--ep-gpus", type=int, default=None, help="GPUS for --ep-suite (default: all visible)")
    group.addoption("--ep-allow-empty", action="store_true",
                    help="an --ep-suite session in which no check passed (all skipped or vacuous) succeeds")


SUITE_DIR = pytest.StashKey[tuple]()  # (private directory, nonce) of this session's --ep-suite run


def pytest_configure(config):
    # Nothing else: a session that uses none of the plugin's options imports nothing and
    # changes nothing (--ep-suite's one verify run sees every GPU, whichever worker makes it).
    config.addinivalue_line("markers", "gpus(n): needs n GPUs; skipped with the reason when fewer are visible")
    if config.getoption("--ep-suite", None):
        worker = getattr(config, "workerinput", None)
        if worker is not None:  # an xdist worker: the controller named the directory
            config.stash[SUITE_DIR] = (Path(worker["ep_suite_dir"]), worker["ep_suite_nonce"])
        else:  # the controller, or a session without xdist: mode 0700, an unguessable name
            config.stash[SUITE_DIR] = (Path(tempfile.mkdtemp(prefix="ep-harness-suite-")), secrets.token_hex(16))


def pytest_sessionstart(session):
    config = session.config
    if config.getoption("--ep-suite", None) and getattr(config, "workerinput", None) is None \
            and not config.getoption("--ep-allow-empty", False):  # the controller counts every worker's reports
        config.pluginmanager.register(NothingRan(), "ep-harness-nothing-ran")


class NothingRan:
    """`pytest --ep-suite` agrees with `ep-harness verify`: a session whose checks were all
    skipped or vacuous measured nothing that could fail, and exits 1, not 0 (pytest's exit
    for all-skipped). Counted on the controller from the reports (xdist workers send theirs)."""

    def __init__(self):
        self.checks, self.passed = set(), set()

    def pytest_runtest_logreport(self, report):
        check = dict(report.user_properties).get("ep_check")
        if check is not None:
            self.checks.add(check)
            if report.when == "call" and report.passed:
                self.passed.add(check)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.checks and not self.passed and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"ep-harness: nothing ran: none of the {len(self.checks)} check(s) passed (all "
                                    f"skipped or vacuous); pass --ep-allow-empty to accept that")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: each worker is told the controller's directory and nonce."""
    if SUITE_DIR in node.config.stash:
        shared, nonce = node.config.stash[SUITE_DIR]
        node.workerinput["ep_suite_dir"], node.workerinput["ep_suite_nonce"] = str(shared), nonce


def pytest_unconfigure(config):
    if SUITE_DIR in config.stash and getattr(config, "workerinput", None) is None:
        shutil.rmtree(config.stash[SUITE_DIR][0], ignore_errors=True)


class ForeignResults(Exception):
    """--ep-suite records that this session cannot show to be its own."""


RUN_NAME = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{4}")


def _private(shared: Path) -> None:
    info = os.lstat(shared)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ForeignResults(f"{shared} is not a private directory of this user (mode {oct(info.st_mode)}, "
                             f"owner {info.st_uid}); its records are not read")


def suite_records(shared: Path, nonce: str, run_verify) -> dict[str, dict]:
    """The records of the session's one verify run, by check id. The first caller runs it
    (run_verify(out_root) -> run directory) and stamps the run with the session's nonce;
    every caller reads only a run so stamped, in `shared`, whose records are all its own."""
    from filelock import FileLock

    from ep_harness.records import read_jsonl, write_atomic

    _private(shared)
    claim = shared / "ep-suite.json"
    with FileLock(str(shared / "ep-suite.lock")):
        if not claim.exists():
            run_dir = run_verify(shared / "ep-suite")
            write_atomic(claim, json.dumps({"nonce": nonce, "run": run_dir.name}))
        stamp = json.loads(claim.read_text())
    if not secrets.compare_digest(str(stamp.get("nonce")), nonce) or not RUN_NAME.fullmatch(str(stamp.get("run"))):
        raise ForeignResults(f"{claim} is not this session's (its nonce differs); its records are not read")
    run_dir = shared / "ep-suite" / stamp["run"]
    records = read_jsonl(run_dir / "results.jsonl")
    if not records or any(r.get("run_id") != run_dir.name for r in records):
        raise ForeignResults(f"{run_dir}/results.jsonl holds records of another run; they are not read")
    return {r["check"]: r for r in records}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used ep_world names its backend and ranks in the summary line's
    message (`FAILED nodeid - [gloo x4] ...`), never before the node id, which stays pasteable;
    every report keeps them as the user property `ep_world` (a JUnit property)."""
    report = yield
    worlds = [value for key, value in report.user_properties if key == "ep_world"]
    crash = getattr(report.longrepr, "reprcrash", None)
    if worlds and report.failed and crash is not None:
        crash.message = f"[{', '.join(dict.fromkeys(worlds))}] {crash.message}"
    return report


def pytest_runtest_setup(item):
    for mark in item.iter_markers(name="gpus"):
        needed = mark.args[0] if mark.args else mark.kwargs.get("n", 1)
        found = _gpu_count()
        if found < needed:
            pytest.skip(f"needs {needed} GPU{'s' if needed != 1 else ''}, found {found}")


SUITE_RECORDS = pytest.StashKey[dict]()  # check id -> record, from the session's one verify run


class SuiteChecks(pytest.Collector):
    """The parent of a suite's check items, named after the suite: node ids read
    `SUITE::CHECK_ID`, so JUnit XML gets the suite as each check's classname (a bare
    `::CHECK_ID` gave an empty one). Its items are made in pytest_collection_modifyitems."""

    def collect(self):
        return []


class CheckItem(pytest.Item):
    def __init__(self, *, check, suite: str, gpus, **kwargs):  # check: an ep_harness.check.Check
        super().__init__(**kwargs)
        self.check, self.suite, self.gpus = check, suite, gpus
        self.user_properties.append(("ep_check", check.id))  # reaches the controller's reports under xdist

    def _record(self) -> dict:
        """This check's record from one verify run of every collected check (one launch on
        gloo, one per world size on NCCL), made when the first item runs. Under pytest-xdist
        the first worker to get here runs it and the others read its records (suite_records:
        a file lock in the session's private directory)."""
        if SUITE_RECORDS not in self.config.stash:
            from ep_harness.console import Console, using
            from ep_harness.run.plan import literal
            from ep_harness.run.verify import RunOptions, verify

            def run_verify(out_root: Path) -> Path:
                batch = [i.check.id for i in self.session.items if isinstance(i, CheckItem) and not i.check.skip_reason]
                with using(Console(quiet=True)):  # pytest reports the checks
                    return verify(RunOptions(self.suite, gpus=self.gpus, selection=[literal(c) for c in batch],
                                             out_root=out_root, render=False))[1]

            shared, nonce = self.config.stash[SUITE_DIR]
            self.config.stash[SUITE_RECORDS] = suite_records(shared, nonce, run_verify)
        return self.config.stash[SUITE_RECORDS][self.check.id]

    def runtest(self):
        if self.check.skip_reason:
            pytest.skip(self.check.skip_reason)
        record = self._record()
        if record["status"] == "vacuous":
            pytest.skip(f"vacuous (not a pass): {record['reason']}")
        from ep_harness.reports.analysis import FAILING
        from ep_harness.reports.text import mismatch_text

        if record["status"] in FAILING:
            raise AssertionError(f"{record['status']}: {record['reason']}\n\n{mismatch_text(record)}")

    def reportinfo(self):
        return self.suite, None, self.check.id

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, AssertionError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


def pytest_collection_modifyitems(session, config, items):
    suite = config.getoption("--ep-suite")
    if not suite:
        return
    from ep_harness import subject as registry
    from ep_harness.cases import load_suite, resolve_suite_path
    from ep_harness.environment import detect
    from ep_harness.errors import HarnessError
    from ep_harness.run.plan import expand

    gpus = config.getoption("--ep-gpus")
    try:
        path = resolve_suite_path(suite)
        loaded = load_suite(path)
        registry.load_all(loaded.plugins)
        checks = expand(loaded, detect(gpus))
    except HarnessError as exc:  # bad input: pytest's one-line usage error, not an INTERNALERROR traceback
        raise pytest.UsageError(f"--ep-suite {suite}: {exc}") from None
    parent = SuiteChecks.from_parent(session, name=loaded.name, nodeid=loaded.name)
    for check in checks:
        items.append(CheckItem.from_parent(parent, name=check.id, check=check, suite=str(path), gpus=gpus))
