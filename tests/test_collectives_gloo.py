"""Real multi-process gloo: the subjects' contracts, and the gloo order model against the
measured bits, with no mocked process group."""
import json
import os
import subprocess
import sys

import pytest

from ep_harness.launch.processes import agent_command
from ep_harness.launch.nodes import Nodes
from tests.conftest import REPO, REPO_ON_PYTHONPATH, run_cli

WITH_REPO_ON_PATH = {**os.environ, **REPO_ON_PYTHONPATH}


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_subject_contracts(tmp_path, world):
    out = tmp_path / "findings.json"
    proc = subprocess.run(
        agent_command(Nodes(), world, "contracts", None, tmp_path, module="tests.distributed.contracts",
                      args=(str(out),)),
        cwd=REPO, capture_output=True, text=True, timeout=240, env=WITH_REPO_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())
    # torchrun's rule (OMP_NUM_THREADS=1 for several ranks) holds in forked ranks too: the
    # agent sets it before torch loads OpenMP (the 2-core machine's default is 2 threads).
    assert found["threads"] == [1] * world
    # Ranks are forks of a single-threaded fork server, never of the agent, which runs its
    # store's server thread and the rendezvous keep-alive when it starts them (forks of the
    # agent read [4, 4, 4] here; one of them hung in CI).
    assert found["parent_threads"] == [1] * world, "a rank was forked from a multi-threaded process"
    findings = found["findings"]
    assert len(findings) == world * (5 + 4)  # even: 5 subjects; uneven: 4 (native tensor form needs even)
    for f in findings:
        assert f["matches_model"], f"{f['subject']} {f['shards']} rank {f['rank']} differs from its order model"
        assert f["input_unchanged"], f"{f['subject']} modified its input on rank {f['rank']}"
        if "alias_ok" in f:
            assert f["alias_ok"], f"{f['subject']} gave other bits with an aliased output on rank {f['rank']}"
    assert any(0 in f["shards"] for f in findings)  # the uneven pass had an empty shard


# The agent with one thread (what it has after importing torch, OMP_NUM_THREADS=1) forks its
# fork server; with another thread running it must start one anew instead.
AGENT_WITH_THREADS = ("import sys, threading; from ep_harness.launch.agent import main\n"
                      "for _ in range(int(sys.argv[1]) - 1): threading.Thread(target=threading.Event().wait, "
                      "daemon=True).start()\n"
                      "sys.exit(main(sys.argv[2:]))")


@pytest.mark.slow
@pytest.mark.parametrize("threads, fork_server", [(1, "from ep_harness.launch.agent import main"),  # a fork of the agent
                                                  (2, "from multiprocessing.forkserver import main")])
def test_ranks_are_forks_of_a_single_threaded_fork_server(tmp_path, threads, fork_server):
    agent = agent_command(Nodes(), 2, "origin", None, tmp_path, module="tests.distributed.fork_origin",
                          args=(str(tmp_path),))
    assert agent[1:3] == ["-m", "ep_harness.launch.agent"]
    proc = subprocess.run([sys.executable, "-c", AGENT_WITH_THREADS, str(threads), *agent[3:]], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=WITH_REPO_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["threads"] for r in ranks] == [1, 1]
    assert all(fork_server in r["command"] for r in ranks), ranks
    # the collector runs in the ranks; what the agent imported is in its frozen generation (forked)
    assert all(r["gc"][0] and (r["gc"][1] > 10_000) == (threads == 1) for r in ranks), [r["gc"] for r in ranks]
    assert ("2 threads after importing torch; the fork server is started anew" in proc.stderr) == (threads == 2)


@pytest.mark.slow
def test_one_rank_without_omp_num_threads_is_still_forked_from_the_agent(tmp_path):
    """A launch of one rank sets no OMP_NUM_THREADS, and numpy's OpenBLAS (loaded by `import
    torch`) would start a thread per core: the agent keeps it to one thread while importing,
    so its fork server is still a fork (not a new interpreter importing torch again), and the
    ranks' environment does not carry the setting."""
    agent = agent_command(Nodes(), 1, "origin", None, tmp_path, module="tests.distributed.fork_origin",
                          args=(str(tmp_path),))
    env = {k: v for k, v in WITH_REPO_ON_PATH.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", AGENT_WITH_THREADS, "1", *agent[3:]], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank = json.loads((tmp_path / "rank0.json").read_text())
    assert "threads after importing torch" not in proc.stderr
    assert "from ep_harness.launch.agent import main" in rank["command"] and rank["threads"] == 1, rank
    assert "OPENBLAS_NUM_THREADS" not in rank["environ"]


@pytest.mark.parametrize("entry", [[], ["-m", "no_such_module_xyz"]])
def test_the_agent_names_a_missing_entry_module_in_one_line(entry):
    proc = run_cli("--nproc-per-node", "2", *entry, module="ep_harness.launch.agent", timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"ep_harness.launch.agent: no importable entry module ({entry[1] if entry else None!r}); "
        "end the options with -m MODULE [ARGS], MODULE defining rank_main"]
