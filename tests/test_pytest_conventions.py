"""The pytest plugin behaves as pytest users expect: node ids that can be pasted back, JUnit
classnames, and a session that pays nothing for what it does not use (no hypothesis)."""
import os
import subprocess
import sys
import textwrap
import tomllib
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import REPO
from tests.forked_cli import forked_pytest
from tests.shared_runs import plugin_items_session  # noqa: F401  (a fixture)

USER_TESTS = '''
import torch.distributed as dist


def all_ranks_agree(rank, world_size):
    return dist.get_world_size()


def rank_one_disagrees(rank, world_size):
    assert rank != 1, "planted on rank 1"


def test_passes(ep_world):
    assert ep_world(2).run(all_ranks_agree) == [2, 2]


def test_fails(ep_world):
    ep_world(2).run(rank_one_disagrees)
'''


def pytest_in(directory, *args, timeout=600, fresh=False):
    """`python -m pytest ARGS` in DIRECTORY with the checkout importable: forked from an
    interpreter that has imported torch and pytest (forked_cli.forked_pytest), or, `fresh`, a
    new interpreter (for what a session imports)."""
    argv, env = ["-p", "no:cacheprovider", *args], {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    if not fresh:
        return forked_pytest(*argv, cwd=directory, env=env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=directory, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_a_failed_ep_world_test_keeps_a_pasteable_node_id(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    proc = pytest_in(tmp_path, "-rfp", "-v", "test_user.py")
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "PASSED "))]
    assert "PASSED test_user.py::test_passes" in summary, summary
    [failed] = [line for line in summary if line.startswith("FAILED")]
    # the node id right after the word, the topology in the message after it
    assert failed.startswith("FAILED test_user.py::test_fails - [gloo x2] AssertionError: planted on rank 1"), failed
    assert "test_user.py::test_passes PASSED" in proc.stdout  # -v lines: id, then the plain word
    again = pytest_in(tmp_path, "-q", failed.split()[1])  # pasted back: exactly that test
    assert again.returncode == 1 and "1 failed in" in again.stdout, again.stdout[-2000:]


FORK_SERVER_TESTS = """
import os


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def fork_server_cmdline(rank, world_size):
    return cmdline(os.getppid())  # a rank's parent: the fork server


def test_fork_server(ep_world):
    first, second = ep_world(2).run(fork_server_cmdline)
    assert first == second
    print("FORK SERVER", "the session's" if first == cmdline(os.getpid()) else first.split(b"\\0")[:4])
"""


def test_ep_world_forks_its_ranks_fork_server_from_a_one_thread_session(tmp_path):
    """A session with one thread starts its ranks' fork server as a fork of itself (its command
    line is the session's), not as a new interpreter that imports torch again; a session with
    a second thread (here a conftest's) starts it anew, as multiprocessing does."""
    (tmp_path / "test_fork_server.py").write_text(FORK_SERVER_TESTS)
    forked = pytest_in(tmp_path, "-s", "-q", "test_fork_server.py")
    (tmp_path / "conftest.py").write_text("import threading\n"
                                          "threading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    anew = pytest_in(tmp_path, "-s", "-q", "test_fork_server.py")
    seen = [[line for line in proc.stdout.splitlines() if line.startswith("FORK SERVER ")] for proc in (forked, anew)]
    assert forked.returncode == anew.returncode == 0 and all(len(s) == 1 for s in seen), forked.stdout + anew.stdout
    assert seen[0] == ["FORK SERVER the session's"], seen
    assert "multiprocessing.forkserver import main" in seen[1][0], seen  # `python -B -c "from multi..."`


@pytest.mark.slow
def test_ep_suite_items_have_the_suite_as_junit_classname(plugin_items_session):
    proc, xml = plugin_items_session  # tests/test_gate.py's session: -k "fold or split-k", split-k fails
    assert proc.returncode == 1 and "1 failed, 1 passed, 1 skipped" in proc.stdout, proc.stdout[-3000:]
    cases = {c.get("name"): c.get("classname") for c in ET.parse(xml).iter("testcase")}
    assert cases == {"fold/rank-invariance/world_size=3": "plugin-items",
                     "fold/rank-invariance/world_size=16": "plugin-items",
                     "split-k/batch-invariance": "plugin-items"}, cases
    fold = [c for c in ET.parse(xml).iter("testcase") if c.get("name").startswith("fold/")]
    # neither fold item failed (one passed, one was skipped)
    assert [[child.tag for child in c if child.tag in ("failure", "error")] for c in fold] == [[], []]


def test_the_plugin_does_not_import_hypothesis():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ep_harness.pytest_plugin"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "ep_harness.pytest_plugin" in imported  # positive control: the listing is of this import
    assert not [m for m in imported if m.split(".")[0] == "hypothesis"]


def test_hypothesis_is_the_explore_extra_not_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("hypothesis")]
    assert [d for d in project["optional-dependencies"]["explore"] if d.startswith("hypothesis")]
    assert [d for d in project["optional-dependencies"]["test"] if d.startswith("hypothesis")]


def test_explore_without_hypothesis_is_one_line_exit_2(monkeypatch, capsys):
    import importlib.util

    from ep_harness import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hypothesis" else real(name, *a))
    assert cli.main(["explore", "all_gather_fold"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ep-harness: error: explore searches with hypothesis, which is not installed; "
                   "pip install 'ep-harness[explore]'"]


@pytest.mark.slow
def test_the_plugin_loads_nothing_heavy_into_a_session_that_does_not_use_it(tmp_path):
    """A user's session that uses none of the plugin's options pays for no torch, launcher or
    report import (what start-up time costs is measured in BENCHMARKS.md, not asserted here:
    timings on a shared machine are noise)."""
    (tmp_path / "test_plain.py").write_text(textwrap.dedent('''
        import sys

        def test_nothing():
            heavy = [m for m in ("torch", "pandas", "matplotlib", "ep_harness.run.verify", "ep_harness.launch.launcher",
                                 "ep_harness.reports.html") if m in sys.modules]
            assert not heavy, heavy
    '''))
    proc = pytest_in(tmp_path, "-q", "test_plain.py", fresh=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--ep-suite" in pytest_in(tmp_path, "--help", fresh=True).stdout  # the plugin was loaded all the same


def test_a_bad_ep_suite_is_a_usage_error_not_an_internal_error(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_nothing():\n    pass\n")
    proc = pytest_in(tmp_path, "-q", "--ep-suite", "smok", "test_plain.py")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage-error exit code
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert "ERROR: --ep-suite smok: unknown suite 'smok' (did you mean 'smoke'?)" in proc.stderr
