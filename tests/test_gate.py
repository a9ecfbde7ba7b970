"""The nightly gate, baselines, history, the workflow file, and `pytest --ep-suite`."""
import json
import subprocess
import sys

import pytest
import yaml

from harness.errors import HarnessError
from harness.gate import append_history, gate, platform_key, update_baseline
from reports.render import render_run
from tests.conftest import REPO
from tests.test_reports import record, write_run

ENV = {"command": "test", "backend": "gloo", "max_ranks": 4, "date": "2026-11-29T00:00:00+00:00",
       "harness_commit": "abc"}


def baseline_records():
    return [record("held-check"), record("other"),
            record("control", subject="reduce_scatter_native", expect="violated", held=False, mismatched=2711),
            record("going-away")]


@pytest.fixture
def baseline(tmp_path):
    run = write_run(tmp_path / "base", baseline_records(), ENV)
    return update_baseline(run, tmp_path / "baseline.jsonl")


def run_with(tmp_path, name, records):
    return write_run(tmp_path / name, records, ENV)


def test_identical_rerun_passes(tmp_path, baseline):
    result = gate(run_with(tmp_path, "same", baseline_records()), baseline)
    assert result["passed"] and not result["regressions"] and not result["improvements"]
    assert json.loads((tmp_path / "same" / "gate.json").read_text())["passed"] is True


@pytest.mark.parametrize("plant, check, what", [
    (lambda rs: rs[0].update(held=False, mismatched=3, status="unexpected"), "held-check", "held before, violated now"),
    (lambda rs: rs.append(record("fresh", status="error", held=None, mismatched=None, total=None,
                                 reason="rank 1 raised")), "fresh", "new check, error"),
    (lambda rs: rs[2].update(mismatched=2712), "control", "control's mismatch count changed for the same inputs"),
    (lambda rs: rs.pop(3), "going-away", "disappeared"),
    (lambda rs: rs[1].update(status="error", reason="timed out"), "other", "now error"),
])
def test_each_planted_regression_fails_the_gate(tmp_path, baseline, plant, check, what):
    records = baseline_records()
    plant(records)
    result = gate(run_with(tmp_path, "planted", records), baseline)
    assert not result["passed"]
    assert [c["check"] for c in result["regressions"]] == [check]
    assert result["regressions"][0]["what"].startswith(what)


def test_improvement_passes_with_a_notice(tmp_path):
    before = baseline_records()
    before[0].update(held=False, mismatched=3, status="unexpected")
    base = update_baseline(write_run(tmp_path / "b", before, ENV), tmp_path / "baseline.jsonl")
    result = gate(run_with(tmp_path, "better", baseline_records()), base)
    assert result["passed"] and [c["check"] for c in result["improvements"]] == ["held-check"]


def test_missing_baseline_names_the_fix(tmp_path):
    with pytest.raises(HarnessError, match="ep-harness baseline update"):
        gate(run_with(tmp_path, "r", baseline_records()), tmp_path / "none.jsonl")


def test_platform_keys():
    assert platform_key(ENV) == "cpu-gloo-4"
    assert platform_key({"gpus": ["NVIDIA H200"] * 4}) == "nvidia-h200-x4"
    emulated = {"gpus": ["NVIDIA H200"], "topology": {"kind": "emulated-hosts", "ranks": 8, "gpus": 1}}
    assert platform_key(emulated) == "nvidia-h200-x1-emulated-hosts-8"  # never mixed with real GPUs
    assert (REPO / "ci" / "baselines" / f"{platform_key(emulated)}.jsonl").exists()


def test_history_and_trends(tmp_path):
    history = tmp_path / "history.jsonl"
    first = run_with(tmp_path, "n1", baseline_records())
    records = baseline_records()
    records[2].update(mismatched=2800, run_id="r2")
    for r in records:
        r["run_id"] = "r2"
    second = write_run(tmp_path / "n2", records, {**ENV, "date": "2026-11-30T00:00:00+00:00"})
    assert append_history(first, history) == 4 and append_history(second, history) == 4
    render_run(second, history=history, quiet=True)
    page = (second / "report.html").read_text()
    assert "<h2>Trends</h2>" in page and "2 run(s)" in page
    assert "Changed since the previous run" in page and "ok 2800" in page
    assert page.count('alt="mismatched elements per check"') == 1


def test_workflow_is_safe_and_thin():
    wf = yaml.safe_load((REPO / "ci" / "nightly.yml").read_text())
    triggers = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert set(triggers) == {"schedule", "workflow_dispatch"}
    assert wf["permissions"] == {"contents": "read"}
    job = wf["jobs"]["nightly"]
    assert job["strategy"]["matrix"]["gpus"] == [1, 4, 8]
    assert {"gpus": 1, "emulate": "1", "suite": "h200-emulated"} in job["strategy"]["matrix"]["include"]
    assert job["runs-on"][0] == "self-hosted"
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert runs and all(r.strip().startswith("make ") for r in runs)
    assert any("upload-artifact" in s.get("uses", "") for s in job["steps"])


@pytest.mark.slow
def test_ep_suite_runs_checks_as_pytest_items(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ep-suite",
                           "tests/cases/plugin_items.toml", "--ep-gpus", "0", "-rs", "tests/test_gate.py", "-k",
                           "fold or split-k"], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out[-2000:]
    assert "1 failed, 1 passed, 1 skipped" in out, out[-2000:]
    assert "needs 16 ranks" in out
    assert "Mismatched elements:" in out
