"""The torchrun agent forked by the command (harness/launch/forks.py) against the agent started
as a new interpreter: the same ranks, or no fork at all."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ep_harness.launch.nodes import Nodes
from ep_harness.launch.processes import agent_command, child_env
from tests.conftest import REPO

# The server declines on a CUDA build of torch (a fork must never follow a CUDA initialisation).
cpu_build = pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                               reason="agents are forked only where torch is a CPU build (harness/launch/forks.py)")

# A command's side, in a new interpreter that imports torch as `ep-harness verify` does: start
# the agent server, then launch the probe's ranks once through it (or anew: FRESH) and wait.
_COMMAND = textwrap.dedent(r"""
    import json, os, sys
    from pathlib import Path
    from ep_harness.launch.agent import _blas_without_a_thread_pool
    with _blas_without_a_thread_pool():
        import torch
    from ep_harness.launch import forks
    import contextlib
    from ep_harness.launch.processes import interruptible, spawn
    out, cmd, env, handled = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
    with forks.serving() as server, interruptible() if handled else contextlib.nullcontext():
        proc = spawn(cmd, env, Path(out) / "agent.log")
        code = proc.wait(120)
    print(json.dumps({"server": server is not None, "forked": type(proc).__name__ == "ForkedAgent", "code": code}))
""")


def _launch(tmp_path, name: str, command_env: dict, launch_env: dict | None = None, handled: bool = True) -> dict:
    out = tmp_path / name
    out.mkdir()
    nodes = Nodes()
    cmd = agent_command(nodes, 2, name, None, out, module="tests.agent_probe", args=(str(out),))
    env = child_env({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PROBE_MARK": "m", **(launch_env or {})},
                    "127.0.0.1:1", name, out, nodes)
    proc = subprocess.run([sys.executable, "-c", _COMMAND, str(out), json.dumps(cmd), json.dumps(env), str(int(handled))],
                          cwd=tmp_path,
                          env=command_env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stderr[-3000:]
    how = json.loads(proc.stdout.splitlines()[-1])
    assert how["code"] == 0, (out / "agent.log").read_text()[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"how": how, "ranks": ranks, "log": (out / "agent.log").read_text()}


def _command_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


@cpu_build
@pytest.mark.parametrize("handled", [True, False], ids=["launch-handles-signals", "sigint-ignored"])
def test_a_forked_agent_starts_its_ranks_as_a_new_agent_would(tmp_path, handled):
    """The command starts with SIGINT ignored (as under nohup); the launcher handles it while
    launches run (processes.interruptible), or not: a new agent has Python's handler, or keeps
    it ignored, and so must a forked one."""
    forked = _launch(tmp_path, "forked", _command_env(PYTHONHASHSEED="0"), handled=handled)
    fresh = _launch(tmp_path, "fresh", _command_env(PYTHONHASHSEED="0", EP_HARNESS_AGENT_FORKS="0"), handled=handled)
    assert forked["how"] == {"server": True, "forked": True, "code": 0}
    assert fresh["how"] == {"server": False, "forked": False, "code": 0}
    # the control: the two agents really were different processes (the fork's command line is the command's)
    assert fresh["ranks"][0]["agent_cmdline"][1:3] == ["-m", "ep_harness.launch.agent"]
    assert forked["ranks"][0]["agent_cmdline"][1:3] == ["-c", _COMMAND]
    for a, b in zip(forked["ranks"], fresh["ranks"]):
        a, b = dict(a), dict(b)
        del a["agent_cmdline"], b["agent_cmdline"]
        a["env"].pop("TORCHELASTIC_RUN_ID"), b["env"].pop("TORCHELASTIC_RUN_ID")
        a["path"] = [p.replace("/forked", "/fresh") for p in a["path"]]
        a["env"]["PYTHONPATH"] = a["env"]["PYTHONPATH"].replace("/forked", "/fresh")
        assert a == b
    assert forked["ranks"][0]["main"] == "ep_harness.launch.agent.__main__"
    assert forked["ranks"][0]["hash_randomization"] == 0 and forked["ranks"][1]["threads"] == 1
    assert forked["ranks"][0]["signals"]["SIGINT"] == ("<built-in function default_int_handler>" if handled else "1")
    for run in (forked, fresh):
        assert "probe rank 0 on stdout" in run["log"] and "probe rank 1 on stdout" in run["log"]


@pytest.mark.parametrize("command_extra, launch_extra, why", [
    ({}, {}, "the command's hash seed is not the launch's 0"),
    ({"PYTHONHASHSEED": "0"}, {"MKL_NUM_THREADS": "3"}, "the launch sets a variable read as torch loads"),
    ({"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "2"}, {}, "numpy's BLAS started threads in the command"),
])
def test_an_agent_that_a_fork_would_not_reproduce_is_a_new_interpreter(tmp_path, command_extra, launch_extra, why):
    run = _launch(tmp_path, "run", _command_env(**command_extra), launch_extra)
    assert run["how"]["forked"] is False, why
    assert run["ranks"][0]["agent_cmdline"][1:3] == ["-m", "ep_harness.launch.agent"], why


_KILLED = textwrap.dedent(r"""
    import json, os, sys, time
    from pathlib import Path
    from ep_harness.launch.agent import _blas_without_a_thread_pool
    with _blas_without_a_thread_pool():
        import torch
    from ep_harness.launch import forks
    from ep_harness.launch.processes import kill_launch, spawn
    out, cmd, env = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    with forks.serving() as server:
        proc = spawn(cmd, env, Path(out) / "agent.log")
        while not all((Path(out) / f"rank{r}.json").exists() for r in range(2)):
            assert proc.poll() is None, (Path(out) / "agent.log").read_text()
            time.sleep(0.05)
        kill_launch(proc, grace_s=2.0)
        code, pid = proc.returncode, server.pid
    ended = not os.path.exists(f"/proc/{pid}")
    print(json.dumps({"forked": type(proc).__name__, "code": code, "server_ended": ended}))
""")


@cpu_build
def test_a_forked_agent_killed_with_its_launch_ends_with_its_ranks_and_the_server_with_the_command(tmp_path):
    nodes = Nodes()
    cmd = agent_command(nodes, 2, "killed", None, tmp_path, module="tests.agent_probe", args=(str(tmp_path), "600"))
    env = child_env({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}, "127.0.0.1:1", "killed", tmp_path, nodes)
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path), json.dumps(cmd), json.dumps(env)],
                          env=_command_env(PYTHONHASHSEED="0"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["forked"] == "ForkedAgent" and result["server_ended"], result
    assert result["code"] not in (None, 0), result  # ended by the signal, its exit code reported by the server
    # both ranks had started (the command waited for them); none may outlive the launch
    leftover = subprocess.run(["pgrep", "-f", f"agent_probe.*{tmp_path}"], capture_output=True, text=True).stdout
    assert leftover.strip() == "", leftover
