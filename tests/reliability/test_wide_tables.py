"""Wide tables: schema normalisation is linear in the number of columns.

Before issue 12, :func:`replay.schema.apply_aliases` re-built ``table.column_names`` once per
column (4,000 columns took 31 s, 20,000 never finished).  The test times normalisation (aliases +
:func:`normalize_table`, unsorted and with duplicate steps to merge) at 2,000 and 20,000 columns:
a linear implementation takes about 10x longer for 10x the columns, a quadratic one about 100x.
The ratio bound (30) is loose so that a busy machine does not fail it; it is the only timing in
the suite and measures a ratio, not a duration.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from replay.reader import default_aliases
from replay.schema import apply_aliases, normalize_table


def _wide(n_cols: int, n_rows: int = 8) -> pa.Table:
    rng = np.random.default_rng(0)
    steps = np.r_[np.arange(n_rows - 1, -1, -1), 0]  # unsorted, one duplicate step
    cols = {"step": pa.array(steps)}
    block = rng.random((n_cols, len(steps)))
    for i in range(n_cols):
        name = "train/loss" if i == n_cols - 1 else f"grad_norm/layer{i}"  # alias last
        cols[name] = pa.array(block[i])
    return pa.table(cols)


def _normalise_seconds(table: pa.Table, aliases: dict[str, str]) -> float:
    best = np.inf
    for _ in range(2):
        t0 = time.perf_counter()
        out = normalize_table(apply_aliases(table, aliases), "wide.parquet")
        best = min(best, time.perf_counter() - t0)
    assert out.num_columns == table.num_columns and out.column_names[-1] == "loss"
    assert out.column("step").to_pylist() == sorted(set(out.column("step").to_pylist()))
    return float(best)


def test_normalisation_is_linear_in_columns() -> None:
    aliases = default_aliases()
    small, big = _wide(2_000), _wide(20_000)
    t_small = _normalise_seconds(small, aliases)
    t_big = _normalise_seconds(big, aliases)
    ratio = t_big / max(t_small, 1e-4)
    assert ratio < 30, f"2k columns {t_small:.3f} s, 20k columns {t_big:.3f} s (x{ratio:.1f})"
