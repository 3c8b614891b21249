"""The registry is the one table of detectors: the docs' tables are generated from it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from stability.config.registry import (
    REGISTRY,
    detector_class,
    make_detector,
    register_detector,
    tune_grids,
)
from stability.config.registry_docs import (
    BEGIN,
    END,
    TABLES,
    detectors_table,
    main,
    render,
    stale_files,
)

ROOT = Path(__file__).resolve().parents[1]
FIX = (
    "run `python -m stability.config.registry_docs` to regenerate it from "
    "stability/config/registry.py"
)


@pytest.mark.parametrize("rel", sorted(TABLES))
def test_docs_tables_are_the_generated_ones(rel: str) -> None:
    text = (ROOT / rel).read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{rel}: table markers missing"
    assert render(text, TABLES[rel](), rel) == text, f"{rel}: the detector table is stale; {FIX}"


def test_every_registered_detector_has_a_row_in_each_table() -> None:
    for rel, make in TABLES.items():
        table = make()
        for name in REGISTRY:
            assert f"| `{name}` |" in table, (rel, name)
    assert all(e.doc for e in REGISTRY.values()), "every built-in entry needs a doc= row"


def test_the_generator_rewrites_a_stale_table_and_check_reports_it(tmp_path: Path) -> None:
    for rel in TABLES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"intro\n\n{BEGIN}\n| old |\n{END}\n\noutro\n",
                                    encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert main(["--root", str(tmp_path)]) == 0
    assert stale_files(tmp_path) == []
    page = "docs/concepts/detectors.md"
    text = (tmp_path / page).read_text(encoding="utf-8")
    assert text.startswith("intro\n\n") and text.endswith(f"{END}\n\noutro\n")
    assert f"{BEGIN}\n{detectors_table()}\n{END}" in text
    (tmp_path / page).write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="detectors.md: no .* markers"):
        stale_files(tmp_path)


def test_tune_grids_name_real_parameters() -> None:
    for name, grid in tune_grids().items():
        args = set(inspect.signature(detector_class(name)).parameters)
        assert set(grid) <= args, (name, grid)


def test_register_detector_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, "my_z", REGISTRY["ewma_z"])  # restored after the test
    register_detector("my_z", "detectors.ewma:EWMAZScore", kind="loss_spike",
                      grid={"alpha": [0.1]}, doc="An EWMA z-score under another name.")
    assert REGISTRY["my_z"].kind == "loss_spike"
    assert tune_grids()["my_z"] == {"alpha": [0.1]}
    assert "| `my_z` | `EWMAZScore` | An EWMA z-score under another name. |" in detectors_table()
    from stability.config.config import MonitorConfig

    cfg = MonitorConfig.from_dict({"detectors": [
        {"name": "a", "detector": "my_z", "inputs": ["grad_norm"]}]})
    assert cfg.detectors[0].kind == "loss_spike"


def test_register_detector_takes_a_class_and_rejects_anything_else(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from detectors import CUSUM

    monkeypatch.setitem(REGISTRY, "my_cusum", REGISTRY["cusum"])
    register_detector("my_cusum", CUSUM, kind="level_shift")
    assert detector_class("my_cusum") is CUSUM
    assert REGISTRY["my_cusum"].target == "detectors.cusum:CUSUM"
    assert make_detector("my_cusum", {"k": 0.3}, n_series=2).n_series == 2
    with pytest.raises(ValueError, match="not a BankDetector"):
        register_detector("bad", dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="module:Class"):
        register_detector("bad", "detectors.cusum.CUSUM")
    assert "bad" not in REGISTRY
