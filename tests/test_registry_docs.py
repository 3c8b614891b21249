"""The registry is the one table of detectors: the docs' tables must list exactly its entries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stability.registry import REGISTRY, detector_class, register_detector, tune_grids

ROOT = Path(__file__).resolve().parents[1]


def _table_rows(text: str, header: str) -> list[list[str]]:
    """Cells of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_contracts_table_lists_every_registered_detector_with_its_class_and_kind() -> None:
    rows = _table_rows((ROOT / "docs" / "CONTRACTS.md").read_text(), "| name | class |")
    names = [r[0].strip("`") for r in rows]
    assert names == list(REGISTRY)
    for r in rows:
        spec = REGISTRY[r[0].strip("`")]
        assert r[1].split()[0].strip("`") == spec.target.replace(":", "."), r
        if spec.kind is not None:
            assert r[3].startswith(spec.kind), r


def test_readme_table_lists_every_registered_detector() -> None:
    rows = _table_rows((ROOT / "README.md").read_text(), "| registry name | class |")
    assert [r[0].strip("`") for r in rows] == list(REGISTRY)
    for r in rows:
        assert r[1].strip("`") == REGISTRY[r[0].strip("`")].target.split(":")[1], r


def test_tune_grids_name_real_parameters() -> None:
    for name, grid in tune_grids().items():
        args = set(re.findall(r"\w+", str(detector_class(name).__init__.__code__.co_varnames)))
        assert set(grid) <= args, (name, grid)


def test_register_detector_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, "my_z", REGISTRY["ewma_z"])  # restored after the test
    register_detector("my_z", "detectors.ewma:EWMAZScore", kind="loss_spike",
                      grid={"alpha": [0.1]})
    assert REGISTRY["my_z"].kind == "loss_spike"
    assert tune_grids()["my_z"] == {"alpha": [0.1]}
    from stability.config import MonitorConfig

    cfg = MonitorConfig.from_dict({"detectors": [
        {"name": "a", "detector": "my_z", "inputs": ["grad_norm"]}]})
    assert cfg.detectors[0].kind == "loss_spike"
