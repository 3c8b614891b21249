"""read_run / iter_batches: files, parts, globs, URIs, columns, aliases, hostile files."""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.reader import default_aliases, iter_batches, list_sources, read_run, read_schema
from replay.recorder import RunRecorder
from replay.schema import RunFormatError, make_metadata, read_metadata

from .fixtures import NANOGPT, PUBLIC_RUNS, need


@pytest.fixture
def parts_dir(tmp_path):
    d = tmp_path / "run"
    with RunRecorder(d, part_steps=4, metadata={"monitor_config": {"preset": "p"}}) as rec:
        for s in range(10):
            m = {"train/loss": 1.0 / (s + 1), "lr": 1e-3}
            if s >= 6:
                m["grad_norm/blk0"] = float(s)
            if s == 3:
                m["train/loss"] = math.nan
            rec.log(s, m)
    return d


def same(a: pa.Table, b: pa.Table) -> bool:
    """Equal data with NaN == NaN."""
    return a.schema.equals(b.schema) and str(a.to_pydict()) == str(b.to_pydict())


def test_directory_of_parts(parts_dir):
    t = read_run(parts_dir)
    assert t.column_names == ["step", "loss", "lr", "grad_norm/blk0"]
    assert t.column("step").to_pylist() == list(range(10))
    assert math.isnan(t.column("loss")[3].as_py())
    assert t.column("grad_norm/blk0").null_count == 6
    assert read_metadata(t.schema)["monitor_config"] == {"preset": "p"}


def test_file_glob_and_file_uri(parts_dir):
    whole = read_run(parts_dir)
    assert same(read_run(str(parts_dir / "part-*.parquet")), whole)
    assert same(read_run(f"file://{parts_dir}"), whole)
    assert same(read_run(f"file://{parts_dir}/part-*.parquet"), whole)
    one = read_run(parts_dir / "part-000000.parquet")
    assert one.num_rows == 4
    assert list_sources(f"file://{parts_dir}")[0] == f"file://{parts_dir}/part-000000.parquet"


def test_part_order_is_numeric(tmp_path):
    for i in (10, 9, 100):
        pq.write_table(pa.table({"step": [i], "x": [float(i)]}), tmp_path / f"part-{i}.parquet")
    assert [os.path.basename(p) for p in list_sources(tmp_path)] == [
        "part-9.parquet",
        "part-10.parquet",
        "part-100.parquet",
    ]


def test_columns_and_aliases(parts_dir):
    t = read_run(parts_dir, columns=["loss", "grad_norm/blk0", "nope"])
    assert t.column_names == ["step", "loss", "grad_norm/blk0"]
    raw = read_run(parts_dir, default_aliases=False)
    assert "train/loss" in raw.column_names
    custom = read_run(parts_dir, aliases={"lr": "learning_rate"})
    assert "learning_rate" in custom.column_names
    assert default_aliases()["learning_rate"] == "lr"


def test_iter_batches_matches_read_run(parts_dir):
    batches = list(iter_batches(parts_dir, batch_rows=3))
    assert all(b.num_rows <= 3 for b in batches)
    assert len({b.schema for b in batches}) == 1
    t = pa.Table.from_batches(batches)
    whole = read_run(parts_dir)
    assert t.column_names == whole.column_names
    for name in whole.column_names:
        np.testing.assert_array_equal(
            np.array(t.column(name).to_pylist(), dtype=float),
            np.array(whole.column(name).to_pylist(), dtype=float),
        )
    sel = list(iter_batches(parts_dir, columns=["loss"], batch_rows=100))
    assert sel[0].schema.names == ["step", "loss"]
    with pytest.raises(ValueError, match="batch_rows"):
        next(iter_batches(parts_dir, batch_rows=0))


def test_iter_batches_bounded_row_groups(tmp_path):
    p = tmp_path / "big.parquet"
    n = 50_000
    pq.write_table(pa.table({"step": np.arange(n), "loss": np.ones(n)}), p, row_group_size=8192)
    sizes = [b.num_rows for b in iter_batches(p, batch_rows=5000)]
    assert max(sizes) <= 5000 and sum(sizes) == n


def test_long_format_file(tmp_path):
    p = tmp_path / "long.parquet"
    pq.write_table(
        pa.table(
            {
                "step": [0, 0, 1],
                "name": ["train/loss", "lr", "train/loss"],
                "value": [2.0, 0.1, math.nan],
            }
        ),
        p,
    )
    t = read_run(p)
    assert t.column_names == ["step", "loss", "lr"]
    assert read_schema(p).names == ["step", "loss", "lr"]
    b = pa.Table.from_batches(list(iter_batches(p, columns=["loss"])))
    assert b.column_names == ["step", "loss"] and b.num_rows == 2


def test_string_columns_dropped_with_warning(tmp_path):
    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"step": [0], "loss": [1.0], "note": ["hi"]}), p)
    with pytest.warns(UserWarning, match=r"x.parquet: dropped non-numeric column\(s\) \['note'\]"):
        assert read_run(p).column_names == ["step", "loss"]
    pq.write_table(pa.table({"step": [0], "loss": [1.0], "hist": [[1, 2]]}), p)
    with pytest.warns(UserWarning, match=r"x.parquet: dropped non-numeric column\(s\) \['hist'\]"):
        assert pa.Table.from_batches(list(iter_batches(p))).column_names == ["step", "loss"]
    pq.write_table(pa.table({"step": [0, 1], "loss": ["1.0", "bad"]}), p)
    with pytest.raises(RunFormatError, match=r"x.parquet: column 'loss' holds non-numeric value"):
        read_run(p)


def test_metadata_fallback_and_unsorted(tmp_path):
    p = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"step": [2, 1, 1], "loss": [1.0, 2.0, 3.0]}), p)
    t = read_run(p)
    assert t.column("step").to_pylist() == [1, 2] and t.column("loss").to_pylist() == [3.0, 1.0]
    assert read_metadata(t.schema)["run"]["source"] == str(p)
    q = tmp_path / "md.parquet"
    pq.write_table(
        pa.table({"step": [0], "loss": [1.0]}).replace_schema_metadata(
            make_metadata(run={"name": "abc"})
        ),
        q,
    )
    assert read_metadata(read_run(q).schema)["run"] == {"name": "abc"}


# --------------------------------------------------------------------------- hostile files


def test_truncated_parquet_names_the_file(tmp_path):
    p = tmp_path / "trunc.parquet"
    pq.write_table(pa.table({"step": np.arange(100), "loss": np.ones(100)}), p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(RunFormatError, match=r"trunc.parquet: not a readable Parquet file"):
        read_run(p)
    with pytest.raises(RunFormatError, match="trunc.parquet"):
        list(iter_batches(p))


def test_corrupted_pages_name_the_file(tmp_path):
    p = tmp_path / "corrupt.parquet"
    rng = np.random.default_rng(0)
    pq.write_table(
        pa.table({"step": np.arange(5000), "loss": rng.normal(size=5000)}), p, compression="zstd"
    )
    data = bytearray(p.read_bytes())
    for i in range(16, 2000):  # smash the data pages, keep the footer
        data[i] = 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(RunFormatError, match=r"corrupt.parquet: "):
        read_run(p)
    with pytest.raises(RunFormatError, match=r"corrupt.parquet: "):
        list(iter_batches(p))


def test_not_parquet_missing_and_empty(tmp_path):
    p = tmp_path / "text.parquet"
    p.write_text("hello")
    with pytest.raises(RunFormatError, match="text.parquet: not a readable Parquet"):
        read_run(p)
    with pytest.raises(RunFormatError, match="no such file or directory"):
        read_run(tmp_path / "missing.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFormatError, match="empty: directory holds no"):
        read_run(tmp_path / "empty")
    with pytest.raises(RunFormatError, match="glob matched no files"):
        read_run(str(tmp_path / "nothing-*.parquet"))
    q = tmp_path / "nostep.parquet"
    pq.write_table(pa.table({"loss": [1.0]}), q)
    with pytest.raises(RunFormatError, match="nostep.parquet: no 'step' column"):
        read_run(q)
    with pytest.raises(RunFormatError, match="cannot open URI"):
        read_run("nosuchscheme://bucket/run.parquet")


# --------------------------------------------------------------------------- real data


def test_public_runs_wide_format():
    runs = sorted(need(PUBLIC_RUNS).glob("*.parquet"))
    t = read_run(runs[0])
    raw = pq.read_table(runs[0])
    assert t.num_rows == raw.num_rows
    assert t.column("step").to_pylist() == raw.column("step").to_pylist()
    assert t.column("grad_norm/block0").equals(raw.column("grad_norm/block0"))
    # a glob over all public runs streams in bounded batches
    n = sum(
        b.num_rows
        for b in iter_batches(
            str(PUBLIC_RUNS / "public_000*.parquet"), columns=["loss"], batch_rows=1000
        )
    )
    assert n == sum(
        pq.ParquetFile(p).metadata.num_rows for p in PUBLIC_RUNS.glob("public_000*.parquet")
    )


def test_modded_nanogpt_runs():
    p = sorted(need(NANOGPT).glob("*.parquet"))[0]
    t = read_run(p)
    raw = pq.read_table(p)
    assert t.num_rows == raw.num_rows
    # NaN vs null survives: val_loss is only logged every so often
    assert t.column("val_loss").null_count == raw.column("val_loss").null_count
