"""Golden bits: a check whose counts stay 0 but whose output bits moved since the baseline
is a regression (a different, still invariant summation order)."""
import json
import shutil

import pytest

from tests.conftest import REPO_ON_PYTHONPATH, run_cli
from tests.shared_runs import pass_run, pass_suite_run  # noqa: F401 (a fixture)


@pytest.mark.slow
def test_bits_that_move_with_unchanged_counts_fail_the_gate(tmp_path, pass_run):
    """golden_a.toml's fold, in the shared passing run (tests/shared_runs.py), against the same
    run with golden_b.toml's fold (the same case name, another subject)."""
    base_proc, shared_run, _ = pass_run
    base_run, new_run, baseline = tmp_path / "a", tmp_path / "b", tmp_path / "baseline.jsonl"
    shutil.copytree(shared_run, base_run / "latest")  # the gate writes gate.json beside the records
    new_proc = pass_suite_run(new_run, golden="golden_b.toml")
    for proc in (base_proc, new_proc):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    old = [json.loads(line) for line in (base_run / "latest" / "results.jsonl").read_text().splitlines()]
    new = [json.loads(line) for line in (new_run / "out" / "latest" / "results.jsonl").read_text().splitlines()]
    assert {r["subject"] for r in old if r["case"] == "fold"} == {"all_gather_fold"}
    assert {r["subject"] for r in new if r["case"] == "fold"} == {"planted_reverse_fold"}
    # the same verdicts and counts: only the bits tell the two subjects apart
    assert [(r["check"], r["status"], r["mismatched"]) for r in old] == \
        [(r["check"], r["status"], r["mismatched"]) for r in new]
    assert all(r["bits_fingerprint"].startswith("blake2b:") for r in old + new if r["status"] != "skipped")

    assert run_cli("baseline", "update", str(base_run / "latest"), "--baseline", str(baseline)).returncode == 0
    same = run_cli("gate", str(base_run / "latest"), "--baseline", str(baseline))
    assert same.returncode == 0, same.stdout + same.stderr  # a run against its own baseline passes
    moved = run_cli("gate", str(new_run / "out" / "latest"), "--baseline", str(baseline))
    assert moved.returncode == 1, moved.stdout + moved.stderr
    assert "fingerprint moved" in moved.stdout and "first differing block" in moved.stdout


@pytest.mark.slow
def test_fresh_processes_catch_bits_that_depend_on_the_launch(tmp_path, monkeypatch, pass_run):
    """In one launch the planted fold is invariant (run-to-run and rank-invariance hold); its
    first relaunch folds in another order, which only --fresh-processes sees."""
    for key, value in REPO_ON_PYTHONPATH.items():
        monkeypatch.setenv(key, value)
    proc = run_cli("verify", "--suite", "tests/cases/fresh.toml", "--gpus", "0", "--cpu-ranks", "3", "--no-report",
                   "--out", str(tmp_path), "--fresh-processes", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "latest" / "results.jsonl").read_text().splitlines()]
    for r in records:
        assert r["status"] == "unexpected", r
        assert r["reason"].startswith("bits differ across fresh processes: 1 of 2 relaunches differ from the first")
        fps = r["fresh_processes"]["fingerprints"]
        assert fps[0] == fps[2] != fps[1]
    # one launch alone cannot see it: fresh.toml's fold in the shared passing run (tests/shared_runs.py)
    control, _, once = pass_run
    assert [r["status"] for r in once.values() if r["case"] == "fresh-fold"] == ["ok"] * 2, control.stdout
