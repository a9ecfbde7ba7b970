"""Golden bits: a check whose counts stay 0 but whose output bits moved since the baseline
is a regression (a different, still invariant summation order)."""
import json

import pytest

from tests.conftest import REPO_ON_PYTHONPATH, run_cli


@pytest.mark.slow
def test_bits_that_move_with_unchanged_counts_fail_the_gate(tmp_path, monkeypatch):
    for key, value in REPO_ON_PYTHONPATH.items():
        monkeypatch.setenv(key, value)
    base_run, new_run, baseline = tmp_path / "a", tmp_path / "b", tmp_path / "baseline.jsonl"
    for suite, out in (("tests/cases/golden_a.toml", base_run), ("tests/cases/golden_b.toml", new_run)):
        proc = run_cli("verify", "--suite", suite, "--gpus", "0", "--cpu-ranks", "3", "--no-report", "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    old = [json.loads(line) for line in (base_run / "latest" / "results.jsonl").read_text().splitlines()]
    new = [json.loads(line) for line in (new_run / "latest" / "results.jsonl").read_text().splitlines()]
    # the same verdicts and counts: only the bits tell the two subjects apart
    assert [(r["check"], r["status"], r["mismatched"]) for r in old] == \
        [(r["check"], r["status"], r["mismatched"]) for r in new]
    assert all(r["bits_fingerprint"].startswith("blake2b:") for r in old + new)

    assert run_cli("baseline", "update", str(base_run / "latest"), "--baseline", str(baseline)).returncode == 0
    same = run_cli("gate", str(base_run / "latest"), "--baseline", str(baseline))
    assert same.returncode == 0, same.stdout + same.stderr  # a run against its own baseline passes
    moved = run_cli("gate", str(new_run / "latest"), "--baseline", str(baseline))
    assert moved.returncode == 1, moved.stdout + moved.stderr
    assert "fingerprint moved" in moved.stdout and "first differing block" in moved.stdout


@pytest.mark.slow
def test_fresh_processes_catch_bits_that_depend_on_the_launch(tmp_path, monkeypatch):
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
    control = run_cli("verify", "--suite", "tests/cases/fresh.toml", "--gpus", "0", "--cpu-ranks", "3",
                      "--no-report", "--out", str(tmp_path / "once"))
    assert control.returncode == 0, control.stdout  # one launch alone cannot see it
