"""Helpers to load the labelled public runs (``../shared/runs/public``) for sanity tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.shared_data import PUBLIC as _PUBLIC

PUBLIC = _PUBLIC


def labels() -> list[dict]:
    pq = pytest.importorskip("pyarrow.parquet")
    path = PUBLIC / "labels.parquet"
    if not path.exists():
        pytest.skip(f"no labelled runs at {PUBLIC}")
    return pq.read_table(path).to_pylist()


def runs_of(scenario: str) -> list[dict]:
    return [r for r in labels() if r["scenario"] == scenario]


def hparams(row: dict) -> dict:
    return json.loads(row["hparams"])


def columns(run_id: str, names: list[str] | None = None, prefix: str | None = None):
    """``{name: (values float64 with nan for null, missing bool)}`` and the column names."""
    import pyarrow.parquet as pq

    table = pq.read_table(PUBLIC / "runs" / f"{run_id}.parquet")
    cols = table.column_names
    want = list(names or [])
    if prefix is not None:
        want += [c for c in cols if c.startswith(prefix)]
    out = {}
    for c in want:
        col = table.column(c)
        values = np.array(col.to_numpy(zero_copy_only=False), dtype=np.float64)
        out[c] = (values, np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool))
    return out, cols
