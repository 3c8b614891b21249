"""Every ``stability ...`` command of the shell blocks of README.md and docs/**/*.md runs as written
on the bundled data.

Commands on placeholder paths (``/jobs/...``, ``RUN``), multi-line ones and the blocks right
after ``<!-- sketch: not run -->`` (placeholders such as a bucket or a Ray cluster) are
skipped; the rest run in order (the README first, then the pages) in one temporary directory
(``data/`` linked in), so a command may use a file an earlier one wrote (``tuned.toml``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKETCH_MARK = "<!-- sketch: not run -->"
_FENCE = re.compile(r"^```(?:bash|sh|console)[^\n]*\n(.*?)^```", re.S | re.M)


def _commands() -> list[str]:
    out: list[str] = []
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        blocks += [m.group(1) for m in _FENCE.finditer(text)
                   if not text[:m.start()].rstrip().endswith(SKETCH_MARK)]
    for block in blocks:
        for line in block.splitlines():
            line = line.strip()
            if "&&" in line:  # install one-liners: only their final stability command
                line = line.rsplit("&&", 1)[1].strip()
            if not line.startswith("stability ") or line.endswith("\\") or "/jobs/" in line:
                continue
            cmd = line.split("  #")[0].split(" # ")[0].strip()
            if cmd not in out:
                out.append(cmd)
    return out


COMMANDS = _commands()


def test_the_docs_have_commands_to_check() -> None:
    for sub in ("replay", "eval", "tune", "report", "watch", "warmup"):
        assert any(c.startswith(f"stability {sub} ") for c in COMMANDS), sub


def test_readme_commands_run(tmp_path: Path) -> None:
    (tmp_path / "data").symlink_to(ROOT / "data")
    for cmd in COMMANDS:
        args = shlex.split(cmd)[1:]
        res = subprocess.run([sys.executable, "-m", "replay.cli", *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0 and "No module named" in res.stderr:
            pytest.skip(f"{cmd}: optional dependency missing ({res.stderr.strip()[-200:]})")
        assert res.returncode == 0, f"{cmd}\n{res.stdout[-1500:]}\n{res.stderr[-1500:]}"
        assert res.stdout.strip() or res.stderr.strip(), f"{cmd}: printed nothing"
