"""Launches shared between tests (issue 37): command lines that refuse their input run one
after another in one interpreter (cli_batch), and runs that many tests read are made once
per session (tests.conftest.once_per_session)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, completed, once_per_session, shared_dir

# One interpreter for many `ep-harness` command lines: each job is what the console script
# does (`sys.exit(main(ARGS))`) in its own working directory, with its stdout and stderr (file
# descriptors 1 and 2, so C-level output too) in files of its own, and the warning filters
# reset first (a warning shown once per process would otherwise be shown to the first job only).
_DRIVER = r'''
import json, os, sys, traceback, warnings
jobs_file, results_file = sys.argv[1:3]
jobs = json.loads(open(jobs_file).read())
from ep_harness.cli import main
filters = warnings.filters[:]
results = []
for job in jobs:
    os.chdir(job["cwd"])
    warnings.filters[:] = filters
    warnings._filters_mutated()
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(job["stdout"], "w") as out, open(job["stderr"], "w") as err:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            rc = main(job["args"])
        except SystemExit as exc:
            rc = exc.code
            if isinstance(rc, str):
                print(rc, file=sys.stderr)
                rc = 1
            rc = 0 if rc is None else rc
        except BaseException:
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
    results.append(rc)
open(results_file, "w").write(json.dumps(results))
'''


def cli_batch(folder: Path, jobs: list[tuple[list[str], Path]], env: dict, timeout: float = 600) -> list[dict]:
    """`ep-harness ARGS` run in CWD for every (ARGS, CWD) of `jobs`, one after another in one
    process with environment `env` (what each run would pay for its imports is paid once).
    Returns per job what tests.conftest.completed returns for a process; the streams' files
    are in `folder`, outside every job's working directory."""
    folder.mkdir(parents=True, exist_ok=True)
    described = [{"args": [str(a) for a in args], "cwd": str(cwd), "stdout": str(folder / f"job{i}.out"),
                  "stderr": str(folder / f"job{i}.err")} for i, (args, cwd) in enumerate(jobs)]
    (folder / "jobs.json").write_text(json.dumps(described))
    driver = subprocess.run([sys.executable, "-c", _DRIVER, str(folder / "jobs.json"), str(folder / "results.json")],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert driver.returncode == 0 and (folder / "results.json").exists(), driver.stdout[-2000:] + driver.stderr[-2000:]
    codes = json.loads((folder / "results.json").read_text())
    return [{"args": ["ep-harness", *job["args"]], "returncode": rc, "stdout": Path(job["stdout"]).read_text(),
             "stderr": Path(job["stderr"]).read_text()} for job, rc in zip(described, codes)]


@pytest.fixture(scope="session")
def plugin_items_session(tmp_path_factory):
    """`pytest -q -rs --ep-suite tests/cases/plugin_items.toml --ep-gpus 0 -k "fold or split-k"
    tests/test_gate.py --junitxml=...` (no xdist), once per session: one pytest session (and
    its one launch) whose three items pass, fail and are skipped. Returns the process and the
    path of its JUnit XML."""
    def make(folder):
        folder.mkdir(parents=True)
        return completed(subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ep-suite", "tests/cases/plugin_items.toml",
             "--ep-gpus", "0", "-rs", "tests/test_gate.py", "-k", "fold or split-k", f"--junitxml={folder / 'junit.xml'}"],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}))

    proc = once_per_session(tmp_path_factory, "plugin-items-session", make)
    return subprocess.CompletedProcess(**proc), shared_dir(tmp_path_factory) / "plugin-items-session" / "junit.xml"
