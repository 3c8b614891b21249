"""Loaders for the shared real / public runs used by the detection sanity tests (skip if absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.shared_data import SHARED as _SHARED

SHARED = _SHARED
BLOOM = (
    SHARED / "realruns" / "bigscience_chronicles" / "tr11-176B_BLOOM_first_loss_spike_31216.parquet"
)
PUBLIC = SHARED / "runs" / "public"


def _read(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    pq = pytest.importorskip("pyarrow.parquet")
    if not path.exists():
        pytest.skip(f"{path} not available")
    table = pq.read_table(path, columns=columns)
    return {
        c: np.asarray(table.column(c).to_numpy(zero_copy_only=False), dtype=float) for c in columns
    }


def bloom_with_history(column: str, n_history: int = 300, sigma: float = 0.1, seed: int = 0):
    """BLOOM-176B's first spike with a synthetic warm history prepended.

    The history repeats the file's first (healthy) value with multiplicative log-normal noise
    of ``sigma``; returns ``(x, n_history)`` where ``x[n_history:]`` is the real data.
    """
    d = _read(BLOOM, [column])[column]
    rng = np.random.default_rng(seed)
    hist = d[0] * np.exp(rng.normal(0.0, sigma, n_history))
    return np.concatenate([hist, d]), n_history


def public_runs(outcome: str) -> list[tuple[dict, dict[str, np.ndarray]]]:
    """All public runs with the given outcome, as ``(label_row, {"step", "loss", "grad_norm"})``."""
    pq = pytest.importorskip("pyarrow.parquet")
    labels_path = PUBLIC / "labels.parquet"
    if not labels_path.exists():
        pytest.skip(f"{labels_path} not available")
    rows = [r for r in pq.read_table(labels_path).to_pylist() if r["outcome"] == outcome]
    return [
        (r, _read(PUBLIC / "runs" / f"{r['run_id']}.parquet", ["step", "loss", "grad_norm"]))
        for r in rows
    ]
