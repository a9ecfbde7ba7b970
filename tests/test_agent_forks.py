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

# A command's side, in a new interpreter that imports torch as `ep-harness verify` does (its
# _launching_imports: BLAS without a thread pool, the imports out of the collector's reach).
_PREAMBLE = r"""
import contextlib, json, os, sys, time
from pathlib import Path
from ep_harness.cli import _launching_imports
with _launching_imports():
    import torch
from ep_harness.launch import forks
from ep_harness.launch.processes import interruptible, kill_launch, spawn
"""
# Its launches in turn (JSON: each one's folder, agent command and environment, whether the
# launcher's signal handlers are on, whether the agent server is): each starts the agent server
# (or not: EP_HARNESS_AGENT_FORKS=0), launches the probe's ranks once through it (or anew where
# it declines) and waits. The later launches fork from a command that has made the earlier ones,
# as `verify` does.
_COMMAND = _PREAMBLE + textwrap.dedent(r"""
    how = []
    for launch in json.loads(sys.argv[1]):
        if launch["serve"]:
            os.environ.pop(forks.SWITCH, None)
        else:
            os.environ[forks.SWITCH] = "0"
        with forks.serving() as server, interruptible() if launch["handled"] else contextlib.nullcontext():
            proc = spawn(launch["cmd"], launch["env"], Path(launch["out"]) / "agent.log")
            code = proc.wait(120)
        how.append({"server": server is not None, "forked": type(proc).__name__ == "ForkedAgent", "code": code})
    print(json.dumps(how))
""")


MARK = "in the command's environment and the launch's"  # what the ranks must see either way


def _probe_launch(name: str, out, args: tuple, launch_env: dict | None = None) -> tuple[list, dict]:
    """The agent command of a 2-rank launch of tests/agent_probe.py, and its environment."""
    nodes = Nodes()
    cmd = agent_command(nodes, 2, name, None, out, module="tests.agent_probe", args=args)
    env = child_env({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PROBE_MARK": MARK, **(launch_env or {})},
                    "127.0.0.1:1", name, out, nodes)
    return cmd, env


def _launches(tmp_path, command_env: dict, launches: dict[str, dict], options=()) -> dict[str, dict]:
    """One command (`command_env`, interpreter `options`) making `launches` in turn: name ->
    {"launch_env": ..., "handled": True, "serve": True} where not the default. Returns name ->
    how it was started, its ranks' reports and its agent's log."""
    plan = []
    for name, how in launches.items():
        out = tmp_path / name
        out.mkdir()
        cmd, env = _probe_launch(name, out, (str(out),), how.get("launch_env"))
        plan.append({"out": str(out), "cmd": cmd, "env": env, "handled": how.get("handled", True),
                     "serve": how.get("serve", True)})
    argv = [sys.executable, *options, "-c", _COMMAND, json.dumps(plan)]
    proc = subprocess.run(argv, cwd=tmp_path, env=command_env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {}
    for name, how in zip(launches, json.loads(proc.stdout.splitlines()[-1])):
        out = tmp_path / name
        assert how["code"] == 0, (out / "agent.log").read_text()[-3000:]
        runs[name] = {"how": how, "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
                      "log": (out / "agent.log").read_text()}
    return runs


def _command_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return {**env, "PYTHONPATH": str(REPO), "PROBE_MARK": MARK, **extra}


@cpu_build
def test_a_forked_agent_starts_its_ranks_as_a_new_agent_would(tmp_path):
    """The command starts with SIGINT ignored (as under nohup); the launcher handles it while
    launches run (processes.interruptible), or not: a new agent has Python's handler, or keeps
    it ignored, and so must a forked one. Each pair of launches, forked and new (the server off),
    comes from one command."""
    runs = _launches(tmp_path, _command_env(PYTHONHASHSEED="0"),
                     {f"{kind}{int(handled)}": {"handled": handled, "serve": kind == "forked"}
                      for handled in (True, False) for kind in ("forked", "fresh")})
    for handled in (True, False):
        forked, fresh = runs[f"forked{int(handled)}"], runs[f"fresh{int(handled)}"]
        assert forked["how"] == {"server": True, "forked": True, "code": 0}
        assert fresh["how"] == {"server": False, "forked": False, "code": 0}
        # the control: the two agents really were different processes (the fork's command line is the command's)
        assert fresh["ranks"][0]["agent_cmdline"][1:3] == ["-m", "ep_harness.launch.agent"]
        assert forked["ranks"][0]["agent_cmdline"][1:3] == ["-c", _COMMAND]
        for a, b in zip(forked["ranks"], fresh["ranks"]):
            a, b = dict(a), dict(b)
            del a["agent_cmdline"], b["agent_cmdline"]
            a["env"].pop("TORCHELASTIC_RUN_ID"), b["env"].pop("TORCHELASTIC_RUN_ID")
            a["path"] = [p.replace(f"/forked{int(handled)}", f"/fresh{int(handled)}") for p in a["path"]]
            a["env"]["PYTHONPATH"] = a["env"]["PYTHONPATH"].replace(f"/forked{int(handled)}", f"/fresh{int(handled)}")
            assert a == b
        assert forked["ranks"][0]["main"] == "ep_harness.launch.agent.__main__"
        assert forked["ranks"][0]["hash_randomization"] == 0 and forked["ranks"][1]["threads"] == 1
        python_handler = "<built-in function default_int_handler>"
        assert forked["ranks"][0]["signals"]["SIGINT"] == (python_handler if handled else "1")
        for run in (forked, fresh):
            assert "probe rank 0 on stdout" in run["log"] and "probe rank 1 on stdout" in run["log"]


@pytest.mark.parametrize("command_extra, options, launch_extras", [
    ({}, [], {"the command's hash seed is not the launch's 0": {}}),
    ({"PYTHONHASHSEED": "0"}, [], {"the launch sets a variable read as torch loads": {"MKL_NUM_THREADS": "3"},
                                   "the launch sets a variable the launcher does not own": {"PYTORCH_JIT": "0"}}),
    ({"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "2"}, [], {"numpy's BLAS started threads in the command": {}}),
    ({"PYTHONHASHSEED": "0"}, ["-O"], {"the command runs with an interpreter option a new agent lacks": {}}),
], ids=["hash-seed", "launch-variables", "blas-threads", "interpreter-option"])
def test_an_agent_that_a_fork_would_not_reproduce_is_a_new_interpreter(tmp_path, command_extra, options,
                                                                        launch_extras):
    names = {f"run{i}": why for i, why in enumerate(launch_extras)}
    runs = _launches(tmp_path, _command_env(**command_extra),
                     {name: {"launch_env": launch_extras[why]} for name, why in names.items()}, options=options)
    for name, why in names.items():
        assert runs[name]["how"]["forked"] is False, why
        assert runs[name]["ranks"][0]["agent_cmdline"][1:3] == ["-m", "ep_harness.launch.agent"], why


# Launch ranks that sleep, wait until they (and rank 0's daemon) run, then end the launch.
_KILLED = _PREAMBLE + textwrap.dedent(r"""
    out, cmd, env = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    with forks.serving() as server:
        proc = spawn(cmd, env, Path(out) / "agent.log")
        while not all((Path(out) / name).exists() for name in ("rank0.json", "rank1.json", "daemon.pid")):
            assert proc.poll() is None, (Path(out) / "agent.log").read_text()
            time.sleep(0.05)
        kill_launch(proc, grace_s=2.0)
        code, pid = proc.returncode, server.pid
    ended = not os.path.exists(f"/proc/{pid}")
    print(json.dumps({"forked": type(proc).__name__, "code": code, "server_ended": ended}))
""")


@cpu_build
def test_a_forked_agent_killed_with_its_launch_ends_with_its_ranks_and_the_server_with_the_command(tmp_path):
    """kill_launch on a forked agent ends its ranks and a daemon one of them left behind (the
    agent is the launch's subreaper); the agent's exit code comes through the server, and the
    server exits when the command closes it."""
    cmd, env = _probe_launch("killed", tmp_path, (str(tmp_path), "600", "1"))
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path), json.dumps(cmd), json.dumps(env)],
                          env=_command_env(PYTHONHASHSEED="0"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["forked"] == "ForkedAgent" and result["server_ended"], result
    assert result["code"] not in (None, 0), result  # ended by the signal, its exit code reported by the server
    # both ranks and rank 0's daemon (forked, set apart in a session of its own, its parent
    # gone) had started (the command waited for them); none may outlive the launch
    daemon = int((tmp_path / "daemon.pid").read_text())
    assert not os.path.exists(f"/proc/{daemon}") or open(f"/proc/{daemon}/stat").read().split()[2] in "ZX"
    leftover = subprocess.run(["pgrep", "-f", f"agent_probe.*{tmp_path}"], capture_output=True, text=True).stdout
    assert leftover.strip() == "", leftover
