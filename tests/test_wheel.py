"""The package as a user installs it: a wheel, in a virtual environment outside the
checkout, run from a directory that has `reports/` and `harness/` packages of its own."""
import os
import site
import subprocess
import sys
import venv

import pytest

from tests.conftest import REPO


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
