"""Bakes the commit a wheel is built from into it (ep_harness/_commit.py), so that an installed
copy, which has no .git, still names its commit (`ep-harness --version`, environment.json, the
check that every node of a run runs the same harness). Everything else is in pyproject.toml."""
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=SOURCE, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def source_commit() -> str | None:
    """HEAD of the checkout being built, '+dirty' when tracked files differ from it; None for
    a tree that is not its own checkout (an unpacked sdist, or a copy inside another project)."""
    try:
        top, sha = _git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if Path(top).resolve() != SOURCE or len(sha) != 40:
        return None
    return sha + ("+dirty" if dirty else "")


class BuildPyWithCommit(build_py):
    def run(self):
        super().run()
        commit = source_commit()
        if commit and not getattr(self, "editable_mode", False):  # an editable install reads git itself
            Path(self.build_lib, "ep_harness", "_commit.py").write_text(
                f'"""Written by setup.py when this copy was built."""\nCOMMIT = {commit!r}\n')


setup(cmdclass={"build_py": BuildPyWithCommit})
