"""ci/compare_runs.py: two runs compared check by check on status, mismatched,
predicted_mismatched and the bits' fingerprint; everything else (timing, run id, reason
wording) may differ."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "ci" / "compare_runs.py"


def record(check: str, **fields) -> dict:
    base = {"run_id": "r1", "check": check, "status": "ok", "mismatched": 0, "predicted_mismatched": 0,
            "bits_fingerprint": "blake2b:aa", "seconds": 0.5, "reason": "held"}
    return base | fields


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def compare(old: Path, new: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(old), str(new)], capture_output=True, text=True,
                          timeout=60)


OLD = [record("a/rank-invariance/world_size=2"),
       record("b/batch-invariance", status="ok", mismatched=12, predicted_mismatched=12, bits_fingerprint="blake2b:bb"),
       record("c/repeatability", status="vacuous", mismatched=None, predicted_mismatched=None,
              bits_fingerprint=None)]


def test_same_answers_with_other_timing_and_wording_pass(tmp_path):
    new = [r | {"run_id": "r2", "seconds": 9.0, "reason": "other words"} for r in OLD]
    out = compare(write(tmp_path / "old.jsonl", OLD), write(tmp_path / "new.jsonl", new))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 of 3 checks differ" in out.stdout


def test_each_compared_field_that_changes_is_printed(tmp_path):
    new = [OLD[0] | {"status": "failed"}, OLD[1] | {"mismatched": 13, "bits_fingerprint": "blake2b:cc"},
           OLD[2] | {"predicted_mismatched": 4}]
    out = compare(write(tmp_path / "old.jsonl", OLD), write(tmp_path / "new.jsonl", new))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert "a/rank-invariance/world_size=2: status ok -> failed" in lines
    assert "b/batch-invariance: mismatched 12 -> 13; bits_fingerprint blake2b:bb -> blake2b:cc" in lines
    assert "c/repeatability: predicted_mismatched None -> 4" in lines
    assert "3 of 3 checks differ" in lines[-1]


def test_a_check_only_one_run_has_differs(tmp_path):
    new = OLD[:2] + [record("d/new-check")]
    out = compare(write(tmp_path / "old.jsonl", OLD), write(tmp_path / "new.jsonl", new))
    assert out.returncode == 1
    assert "c/repeatability: only in the old run" in out.stdout
    assert "d/new-check: only in the new run" in out.stdout


def test_a_run_directory_stands_for_its_results(tmp_path):
    (tmp_path / "run").mkdir()
    write(tmp_path / "run" / "results.jsonl", OLD)
    out = compare(tmp_path / "run", write(tmp_path / "new.jsonl", OLD))
    assert out.returncode == 0, out.stderr


def test_unreadable_input_is_one_line_naming_the_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no_check": 1}\n')
    out = compare(bad, write(tmp_path / "new.jsonl", OLD))
    assert out.returncode == 2
    assert out.stderr.strip() == f"{bad}:1: not a check record (JSON with a `check` field); pass a run's results.jsonl"
    missing = compare(tmp_path / "absent.jsonl", bad)
    assert missing.returncode == 2 and "cannot read it" in missing.stderr and len(missing.stderr.splitlines()) == 1
