import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_cli(*args, cwd=REPO, timeout=600):
    """Run the installed console script the way a user would."""
    exe = shutil.which("ep-harness", path=str(Path(sys.executable).parent)) or "ep-harness"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The CPU default, once per test session: `ep-harness verify` with the smoke suite (one
    launch). Under pytest-xdist the first worker that needs it runs it and the others read its
    output (pytest-xdist's recipe: a file lock in the temporary directory the workers share)."""
    import json

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else \
        tmp_path_factory.getbasetemp()
    out, done = shared / "smoke-run", shared / "smoke-run.json"
    with FileLock(str(shared / "smoke-run.lock")):
        if not done.exists():
            proc = run_cli("verify", "--suite", "smoke", "--gpus", "0", "--out", str(out))
            done.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout,
                                        "stderr": proc.stderr}))
    result = json.loads(done.read_text())
    return subprocess.CompletedProcess(**result), out / "latest"


def processes_with_env(fragment: str) -> list[int]:
    """PIDs of this user's processes whose environment contains `fragment` (e.g. the run's
    store namespace, EP_HARNESS_CHANNEL=ep-harness/<run id>/, which every rank carries)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or another user's
                pass
    return pids


def gone(pid: int) -> bool:
    """Whether a process has ended. A zombie has (only its parent's wait is missing; a rank
    orphaned with its fork server waits for init, which may reap late or never)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def rank_pids(run_dir: Path) -> list[int]:
    """Every rank of a finished run, from the fingerprints each launch's ranks reported."""
    import json

    ranks = json.loads((run_dir / "environment.json").read_text())["ranks"]
    return [fp["pid"] for fingerprints in ranks.values() for fp in fingerprints]
