"""Red-team holes in teardown and retries (issue 23, items 4 and 6): a subject's child that
leaves every process group of the launch must still end with it, and a failing check is
reported failed once, never rerun."""
import json
import os
import time

import pytest

from ep_harness.launch.processes import ENDED_STATES, process_state
from tests.conftest import REPO, REPO_ON_PYTHONPATH, run_cli

CASE = """
[suite]
name = "redteam"
plugins = ["tests.redteam_subjects"]

[[case]]
name = "{name}"
subject = "{subject}"
properties = ["rank-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 3
hidden = 256
"""


def alive(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state.state not in ENDED_STATES


AFTER = """
[[case]]
name = "after"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 3
hidden = 256
"""


def verify(tmp_path, name, subject, env, *args, then=""):
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(name=name, subject=subject) + then)
    old = dict(os.environ)
    os.environ.update({**REPO_ON_PYTHONPATH, **env})
    try:
        proc = run_cli("verify", "--suite", str(suite), "--gpus", "0", "--no-report", "--out", str(tmp_path / "out"),
                       *args, cwd=tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return proc, [json.loads(line) for line in (tmp_path / "out" / "latest" / "results.jsonl").read_text()
                  .splitlines()]


@pytest.mark.slow
def test_a_subjects_child_in_its_own_session_ends_with_the_run(tmp_path):
    children = tmp_path / "children"
    children.mkdir()
    proc, [record] = verify(tmp_path, "escapes", "redteam_setsid_child", {"EP_TEST_CHILD_PIDS": str(children)})
    assert proc.returncode == 0 and record["status"] == "ok", proc.stdout[-2000:] + proc.stderr[-2000:]
    pids = {p.name: int(p.read_text()) for p in children.iterdir()}
    assert sorted(pids) == [f"{kind}-{r}" for kind in ("daemon", "setsid") for r in range(3)]
    # they did leave the launch's process groups: their own session, not the agent's
    deadline = time.time() + 5
    while time.time() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    for pid in left.values():  # never leave them to the next test, whatever happened
        os.kill(pid, 9)
    assert not left, f"outlived the run: {left}"


@pytest.mark.slow
def test_a_failing_check_is_run_once_and_reported_failed_once(tmp_path):
    """The launcher relaunches after a failure from the next check, never from the failed one."""
    calls = tmp_path / "calls"
    proc, [failed, after] = verify(tmp_path, "fails", "redteam_fails_counted", {"EP_TEST_CALLS": str(calls)},
                                   then=AFTER)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert failed["status"] == "error" and "planted failure" in failed["reason"] and after["status"] == "ok"
    assert len(calls.read_text().splitlines()) == 1  # rank 0 called the subject once: no second attempt
    assert len(list((tmp_path / "out" / "latest" / "jobs").glob("*/torchrun-*.log"))) == 2  # the relaunch ran "after"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("[")]  # one streamed row per check
    assert len(rows) == 2 and [row.split()[2] for row in rows] == ["error", "ok"], rows


def test_nothing_configures_a_retry_of_a_failing_check():
    """No rerun plugin, marker or option anywhere a check or test is run from (pytest's
    configuration, the Makefile, the CI workflows, the pytest plugin, the nightly)."""
    places = [REPO / "pyproject.toml", REPO / "Makefile", REPO / "tests" / "conftest.py",
              REPO / "harness" / "pytest_plugin.py", REPO / "harness" / "regress" / "nightly.py", *sorted((REPO / "ci").glob("*.yml"))]
    for path in places:
        text = path.read_text().lower()
        for word in ("reruns", "rerunfailures", "flaky", "retry", "retries"):
            assert word not in text, f"{path.name} mentions {word!r}"
