"""Which harness this is: its version (checkout or installed distribution) and commit."""
from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "ep-harness"


def _checkout_version() -> str | None:
    """pyproject's version when the package runs from its own checkout (which may have a
    stale or no installed metadata of its own)."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return str(project["version"]) if project.get("name") == DISTRIBUTION and "version" in project else None


@functools.cache
def harness_version() -> str | None:
    """The checkout's pyproject version, else the installed ep-harness distribution's."""
    found = _checkout_version()
    if found:
        return found
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """What `ep-harness --version` prints: version and commit, each said when unknown."""
    from harness.environment import git_commit

    commit = git_commit() or "commit unknown: not a git checkout; EP_HARNESS_COMMIT names it"
    return f"ep-harness {harness_version() or 'unknown version (not installed, no pyproject.toml)'} ({commit})"
