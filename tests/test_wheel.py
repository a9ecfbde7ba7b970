"""The package as a user installs it: a wheel, in a virtual environment outside the
checkout, run from a directory that has `reports/` and `harness/` packages of its own."""
import json
import os
import site
import subprocess
import sys
import tomllib
import venv

import pytest

from tests.conftest import REPO

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.slow
def test_the_wheel_verifies_the_smoke_suite_from_anywhere(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(REPO)], check=True, timeout=600)
    [wheel] = wheels.glob("ep_harness-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # no pip of its own: this environment's pip installs into it (--python)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=600)
    # The third-party dependencies (torch, pandas, ...) come from this test's environment, appended
    # after the new environment's own site-packages; the harness itself only from the wheel.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "project"
    for shadow in ("reports", "harness"):  # a user's own packages with the harness's names
        (work / shadow).mkdir(parents=True)
        (work / shadow / "__init__.py").write_text(f"raise SystemExit('the user {shadow} package was imported')\n")
    proc = subprocess.run([str(env_dir / "bin" / "ep-harness"), "verify", "--suite", "smoke", "--check",
                           "rs-native/rank-invariance/dtype=bfloat16/world_size=3", "--gpus", "0", "--out", "runs"],
                          cwd=work, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (work / "runs" / "latest" / "report.html").stat().st_size > 10_000
    assert "rs-native" in proc.stdout and "# OK" in proc.stdout
    listing = subprocess.run([str(env_dir / "bin" / "ep-harness"), "list"], cwd=work, capture_output=True, text=True,
                             timeout=300)
    assert "smoke" in listing.stdout and "nightly" in listing.stdout and "composed_moe" in listing.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, timeout=600)
    [built] = out.glob("ep_harness-*.whl")
    return built


def test_the_wheel_carries_every_package_and_the_suites_as_package_data(wheel):
    import zipfile

    from setuptools import find_packages

    names = zipfile.ZipFile(wheel).namelist()
    suites = sorted(n.rpartition("/")[2] for n in names if n.startswith("harness/suites/"))
    assert suites == sorted(p.name for p in (REPO / "cases").glob("*.toml")) and "smoke.toml" in suites
    assert not [n for n in names if ".data/" in n]  # nothing installed outside the packages (no share/)
    packaged = {n.rpartition("/")[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packaged == set(find_packages(str(REPO), include=["harness*", "reference*", "reports*"]))


@pytest.mark.slow
def test_a_target_install_finds_its_suites_from_a_directory_with_its_own_cases(wheel, tmp_path):
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=600)
    work = tmp_path / "project"
    (work / "cases").mkdir(parents=True)
    (work / "cases" / "config.toml").write_text("not = [a suite\n")  # unrelated, and not even valid TOML
    env = {**{k: v for k, v in os.environ.items() if k != "EP_HARNESS_COMMIT"}, "PYTHONPATH": str(target)}

    def harness(*args):
        return subprocess.run([sys.executable, "-m", "ep_harness", *args], cwd=work, capture_output=True, text=True,
                              timeout=600, env=env)

    where = subprocess.run([sys.executable, "-c", "import ep_harness; print(ep_harness.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target)), where  # the installed copy, not the checkout
    listing = harness("list")
    assert listing.returncode == 0, listing.stderr
    for name in ("smoke", "nightly", "h200"):
        assert f"\n  {name} " in listing.stdout, listing.stdout
    assert "config" not in listing.stdout
    doctor = harness("doctor")  # the fixes name the installed metadata's pins (no pyproject here)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deepgemm"]
    assert "fix: pip install " + " ".join(f"'{r}'" for r in pins) in doctor.stdout, doctor.stdout
    version = harness("--version")
    assert version.stdout.startswith(f"ep-harness {VERSION} (commit unknown"), version.stdout
    run = harness("verify", "--suite", "smoke", "--check", "rs-native/rank-invariance/dtype=bfloat16/world_size=3",
                  "--gpus", "0", "--out", "runs", "--no-report")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [record] = [json.loads(line) for line in (work / "runs/latest/results.jsonl").read_text().splitlines()]
    assert record["status"] == "ok" and record["harness_version"] == VERSION, record
    # a built-in suite is named in the rerun command: it resolves in any install, a path may not
    assert record["rerun"] == ("ep-harness verify --suite smoke --check "
                               "rs-native/rank-invariance/dtype=bfloat16/world_size=3 --gpus 0"), record["rerun"]
    env_json = json.loads((work / "runs" / "latest" / "environment.json").read_text())
    assert env_json["suite"] == str(target / "harness" / "suites" / "smoke.toml")
    assert env_json["harness_commit"] is None and env_json["harness_version"] == VERSION
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
    deps = os.pathsep.join(site.getsitepackages())
    env = {**{k: v for k, v in os.environ.items() if k not in ("EP_HARNESS_COMMIT", "VIRTUAL_ENV")},
           "PYTHONUSERBASE": str(userbase), "PYTHONPATH": deps}
    subprocess.run([python, "-m", "pip", "install", "-q", "--user", "--no-deps", "--no-warn-script-location",
                    str(wheel)], check=True, timeout=600, env=env, capture_output=True)
    work = tmp_path / "project"
    (work / "cases").mkdir(parents=True)
    (work / "cases" / "smoke.toml").write_text("not = [a suite\n")  # a file of the user's, named like a built-in
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
