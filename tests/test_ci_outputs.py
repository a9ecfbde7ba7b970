"""What CI systems read: JUnit XML, the Markdown summary, GitHub annotations, and a terminal
table whose every row says which check it is."""
import json
import xml.etree.ElementTree as ET
from dataclasses import asdict

from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.run.plan import expand
from ep_harness.subject import Platform
from ep_harness.reports.ci_outputs import github_annotations, junit_xml, summary_markdown
from ep_harness.reports.terminal import render
from tests.conftest import REPO
from tests.test_reports import record


def test_junit_and_summary_from_a_real_run(smoke_run):
    proc, run_dir = smoke_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    suite = ET.parse(run_dir.parent / "junit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == int(suite.get("tests")) == len(records)
    assert {c.get("name") for c in cases} == {r["check"] for r in records}
    skipped = sum(r["status"] in ("skipped", "vacuous") for r in records)
    assert int(suite.get("skipped")) == skipped == sum(c.find("skipped") is not None for c in cases) > 0
    assert int(suite.get("failures")) == int(suite.get("errors")) == 0
    text = (run_dir.parent / "summary.md").read_text()
    assert text.startswith("## ep-harness: OK") and "Control -> fix" in text  # the smoke suite's pairs


def test_seed_reseeds_every_check_and_the_record_says_so(planted_run):
    assert {r["params"]["seed"] for r in planted_run.values()} == {5}


def test_failures_reach_junit_and_annotations_without_forging_anything():
    evil = record("c\n::error::forged", status="unexpected", held=False, mismatched=3, total=8,
                  reason="expected to hold, but 3 / 8 differ\n# OK: all good")
    recs = [evil, record("fine")]
    suite = ET.fromstring(junit_xml(recs, "r")).find("testsuite")
    assert suite.get("failures") == "1" and "Mismatched elements: 3 / 8" in suite.find("testcase/failure").text
    [line] = github_annotations(recs)
    assert "\n" not in line and line.count("::") == 2 and "%0A%3A%3Aerror%3A%3Aforged" in line
    md = summary_markdown(recs, {}, regressions=[{"check": "c", "what": "held before, violated now",
                                                  "before": "0 / 8", "after": "3 / 8"}])
    assert md.startswith("## ep-harness: FAILED") and "### Regressions" in md and "\n# OK" not in md


def test_every_row_of_the_nightly_table_tells_its_check_apart():
    registry.load_all()
    platform = Platform(backend="nccl", device="cuda", ranks=8, gpu_name="H200", gpus=8)
    checks = expand(load_suite(REPO / "cases" / "nightly.toml"), platform)
    recs = [record(c.id, case=c.case, subject=c.subject, family=c.family, property=c.property,
                   params=asdict(c.params)) for c in checks]
    rows = [line for line in render(recs, {}).splitlines() if line.startswith("  ok")]
    assert len(rows) == len(recs) == len(set(rows))
    assert any("layout=masked" in row and "routing=zipf" in row for row in rows)


def test_skipped_checks_are_counted_by_reason():
    recs = [record("a"), *(record(f"s{i}", status="skipped", reason="needs 8 ranks", held=None, mismatched=None)
                           for i in range(3))]
    out = render(recs, {})
    assert "#   3 x needs 8 ranks" in out and "  skipped" not in out
    assert render(recs, {}, show_skipped=True).count("  skipped") == 3
