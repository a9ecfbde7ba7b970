import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Every process the tests start runs with the hash seed the harness pins for its ranks, so a
# command forks its torchrun agents instead of starting them anew (harness/launch/forks.py);
# set before anything reads the session's environment (tests/forked_cli.py).
os.environ["PYTHONHASHSEED"] = "0"
sys.path.insert(0, str(REPO))
# For processes that import the tests' own modules (tests.planted, tests.distributed.*).
REPO_ON_PYTHONPATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}



# The tests that take longest (from `pytest --durations`), longest first; order only, never
# asserted. Under `--dist worksteal` each xdist worker starts on one contiguous share of the
# collection and idle workers steal from the tail of others: the longest tests are dealt to the
# head of every share, so none of them starts last and leaves one worker running alone.
LONGEST = [line for line in (Path(__file__).parent / "longest.txt").read_text().splitlines() if line]


def _shares(count: int, workers: int) -> list[int]:
    """The sizes of worksteal's first shares (xdist.scheduler.worksteal.check_schedule)."""
    sizes = []
    for remaining in range(workers, 0, -1):
        sizes.append((count - sum(sizes)) // remaining)
    return sizes


def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:
        return
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST)}
    position = {id(item): rank.get(item.nodeid.partition("[")[0]) for item in items}
    heavy = sorted((item for item in items if position[id(item)] is not None), key=lambda item: position[id(item)])
    light = [item for item in items if position[id(item)] is None]
    ordered = []
    for share, size in enumerate(_shares(len(items), workers)):
        mine = heavy[share::workers]
        take = max(0, size - len(mine))
        ordered += mine + light[:take]
        light = light[take:]
    items[:] = ordered + light


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The collection imports torch and every test module (about 3 CPU-s a process): the cyclic
    collector is off meanwhile (it would walk all they make again and again, finding almost
    nothing). What they made lives until the process ends: moved out of the collector's reach
    (gc.freeze), so that neither a full collection during the tests nor pytest's last one (its
    unraisable-exception check) walks it again (0.3 CPU-s each in a process that imported
    torch). What the tests make is collected as before. (The xdist controller collects nothing:
    only its own modules are frozen.) The harness's agent imports torch the same way."""
    from ep_harness.launch.agent import _imports_without_gc

    with _imports_without_gc():
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Torch's work in the test processes themselves on one intra-op thread: on 2 cores shared
    with the ranks that other tests launch, a second OpenMP thread mostly spins (3-6 CPU-s in
    one module, measured). Ranks and commands are processes of their own and pin their own
    threads; a session that has not imported torch is left without it."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The subject registry as a copy for a test that registers subjects: whatever it adds is
    gone afterwards, and it starts without `my_reduce_scatter`, a name both the README example
    and tests.planted_verdicts use (another test in the same xdist worker may have imported the
    latter)."""
    from ep_harness import subject

    scratch = {name: s for name, s in subject._REGISTRY.items() if name != "my_reduce_scatter"}
    monkeypatch.setattr(subject, "_REGISTRY", scratch)
    return scratch


def run_cli(*args, cwd=REPO, timeout=600, env: dict | None = None, module: bool | str = False,
            code: str | None = None):
    """Run the installed console script the way a user would (`module`: `python -m ep_harness`,
    or `python -m MODULE` given its name; `code`: `python -c CODE ARGS`, a script of the test's
    that calls the harness's functions):
    forked from this test process's interpreter that has imported torch and the harness already
    (tests/forked_cli.py; 1.5-2 s of CPU less a command, ranks and agents still their own
    processes), or, where the environment differs in what is read at start-up, as a process of
    its own. `env`: the command's whole environment (this process's, with PYTHONUNBUFFERED=1,
    unless given)."""
    from tests.forked_cli import shared_server

    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
    if (server := shared_server(env)) is not None:
        return server(*args, cwd=cwd, env=env, timeout=timeout, module=module, code=code)
    return subprocess.run([*command(module, code), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


def module_name(module: bool | str) -> str | None:
    """run_cli's `module`: True is the harness's."""
    return "ep_harness" if module is True else module or None


def command(module: bool | str = False, code: str | None = None) -> list[str]:
    """The command line of run_cli's and start_cli's commands (as processes of their own)."""
    return [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", module_name(module)] \
        if module else [shutil.which("ep-harness", path=str(Path(sys.executable).parent)) or "ep-harness"]


def start_cli(*args, cwd=REPO, env: dict | None = None, code: str | None = None):
    """`ep-harness ARGS` (`code`: `python -c CODE ARGS`) started and not waited for, as
    subprocess.Popen(stdout=PIPE, stderr=STDOUT, text=True, start_new_session=True) starts it
    (a test that signals a run): forked as run_cli's are (tests/forked_cli.py ForkedRun), or a
    process of its own where `env` differs in what is read at start-up."""
    from tests.forked_cli import shared_server

    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
    if (server := shared_server(env)) is not None:
        return server.start(*args, cwd=cwd, env=env, code=code)
    return subprocess.Popen([*command(code=code), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)


def shared_dir(tmp_path_factory) -> Path:
    """The temporary directory every xdist worker of this session shares (this session's own
    where there are no workers)."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else \
        tmp_path_factory.getbasetemp()


def once_per_session(tmp_path_factory, name: str, make):
    """`make(folder)` once per test session, in a folder NAME of the directory the xdist workers
    share: the first worker that needs it runs it and the others wait on a file lock and read its
    result (pytest-xdist's recipe). `make` returns something JSON can hold."""
    import json

    from filelock import FileLock

    shared = shared_dir(tmp_path_factory)
    done = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            done.write_text(json.dumps(make(shared / name)))
    return json.loads(done.read_text())


def completed(proc: subprocess.CompletedProcess) -> dict:
    """A finished process as JSON can hold it (subprocess.CompletedProcess(**it) rebuilds it)."""
    return {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def _shared_run(tmp_path_factory, name: str, *args: str):
    """`ep-harness verify ARGS --out <shared>/NAME`, once per test session (once_per_session).
    Returns the process and the run's output directory."""
    out = shared_dir(tmp_path_factory) / name
    result = once_per_session(tmp_path_factory, name, lambda out: completed(
        run_cli("verify", *(a.format(out=out) for a in args), "--out", str(out))))
    return subprocess.CompletedProcess(**result), out


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The CPU default, once per test session: `ep-harness verify` with the smoke suite (one
    launch), with its JUnit XML and Markdown summary in the output directory."""
    proc, out = _shared_run(tmp_path_factory, "smoke-run", "--suite", "smoke", "--gpus", "0",
                            "--junit-xml", "{out}/junit.xml", "--summary-md", "{out}/summary.md")
    return proc, out / "latest"


@pytest.fixture(scope="session")
def planted_run(tmp_path_factory):
    """tests/cases/planted.toml (planted defects, a per-launch setup, degenerate checks), once
    per test session, in one launch, re-seeded with --seed 5: a dict of records by check."""
    import json

    proc, out = _shared_run(tmp_path_factory, "planted-run", "--suite", "tests/cases/planted.toml", "--gpus", "0",
                            "--seed", "5", "--no-report")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # the planted defects fail the run
    lines = (out / "latest" / "results.jsonl").read_text().splitlines()
    return {r["check"]: r for r in map(json.loads, lines)}


def processes_with_env(fragment: str) -> list[int]:
    """PIDs of this user's processes whose environment contains `fragment` (e.g. the run's
    store namespace, EP_HARNESS_CHANNEL=ep-harness/<run id>/, which every rank carries)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or another user's
                pass
    return pids


def gone(pid: int) -> bool:
    """Whether a process has ended, a zombie included (as the launcher counts them)."""
    from ep_harness.launch.processes import ENDED_STATES, process_state

    found = process_state(pid)
    return found is None or found.state in ENDED_STATES


def process_tree(pid: int) -> list[int]:
    """Every live descendant of `pid`: a run's agents, fork servers, ranks and compile workers,
    whether forked or new interpreters (a fork's /proc/PID/environ is its forker's)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rank_pids(run_dir: Path) -> list[int]:
    """Every rank of a finished run, from the fingerprints each launch's ranks reported."""
    import json

    ranks = json.loads((run_dir / "environment.json").read_text())["ranks"]
    return [fp["pid"] for fingerprints in ranks.values() for fp in fingerprints]


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process and its ep_harness.context.RankContext."""
    import tempfile

    import torch
    import torch.distributed as dist

    from ep_harness.context import RankContext

    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    yield RankContext(0, 1, "gloo", torch.device("cpu"), dist.group.WORLD)
    dist.destroy_process_group()
