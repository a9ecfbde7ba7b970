"""Reports: they read records only, name bad input by file and line, compare runs, and the
page works in a real browser."""
import json
import shutil
from pathlib import Path
import subprocess
import sys

import pytest

from ep_harness.errors import HarnessError
from ep_harness.reports.analysis import compare_runs, outcome
from ep_harness.reports.load import load_run
from ep_harness.reports.render import render_run
from tests.conftest import run_cli


def record(check, **kw):
    base = {"run_id": "r1", "check": check, "case": check.split("/")[0], "subject": "all_gather_fold",
            "family": "collective", "property": "rank-invariance", "params": {"dtype": "bfloat16", "world_size": 4},
            "expect": "holds", "held": True, "mismatched": 0, "total": 8192, "status": "ok", "reason": "holds",
            "rerun": f"ep-harness verify --check {check}", "seconds": 0.1}
    base.update(kw)
    return base


def write_run(path, records, env=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "environment.json").write_text(json.dumps(env or {"command": "test"}))
    return path


def test_truncated_results_name_the_file_and_line(tmp_path):
    run = write_run(tmp_path / "run", [record("a"), record("b")])
    text = (run / "results.jsonl").read_text()
    (run / "results.jsonl").write_text(text[: len(text) - 20])
    with pytest.raises(HarnessError, match=r"results.jsonl:2: invalid JSON"):
        load_run(run)
    proc = run_cli("report", str(run))
    assert proc.returncode == 2 and "results.jsonl:2: invalid JSON" in proc.stderr


def test_record_missing_required_keys(tmp_path):
    rec = record("a")
    del rec["rerun"]
    run = write_run(tmp_path / "run", [rec])
    with pytest.raises(HarnessError, match=r"results.jsonl:1: record lacks rerun"):
        load_run(run)


def test_missing_optional_fields_render_as_dash(tmp_path, capsys):
    run = write_run(tmp_path / "run", [record("a", mismatched=None, total=None, held=None, status="skipped",
                                              reason="needs 8 ranks")])
    render_run(run, show_skipped=True)
    out = capsys.readouterr().out
    assert "skipped" in out and " - " in out
    render_run(run)  # by default skipped checks are counted by reason
    assert "#   1 x needs 8 ranks" in capsys.readouterr().out
    assert (run / "report.html").exists()


def test_empty_run_says_so(tmp_path):
    run = write_run(tmp_path / "run", [])
    render_run(run, quiet=True)
    assert "This run has no records" in (run / "report.html").read_text()


def test_against_marks_exactly_the_planted_regression(tmp_path, capsys):
    good = [record(f"c{i}") for i in range(6)] + [
        record("ctl", subject="reduce_scatter_native", expect="violated", held=False, mismatched=2711)]
    bad = json.loads(json.dumps(good))
    bad[3].update(held=False, mismatched=17, status="unexpected", reason="expected to hold, but 17 differ")
    old, new = write_run(tmp_path / "old", good), write_run(tmp_path / "new", bad)
    changes = compare_runs(load_run(new).records, load_run(old).records)
    assert [(c["check"], c["kind"]) for c in changes] == [("c3", "regression")]
    assert render_run(new, against=old) == 1  # `ep-harness report --against` exits 1 on a regression
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-2].startswith("# FAILED")
    assert "regression: c3: held before, violated now (0 / 8,192 -> 17 / 8,192)" in out
    assert "regression" in (new / "report.html").read_text()


def test_compare_runs_sees_every_kind(tmp_path):
    before = [record("held"), record("ctl", expect="violated", held=False, mismatched=10),
              record("gone"), record("broken", status="error", held=None, mismatched=None, total=None)]
    after = [record("held", held=False, mismatched=1, status="unexpected"),
             record("ctl", expect="violated", held=False, mismatched=11),
             record("broken"), record("new")]
    kinds = {c["check"]: (c["kind"], c["what"]) for c in compare_runs(after, before)}
    assert kinds["held"][0] == "regression"
    assert kinds["ctl"] == ("regression", "control's mismatch count changed for the same inputs")
    assert kinds["gone"] == ("regression", "disappeared")
    assert kinds["broken"][0] == "improvement"
    assert kinds["new"][0] == "new"


def browser():
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return exe, "playwright is not installed (pip install playwright; .ci/run installs it)"
    if exe is None:
        return None, "no Chromium on this machine (apt-get install chromium; .ci/run installs it)"
    return exe, None


@pytest.mark.slow
def test_report_in_headless_chromium(smoke_run, tmp_path):
    exe, missing = browser()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    _, run_dir = smoke_run
    records = load_run(run_dir).records
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto((run_dir / "report.html").resolve().as_uri())
        rows = page.locator("#summary tbody tr")
        assert rows.count() == len(records)
        listed = set(page.eval_on_selector_all("#summary tbody tr td:nth-child(2)", "els => els.map(e => e.textContent)"))
        assert listed == {r["check"] for r in records}
        plots = page.locator("svg.bars")
        assert plots.count() == 1
        maps = page.locator("svg.map")
        assert maps.count() == sum(1 for r in records if outcome(r) == "xfail" and r.get("mismatched"))
        page.locator("details:has(svg.map) > summary").first.click()  # controls start collapsed
        for drawn in [plots.first, maps.first]:
            drawn.scroll_into_view_if_needed()
            assert drawn.is_visible()
            box = drawn.bounding_box()
            assert box["width"] > 100 and box["height"] > 5
        page.locator("#all-checks > summary").click()  # the full table starts collapsed
        page.select_option("select[name=outcome]", "vacuous")  # the filters work
        assert page.locator("#summary tbody tr:visible").count() == sum(r["status"] == "vacuous" for r in records)
        b.close()
    assert problems == []


def chromium_page(html_path, viewport):
    from playwright.sync_api import sync_playwright

    exe, _ = browser()
    p = sync_playwright().start()
    b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
    page = b.new_page(viewport=viewport)
    page.goto(Path(html_path).resolve().as_uri())
    return p, b, page


@pytest.mark.slow
def test_the_first_screen_answers_the_reviewer(tmp_path):
    exe, missing = browser()
    if missing:
        pytest.skip(missing)
    good = [record(f"c{i:02d}", params={"dtype": "bfloat16", "world_size": 4, "seed": i + 1}) for i in range(40)] + [
        record("ctl", subject="reduce_scatter_native", expect="violated", held=False, mismatched=1439),
        record("fix", subject="all_gather_fold", detail={"order_sensitive": 825})]
    bad = json.loads(json.dumps(good))
    bad[3].update(held=False, mismatched=17, status="unexpected", reason="expected to hold, but 17 differ")
    old, new = write_run(tmp_path / "old", good), write_run(tmp_path / "new", bad)
    proc = run_cli("report", str(new), "--against", str(old))
    assert proc.returncode == 1  # a regression fails `report --against`
    p, b, page = chromium_page(new / "report.html", {"width": 1400, "height": 900})
    try:
        def on_first_screen(selector):
            box = page.locator(selector).first.bounding_box()
            return box is not None and box["y"] + box["height"] <= 900

        assert page.inner_text(".verdict") == "FAILED" and on_first_screen(".verdict")
        assert on_first_screen("#regressions") and on_first_screen("td.regression")
        assert "c03" in page.inner_text("#regressions + table")
        assert on_first_screen("#pairs") and on_first_screen("#pairs + table tr:nth-child(2)")  # its first pair
        assert "825 order-sensitive probe elements" in page.inner_text("#pairs + table")
        assert not page.locator("#environment table").first.is_visible()  # below, collapsed
    finally:
        b.close()
        p.stop()


def test_reports_import_no_torch():
    code = "import sys, ep_harness.reports.render, ep_harness.reports.html; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SCRIPT = "<script>alert(1)</script>"
IMG = '<img src=x onerror="alert(2)">'


def crafted_run(tmp_path):
    """A results.jsonl an attacker could write: markup in every string and number field."""
    evil = record("c", reason=SCRIPT, rerun=IMG, subject=IMG, property=SCRIPT, status="unexpected", held=False,
                  mismatched=SCRIPT, total=IMG, expect="holds", seconds=SCRIPT, max_abs=SCRIPT, error_vs_reference=IMG, max_ulp=SCRIPT,
                  tolerance={"allowed": SCRIPT, "rule": IMG}, predicted_mismatched=SCRIPT,
                  params={"dtype": SCRIPT, "world_size": IMG},
                  first_mismatch={"index": [0, 1], "row": SCRIPT, "actual": IMG, "expected": SCRIPT,
                                  "actual_bits": IMG, "expected_bits": SCRIPT, "ulp": SCRIPT},
                  detail={"first_mismatches": [{"index": [0, 1], "row": SCRIPT, "actual": IMG, "expected": SCRIPT,
                                                "actual_bits": IMG, "expected_bits": SCRIPT, "ulp": IMG}],
                          "ulp_histogram": {SCRIPT: 3}, "tracebacks": {"1": SCRIPT}, "log": IMG,
                          "mismatch_map": {"rows": [SCRIPT, IMG], "columns": 64, "bins": 2,
                                           "fraction": [[0.5, 0.0], [0.0, 1.0]]}})
    evil["check"] = f"c{SCRIPT}"
    return write_run(tmp_path / "evil", [evil, record("fine")],
                     {"command": IMG, "topology": {"describe": SCRIPT}, "libraries": {SCRIPT: IMG}})


def test_crafted_records_reach_the_page_escaped(tmp_path):
    run = crafted_run(tmp_path)
    render_run(run, quiet=True)
    page = (run / "report.html").read_text()
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count('<svg class="map"') == 1  # the map's row names are escaped too


def test_the_mismatch_map_colours_each_cell_by_its_fraction_of_the_peak():
    import base64
    import io
    import re

    from PIL import Image

    from ep_harness.reports.heatmap import RAMP, map_svg

    fraction = [[0.0, 0.02, 0.04, 0.0], [0.01, 0.0, 0.0, 0.0], [0.0] * 4]  # the peak is 4 %, not 100 %
    svg = map_svg({"rows": ["dest 0", "dest 1", "dest 2"], "columns": 4_000, "bins": 4, "fraction": fraction})
    png = re.search(r'href="data:image/png;base64,([^"]+)"', svg).group(1)
    cells = Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB")
    assert cells.size == (4, 3)
    hexes = [["#%02x%02x%02x" % cells.getpixel((j, i)) for j in range(4)] for i in range(3)]
    assert hexes[0][2] == RAMP[-1] and hexes[2] == [RAMP[0]] * 4 and hexes[0][0] == RAMP[0]
    darkness = [sum(cells.getpixel((j, i))) for i, j in ((1, 0), (0, 1), (0, 2))]  # 1 %, 2 %, 4 %
    assert darkness == sorted(darkness, reverse=True) and len(set(darkness)) == 3
    assert "dest 1: 1 of 4 bins differ, at most 1.0%" in svg  # each row's tooltip
    assert ">4%<" in svg and ">2%<" in svg  # 12 cells: each one labelled
    assert ">4.0%<" in svg and ">0%<" in svg  # the scale's ends
    for tick in (">0<", ">1,000<", ">2,000<", ">3,000<"):
        assert tick in svg


@pytest.mark.slow
def test_crafted_records_in_headless_chromium(tmp_path):
    exe, missing = browser()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    run = crafted_run(tmp_path)
    render_run(run, quiet=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                                         "--disable-background-networking"])
        page = b.new_page()
        dialogs, requests = [], []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.on("request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
        page.goto((run / "report.html").resolve().as_uri())
        page.locator("details summary").first.click()
        page.wait_for_timeout(300)
        text = page.inner_text("body")
        b.close()
    assert dialogs == [] and requests == []
    assert SCRIPT in text and IMG in text  # shown literally, as text
