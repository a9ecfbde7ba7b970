"""The nightly gate, baselines, history, the workflow file, and `pytest --ep-suite`."""
import json
import re
from pathlib import Path

import pytest
import yaml

from ep_harness.regress.gate import (NotComparable, append_history, baseline_path, fingerprint, fingerprint_hash, gate,
                          platform_key, read_baseline, update_baseline)
from ep_harness.reports.render import render_run
from tests.conftest import REPO, run_cli
from tests.shared_runs import plugin_items_session  # noqa: F401  (a fixture)
from tests.test_reports import record, write_run

CPU = {"model": "AMD EPYC", "isa": ["avx2", "avx512f"], "torch_capability": "AVX512", "onednn_max_cpu_isa": None}
ENV = {"command": "test", "backend": "gloo", "max_ranks": 4, "date": "2026-11-29T00:00:00+00:00",
       "harness_commit": "abc", "torch": "2.13.0+cpu", "cpu": CPU}


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
    (lambda rs: rs[1].update(status="skipped", held=None, mismatched=None, reason="deep_gemm cannot be imported"),
     "other", "ok before, skipped now"),
    (lambda rs: rs[1].update(status="vacuous", reason="could not fail: one run"), "other", "ok before, vacuous now"),
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
    with pytest.raises(NotComparable, match="ep-harness baseline update"):
        gate(run_with(tmp_path, "r", baseline_records()), tmp_path / "none.jsonl")


@pytest.mark.parametrize("change", [
    {"cpu": {**CPU, "model": "Intel Xeon", "torch_capability": "AVX2"}},
    {"cpu": {**CPU, "onednn_max_cpu_isa": "AVX2"}},  # the same machine, another oneDNN ISA
    {"torch": "2.14.0+cpu"},
])
def test_another_platform_is_not_comparable_and_exits_3(tmp_path, baseline, change):
    run = write_run(tmp_path / "elsewhere", baseline_records(), {**ENV, **change})
    with pytest.raises(NotComparable) as err:
        gate(run, baseline)
    message = str(err.value)
    assert message.startswith("not comparable: baseline") and "this run on cpu-gloo-4" in message
    assert "ep-harness baseline update" in message and "\n" not in message
    proc = run_cli("gate", str(run), "--baseline", str(baseline), timeout=120)
    assert proc.returncode == 3 and "not comparable" in proc.stderr
    # ... while a GPU run's fingerprint leaves the host CPU out (the GPU computes what is measured)
    gpu = {**ENV, "backend": "nccl", "gpus": ["NVIDIA H200"]}
    assert fingerprint({**gpu, **change}).get("cpu") is None


def test_baselines_are_kept_per_fingerprint(tmp_path):
    run = write_run(tmp_path / "run", baseline_records(), ENV)
    path = baseline_path(run, None)
    assert path.parent == Path("ci/baselines") and path.name.startswith("cpu-gloo-4-")
    other = write_run(tmp_path / "other", baseline_records(), {**ENV, "cpu": {**CPU, "model": "Intel Xeon"}})
    assert baseline_path(other, None) != path


def test_two_suites_on_one_platform_keep_a_baseline_each(tmp_path):
    """The nightly job runs h200-emulated and h200-deepep on one runner: neither is gated
    against the other's checks."""
    a = write_run(tmp_path / "a", baseline_records(), {**ENV, "suite": "/x/cases/nightly.toml"})
    b = write_run(tmp_path / "b", baseline_records(), {**ENV, "suite": "smoke"})
    assert baseline_path(a, None).name.startswith("cpu-gloo-4-nightly-")
    assert baseline_path(b, None).name.startswith("cpu-gloo-4-smoke-")
    update_baseline(a, tmp_path / "nightly.jsonl")
    with pytest.raises(NotComparable):
        gate(b, tmp_path / "nightly.jsonl")


def test_platform_keys():
    assert platform_key(ENV) == "cpu-gloo-4"
    assert platform_key({"gpus": ["NVIDIA H200"] * 4}) == "nvidia-h200-x4"
    emulated = {"gpus": ["NVIDIA H200"], "topology": {"kind": "emulated-hosts", "ranks": 8, "gpus": 1}}
    assert platform_key(emulated) == "nvidia-h200-x1-emulated-hosts-8"  # never mixed with real GPUs
    assert list((REPO / "ci" / "baselines").glob(f"{platform_key(emulated)}-*.jsonl"))


def test_committed_baselines_match_their_own_runs():
    """Every committed baseline starts with its fingerprint, is named by it, and is in the
    typed record format (every measured record says which comparison it made)."""
    paths = sorted((REPO / "ci" / "baselines").glob("*.jsonl"))
    assert len(paths) >= 2
    for path in paths:
        fp, records = read_baseline(path)
        assert fp is not None and path.name == f"{fp['platform']}-{fp['suite']}-{fingerprint_hash(fp)}.jsonl"
        assert records and all(r["params"].get("seed") is not None for r in records)  # every effective parameter
        assert all("comparison" in r for r in records if r["status"] not in ("error", "skipped"))


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
    assert {"gpus": 1, "emulate": "1", "suite": "h200-deepep", "deepep": "1"} in job["strategy"]["matrix"]["include"]
    for name in ("PYTHONPATH", "EP_HARNESS_DEEPEP_VERSION"):  # DeepEP for its own entry only
        assert job["env"][name].startswith("${{ matrix.deepep == '1' && vars."), job["env"][name]
    for entry in job["strategy"]["matrix"]["include"]:  # every suite the job runs has its baseline
        platform = "nvidia-h200-x1-emulated-hosts-8" if entry["emulate"] == "1" else None
        if platform:
            paths = list((REPO / "ci" / "baselines").glob(f"{platform}-{entry['suite']}-*.jsonl"))
            assert paths, entry
            for path in paths:  # a baseline has DeepEP in its fingerprint exactly where the entry gets it
                fp = json.loads(path.read_text().splitlines()[0])["fingerprint"]
                assert ("deep_ep" in fp) == (entry.get("deepep") == "1"), (entry, path.name)
    assert job["runs-on"][0] == "self-hosted"
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert runs and all(r.strip().startswith("make ") for r in runs)
    assert any("upload-artifact" in s.get("uses", "") for s in job["steps"])
    uses = [s["uses"] for s in job["steps"] if "uses" in s]
    assert uses and all(re.fullmatch(r"[\w./-]+@[0-9a-f]{40}", u) for u in uses)  # pinned by commit SHA
    constraints = REPO / job["env"]["PIP_CONSTRAINT"]
    assert constraints.exists() and "pandas==" in constraints.read_text()
    cached = [s["with"]["path"] for s in job["steps"] if s.get("uses", "").startswith("actions/cache@")]
    assert cached == ["~/.cache/ep-harness/deep_gemm"]  # DeepGEMM's kernels, where pinned_env puts them


@pytest.mark.slow
def test_ep_suite_runs_checks_as_pytest_items(plugin_items_session):
    proc, _ = plugin_items_session  # -k "fold or split-k" of tests/cases/plugin_items.toml
    out = proc.stdout
    assert proc.returncode == 1, out[-2000:]
    assert "1 failed, 1 passed, 1 skipped" in out, out[-2000:]
    assert "needs 16 ranks" in out
    assert "Mismatched elements:" in out
