"""Past one machine: two torchrun agents on localhost as two nodes (2 gloo ranks each),
Slurm's srun (a stand-in: Slurm cannot run here), and what a lost node leaves behind.

Each agent runs in its own directory with its own --out, so the head can only have read
what the other node's ranks sent through the run's store."""
import fnmatch
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ep_harness.run_environment import node_differences
from ep_harness.launch.processes import _live
from tests.conftest import REPO, REPO_ON_PYTHONPATH, once_per_session, processes_with_env, run_cli

EXE = str(Path(sys.executable).parent / "ep-harness")
# The smoke suite's collectives in bfloat16, at world sizes 2, 3 and 4.
COLLECTIVES = ["rs-native/*/dtype=bfloat16/*", "ar-slice/*/dtype=bfloat16/*", "ag-fold/*/dtype=bfloat16/*",
               "a2a-fold/*/dtype=bfloat16/*", "two-ranks/*"]


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port from bind(0) could be handed to
    another process (an agent's store, a gloo connection of a concurrent test) before the
    head binds it; one below the range never is."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = range(max(1024, ephemeral_low - 10000), ephemeral_low)
    for port in random.sample(below, min(100, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                pass
    raise RuntimeError(f"no free port below {ephemeral_low}")


RUN_SECRET = "two-node-test-secret-0123456789"


@pytest.fixture
def node():
    """node(rank, port, cwd, *args): `ep-harness verify` for one node of a 2-node run (a
    launcher, in a session of its own). Whatever a test leaves running, a failing one
    included, is ended after it: SIGTERM, which the launcher passes on to its agent, then SIGKILL."""
    started = []

    def launch(node_rank: int, port: int, cwd: Path, *args, env=None) -> subprocess.Popen:
        cwd.mkdir(parents=True, exist_ok=True)
        # Both nodes hold the run's secret, and name one commit (a commit made in this shared
        # checkout between the two starts would otherwise make the follower refuse the head).
        started.append(subprocess.Popen(
            [EXE, "verify", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--node-rank", str(node_rank), "--gpus", "0", "--run-secret", RUN_SECRET, *args], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "EP_HARNESS_COMMIT": "two-node-test", **(env or {})}))
        return started[-1]

    yield launch
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
        for proc in started:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


def counts(run_dir: Path) -> dict:
    return {r["check"]: (r["status"], r["mismatched"], r.get("predicted_mismatched"), r["total"])
            for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}


def node_ranks(env: dict) -> list[list[int]]:
    """The ranks of nodes "0" and "1" (environment.json), in rank order. torchrun's c10d
    rendezvous numbers the agents by host, then process id, not by --node-rank or
    SLURM_NODEID: on one machine either node may hold ranks 0 and 1."""
    assert env["nodes"].keys() == {"0", "1"}, env["nodes"]
    return sorted(info["ranks"] for info in env["nodes"].values())


def selection(patterns=COLLECTIVES) -> list[str]:
    return [arg for pattern in patterns for arg in ("--check", pattern)]


def matching(counted: dict, patterns) -> dict:
    return {check: c for check, c in counted.items() if any(fnmatch.fnmatchcase(check, p) for p in patterns)}


@pytest.fixture
def single_agent(smoke_run):
    """The smoke collectives' counts from the session's single-agent run (4 ranks, one launch)."""
    proc, run_dir = smoke_run
    assert proc.returncode == 0, proc.stdout[-2000:]
    return matching(counts(run_dir), COLLECTIVES)


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    """The smoke collectives (COLLECTIVES) on two agents as two nodes of 2 gloo ranks each, once
    per session: a head given no --run-secret, which draws one and prints the command for the
    other nodes, and node 1 started with that command, each in a directory of its own with its
    own (default) --out. Returns what both printed and how they ended, and the head's port and
    both directories; `printed` is None if the head never printed the command."""
    import shlex

    def make(folder):
        port = free_port()
        env = {**os.environ, "EP_HARNESS_COMMIT": "two-node-test"}
        env.pop("EP_HARNESS_RUN_SECRET", None)
        for name in ("node0", "node1"):
            (folder / name).mkdir(parents=True)
        base = [EXE, "verify", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--gpus", "0"]
        popen = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                 "start_new_session": True}
        started = [subprocess.Popen([*base, "--suite", "smoke", "--no-report", *selection()], cwd=folder / "node0",
                                    **popen)]
        result = {"port": port, "node0": str(folder / "node0"), "node1": str(folder / "node1"), "printed": None}
        try:
            lines = []
            while not any("# on each other node K:" in line for line in lines):
                line = started[0].stdout.readline()
                if not line:
                    break
                lines.append(line)
            if lines and "# on each other node K:" in lines[-1]:
                result["printed"] = shlex.split(re.sub(r".*# on each other node K: ", "", lines[-1])
                                                .replace(" K ", " 1 "))
                started.append(subprocess.Popen([EXE, *result["printed"][1:]], cwd=folder / "node1", **popen))
            rest, _ = started[0].communicate(timeout=300)
            result.update(head_out="".join(lines) + rest, head_rc=started[0].returncode)
            if len(started) > 1:
                other_out, _ = started[1].communicate(timeout=60)
                result.update(other_out=other_out, other_rc=started[1].returncode)
            return result
        finally:
            for proc in started:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)

    found = once_per_session(tmp_path_factory, "two-nodes", make)
    found["node0"], found["node1"] = Path(found["node0"]), Path(found["node1"])
    return found


@pytest.mark.slow
def test_two_agents_reproduce_the_single_agent_bits(two_nodes, single_agent):
    port, head_out, node0, node1 = two_nodes["port"], two_nodes["head_out"], two_nodes["node0"], two_nodes["node1"]
    assert two_nodes["printed"] is not None, head_out[-3000:]
    other_out = two_nodes["other_out"]
    assert two_nodes["head_rc"] == 0, head_out[-3000:]
    assert two_nodes["other_rc"] == 0 and "the records are on the head node" in other_out, other_out[-2000:]
    run_dir = node0 / "reports" / "out" / "latest"
    two = counts(run_dir)
    assert two == single_agent  # same gloo ring and fold orders at every world size: the same counts
    assert sum(1 for s, m, *_ in two.values() if s == "ok" and m) >= 10  # the controls did differ
    rerun = json.loads((run_dir / "results.jsonl").read_text().splitlines()[0])["rerun"]
    assert f"--nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:{port}" in rerun  # the head's rerun
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["topology"]["nodes"] == 2 and "2 nodes of 2 ranks" in env["topology"]["describe"]
    assert node_ranks(env) == [[0, 1], [2, 3]]
    assert env["node_differences"] == []
    for fingerprint in next(iter(env["ranks"].values())):  # the pinned variables, as each rank saw them
        assert fingerprint["env"]["PYTHONHASHSEED"] == "0"
    # The other node's logs stayed on it; nothing of its ranks is in the head's run directory.
    assert not list(node1.glob("reports/out/*/*/*.json"))
    assert list(node1.glob("reports/out/node1-*/*/torchrun-launch0.log"))
    assert not [p for p in run_dir.rglob("*") if "node1" in p.name]


@pytest.mark.slow
def test_killing_one_agent_ends_the_run_and_names_the_node(tmp_path, node):
    port = free_port()
    suite = str(REPO / "tests" / "cases" / "node_loss.toml")  # a check, then one that never ends
    # The head's default node timeout (6 s; the follower beats every 0.5 s): a shorter one can take
    # a follower starved of CPU on a loaded machine for a lost one before the test kills it.
    head = node(0, port, tmp_path / "node0", "--suite", suite, "--no-report", env=REPO_ON_PYTHONPATH)
    other = node(1, port, tmp_path / "node1", env=REPO_ON_PYTHONPATH)
    results = None
    deadline = time.time() + 240
    while time.time() < deadline and head.poll() is None:  # mid-launch: a check recorded, the hang under way
        found = [p for p in (tmp_path / "node0" / "reports" / "out").glob("*/results.jsonl")
                 if p.parent.name != "latest"]
        if found and found[0].read_text().splitlines():
            results = found[0]
            break
        time.sleep(0.2)
    assert results is not None, head.communicate(timeout=60)[0][-2000:]
    run_id = results.parent.name
    # Each node's command forks an agent server, which forks the launch's agent (the follower as
    # the head: harness/launch/forks.py), whose fork server forks its 2 ranks: 2 processes 4
    # generations below each command (a fork's environment is its command's, without the run's).
    trees = [descendants(proc.pid) for proc in (head, other)]
    for tree in trees:
        assert sorted(depth for depth, _ in tree.values()).count(4) == 2, tree
    os.killpg(other.pid, signal.SIGKILL)  # node 1's launcher; its agent and ranks must follow
    out, _ = head.communicate(timeout=120)
    other.wait(timeout=10)
    assert head.returncode == 1, out[-2000:]
    records = {r["case"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert records["before"]["status"] == "ok"
    hung, after = records["hangs"], records["after"]
    assert hung["status"] == "error" and "node 1" in hung["reason"], hung["reason"][:300]
    killed = json.loads((results.parent / "environment.json").read_text())["nodes"]["1"]["ranks"]
    assert killed in ([0, 1], [2, 3]) and f"ranks {killed} ended with it" in hung["reason"], hung["reason"][:300]
    assert after["status"] == "error" and after["reason"].startswith("not run: node 1")  # nothing ran after
    # The head has returned; what it ended may still be exiting: wait for that, never for a fixed time.
    assert left_after(lambda: [p for tree in trees for p, (_, started) in tree.items() if _started(p) == started]) == []
    # nor any process either node's launches started anew (those carry the run's namespace)
    assert left_after(lambda: processes_with_env(f"EP_HARNESS_CHANNEL=ep-harness/{run_id}/")) == []


def _started(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot; a later process given the same pid
    starts later), or None once it has ended (a zombie included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def descendants(root: int) -> dict[int, tuple[int, int]]:
    """pid -> (generations below `root`, start time) of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    for pid, state in _live().items():
        children.setdefault(state.parent, []).append(pid)
    found, todo = {}, [(root, 0)]
    while todo:
        pid, depth = todo.pop()
        for child in children.get(pid, ()):
            started = _started(child)
            if started is not None:
                found[child] = (depth + 1, started)
                todo.append((child, depth + 1))
    return found


def left_after(find, limit_s: float = 60) -> list[int]:
    """What `find()` returns (processes) after `limit_s`, or nothing as soon as it returns none."""
    deadline = time.monotonic() + limit_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
def test_slurm_launcher_starts_every_node_through_srun(tmp_path, single_agent):
    """--launcher slurm: the head (inside an allocation) runs `srun ... torchrun` per launch.
    srun here is tests/fake_slurm/srun, which starts one task per node on this machine."""
    patterns = COLLECTIVES[:1] + COLLECTIVES[-1:]  # rs-native and two-ranks: world sizes 2, 3 and 4
    env = {**os.environ, "PATH": f"{REPO / 'tests' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}"}
    proc = run_cli("verify", "--launcher", "slurm", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--gpus", "0", "--suite", "smoke",
                   "--no-report", "--out", str(tmp_path), *selection(patterns), cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert counts(tmp_path / "latest") == matching(single_agent, patterns)
    env = json.loads((tmp_path / "latest" / "environment.json").read_text())
    assert node_ranks(env) == [[0, 1], [2, 3]]  # named by SLURM_NODEID


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "--nproc-per-node", "2"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "needs --nproc-per-node P"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "nohost"], "is not HOST:PORT"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "2"],
     "--node-rank 2 is outside 0..1"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:1", "--gpus", "3"],
     "--gpus 3 cannot be given by 2 nodes x 2 ranks = 4"),
    (["--launcher", "slurm", "--nnodes", "2", "--nproc-per-node", "2"], "--launcher slurm needs srun on PATH"),
])
def test_bad_node_options_are_one_line_and_write_nothing(tmp_path, args, message):
    proc = run_cli("verify", "--suite", "smoke", "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_bad_node_options_are_rejected_before_torch_loads(tmp_path):
    code = ("import sys; from ep_harness.cli import main; "
            "rc = main(['verify', '--nnodes', '2', '--nproc-per-node', '2', '--out', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert "needs --rdzv-endpoint HOST:PORT" in proc.stderr


def test_nodes_that_differ_in_what_decides_bits_are_named():
    nodes = {"0": {"torch": "2.13.0", "nccl": "2.28.9", "device": "NVIDIA H200", "cuda": "13.0", "driver": "580"},
             "1": {"torch": "2.12.0", "nccl": "2.28.9", "device": "NVIDIA H200", "cuda": "13.0", "driver": "580"}}
    assert node_differences(nodes) == ["torch: node 0 2.13.0, node 1 2.12.0"]
    nodes["1"]["torch"] = "2.13.0"
    assert node_differences(nodes) == []


def test_the_report_banner_says_when_nodes_differ(tmp_path):
    from ep_harness.reports.render import render_run
    from tests.test_reports import record, write_run

    env = {"command": "test", "node_differences": ["torch: node 0 2.13.0, node 1 2.12.0"]}
    render_run(write_run(tmp_path / "run", [record("a")], env), quiet=True)
    page = (tmp_path / "run" / "report.html").read_text()
    assert "does not measure one stack" in page and "torch: node 0 2.13.0, node 1 2.12.0" in page


def test_a_node_that_never_joins_is_named_in_every_check(tmp_path):
    proc = subprocess.run([EXE, "verify", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint",
                           f"127.0.0.1:{free_port()}", "--gpus", "0", "--suite", "smoke", "--check", "rs-native/*",
                           "--no-report", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EP_HARNESS_START_TIMEOUT_S": "3"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = list(map(json.loads, (tmp_path / "latest" / "results.jsonl").read_text().splitlines()))
    assert records and all(r["status"] == "error" and "node 1 never joined the run" in r["reason"] for r in records)
