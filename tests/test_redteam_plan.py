"""Red-team holes in what a run takes from its inputs (issue 23, item 6): a case's timeout,
a record's launch environment, and credentials in what a run writes."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.environment import applicable_env, recorded_env, redacted_command
from ep_harness.errors import HarnessError
from ep_harness.run.plan import expand
from ep_harness.run.verify import base_record
from ep_harness.subject import Platform
from tests.conftest import once_per_session, run_cli, shared_dir
from tests.forked_cli import cli_batch

CASE = """
[[case]]
name = "one"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
timeout_s = {timeout}
[case.params]
dtype = "bfloat16"
hidden = 256
world_size = 2
"""


@pytest.mark.parametrize("timeout", ["inf", "-inf", "nan", "0", "-1", "true", '"60"'])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_plan_time(tmp_path, timeout):
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(timeout=timeout))
    with pytest.raises(HarnessError, match="timeout_s"):
        load_suite(suite)
    proc = run_cli("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "timeout_s" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


def test_a_finite_timeout_still_loads(tmp_path):
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(timeout="2.5"))
    assert load_suite(suite).cases[0].timeout_s == 2.5


def _record(tmp_path, **changes) -> Path:
    """A results.jsonl of one real check's record, with `changes` planted."""
    registry.load_all()
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(timeout="60"))
    [check] = expand(load_suite(suite), Platform(backend="gloo", device="cpu", ranks=4))
    record = {**base_record(check, "r1", "rerun"), "status": "ok", **changes}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


FORBIDDEN = [
    ({"timeout_s": float("inf")}, "timeout_s = inf"),
    ({"timeout_s": float("nan")}, "timeout_s = nan"),
    ({"launch_env": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD"),
    ({"launch_env": {"NCCL_NET_PLUGIN": "evil"}}, "NCCL_NET_PLUGIN"),  # a library NCCL would load
    ({"launch_env": {"NCCL_DEBUG_FILE": "x"}}, "NCCL_DEBUG_FILE"),  # a file NCCL would write
    ({"launch_env": {"NCCL_ALGO": "../../tmp/x"}}, "NCCL_ALGO"),
    ({"launch_env": {"PYTHONPATH": "/tmp"}}, "PYTHONPATH"),
    ({"launch_env": {"EP_HARNESS_COMMIT": "forged"}}, "EP_HARNESS_COMMIT"),
]


@pytest.fixture(scope="session")
def from_record_refusals(tmp_path_factory):
    """`verify --from-record` of every planted results file of FORBIDDEN, each in a directory of
    its own, once per session: the refusals run one after another in one interpreter (cli_batch).
    Returns by `named` the process and the directory (the test's tmp_path as it was)."""
    def make(folder):
        jobs = []
        for i, (changes, _) in enumerate(FORBIDDEN):
            case = folder / f"case{i}"
            case.mkdir(parents=True)
            results = _record(case, **changes)
            jobs.append((["verify", "--from-record", results, "--gpus", "0", "--out", case / "out"], case))
        return cli_batch(jobs, {**os.environ, "PYTHONUNBUFFERED": "1"})

    done = once_per_session(tmp_path_factory, "redteam-plan-from-record", make)
    folder = shared_dir(tmp_path_factory) / "redteam-plan-from-record"
    return {named: (subprocess.CompletedProcess(**proc), folder / f"case{i}")
            for i, ((_, named), proc) in enumerate(zip(FORBIDDEN, done))}


@pytest.mark.parametrize("changes, named", FORBIDDEN)
def test_from_record_refuses_what_a_results_file_must_not_set(from_record_refusals, changes, named):
    """A record's launch_env used to be applied verbatim: an LD_PRELOAD in a results file ran."""
    proc, tmp_path = from_record_refusals[named]
    planted = json.loads((tmp_path / "results.jsonl").read_text())  # the record this run was given
    assert all(planted[k] == v or v != v for k, v in changes.items()), planted  # (v != v: NaN)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_variables_a_record_may_set_are_kept():
    env = {"NCCL_ALGO": "allreduce:tree;reducescatter:ring", "NCCL_PROTO": "Simple", "CUBLAS_WORKSPACE_CONFIG":
           ":4096:8", "NCCL_IB_PASSWD": "<redacted>"}
    # the redacted credential is left to this machine's own environment, never set to "<redacted>"
    assert applicable_env(env, "r") == {k: v for k, v in env.items() if k != "NCCL_IB_PASSWD"}


def test_credentials_are_redacted_by_pattern_wherever_env_is_recorded(tmp_path):
    names = ["NCCL_IB_PASSWD", "NCCL_X_PASS", "NCCL_SOCKET_CREDENTIAL", "NCCL_AUTH_MODE", "NCCL_IB_KEY",
             "NCCL_API_TOKEN", "NCCL_SECRET", "NCCL_PASSWORD"]
    env = recorded_env({**{n: "hunter2" for n in names}, "NCCL_ALGO": "ring"})
    assert env == {**{n: "<redacted>" for n in names}, "NCCL_ALGO": "ring"}
    # ... in a record's launch_env (a case's env overrides) ...
    suite = tmp_path / "suite.toml"
    text = CASE.format(timeout="60").replace('timeout_s = 60', 'timeout_s = 60\nenv = { NCCL_IB_PASSWD = "hunter2", '
                                                                  'NCCL_X_CREDENTIAL = "hunter2", NCCL_ALGO = "ring" }')
    suite.write_text(text)
    registry.load_all()
    [check] = expand(load_suite(suite), Platform(backend="gloo", device="cpu", ranks=4))
    record = base_record(check, "r1", "rerun")
    assert record["launch_env"] == {"NCCL_IB_PASSWD": "<redacted>", "NCCL_X_CREDENTIAL": "<redacted>",
                                    "NCCL_ALGO": "ring", "OMP_NUM_THREADS": "1"}
    assert check.env["NCCL_IB_PASSWD"] == "hunter2"  # the launch itself still gets the value
    # ... and in the command line environment.json keeps
    assert redacted_command(["ep-harness", "verify", "--run-secret", "s3cr3t", "--run-secret=s3cr3t"]) == [
        "ep-harness", "verify", "--run-secret", "<redacted>", "--run-secret=<redacted>"]


def test_credentials_in_nccls_own_log_are_redacted(tmp_path):
    """NCCL's ENV subsystem logs every variable it reads with its value, into the run directory."""
    from ep_harness.launch.launcher import redact_logs

    log = tmp_path / "nccl-rank0-0.log"
    log.write_text("h:1:1 [0] NCCL INFO NCCL_IB_PASSWD set by environment to hunter2\n"
                   "h:1:1 [0] NCCL INFO NCCL_ALGO set by environment to allreduce:tree\n"
                   "h:1:1 [0] NCCL INFO NCCL_SOCKET_CREDENTIAL set by environment to hunter2\n")
    redact_logs(tmp_path)
    text = log.read_text()
    assert "hunter2" not in text and text.count("set by environment to <redacted>") == 2
    assert "NCCL_ALGO set by environment to allreduce:tree" in text
