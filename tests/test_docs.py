"""The README and docs/ as a newcomer reads them: every code example runs as written, the
sample output is a real run's, and every file they name is in the repository.

Examples are the page's own code blocks (tests/doc_blocks.py): the subject and the suite of the
README go through `ep-harness verify` (one launch of 4 gloo ranks), its pytest example through
pytest (with the wheel installed, in tests/shared_wheel.py's environment), and each is checked to pass and to fail where the page says so.
"""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.doc_blocks import doc_block, unmarked_code
from tests.shared_wheel import readme_pytest_in_the_wheel_venv, wheel, wheel_venv  # noqa: F401  (fixtures)

README = REPO / "README.md"
PAGES = [README, REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_is_a_page_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_every_python_and_toml_example_is_one_a_test_runs():
    assert [line for page in PAGES for line in unmarked_code(page)] == []


# A path the pages name: a markdown link, or a backticked folder, or a file in a folder.
LINK = re.compile(r"\]\(([^)#\s]+)\)")
TICKED = re.compile(r"`((?:[\w.-]+/)+(?:[\w.-]*\.(?:py|md|toml|sh|yml|txt|jsonl|sbatch|png))?)`")
GENERATED = ("reports/out/", "RUN/", "dist/", ".github/")  # written by a run or a build, or copied to by the user


def named_paths(page: Path) -> set[str]:
    text = page.read_text()
    found = set(LINK.findall(text)) | set(TICKED.findall(text))
    return {p for p in found if "://" not in p and not p.startswith(GENERATED)}


def test_every_file_the_pages_name_is_in_the_repository():
    missing = [f"{page.name}: {p}" for page in PAGES for p in sorted(named_paths(page))
               if not ((page.parent / p).exists() or (REPO / p).exists())]
    assert missing == []


def test_the_path_check_sees_a_missing_file(tmp_path):
    page = tmp_path / "page.md"  # positive control: a link and a path that do not exist
    page.write_text("See [the schema](docs/nothing.md) and `harness/nothing.py`.\n")
    assert named_paths(page) == {"docs/nothing.md", "harness/nothing.py"}
    assert not (REPO / "docs/nothing.md").exists() and not (REPO / "harness/nothing.py").exists()


def _verify_readme_suite(tmp_path, subjects: str):
    (tmp_path / "my_subjects.py").write_text(subjects)
    (tmp_path / "mine.toml").write_text(doc_block(README, "mine.toml"))
    command = shlex.split(doc_block(README, "run mine"), comments=True)
    assert command[:2] == ["ep-harness", "verify"], command
    proc = run_cli(*command[1:], "--gpus", "0", "--out", str(tmp_path / "out"), cwd=tmp_path)
    results = tmp_path / "out" / "latest" / "results.jsonl"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = results.read_text().splitlines()
    return proc, {r["check"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
def test_the_readme_subject_and_suite_pass_a_real_check_as_the_readme_says(tmp_path):
    proc, records = _verify_readme_suite(tmp_path, doc_block(README, "my_subjects.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = re.search(r"Expected: `(# OK: [^`]+)`", README.read_text())[1]
    assert expected in proc.stdout.splitlines()
    mine = [r for r in records.values() if r["subject"] == "my_reduce_scatter"]
    assert len(mine) == 12 and all(r["status"] == "ok" and r["held"] is True for r in mine)
    reference = records["my-rs/reference/dtype=bfloat16/world_size=4"]
    assert reference["mismatched"] == 0 and reference["total"] > 0 and 0 < reference["error_vs_reference"] <= 1
    control = records["native-control/rank-invariance"]
    assert control["status"] == "ok" and control["mismatched"] > 0  # the same inputs did differ


@pytest.mark.slow
def test_the_readme_subject_with_a_rank_dependent_order_fails_rank_invariance(tmp_path):
    """Positive control: the README's subject, adding in an order that depends on the rank
    (odd ranks backwards), is caught by the same suite."""
    source = doc_block(README, "my_subjects.py")
    loop = "for part in every[1:]:"
    assert loop in source
    planted = source.replace(loop, "for part in (every[:0:-1] if rank % 2 else every[1:]):")
    proc, records = _verify_readme_suite(tmp_path, planted)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    caught = records["my-rs/rank-invariance/dtype=bfloat16/world_size=4"]
    assert caught["status"] == "unexpected" and caught["mismatched"] > 0


@pytest.mark.slow
def test_the_readme_pytest_example_passes_and_fails_as_it_says(readme_pytest_in_the_wheel_venv):
    """The example as a reader runs it after the README's install: `pytest -q -rfEp
    test_my_reduce_scatter.py` with the wheel installed (one run, shared with tests/test_wheel.py)."""
    proc = readme_pytest_in_the_wheel_venv
    out = proc.stdout
    assert proc.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:] + proc.stderr[-3000:]
    assert "PASSED test_my_reduce_scatter.py::test_fold_is_rank_invariant" in out, out[-3000:]
    assert "FAILED test_my_reduce_scatter.py::test_all_reduce_slice_is_rank_invariant" in out, out[-3000:]
    shown = {line.removeprefix("E").strip() for line in out.splitlines()}
    said = [line.strip() for line in doc_block(README, "pytest failure").splitlines() if line.strip()]
    assert [line for line in said if line not in shown] == [], out[-3000:]


# --- the sample output ----------------------------------------------------------------

def _sample() -> list[str]:
    text = README.read_text()
    return text.split("<!-- sample: make verify -->\n```text\n", 1)[1].split("```", 1)[0].splitlines()


def _row_key(line: str) -> list[str]:
    """A table row without the columns that vary between runs (elapsed, sec)."""
    words = line.split()
    return [words[0], *words[2:-2], words[-1]]


def test_the_readme_sample_is_a_current_make_verify(smoke_run):
    """The sample's header, rows, skip, pair and verdict lines are the CPU default's as it
    prints them now; when the table changes, paste new lines from `make verify`."""
    proc, _ = smoke_run
    real = proc.stdout.splitlines()
    rows = {_row_key(line)[0]: _row_key(line) for line in real if line.startswith("[")}
    stale = []
    for line in _sample():
        if line.startswith("["):
            if rows.get(_row_key(line)[0]) != _row_key(line):
                stale.append(line)
        elif line not in real:
            stale.append(line)
    assert stale == [], "README's sample differs from `make verify` now:\n" + "\n".join(stale)
    assert _sample()[-1] == [line for line in real if line.startswith(("# OK", "# FAILED"))][-1]


def test_the_sample_check_sees_a_stale_line():
    sample = "[2/164]       2.5s ok          rs-native               rank-invariance      bfloat16    4     1,439 / 8,192 (17.6%)      1,439   15,360          4    0.05  -"
    moved = sample.replace("1,439 / 8,192", "1,438 / 8,192")
    assert _row_key(sample) != _row_key(moved) and _row_key(sample) == _row_key(sample.replace("2.5s", "9.9s"))


@pytest.mark.slow
def test_the_readme_install_line_takes_a_cpu_torch_here(tmp_path):
    """The README's first install line, resolved by pip as this machine would install it
    (nothing installed): a torch without CUDA's libraries, which a CPU box needs."""
    [line] = [line for line in doc_block(README, "install").splitlines() if line.startswith("pip install torch")]
    args = shlex.split(line, comments=True)[2:]
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q",
                    "--report", str(report), *args], check=True, capture_output=True, timeout=300)
    [torch] = json.loads(report.read_text())["install"]
    requires = torch["metadata"].get("requires_dist") or []
    assert torch["metadata"]["name"] == "torch" and torch["metadata"]["version"].startswith("2.13.0"), torch["metadata"]
    assert [r for r in requires if r.lower().startswith("nvidia-")] == [], (torch["download_info"]["url"], requires)
