"""Refresh docs/report.png (`make screenshot`): two real CPU runs of the same checks, the
second after a change that swapped the TP reduce for the native reduce-scatter, rendered
--against the first, photographed at 1400 x 900 in headless Chromium."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(target: Path) -> int:
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        print("screenshot: no Chromium on this machine (apt-get install chromium)", file=sys.stderr)
        return 2
    cli = [sys.executable, "-m", "ep_harness"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("before", "after"):
            subprocess.run([*cli, "verify", "--suite", str(HERE / f"{name}.toml"), "--gpus", "0", "--no-report",
                            "--out", f"{tmp}/{name}"], check=False, stdout=subprocess.DEVNULL)
        page_path = Path(tmp) / "report.html"
        subprocess.run([*cli, "report", f"{tmp}/after/latest", "--against", f"{tmp}/before/latest",
                        "--out", str(page_path)], check=False, stdout=subprocess.DEVNULL)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(page_path.as_uri())
            page.screenshot(path=str(target))
            browser.close()
    print(f"screenshot: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "report.png"))
