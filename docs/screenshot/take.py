"""Refresh docs/report.png (`make screenshot`): a real CPU run of the smoke suite with one
planted failure added (docs/screenshot/planted.toml: a GEMM that switches to split-K with
the batch, from tests/planted.py), its report.html photographed at 1400 x 2100 in headless
Chromium: the failure first, then controls beside their fixes and the summary plot."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main(target: Path) -> int:
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        print("screenshot: no Chromium on this machine (apt-get install chromium)", file=sys.stderr)
        return 2
    cli = [sys.executable, "-m", "ep_harness"]
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "smoke-planted.toml"  # the smoke suite as shipped, plus the planted case
        suite.write_text((ROOT / "cases" / "smoke.toml").read_text() + "\n" + (HERE / "planted.toml").read_text())
        subprocess.run([*cli, "verify", "--suite", str(suite), "--gpus", "0", "--plugin", "tests.planted",
                        "--no-report", "--out", f"{tmp}/runs"], check=False, stdout=subprocess.DEVNULL, cwd=ROOT)
        page_path = Path(tmp) / "report.html"
        subprocess.run([*cli, "report", f"{tmp}/runs/latest", "--out", str(page_path)], check=False,
                       stdout=subprocess.DEVNULL, cwd=ROOT)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 2100})
            page.goto(page_path.as_uri())
            page.screenshot(path=str(target))
            browser.close()
    print(f"screenshot: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "report.png"))
