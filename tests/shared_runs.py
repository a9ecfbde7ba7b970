"""Runs made once per test session whose records several test files read.

`pass_run`: one passing run (see PASS_SUITE); `pass_suite_run(golden=...)`: that run's suite
with one subject changed, for the golden-bits gate. `fail_run`: the planted faults, then the
corruption-rate cases, in one run. `model_and_defaults_run`: tests/cases/model.toml's and
defaults.toml's cases in one launch. `plugin_items_session`: one pytest --ep-suite session.
`shared_cli`: any command line once per session.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, completed, once_per_session, run_cli, shared_dir
from tests.forked_cli import forked_pytest

def shared_cli(tmp_path_factory, name: str, *args: str, cwd=None):
    """`ep-harness ARGS` once per test session, "{out}" in ARGS read as the directory
    <shared>/NAME (created); the process and that directory."""
    out = shared_dir(tmp_path_factory) / name

    def make(folder):
        folder.mkdir(parents=True, exist_ok=True)
        return completed(run_cli(*(a.format(out=folder) for a in args), **({"cwd": cwd} if cwd else {})))

    return subprocess.CompletedProcess(**once_per_session(tmp_path_factory, name, make)), out


# --- one passing run that several tests read ----------------------------------------------------

CASES = REPO / "tests" / "cases"
# The case files whose cases the shared run holds, each test's own file: the cases as written
# there (a case renamed where two files use one name), under one [suite] with all their plugins.
PASS_SUITE = {
    "golden_a.toml": {},  # test_golden_bits: an invariant fold, the baseline's (golden_run: golden_b.toml's)
    "fresh.toml": {'name = "fold"': 'name = "fresh-fold"'},  # test_golden_bits: the one-launch control
    "threads.toml": {},  # test_threads: the pinned thread count (--threads 2 from OMP_NUM_THREADS=1)
    "unmeasured.toml": {},  # test_robust_inputs: a case of which nothing was measured
}
PASS_PLUGINS = ["tests.planted", "tests.planted_threads", "tests.planted_robust"]
# test_reliability: the run starts in a directory whose modules would shadow the standard
# library and the harness, with credentials in its environment that must not be recorded.
SECRETS = {"EP_API_TOKEN": "secret-value", "NCCL_SOCKET_KEY": "another-secret"}


def cases_text(path: Path, renames: dict | None = None, leave_out: tuple[str, ...] = ()) -> str:
    """A suite file's cases as written (its [suite] table left out), but the cases named in
    `leave_out`, each of `renames` (old text: new text, e.g. a case's name where two files use
    one) applied once."""
    text = path.read_text()
    cases = text[text.index("[[case]]"):]
    if leave_out:
        kept = [c for c in cases.split("[[case]]")[1:] if not any(f'\nname = "{n}"\n' in c for n in leave_out)]
        assert len(kept) == cases.count("[[case]]") - len(leave_out), (path.name, leave_out)
        cases = "".join("[[case]]" + c for c in kept)
    renames = renames or {}
    for old, new in renames.items():
        assert cases.count(old) == 1, (path.name, old)
        cases = cases.replace(old, new)
    return cases


def pass_suite_text(golden: str = "golden_a.toml") -> str:
    parts = [f'[suite]\nname = "shared-pass"\nplugins = {json.dumps(PASS_PLUGINS)}\n']
    for name, renames in PASS_SUITE.items():
        parts.append(f"# --- {name}\n" + cases_text(CASES / (golden if name == "golden_a.toml" else name), renames))
    return "\n".join(parts)


def pass_suite_run(folder: Path, golden: str = "golden_a.toml") -> subprocess.CompletedProcess:
    """`ep-harness verify` of pass_suite_text(golden) with --threads 2 from a shell with
    OMP_NUM_THREADS=1, started in FOLDER/work (modules that shadow `json` and a `reports`
    package there), with SECRETS in its environment; the run in FOLDER/out/latest."""
    work = folder / "work"
    (work / "reports").mkdir(parents=True)
    (work / "json.py").write_text("raise SystemExit('the working directory shadowed the standard library')\n")
    (work / "reports" / "__init__.py").write_text("raise SystemExit('the user reports package was imported')\n")
    suite = folder / "suite.toml"
    suite.write_text(pass_suite_text(golden))
    env = {**os.environ, **SECRETS, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # the plugins
    exe = shutil.which("ep-harness", path=str(Path(sys.executable).parent)) or "ep-harness"
    return subprocess.run([exe, "verify", "--suite", str(suite), "--gpus", "0", "--threads", "2", "--no-report",
                           "--out", str(folder / "out")], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="session")
def pass_run(tmp_path_factory):
    """pass_suite_run once per test session: (the process, the run directory, records by check)."""
    result = once_per_session(tmp_path_factory, "shared-pass-run", lambda folder: completed(pass_suite_run(folder)))
    run_dir = shared_dir(tmp_path_factory) / "shared-pass-run" / "out" / "latest"
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    return subprocess.CompletedProcess(**result), run_dir, {r["check"]: r for r in records}


# --- one failing run that two tests read --------------------------------------------------------

# test_verify_cpu's planted faults (each an error record, the run going on in relaunches), then
# test_corruption's rarely corrupting dispatcher, in the launch after the last fault. The clean
# dispatcher it is held against is the smoke run's dispatch-corruption: the same subject and 300
# calls of 32 tokens, with the default 16 experts where corruption.toml has 8.
FAIL_SUITE = {"faults.toml": (), "corruption.toml": ("a2a",)}  # file: the cases left out


def fail_suite_text() -> str:
    return '[suite]\nname = "shared-fail"\nplugins = ["tests.planted"]\n\n' + \
        "\n".join(f"# --- {name}\n" + cases_text(CASES / name, leave_out=out) for name, out in FAIL_SUITE.items())


@pytest.fixture(scope="session")
def fail_run(tmp_path_factory):
    """`ep-harness verify` of fail_suite_text(), once per test session: (the process, the run
    directory, records by case)."""
    def make(folder: Path) -> dict:
        folder.mkdir(parents=True)
        suite = folder / "suite.toml"
        suite.write_text(fail_suite_text())
        return completed(run_cli("verify", "--suite", str(suite), "--gpus", "0", "--out", str(folder / "out")))

    result = once_per_session(tmp_path_factory, "shared-fail-run", make)
    run_dir = shared_dir(tmp_path_factory) / "shared-fail-run" / "out" / "latest"
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    return subprocess.CompletedProcess(**result), run_dir, {r["case"]: r for r in records}


@pytest.fixture(scope="session")
def plugin_items_session(tmp_path_factory):
    """`pytest -q -rs --ep-suite tests/cases/plugin_items.toml --ep-gpus 0 -k "fold or split-k"
    tests/test_gate.py --junitxml=...` (no xdist; forked_cli.forked_pytest), once per session: one pytest session (and
    its one launch) whose three items pass, fail and are skipped. Returns the process and the
    path of its JUnit XML."""
    def make(folder):
        folder.mkdir(parents=True)
        return completed(forked_pytest(
            "-q", "-p", "no:cacheprovider", "--ep-suite", "tests/cases/plugin_items.toml", "--ep-gpus", "0", "-rs",
            "tests/test_gate.py", "-k", "fold or split-k", f"--junitxml={folder / 'junit.xml'}",
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}))

    proc = once_per_session(tmp_path_factory, "plugin-items-session", make)
    return subprocess.CompletedProcess(**proc), shared_dir(tmp_path_factory) / "plugin-items-session" / "junit.xml"


# --- tests/cases/model.toml and defaults.toml in one launch -----------------------------------

MODEL_SUITE, DEFAULTS_SUITE = REPO / "tests" / "cases" / "model.toml", REPO / "tests" / "cases" / "defaults.toml"


def case_names(path: Path) -> set[str]:
    import tomllib

    return {c["name"] for c in tomllib.loads(path.read_text())["case"]}


@pytest.fixture(scope="session")
def model_and_defaults_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """`ep-harness verify` of the cases of tests/cases/model.toml and tests/cases/defaults.toml
    (case names distinct), both files' plugins loaded, in one launch of 4 gloo ranks, once per
    session: the process and a dict of its records by check. The exit code is the two suites'
    together (defaults.toml's planted defects make it 1); each test module holds its own cases'
    records to what its suite alone would have exited with."""
    import json

    from tests.conftest import REPO_ON_PYTHONPATH

    assert not case_names(MODEL_SUITE) & case_names(DEFAULTS_SUITE)
    shared = shared_dir(tmp_path_factory)
    suite = shared / "model-and-defaults.toml"

    def make(out):
        suite.write_text('[suite]\nname = "model-and-defaults"\n'
                         'description = "tests/cases/model.toml and tests/cases/defaults.toml in one launch"\n'
                         'plugins = ["tests.planted_model", "tests.planted_defaults"]\n\n'
                         + cases_text(MODEL_SUITE) + "\n" + cases_text(DEFAULTS_SUITE))
        with pytest.MonkeyPatch.context() as mp:
            for k, v in REPO_ON_PYTHONPATH.items():
                mp.setenv(k, v)  # the ranks import tests.planted_model and tests.planted_defaults
            return completed(run_cli("verify", "--suite", str(suite), "--gpus", "0", "--no-report", "--out", str(out)))

    proc = subprocess.CompletedProcess(**once_per_session(tmp_path_factory, "model-and-defaults-run", make))
    results = shared / "model-and-defaults-run" / "latest" / "results.jsonl"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, {r["check"]: r for r in map(json.loads, results.read_text().splitlines())}
