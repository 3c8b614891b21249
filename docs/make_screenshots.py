"""Regenerate docs/img/report_<run>.png: the HTML report of every bundled run, in headless chromium.

    python docs/make_screenshots.py            # needs `chromium` on PATH

Each run is replayed through the default preset (`stability report RUN -o ...`) and the page is
rendered at 1000 x 2000 px.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("chromium not found", file=sys.stderr)
        return 1
    out_dir = ROOT / "docs" / "img"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for run in sorted(p for p in (ROOT / "data" / "runs").iterdir() if p.is_dir()):
            html = Path(tmp) / f"{run.name}.html"
            subprocess.run([sys.executable, "-m", "replay.cli", "report", str(run), "-o",
                            str(html)], check=True, cwd=ROOT, capture_output=True)
            shot = out_dir / f"report_{run.name}.png"
            subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp}/profile",
                            "--window-size=1000,2000", f"--screenshot={shot}", html.as_uri()],
                           check=True, capture_output=True, timeout=180)
            print(f"{shot.relative_to(ROOT)}: {shot.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
