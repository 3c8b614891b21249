"""The import-linter contracts (``lint-imports`` in CI) cover every core module."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NOT_CORE = {"__init__", "cli", "torch"}


def test_core_contract_lists_every_core_module() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in cfg["contracts"] if c["name"].startswith("the core never"))
    listed = {m.split(".", 1)[1] for m in contract["source_modules"]}
    core = {p.stem for p in (ROOT / "stability").glob("*.py")} - NOT_CORE
    core |= {p.parent.name for p in (ROOT / "stability").glob("*/__init__.py")} - {
        "adapters", "testing"}
    assert listed == core, f"add to / remove from the contract: {sorted(listed ^ core)}"
