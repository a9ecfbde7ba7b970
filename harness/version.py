"""Which harness this is: its version (checkout or installed distribution) and commit."""
from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "ep-harness"


def checkout_project() -> dict | None:
    """pyproject's [project] table when the package runs from its own checkout (whose
    installed metadata, if any, may be stale); None for an installed copy."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return project if project.get("name") == DISTRIBUTION else None


@functools.cache
def harness_version() -> str | None:
    """The checkout's pyproject version, else the installed ep-harness distribution's."""
    project = checkout_project()
    if project and "version" in project:
        return str(project["version"])
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def extra_requirements(extra: str) -> list[str]:
    """The requirements of an optional extra (`deepgemm`: the pinned wheels), from the checkout's
    pyproject or the installed metadata: what to pip install without re-resolving ep-harness."""
    project = checkout_project()
    if project is not None:
        return list(project.get("optional-dependencies", {}).get(extra, []))
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = f'extra == "{extra}"'
    return [r.split(";")[0].strip() for r in requires if marker in r.replace("'", '"')]


def built_commit() -> str | None:
    """The commit setup.py baked into this copy when its wheel was built; None in a checkout
    (which has no ep_harness/_commit.py) and in a copy built from a tree without git."""
    try:
        from ep_harness._commit import COMMIT
    except ImportError:
        return None
    return COMMIT


def version_line() -> str:
    """What `ep-harness --version` prints: version and commit, each said when unknown."""
    from ep_harness.environment import git_commit

    commit = git_commit() or "commit unknown: not a git checkout, and built without one; EP_HARNESS_COMMIT names it"
    return f"ep-harness {harness_version() or 'unknown version (not installed, no pyproject.toml)'} ({commit})"
