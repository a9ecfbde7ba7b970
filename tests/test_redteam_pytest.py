"""Red-team hole of `pytest --ep-suite` (issue 23, item 6): it trusted a results file found
in a guessable /tmp directory (a forged one gave 30 passed). Records are now read only from
the session's private directory, and only when stamped with the session's nonce."""
import json
import os
import secrets
import tempfile
from pathlib import Path

import pytest

from ep_harness.pytest_plugin import ForeignResults, suite_records
from tests.conftest import REPO
from tests.forked_cli import forked_pytest
from tests.test_reports import record

CHECKS = ["fold/rank-invariance/world_size=3", "fold/rank-invariance/world_size=16",
          "split-k/batch-invariance"]


def forge(directory: Path) -> None:
    """Every check of tests/cases/plugin_items.toml `ok`, where the old plugin looked."""
    run = directory / "ep-suite" / "20261201-000000-f0f0"
    run.mkdir(parents=True)
    run.joinpath("results.jsonl").write_text("".join(json.dumps(record(c, run_id=run.name)) + "\n" for c in CHECKS))
    (directory / "ep-suite" / "latest").symlink_to(run.name)


@pytest.mark.slow
def test_a_forged_results_file_at_the_old_location_is_not_used(tmp_path):
    uid = f"redteam{secrets.token_hex(4)}"
    old = Path(tempfile.gettempdir()) / f"ep-harness-suite-{uid}"  # what the old plugin read, under xdist
    old.mkdir()
    try:
        forge(old)
        proc = forked_pytest("-q", "-p", "no:cacheprovider", "-n", "2", "--testrunuid", uid, "--ep-suite",
                             "tests/cases/plugin_items.toml", "--ep-gpus", "0", "-rfs", "tests/test_gate.py", "-k",
                             "fold or split-k", cwd=REPO, env={**os.environ, "PYTEST_XDIST_TESTRUNUID": uid})
    finally:
        import shutil

        shutil.rmtree(old)
    out = proc.stdout
    # the real verdicts, measured in this session: split-k fails (once, never rerun), fold passes
    assert proc.returncode == 1, out[-3000:]
    assert "1 failed, 1 passed, 1 skipped" in out, out[-3000:]
    assert out.count("FAILED plugin-items::split-k/batch-invariance") == 1, out[-3000:]
    assert "rerun" not in out.lower().replace("rerun:", "")


def test_the_session_directory_is_private_and_unguessable(tmp_path):
    from ep_harness.pytest_plugin import SUITE_DIR, pytest_configure, pytest_unconfigure

    made = []
    for _ in range(2):
        config = _config()
        pytest_configure(config)
        shared, nonce = config.stash[SUITE_DIR]
        assert shared.is_dir() and shared.stat().st_mode & 0o777 == 0o700 and shared.stat().st_uid == os.getuid()
        made.append((shared, nonce))
        pytest_unconfigure(config)
        assert not shared.exists()  # removed with the session
    assert made[0][0] != made[1][0] and made[0][1] != made[1][1] and len(made[0][1]) == 32


class _Config:
    """What pytest_configure and pytest_unconfigure read of a session's config (no xdist: the
    controller's side), with pytest's own Stash."""

    def __init__(self):
        self.stash = pytest.Stash()

    def getoption(self, name, default=None):
        return "smoke" if name == "--ep-suite" else default

    def addinivalue_line(self, name, line):
        pass


def _config():
    return _Config()


def test_records_not_stamped_with_the_sessions_nonce_are_refused(tmp_path):
    shared = Path(tempfile.mkdtemp(prefix="ep-harness-suite-", dir=tmp_path))
    forge(shared)
    shared.joinpath("ep-suite.json").write_text(json.dumps({"nonce": "0" * 32, "run": "20261201-000000-f0f0"}))
    ran = []
    with pytest.raises(ForeignResults, match="nonce differs"):
        suite_records(shared, secrets.token_hex(16), ran.append)
    assert ran == []  # the forged stamp was not taken for a finished run either


def test_a_run_of_this_session_is_read(tmp_path):
    """The positive control: the session's own run, stamped with its nonce, is read."""
    shared = Path(tempfile.mkdtemp(prefix="ep-harness-suite-", dir=tmp_path))
    nonce = secrets.token_hex(16)

    def run_verify(out_root):
        forge(out_root.parent)
        return out_root / "20261201-000000-f0f0"

    assert sorted(suite_records(shared, nonce, run_verify)) == sorted(CHECKS)
    assert sorted(suite_records(shared, nonce, lambda out: pytest.fail("ran twice"))) == sorted(CHECKS)


@pytest.mark.parametrize("plant", ["group-writable", "records of another run"])
def test_a_directory_or_run_that_is_not_the_sessions_own_is_refused(tmp_path, plant):
    shared = Path(tempfile.mkdtemp(prefix="ep-harness-suite-", dir=tmp_path))
    nonce = secrets.token_hex(16)
    forge(shared)
    shared.joinpath("ep-suite.json").write_text(json.dumps({"nonce": nonce, "run": "20261201-000000-f0f0"}))
    if plant == "group-writable":
        shared.chmod(0o770)
    else:
        run = shared / "ep-suite" / "20261201-000000-f0f0" / "results.jsonl"
        run.write_text(json.dumps(record(CHECKS[0], run_id="20261130-000000-0000")) + "\n")
    with pytest.raises(ForeignResults):
        suite_records(shared, nonce, lambda out: pytest.fail("must not run"))
