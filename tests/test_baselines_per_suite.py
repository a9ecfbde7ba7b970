"""Baselines per suite (harness/regress/gate.py) and the nightly workflow's DeepEP entry: the holes a
review of 2026-12-01 found, each reproduced (a rerun named after its records' path, a --check
subset recorded or gated as its whole suite, a suite name that is a path, 'not comparable'
offering another suite's baselines, a night without DeepEP that looks passed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, once_per_session, run_cli



def _verify(*args: str) -> Path:
    proc = run_cli("verify", "-q", *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = Path(args[args.index("--out") + 1])
    return (out / "latest").resolve()


@pytest.fixture(scope="session")
def subset_run(tmp_path_factory) -> Path:
    """`verify --suite smoke --check fold-reference`: a --check subset of the smoke suite (once
    per session)."""
    return Path(once_per_session(tmp_path_factory, "subset-run", lambda out: str(
        _verify("--suite", "smoke", "--check", "fold-reference", "--out", str(out)))))


def test_a_from_record_run_keeps_its_suites_baseline(subset_run, tmp_path):
    """A rerun from records keeps its source run's suite name: its baseline is the suite's
    (named after the records' path it would nest a directory under ci/baselines)."""
    from ep_harness.regress.gate import BASELINE_DIR, baseline_path, fingerprint
    from ep_harness.reports.load import load_run

    rerun = _verify("--from-record", str(subset_run / "results.jsonl"), "--out", str(tmp_path))
    assert fingerprint(load_run(subset_run).environment)["suite"] == "smoke"
    assert baseline_path(rerun, None).parent == BASELINE_DIR, baseline_path(rerun, None)
    assert fingerprint(load_run(rerun).environment)["suite"] == "smoke"


def test_a_check_subset_is_not_recorded_as_the_suites_baseline(subset_run, tmp_path):
    """`make baseline` of a `--check` run would make a few checks the suite's baseline (every
    later full run would see the rest as `new`, never a lost `ok`): refused, naming it."""
    from ep_harness.errors import HarnessError
    from ep_harness.regress.gate import update_baseline

    with pytest.raises(HarnessError, match="selected checks"):
        update_baseline(subset_run, tmp_path / "smoke-baseline.jsonl")


def test_a_check_subset_is_gated_on_what_it_selected(subset_run, tmp_path):
    """Gating a `--check` run against the whole suite's baseline would call every check it
    did not select 'disappeared': not comparable (exit 3), naming the selection."""
    from ep_harness.regress.gate import NotComparable, fingerprint, gate
    from ep_harness.records import read_jsonl, write_jsonl
    from ep_harness.reports.load import load_run

    records = read_jsonl(subset_run / "results.jsonl")
    other = {**records[0], "check": "rs-native/batch-invariance/world_size=4", "case": "rs-native"}
    baseline = tmp_path / "whole-suite.jsonl"
    write_jsonl(baseline, [{"fingerprint": fingerprint(load_run(subset_run).environment)}, *records, other])
    with pytest.raises(NotComparable, match="--check fold-reference"):
        gate(subset_run, baseline)


def _run_with_environment(src: Path, dst: Path, **env) -> Path:
    """A copy of a finished run (its records) with environment.json replaced."""
    dst.mkdir(parents=True)
    (dst / "results.jsonl").write_text((src / "results.jsonl").read_text())
    (dst / "environment.json").write_text(json.dumps(env))
    return dst


def test_a_suite_name_is_a_plain_file_name(subset_run, tmp_path):
    """A suite's name names its baseline files: `name = "team/nightly"` would put one in a
    directory under ci/baselines; refused in one line naming the name."""
    from ep_harness.cases import load_suite
    from ep_harness.errors import HarnessError

    suite = tmp_path / "mine.toml"
    suite.write_text('[suite]\nname = "team/nightly"\n\n[[case]]\nname = "fold"\nsubject = "all_gather_fold"\n'
                     'properties = ["reference"]\nexpect = "holds"\n')
    with pytest.raises(HarnessError, match="not a plain file name"):
        load_suite(suite)
    suite.write_text(suite.read_text().replace("team/nightly", "team-nightly"))
    assert load_suite(suite).name == "team-nightly"  # the control: the same file with a plain name


def test_not_comparable_names_only_this_suites_baselines(subset_run, tmp_path, monkeypatch):
    """A `--suite h200` run on the emulated platform has no baseline; the baselines of
    h200-deepep and h200-emulated (whose names start the same) are not offered as its own."""
    from ep_harness.regress.gate import NotComparable, gate

    monkeypatch.chdir(REPO)  # BASELINE_DIR is relative to the checkout
    path = next((REPO / "ci" / "baselines").glob("nvidia-h200-x1-emulated-hosts-8-h200-emulated-*.jsonl"))
    fp = json.loads(path.read_text().splitlines()[0])["fingerprint"]
    env = {"suite": "cases/h200.toml", "suite_name": "h200", "backend": fp["backend"], "gpus": fp["gpus"],
           "topology": {"kind": fp["topology"], "ranks": fp["ranks"]}, "torch": fp["torch"], "cuda": fp["cuda"],
           "nccl": fp["nccl"], "driver": fp["driver"], "libraries": {"deep-gemm": fp["deep_gemm"]}}
    run = _run_with_environment(subset_run, tmp_path / "run", **env)
    with pytest.raises(NotComparable) as exc:
        gate(run)
    assert "h200-emulated-" not in str(exc.value) and "h200-deepep-" not in str(exc.value), str(exc.value)


def test_a_skipped_deepep_night_is_visible():
    """A runner without DeepEP skips the h200-deepep entry; the reason reaches the job's
    summary and an annotation, so such a night does not look like one DeepEP passed."""
    wf = yaml.safe_load((REPO / "ci" / "nightly.yml").read_text())
    steps = wf["jobs"]["nightly"]["steps"]
    recipe = (REPO / "Makefile").read_text().split("deepep-ready: install", 1)[1].split("\n\n", 1)[0]
    on_skip = [s for s in steps if "skip == 'true'" in str(s.get("if", ""))]
    surfaced = "::warning" in recipe or "GITHUB_STEP_SUMMARY" in recipe or any(
        "::warning" in s.get("run", "") or "GITHUB_STEP_SUMMARY" in s.get("run", "") for s in on_skip)
    assert surfaced
