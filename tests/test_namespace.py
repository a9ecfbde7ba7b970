"""One import namespace, ep_harness, over the folders harness/, reference/, reports/ and cases/
(docs/namespace.md): a checkout imports the same layout as the wheel, no module of the harness
imports the old top-level names, and ci/rename_namespace.py finds and fixes any that come back."""
# rename_namespace: leave this file (it holds the old names on purpose, as the script's input)
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib

from tests.conftest import REPO

RENAME = REPO / "ci" / "rename_namespace.py"


def rename(*args, repo=REPO):
    return subprocess.run([sys.executable, str(RENAME), "--repo", str(repo), *args], capture_output=True, text=True,
                          timeout=120)


def test_no_file_of_the_checkout_uses_the_old_import_names():
    proc = rename("--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_checkouts_layout_is_the_wheels(tmp_path):
    """ep_harness/__init__.py (a checkout on PYTHONPATH) maps the folders as pyproject.toml's
    package-dir does for the wheel and an editable install, all from that checkout: a copy of
    it, so that an editable install of this one (the usual dev set-up) supplies nothing."""
    copy = tmp_path / "checkout"
    for folder in ("ep_harness", "harness", "reference", "reports", "cases"):
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__", "out"))
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    code = textwrap.dedent("""
        import json, os, ep_harness, ep_harness.reference, ep_harness.reports, ep_harness.cases as cases
        print(json.dumps({"ep_harness": ep_harness.__path__[0], "ep_harness.reference": ep_harness.reference.__path__[0],
                          "ep_harness.reports": ep_harness.reports.__path__[0], "ep_harness.suites": str(cases.built_in_dir()),
                          "suites": sorted(cases.known_suites())}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(copy)})
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found.pop("suites") == sorted(p.stem for p in (REPO / "cases").glob("*.toml"))
    assert found == {name: str(copy / folder) for name, folder in mapped.items()}, (found, mapped)


BLOCK_OLD_NAMES = textwrap.dedent("""
    import importlib, pkgutil, sys

    asked = []

    class Refuse:  # first on sys.meta_path: any import of an old top-level name is recorded and fails
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] in ("harness", "reference", "reports"):
                asked.append(name)
                raise ImportError(f"old top-level name imported: {name}")

    sys.meta_path.insert(0, Refuse)
    import ep_harness, ep_harness.reference, ep_harness.reports
    failed = {}
    for package in (ep_harness, ep_harness.reference, ep_harness.reports):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module.name.endswith(".__main__"):
                continue  # a command: importing it runs it
            try:
                importlib.import_module(module.name)
            except BaseException as exc:  # a GPU-only dependency may be missing: reported, judged below
                failed[module.name] = repr(exc)
    imported = sorted(m for m in sys.modules if m.startswith("ep_harness."))
    print(len(imported), asked, failed, sep="\\n")
""")


def test_every_module_imports_with_the_old_top_level_names_refused(tmp_path):
    """Imports every module of the three folders from the checkout with `harness`, `reference`
    and `reports` unimportable (as a user's own packages of those names would make them)."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_OLD_NAMES], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, asked, failed = proc.stdout.strip().splitlines()[-3:]
    assert asked == "[]" and failed == "{}", (asked, failed)
    # every file was imported: all but the __main__ commands and harness/__init__.py (ep_harness itself)
    files = [p for folder in ("harness", "reference", "reports") for p in (REPO / folder).rglob("*.py")]
    assert int(count) == sum(p.name != "__main__.py" for p in files) - 1, (count, len(files))


def test_the_refusal_catches_an_old_import(tmp_path):
    """Positive control for the test above: the same refusal on a module that imports `harness`."""
    (tmp_path / "uses_old.py").write_text("import harness.cli\n")
    code = BLOCK_OLD_NAMES.replace("import ep_harness, ep_harness.reference", "import uses_old, ep_harness.reference")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert proc.returncode == 1 and "old top-level name imported: harness" in proc.stderr, proc.stderr[-2000:]


OLD_STYLE = '''\
"""Uses harness.cli and reference.moe; a reference.shape stays, and so do harness/cli.py and ep-harness.toml."""
import harness
import harness.subjects
from harness import cli
from harness.cli import main
from reference.moe import combine
from reports import html
import reports.html as page
from unittest import mock

CMD = [sys.executable, "-m", "harness", "verify"]
MODULE = "harness.worker"
SUITES = "harness.suites"
PROPERTY = "reference"  # a property name, not the package
PLUGIN = "--plugin tests.fake_plugin"
CODE = "import harness; print(harness.__version__)"


def f(reference, reports):
    mock.patch("harness.cli.main")
    return reference.shape, reports.count, harness.cli.main
'''

NEW_STYLE = '''\
"""Uses ep_harness.cli and ep_harness.reference.moe; a reference.shape stays, and so do harness/cli.py and ep-harness.toml."""
import ep_harness
import ep_harness.subjects
from ep_harness import cli
from ep_harness.cli import main
from ep_harness.reference.moe import combine
from ep_harness.reports import html
import ep_harness.reports.html as page
from unittest import mock

CMD = [sys.executable, "-m", "ep_harness", "verify"]
MODULE = "ep_harness.worker"
SUITES = "ep_harness.suites"
PROPERTY = "reference"  # a property name, not the package
PLUGIN = "--plugin tests.fake_plugin"
CODE = "import ep_harness; print(ep_harness.__version__)"


def f(reference, reports):
    mock.patch("ep_harness.cli.main")
    return reference.shape, reports.count, ep_harness.cli.main
'''


def test_the_rename_rewrites_old_imports_once_and_leaves_the_rest(tmp_path):
    for folder, modules in {"harness": ("cli", "worker", "bench"), "reference": ("moe",), "reports": ("html",)}.items():
        (tmp_path / folder).mkdir()
        for name in ("__init__", *modules):
            (tmp_path / folder / f"{name}.py").write_text("")
    (tmp_path / "harness" / "subjects").mkdir()
    (tmp_path / "harness" / "subjects" / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_old.py").write_text(OLD_STYLE)
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "run.sh").write_text("PYTHONPATH=$PWD python3 -m harness verify --suite smoke\n"
                                            "python3 -m harness.bench compare\n")
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\nep-harness = "harness.cli:main"\n\n'
                                             '[tool.setuptools]\npackages = [\n    "harness", "reference",\n]\n')
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)  # the script rewrites the files git knows

    check = rename("--check", repo=tmp_path)
    assert check.returncode == 1 and "tests/test_old.py" in check.stdout and "ci/run.sh" in check.stdout, check.stdout
    first = rename(repo=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "tests" / "test_old.py").read_text() == NEW_STYLE
    assert (tmp_path / "ci" / "run.sh").read_text() == ("PYTHONPATH=$PWD python3 -m ep_harness verify --suite smoke\n"
                                                        "python3 -m ep_harness.bench compare\n")
    pyproject = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"ep-harness": "ep_harness.cli:main"}
    packages = pyproject["tool"]["setuptools"]["packages"]
    assert packages == ["ep_harness", "ep_harness.reference", "ep_harness.reports", "ep_harness.subjects",
                        "ep_harness.suites"]
    again = rename(repo=tmp_path)  # idempotent: nothing left to do
    assert again.returncode == 0 and "0 file(s) rewritten" in again.stdout, again.stdout
    assert rename("--check", repo=tmp_path).returncode == 0
