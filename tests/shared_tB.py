"""Session-wide launches shared between tests of test_selftest, test_wheel, test_docs,
test_extending, test_model and test_defaults_reach (each once per test session, file-locked
across xdist workers: tests/conftest.py's once_per_session)."""
from __future__ import annotations

import subprocess

from tests.conftest import completed, once_per_session, run_cli, shared_dir


def shared_cli(tmp_path_factory, name: str, *args: str, cwd=None):
    """`ep-harness ARGS` once per test session, "{out}" in ARGS read as the directory
    <shared>/NAME (created); the process and that directory."""
    out = shared_dir(tmp_path_factory) / name

    def make(folder):
        folder.mkdir(parents=True, exist_ok=True)
        return completed(run_cli(*(a.format(out=folder) for a in args), **({"cwd": cwd} if cwd else {})))

    return subprocess.CompletedProcess(**once_per_session(tmp_path_factory, name, make)), out
