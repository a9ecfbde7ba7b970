"""The wheel, built once per test session, and a virtual environment with it installed
(tests/test_wheel.py; tests/test_docs.py runs the README's pytest example in it too)."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO, completed, once_per_session
from tests.doc_blocks import doc_block

# --- the wheel (tests/test_wheel.py), and a virtual environment with it installed, which
# tests/test_docs.py's README pytest example also runs in ---------------------------------

USER_PACKAGES = ("harness", "reference", "reports")
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
# A user's test: its own packages are the ones it imports, and the ep-harness plugin (loaded
# from the wheel) runs ranks for it. The packages refuse to load unless this test asks for them.
USER_TEST = '''
import importlib
import os
import shutil

import torch.distributed as dist


def world_size(rank, size):
    return dist.get_world_size()


def test_my_packages_are_mine(monkeypatch, pytestconfig):
    monkeypatch.setenv("USER_PACKAGES_MAY_LOAD", "1")
    for name in ("harness", "reference", "reports"):
        mine = importlib.import_module(name)
        assert mine.MINE and mine.__file__.startswith(os.getcwd()), mine.__file__
    assert pytestconfig.pluginmanager.has_plugin("ep_harness")


def test_the_plugin_runs_ranks(ep_world):
    assert ep_world(2).run(world_size) == [2, 2]
'''


def user_project(root):
    """A project with packages named like the harness's old top-level packages (importing one
    outside the user's own test fails loudly) and a cases/ folder of unrelated TOML files."""
    work = root / "project"
    for name in USER_PACKAGES:
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(
            "import os\n"
            "if os.environ.get('USER_PACKAGES_MAY_LOAD') != '1':\n"
            f"    raise SystemExit('the user {name} package was imported')\n"
            "MINE = True\n")
    (work / "cases").mkdir()
    (work / "cases" / "config.toml").write_text("not = [a suite\n")  # unrelated, and not even valid TOML
    (work / "cases" / "smoke.toml").write_text("not = [a suite\n")  # the user's, named like a built-in
    (work / "test_mine.py").write_text(USER_TEST)
    return work


def _dependency_paths() -> list[str]:
    """Where this environment's third-party packages (torch, pandas, ...) are: its site
    directories and any directory a .pth file of theirs adds."""
    return list(dict.fromkeys([*site.getsitepackages(), *(p for p in sys.path if p.endswith("-packages"))]))


def _no_harness_env(**extra):
    drop = ("PYTHONPATH", "EP_HARNESS_COMMIT", "VIRTUAL_ENV", "USER_PACKAGES_MAY_LOAD")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """Built once per session, by whichever xdist worker needs it first."""
    return Path(once_per_session(tmp_path_factory, "wheel", lambda out: str(_build_wheel(out, out / "source"))))


def _build_wheel(out, source):
    """Built from a copy of the sources: setuptools reuses a checkout's build/lib, so a wheel
    built in a checkout that built one before could carry files of an older layout."""
    source = source / "ep-harness"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", ".pytest_cache", ".hypothesis",
                                                                "build", "*.egg-info", "__pycache__", "out"))
    # The copy is built as the checkout it came from: git reads the checkout's repository with
    # the copy as its work tree, so setup.py bakes the checkout's commit (and whether tracked
    # files differ from it) into the wheel, as a build in the clone itself would.
    git_dir = subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, timeout=600,
                   env={**_no_harness_env(), "GIT_DIR": git_dir, "GIT_WORK_TREE": str(source)})
    [built] = out.glob("ep_harness-*.whl")
    return built


@pytest.fixture(scope="session")
def wheel_venv(wheel, tmp_path_factory) -> dict:
    """A virtual environment with the wheel installed (--no-deps: no pip of its own, this
    environment's pip installs into it), its third-party dependencies (torch, pandas, ...) read
    from this environment, and a user's project beside it (user_project): once per session.
    Its keys: env (the environment's folder), python, work (the project)."""
    def make(root):
        env_dir = root / "venv"
        venv.create(env_dir)
        python = env_dir / "bin" / "python"
        # (PYTHONPATH dropped: a checkout on it, with its egg-info, reads to pip as "already installed")
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                       check=True, timeout=600, env=_no_harness_env())
        # The third-party dependencies come from this test's environment, appended after the new
        # environment's own site-packages; the harness itself only from the wheel.
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, "zz_test_deps.pth"), "w") as f:
            f.write("\n".join(_dependency_paths()) + "\n")
        return {"env": str(env_dir), "python": str(python), "work": str(user_project(root))}

    return {k: Path(v) for k, v in once_per_session(tmp_path_factory, "wheel-venv", make).items()}


@pytest.fixture(scope="session")
def readme_pytest_in_the_wheel_venv(wheel_venv, tmp_path_factory) -> subprocess.CompletedProcess:
    """The README's pytest example, as written (test_my_reduce_scatter.py), run by pytest in
    the wheel's virtual environment from the user's project, once per session: one test
    passes, the other fails with the mismatch text (test_wheel and test_docs read it)."""
    def make(_):
        work = wheel_venv["work"]
        (work / "test_my_reduce_scatter.py").write_text(doc_block(REPO / "README.md", "test_my_reduce_scatter.py"))
        return completed(subprocess.run(
            [str(wheel_venv["python"]), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-rfEp",
             "test_my_reduce_scatter.py"], cwd=work, capture_output=True, text=True, timeout=600,
            env=_no_harness_env()))

    return subprocess.CompletedProcess(**once_per_session(tmp_path_factory, "wheel-venv-readme", make))


# --- tests/cases/model.toml and tests/cases/defaults.toml in one launch (tests/test_model.py,
# tests/test_defaults_reach.py) --------------------------------------------------------------
