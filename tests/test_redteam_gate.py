"""Red-team holes in the gate (issue 23, item 6): an interrupted run, an all-error run and a
run whose every check is vacuous used to pass; each now fails, with one line saying why. And
(2026-12-07) runs and baselines that were read as complete when they were not."""
import json
import re

import pytest

from ep_harness.errors import HarnessError
from ep_harness.regress.gate import fingerprint, gate, render_gate, update_baseline
from ep_harness.records import write_jsonl
from tests.conftest import run_cli
from tests.test_gate import ENV, baseline, baseline_records, run_with  # noqa: F401 (baseline: a fixture)
from tests.test_reports import write_run


def hand_written_baseline(tmp_path, records):
    """A baseline file as an older harness (or a hand) may have left it: update_baseline now
    refuses to record such a run, so the file is written directly."""
    path = tmp_path / "baseline.jsonl"
    write_jsonl(path, [{"fingerprint": fingerprint(ENV)}, *records])
    return path


def all_error():
    return [dict(r, status="error", held=None, mismatched=None, total=None, reason="rank 1 raised RuntimeError")
            for r in baseline_records()]


def all_vacuous():
    return [dict(r, status="vacuous", reason="could not fail: the compared runs are one placement")
            for r in baseline_records()]


def interrupted():
    records = baseline_records()
    for r in records[2:]:
        r.update(status="interrupted", held=None, mismatched=None, total=None,
                 reason="the run was interrupted by SIGTERM before this check finished")
    return records


@pytest.mark.parametrize("make, said", [
    (all_error, "every check that ran errored (4 of 4)"),
    (all_vacuous, "nothing was shown to hold: all 4 check(s) that ran were vacuous"),
    (interrupted, "the run was interrupted by SIGTERM"),
])
def test_a_run_that_showed_nothing_fails_the_gate_even_against_its_own_baseline(tmp_path, make, said):
    records = make()
    base = hand_written_baseline(tmp_path, records)  # the baseline says the same: no per-check change
    env = {**ENV, "interrupted": "SIGTERM"} if make is interrupted else ENV
    run = write_run(tmp_path / "run", records, env)
    result = gate(run, base)
    assert not result["passed"]
    assert [c["check"] for c in result["regressions"]] == ["(the run)"]
    assert said in result["regressions"][0]["what"]
    assert "FAILED" in render_gate(result) and said in render_gate(result)
    proc = run_cli("gate", str(run), "--baseline", str(base), timeout=120)
    assert proc.returncode == 1 and said in proc.stdout, proc.stdout + proc.stderr
    # ... nor can such a run become the baseline that the next one is compared with
    with pytest.raises(HarnessError, match="not recorded as a baseline"):
        update_baseline(run, tmp_path / "new-baseline.jsonl")


def test_an_interrupted_run_fails_against_a_complete_baseline(tmp_path):
    base = update_baseline(run_with(tmp_path, "base", baseline_records()), tmp_path / "baseline.jsonl")
    result = gate(write_run(tmp_path / "run", interrupted(), {**ENV, "interrupted": "SIGINT"}), base)
    assert not result["passed"] and "interrupted by SIGINT" in result["regressions"][0]["what"]


def test_a_few_vacuous_or_erroring_checks_among_measured_ones_are_judged_per_check(tmp_path):
    records = baseline_records()
    records[1].update(status="vacuous", reason="could not fail: one run")
    base = update_baseline(run_with(tmp_path, "base", records), tmp_path / "baseline.jsonl")
    assert gate(run_with(tmp_path, "same", records), base)["passed"]  # vacuous alongside ok: reported, not failed


VACUOUS_AND_OK = """
[[case]]
name = "vacuous-same-batch"   # compares a batch with itself: could not fail
subject = "reduce_scatter_native"
properties = ["batch-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 2
hidden = 256
batch_sizes = [8, 8]

[[case]]
name = "measured"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 3
hidden = 256
"""


@pytest.mark.slow
def test_verify_fails_a_run_whose_every_check_is_vacuous(tmp_path):
    suite = tmp_path / "suite.toml"
    suite.write_text(VACUOUS_AND_OK)
    proc = run_cli("verify", "--suite", str(suite), "--check", "vacuous-*", "--gpus", "0", "--out",
                   str(tmp_path / "only"), cwd=tmp_path)
    statuses = [json.loads(line)["status"] for line in (tmp_path / "only" / "latest" / "results.jsonl")
                .read_text().splitlines()]
    assert statuses == ["vacuous"], proc.stdout[-2000:]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "# FAILED: nothing was shown to hold: all 1 check(s) that ran were vacuous" in proc.stdout
    assert "\n# OK" not in proc.stdout and "# FAILED (nothing was shown to hold" in proc.stdout
    # one vacuous check among measured ones: reported, and the run passes
    proc = run_cli("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "both"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vacuous (could not fail, not counted as passes): 1" in proc.stdout and "\n# OK" in proc.stdout


# --- Red-team review of 2026-12-07: runs and baselines that were read as complete -------------

def test_a_run_killed_before_it_finished_is_refused_by_report_baseline_and_gate(tmp_path, baseline):
    """verify streams results.jsonl as checks finish and writes environment.json last: a run
    killed with SIGKILL holds the finished checks' records and no environment.json. Its report
    said OK, and it could be recorded as a baseline and passed against one."""
    killed = run_with(tmp_path, "killed", baseline_records()[:2])
    (killed / "environment.json").unlink()
    said = "has no environment.json: the run did not finish"
    for command in (["report", str(killed)], ["baseline", "update", str(killed), "--baseline", str(tmp_path / "b")],
                    ["gate", str(killed), "--baseline", str(baseline)]):
        proc = run_cli(*command)
        assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count("\n") == 1, (command, proc.stderr)
    assert not (tmp_path / "b").exists() and not (killed / "gate.json").exists()
    assert gate(run_with(tmp_path, "whole", baseline_records()), baseline)["passed"]  # control: the finished run


@pytest.mark.parametrize("edit, said", [
    (lambda rs: rs[1].update(status="passed"), "status 'passed' is not one of ok, unexpected"),
    (lambda rs: rs[1].update(status=["ok"]), "status ['ok'] is not one of"),
    (lambda rs: rs.append(dict(rs[0])), "check 'held-check' again (first on line 1)"),
    (lambda rs: rs[0].update(check=""), "has no check id"),
])
def test_a_run_record_the_harness_would_not_write_is_named_by_its_line(tmp_path, baseline, edit, said):
    records = baseline_records()
    edit(records)
    run = run_with(tmp_path, "edited", records)
    with pytest.raises(HarnessError, match=r"results.jsonl:\d+: .*" + re.escape(said)):
        gate(run, baseline)
    proc = run_cli("report", str(run))
    assert proc.returncode == 2 and said in proc.stderr


@pytest.mark.parametrize("header, said", [
    ({"checks": "4"}, "checks = '4' is not a count"), ({"checks": 3.0}, "checks = 3.0 is not a count"),
    ({"checks": True}, "checks = True is not a count"), ({"checks": -1}, "checks = -1 is not a count"),
])
def test_a_baseline_header_whose_count_is_not_a_count_is_refused(tmp_path, header, said):
    records = baseline_records()
    path = tmp_path / "baseline.jsonl"
    write_jsonl(path, [{"fingerprint": fingerprint(ENV), **header}, *records[:-1]])
    with pytest.raises(HarnessError, match=f"baseline.jsonl:1: {said}"):
        gate(run_with(tmp_path, "run", records), path)
    write_jsonl(path, [{"fingerprint": fingerprint(ENV), "checks": 3}, *records[:-1]])  # control: a count
    assert gate(run_with(tmp_path, "run2", records), path)["passed"]


def test_a_baseline_that_repeats_a_check_is_refused(tmp_path):
    """One check's line replaced by a copy of another's kept the count and hid its regression."""
    records = baseline_records()
    path = tmp_path / "baseline.jsonl"
    write_jsonl(path, [{"fingerprint": fingerprint(ENV), "checks": 4}, *records[:-1], records[0]])
    with pytest.raises(HarnessError, match=r"baseline.jsonl:5: check 'held-check' again \(first on line 2\)"):
        gate(run_with(tmp_path, "run", records), path)


def test_nightly_refuses_a_damaged_baseline_before_it_runs(tmp_path):
    path = tmp_path / "baseline.jsonl"
    write_jsonl(path, [{"fingerprint": fingerprint(ENV), "checks": "many"}, *baseline_records()])
    proc = run_cli("nightly", "--suite", "smoke", "--baseline", str(path), "--history", str(tmp_path / "h.jsonl"),
                   cwd=tmp_path)
    assert proc.returncode == 2 and "checks = 'many' is not a count" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "h.jsonl").exists() and not (tmp_path / "reports").exists()  # nothing ran or written
