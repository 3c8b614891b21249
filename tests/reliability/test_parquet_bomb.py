"""A small Parquet file of millions of repeated rows (a decompression bomb) is read in batches,
duplicate steps merged as it goes: the result is the whole read's (last value wins), and what
is held follows the distinct steps, not the row count (figures: benchmarks/bench_parquet_bomb.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay import reader


def _bomb(path: Path, rows: int, steps: int) -> None:
    step = np.arange(rows, dtype=np.int64) % steps
    loss = np.arange(rows, dtype=np.float64)
    lr = np.where(np.arange(rows) % 7 == 0, np.nan, 0.1)
    pq.write_table(pa.table({"step": step, "loss": loss, "lr": pa.array(lr, from_pandas=True)}),
                   path, compression="zstd")


@pytest.mark.parametrize("steps", [1, 37])
def test_batched_read_equals_the_whole_read(tmp_path: Path, steps: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "bomb.parquet"
    _bomb(p, 20_000, steps)
    whole = reader.read_run(p)  # 20,000 rows <= MERGE_ROWS: read whole
    monkeypatch.setattr(reader, "MERGE_ROWS", 1_000)
    held: list[int] = []
    merge = reader._merge_tables

    def spy(tables: list[pa.Table], display: str) -> pa.Table:
        held.append(sum(t.num_rows for t in tables))
        return merge(tables, display)

    monkeypatch.setattr(reader, "_merge_tables", spy)
    batched = reader.read_run(p)
    assert batched.num_rows == steps
    assert batched.to_pydict() == whole.to_pydict()
    assert max(held) <= 2 * 1_000 + steps  # never more than two batches' worth held
    last = {s: float(i) for i, s in enumerate(np.arange(20_000) % steps)}  # last value wins
    assert batched.column("loss").to_pylist() == [last[s] for s in range(steps)]
