"""The package as a user installs it: a wheel (in a virtual environment, with --target, with
--user), outside the checkout, run from a project that has `harness/`, `reference/`, `reports/`
and `cases/` folders of its own. The wheel holds one import package, ep_harness."""
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile

import pytest

from tests.conftest import REPO
from tests.shared_wheel import (  # noqa: F401  (wheel, wheel_venv, readme_pytest_in_the_wheel_venv: fixtures)
    HEAD, _dependency_paths, _no_harness_env, readme_pytest_in_the_wheel_venv, user_project, wheel, wheel_venv)

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.slow
def test_the_wheel_in_a_venv_verifies_and_runs_pytest_from_a_project_with_its_own_packages(
        wheel_venv, readme_pytest_in_the_wheel_venv):
    # The environment (shared_wheel.wheel_venv): the wheel installed with --no-deps, the third-party
    # dependencies (torch, pandas, ...) from this test's environment, the harness only from the wheel.
    env_dir, python, work = wheel_venv["env"], wheel_venv["python"], wheel_venv["work"]
    exe, env = str(env_dir / "bin" / "ep-harness"), _no_harness_env()
    control = subprocess.run([str(python), "-c", "__import__('reference')"], cwd=work, capture_output=True, text=True, env=env)
    assert "the user reference package was imported" in control.stderr  # positive control: the trap works
    proc = subprocess.run([exe, "verify", "--suite", "smoke", "--check",
                           "rs-native/rank-invariance/dtype=bfloat16/world_size=3", "--gpus", "0", "--out", "runs"],
                          cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (work / "runs" / "latest" / "report.html").stat().st_size > 10_000
    assert "rs-native" in proc.stdout and "# OK" in proc.stdout
    listing = subprocess.run([exe, "list"], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "smoke" in listing.stdout and "nightly" in listing.stdout and "composed_moe" in listing.stdout
    # `python -m` puts the project first on sys.path: the harness's modules still resolve to the wheel
    module = subprocess.run([str(python), "-m", "ep_harness", "list"], cwd=work, capture_output=True, text=True,
                            timeout=300, env=env)
    assert module.returncode == 0 and "\n  smoke " in module.stdout, module.stdout + module.stderr
    # the wheel names the commit it was built from (setup.py baked it in; no .git in the venv)
    version = subprocess.run([exe, "--version"], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert len(HEAD) == 40 and version.stdout.startswith(f"ep-harness {VERSION} ({HEAD}"), version.stdout
    # pytest in the user's project: the plugin loads from the wheel, the user's packages stay theirs
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"], cwd=work,
                           capture_output=True, text=True, timeout=600, env=env)
    assert tests.returncode == 0 and "2 passed" in tests.stdout, tests.stdout[-3000:] + tests.stderr[-3000:]
    # the README's pytest example, as written, against the wheel: its helpers import from
    # ep_harness.testing, one test passes and the other fails with the mismatch text
    readme = readme_pytest_in_the_wheel_venv
    assert readme.returncode == 1 and "1 failed, 1 passed" in readme.stdout, readme.stdout[-3000:] + readme.stderr
    assert "Mismatched elements: " in readme.stdout, readme.stdout[-3000:]


def test_the_wheel_holds_one_import_package_and_its_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()  # what `unzip -l` lists
    assert {n.split("/")[0] for n in names} == {"ep_harness", f"ep_harness-{VERSION}.dist-info"}
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ep-harness = ep_harness.cli:main" in text and "ep_harness = ep_harness.pytest_plugin" in text, text


def test_the_testing_extra_brings_pytest_for_the_helpers(wheel):
    [metadata] = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")]
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Provides-Extra: testing" in text and 'Requires-Dist: pytest>=8; extra == "testing"' in text, text[:2000]
    assert "ep_harness/testing.py" in zipfile.ZipFile(wheel).namelist()


def test_the_wheel_names_the_commit_it_was_built_from(wheel):
    baked = zipfile.ZipFile(wheel).read("ep_harness/_commit.py").decode()
    assert len(HEAD) == 40 and f"COMMIT = '{HEAD}" in baked, baked


def test_the_wheel_carries_every_package_and_the_suites_as_package_data(wheel):
    from setuptools import find_packages

    names = zipfile.ZipFile(wheel).namelist()
    suites = sorted(n.rpartition("/")[2] for n in names if n.startswith("ep_harness/suites/"))
    assert suites == sorted(p.name for p in (REPO / "cases").glob("*.toml")) and "smoke.toml" in suites
    assert not [n for n in names if ".data/" in n]  # nothing installed outside the packages (no share/)
    packaged = {n.rpartition("/")[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    # every package folder of the checkout, by its installed name (harness/ is ep_harness itself)
    folders = find_packages(str(REPO), include=["harness*", "reference*", "reports*"])
    assert packaged == {"ep_harness" + p.removeprefix("harness") if p.startswith("harness") else f"ep_harness.{p}"
                        for p in folders}
    assert "ep_harness.reference" in packaged and "ep_harness.subjects.moe" in packaged


@pytest.mark.slow
def test_a_target_install_finds_its_suites_from_a_directory_with_its_own_cases(wheel, tmp_path):
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=600, env=_no_harness_env())
    work = user_project(tmp_path)
    env = _no_harness_env(PYTHONPATH=str(target))

    def harness(*args):  # `python -m`: the project's own packages are first on sys.path
        return subprocess.run([sys.executable, "-m", "ep_harness", *args], cwd=work, capture_output=True, text=True,
                              timeout=600, env=env)

    def script(*args):  # the console script pip put in DIR/bin
        return subprocess.run([str(target / "bin" / "ep-harness"), *args], cwd=work, capture_output=True, text=True,
                              timeout=600, env=env)

    where = subprocess.run([sys.executable, "-c", "import ep_harness; print(ep_harness.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target)), where  # the installed copy, not the checkout
    for listing in (harness("list"), script("list")):
        assert listing.returncode == 0, listing.stderr
        for name in ("smoke", "nightly", "h200"):
            assert f"\n  {name} " in listing.stdout, listing.stdout
        assert "config" not in listing.stdout
    by_script = script("verify", "--suite", "smoke", "--check", "ar-slice/rank-invariance/dtype=float32", "--gpus", "0",
                       "--out", "script-runs", "--no-report")
    assert by_script.returncode == 0, by_script.stdout[-3000:] + by_script.stderr[-3000:]
    statuses = [json.loads(line)["status"] for line in (work / "script-runs/latest/results.jsonl").open()]
    assert statuses == ["ok", "ok"], statuses  # world sizes 3 and 4, from the built-in smoke suite
    doctor = harness("doctor")  # the fixes name the installed metadata's pins (no pyproject here)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deepgemm"]
    assert "fix: pip install " + " ".join(f"'{r}'" for r in pins) in doctor.stdout, doctor.stdout
    version = harness("--version")  # no .git here: the commit baked into the wheel
    assert version.stdout.startswith(f"ep-harness {VERSION} ({HEAD}"), version.stdout
    run = harness("verify", "--suite", "smoke", "--check", "rs-native/rank-invariance/dtype=bfloat16/world_size=3",
                  "--gpus", "0", "--out", "runs", "--no-report")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [record] = [json.loads(line) for line in (work / "runs/latest/results.jsonl").read_text().splitlines()]
    assert record["status"] == "ok" and record["harness_version"] == VERSION, record
    # a built-in suite is named in the rerun command: it resolves in any install, a path may not
    assert record["rerun"] == ("ep-harness verify --suite smoke --check "
                               "rs-native/rank-invariance/dtype=bfloat16/world_size=3 --gpus 0 --threads 1"), record["rerun"]
    env_json = json.loads((work / "runs" / "latest" / "environment.json").read_text())
    assert env_json["suite"] == str(target / "ep_harness" / "suites" / "smoke.toml")
    assert env_json["harness_commit"].startswith(HEAD) and env_json["harness_version"] == VERSION
    # the working directory's cases/ is read when the user names a file in it, and only then
    named = harness("list", "--suite", "cases/config.toml")
    assert named.returncode == 2 and "malformed TOML" in named.stderr, named.stderr
    unknown = harness("list", "--suite", "smok")
    assert unknown.returncode == 2 and "(did you mean 'smoke'?)" in unknown.stderr, unknown.stderr


def _base_python() -> str | None:
    """The interpreter this environment was made from: user installs (--user) need one that
    is not a virtual environment's."""
    candidate = os.path.join(sys.base_prefix, "bin", "python3")
    return candidate if sys.base_prefix != sys.prefix and os.access(candidate, os.X_OK) else None


@pytest.mark.slow
@pytest.mark.skipif(_base_python() is None, reason="needs a base interpreter outside a virtual environment for --user")
def test_a_user_install_finds_its_suites_from_a_directory_with_its_own_cases(wheel, tmp_path):
    python, userbase = _base_python(), tmp_path / "userbase"
    # the harness from the wheel in the user site; its dependencies (torch, ...) from this environment
    deps = os.pathsep.join(_dependency_paths())
    env = _no_harness_env(PYTHONUSERBASE=str(userbase), PYTHONPATH=deps)
    subprocess.run([python, "-m", "pip", "install", "-q", "--user", "--no-deps", "--no-warn-script-location",
                    str(wheel)], check=True, timeout=600, env=env, capture_output=True)
    work = user_project(tmp_path)
    exe = str(userbase / "bin" / "ep-harness")
    where = subprocess.run([python, "-c", "import ep_harness; print(ep_harness.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(userbase)), where
    listing = subprocess.run([exe, "list"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr
    assert "\n  smoke " in listing.stdout and "\n  nightly " in listing.stdout
    run = subprocess.run([exe, "verify", "--suite", "smoke", "--check", "ar-slice/rank-invariance/dtype=float32",
                          "--gpus", "0", "--out", "runs", "--no-report"], cwd=work, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (work / "runs/latest/results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok"]  # world sizes 3 and 4, from the built-in smoke suite


@pytest.mark.slow
def test_an_editable_install_maps_the_folders_onto_the_namespace(tmp_path):
    """`pip install -e` (make install): setuptools' own finder maps ep_harness onto harness/,
    and the ranks, given the checkout on PYTHONPATH, import it through ep_harness/__init__.py."""
    checkout = tmp_path / "checkout"  # a copy: an editable install writes its egg-info into the tree
    for folder in ("harness", "reference", "reports", "cases", "ep_harness"):
        shutil.copytree(REPO / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__", "out"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, checkout / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "zz_test_deps.pth"), "w") as f:  # setuptools for the build, torch, ...
        f.write("\n".join(_dependency_paths()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", str(checkout)], check=True, timeout=600, env=_no_harness_env())
    work = user_project(tmp_path)
    env = _no_harness_env()
    where = subprocess.run([str(python), "-c", "import ep_harness.reports, ep_harness.cases as c; "
                            "print(ep_harness.__file__, ep_harness.reports.__file__, c.built_in_dir())"],
                           cwd=tmp_path, capture_output=True, text=True, env=env)  # not the project: -c puts it first
    assert where.stdout.split() == [str(checkout / "harness" / "__init__.py"), str(checkout / "reports" / "__init__.py"),
                                    str(checkout / "cases")], where.stdout + where.stderr
    exe = str(env_dir / "bin" / "ep-harness")
    listing = subprocess.run([exe, "list"], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert listing.returncode == 0 and "\n  smoke " in listing.stdout, listing.stdout + listing.stderr
    run = subprocess.run([exe, "verify", "--suite", "smoke", "--check", "ar-slice/rank-invariance/dtype=float32",
                          "--gpus", "0", "--out", "runs", "--no-report"], cwd=work, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    statuses = [json.loads(line)["status"] for line in (work / "runs/latest/results.jsonl").open()]
    assert statuses == ["ok", "ok"], statuses
