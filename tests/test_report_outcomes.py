"""What a reader of the terminal, report.html and CI outputs is told apart (issue 36): held,
a control that violated as expected (xfail), a control that did not (XPASS), a failure, a
check that could not fail; failures first, unique labels, controls beside their fixes."""
import json
import os
import re
import xml.etree.ElementTree as ET

import pytest

from ep_harness.reports import bars, terminal
from ep_harness.reports.analysis import outcome, pairs
from ep_harness.reports.ci_outputs import case_lines, github_annotations, junit_xml
from ep_harness.reports.html import render_page
from ep_harness.reports.load import load_run
from tests.conftest import REPO, run_cli
from tests.test_reports import record, write_run


def control(check, **kw):
    return record(check, **{"subject": "reduce_scatter_native", "expect": "violated", "held": False,
                            "mismatched": 1439, "reason": "control shows the violation: 1,439 / 8,192 differ", **kw})


def moe(case, expect, held, mismatched, tp_reduce):
    return record(f"{case}/batch-invariance", case=case, subject="composed_moe", family="moe_layer",
                  property="batch-invariance", expect=expect, held=held, mismatched=mismatched, total=8192,
                  params={"dtype": "bfloat16", "world_size": 4, "tp_reduce": tp_reduce})


def test_outcomes_by_expectation():
    assert outcome(record("a")) == "held"
    assert outcome(control("c")) == "xfail"
    assert outcome(control("c", status="unexpected", held=True, mismatched=0)) == "xpass"
    assert outcome(record("f", status="unexpected", held=False, mismatched=3)) == "failed"
    assert outcome(record("m", expect="model", held=False, mismatched=868)) == "xfail"  # the model says it violates
    assert outcome(record("m", expect="model", held=True)) == "held"
    assert outcome(record("v", status="vacuous")) == "vacuous"


def test_a_composed_control_sits_beside_its_fix_and_every_bar_has_its_own_label():
    native = moe("moe-native-tp", "violated", False, 4612, "reduce_scatter_native")
    fold = moe("moe", "holds", True, 0, "all_gather_fold")
    [(c, fixes)] = pairs([native, fold])  # they differ only in the stage subject that is under test
    assert c is native and fixes == [fold]
    assert "moe-native-tp (composed_moe): 4,612 / 8,192 (56.3%) -> moe (composed_moe): 0 / 8,192 (0.0%)" in \
        terminal.render([native, fold], {})
    labels = [b["label"] for b in bars.summary_bars([fold, native])]
    assert len(set(labels)) == 2 and "moe-native-tp  batch-invariance" in labels


def test_a_small_failure_comes_first_in_the_plot_and_on_the_page(tmp_path):
    small = record("tiny/batch-invariance", case="tiny", property="batch-invariance", status="unexpected",
                   held=False, mismatched=2, total=1000, reason="expected to hold, but 2 / 1,000 differ")
    recs = [control(f"ctl{i}/rank-invariance") for i in range(30)] + [record("fix/rank-invariance"), small]
    drawn = bars.summary_bars(recs)
    assert drawn[0] == {"label": "tiny  batch-invariance", "outcome": "failed", "pct": 0.2}
    assert [b["outcome"] for b in drawn[1:]] == ["xfail"] * 30 + ["held"]
    page = render_page(load_run(write_run(tmp_path / "run", recs)))
    failures, pairs_at, controls = page.index('id="failures"'), page.index('id="pairs"'), page.index("Details: controls")
    assert failures < page.index('id="d-tiny/batch-invariance"') < pairs_at < controls  # its details open, first
    assert 'class="mark xfail">xfail</span> ctl0/rank-invariance' in page



def test_the_summary_bars_name_a_failure_in_words_and_escape_every_label():
    """The SVG summary: each bar as long as its percentage of the axis, a failing bar's row
    marked in words, and a case name carrying markup printed as text."""
    evil = "<script>alert(1)</script>"
    small = record(f"{evil}/batch-invariance", case=evil, property="batch-invariance", status="unexpected",
                   held=False, mismatched=2, total=1000, reason="expected to hold, but 2 / 1,000 differ")
    svg = bars.summary_svg([control("ctl/rank-invariance"), small, record("fix/rank-invariance")])
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;  batch-invariance" in svg
    assert "0.2%  &lt;- FAILED" in svg and "control, violated as expected" in svg and "held: must be 0" in svg
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="\d+" width="([\d.]+)" height="12"', svg)]
    pcts = [b["pct"] for b in bars.summary_bars([control("ctl/rank-invariance"), small])]
    assert len(widths) == 3 and widths[2] == 0 and widths[0] == pytest.approx(widths[1] * pcts[0] / pcts[1], abs=0.1)  # 0.1 px: drawn to .1f
    assert bars.summary_svg([record("ref", property="reference")]) is None  # nothing compared across runs


@pytest.mark.parametrize("mismatched, total, label", [(3, 0, "300.0%"), (9000, 8192, "109.9%"), (float("inf"), 8, "inf%"),
                                                       (float("nan"), 8, "nan%"), (5, 10**12, "0.0%")])
def test_the_summary_bars_draw_any_count_a_record_holds_within_the_plot(mismatched, total, label):
    """A foreign or hand-edited record may count more than it compared, or NaN: the page still
    renders, the bar stays inside the plot and its label says what the record says."""
    odd = record("odd/batch-invariance", case="odd", property="batch-invariance", mismatched=mismatched, total=total)
    svg = bars.summary_svg([odd, control("ctl/rank-invariance")])
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="\d+" width="([\d.]+)" height="12"', svg)]
    assert len(widths) == 2 and all(0 <= w <= bars.PLOT_W for w in widths)
    assert f">{label}<" in svg and not re.search(r'="-?(nan|inf)"', svg)  # every attribute a number

def test_zero_counts_are_neutral_on_an_ok_run(tmp_path):
    page = render_page(load_run(write_run(tmp_path / "run", [record("a"), control("c")])))
    chips = {text: cls for cls, text in re.findall(r'<span class="pill (\w+)"[^>]*>(\d+ \w+)</span>', page)}
    assert chips == {"0 FAILED": "zero", "0 ERROR": "zero", "0 vacuous": "zero", "1 xfail": "xfail", "1 held": "held"}


def test_terminal_marks_controls_like_pytest_and_never_cuts_a_number():
    xpass = control("x/rank-invariance", status="unexpected", held=True, mismatched=0,
                    reason="control expected to show a violation, but 0 / 8,192 differ")
    wide = control("w/rank-invariance", max_ulp=2_542_123)
    text = terminal.render([control("c/rank-invariance"), xpass, wide], {})
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("  ")}
    assert rows["c"].split()[0] == "XFAIL" and rows["x"].split()[0] == "XPASS"
    assert "2,542,123" in rows["w"] and "~" not in rows["w"]
    assert "#   XPASS: x/rank-invariance: control expected to show a violation" in text


def test_the_header_names_no_topology_for_a_one_rank_launch_and_pluralises():
    env = {"harness_version": "0.1.0", "backend": "gloo", "torch": "2.13.0", "suite_name": "s",
           "topology": {"describe": "cpu-gloo: 4 gloo ranks on the CPU"}, "command": "ep-harness verify"}
    one = terminal.run_header(env, [(1, 1)])
    assert not any("topology" in line for line in one) and "# launch plan: 1 launch: 1 check on 1 gloo rank" in one
    four = terminal.run_header(env, [(4, 3), (1, 2)], skipped=5)
    assert "# topology: cpu-gloo: 4 gloo ranks on the CPU" in four
    assert "# launch plan: 2 launches: 3 checks on 4 gloo ranks, 2 checks on 1 gloo rank; 5 skipped" in four
    assert terminal.launch_line(1, 1, "gloo") == "# launching 1 check on 1 gloo rank"


def test_a_model_failure_line_names_its_first_divergence():
    note = "first divergence: layer 0 attention TP reduction on rank 1: outputs differ for 3 of the 3 items"
    failing = record("model-fold/batch-invariance", status="unexpected", held=False, mismatched=40,
                     reason="expected to hold, but 40 / 1,536 differ",
                     detail={"first_divergence": {"layer": 0}, "note": note})
    [line] = [x for x in terminal.render([failing], {}).splitlines() if x.startswith("#   unexpected")]
    assert line.endswith(note)


def test_annotations_point_at_the_case_and_junit_fails_a_vacuous_only_run(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n\n[[case]]\nname = "a"\nsubject = "x"\n\n[[case]]\nname = "b"\n')
    assert case_lines(suite) == {"a": 5, "b": 9}
    [line] = github_annotations([record("b/rank-invariance", case="b", status="unexpected")], {"suite": str(suite)})
    assert line.startswith(f"::error file={suite},line=9,title=")
    xml = ET.fromstring(junit_xml([record("v", status="vacuous", reason="could not fail")], "r")).find("testsuite")
    assert xml.get("failures") == "1" and xml.find("testcase[@name='run']/failure") is not None
    fine = ET.fromstring(junit_xml([record("v", status="vacuous"), record("ok")], "r")).find("testsuite")
    assert fine.get("failures") == "0"  # a vacuous check among others is reported, not failed


@pytest.mark.slow
def test_a_failing_run_under_q_annotates_its_case_and_report_agrees(tmp_path):
    suite = tmp_path / "planted.toml"
    suite.write_text((REPO / "docs/screenshot/planted.toml").read_text())
    env_ci = {**os.environ, "GITHUB_ACTIONS": "true"}
    proc = run_cli("verify", "-q", "--suite", str(suite), "--gpus", "0", "--plugin", "tests.planted", "--out",
                   str(tmp_path / "runs"), cwd=REPO, env={**env_ci, "PYTHONUNBUFFERED": "1"}, module=True)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"::error file={suite},line=4,title=ep-harness gemm-planted-split-k/batch-invariance" in proc.stdout
    again = run_cli("report", str(tmp_path / "runs" / "latest"), "--against", str(tmp_path / "runs" / "latest"))
    assert again.returncode == 1  # the run failed, whatever the comparison says
    assert "# against the earlier run: 0 regressions, 0 improvements, 0 other changes; 1 check in this run" \
        in again.stdout
    assert again.stdout.index("# ep-harness") < again.stdout.index("XFAIL" if "XFAIL" in again.stdout else "unexpected")
