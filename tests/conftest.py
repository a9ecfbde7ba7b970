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


def pytest_collection_modifyitems(config, items):
    """Tests that read the session's smoke run go to one xdist worker (`--dist loadgroup`,
    as `make test` runs), so that the run is made once, not once per worker."""
    for item in items:
        if "smoke_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smoke-run"))


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The CPU default, once per session: `ep-harness verify` with the smoke suite (one launch)."""
    out = tmp_path_factory.mktemp("smoke")
    proc = run_cli("verify", "--suite", "smoke", "--gpus", "0", "--out", str(out))
    return proc, out / "latest"


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


def rank_pids(run_dir: Path) -> list[int]:
    """Every rank of a finished run, from the fingerprints each launch's ranks reported."""
    import json

    ranks = json.loads((run_dir / "environment.json").read_text())["ranks"]
    return [fp["pid"] for fingerprints in ranks.values() for fp in fingerprints]
