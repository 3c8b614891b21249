"""Schema, metadata, validation, long-format pivot and aliases."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.schema import (
    METADATA_KEY,
    SCHEMA_VERSION,
    RunFormatError,
    alias_resolver,
    apply_aliases,
    make_metadata,
    normalize_table,
    pivot_long,
    read_metadata,
    run_schema,
    table_from_records,
)


def test_run_schema_types_and_metadata():
    s = run_schema(["loss", "grad_norm/blk0"], make_metadata({"preset": "x"}, {"name": "r"}))
    assert s.names == ["step", "loss", "grad_norm/blk0"]
    assert s.field("step").type == pa.int64() and not s.field("step").nullable
    assert all(s.field(n).type == pa.float64() for n in s.names[1:])
    md = read_metadata(s)
    assert md == {
        "schema_version": SCHEMA_VERSION,
        "monitor_config": {"preset": "x"},
        "run": {"name": "r"},
    }


def test_read_metadata_errors():
    bad = pa.schema([("step", pa.int64())], metadata={METADATA_KEY: b"{not json"})
    with pytest.raises(RunFormatError, match="f.parquet: metadata .* not valid JSON"):
        read_metadata(bad, "f.parquet")
    newer = pa.schema(
        [("step", pa.int64())], metadata={METADATA_KEY: json.dumps({"schema_version": 99}).encode()}
    )
    with pytest.raises(RunFormatError, match="newer"):
        read_metadata(newer)
    arr = pa.schema([("step", pa.int64())], metadata={METADATA_KEY: b"[1]"})
    with pytest.raises(RunFormatError, match="not a JSON object"):
        read_metadata(arr)


def test_null_and_nan_are_kept_apart():
    t = table_from_records([(0, {"loss": math.nan}), (1, {"loss": None}), (2, {"loss": 1.0})])
    col = t.column("loss")
    assert col.null_count == 1
    assert col.to_pylist()[1] is None
    assert math.isnan(col.to_pylist()[0])
    # and normalize keeps it
    n = normalize_table(t)
    assert n.column("loss").null_count == 1 and math.isnan(n.column("loss")[0].as_py())


def test_normalize_casts_and_sorts():
    t = pa.table(
        {
            "step": pa.array([2, 0, 1], pa.int32()),
            "a": pa.array([1, 2, 3], pa.int16()),
            "b": pa.array([True, False, None]),
            "c": pa.array([None, None, None], pa.null()),
        }
    )
    out = normalize_table(t)
    assert out.schema.types == [pa.int64()] + [pa.float64()] * 3
    assert out.column("step").to_pylist() == [0, 1, 2]
    assert out.column("a").to_pylist() == [2.0, 3.0, 1.0]
    assert out.column("b").to_pylist() == [0.0, None, 1.0]
    assert read_metadata(out.schema)["schema_version"] == 1


def test_duplicate_steps_merge_last_non_null():
    t = pa.table(
        {
            "step": [0, 1, 1, 2, 1],
            "a": [1.0, 2.0, None, 3.0, math.nan],
            "b": [None, 5.0, 6.0, None, None],
        }
    )
    out = normalize_table(t).to_pydict()
    assert out["step"] == [0, 1, 2]
    assert math.isnan(out["a"][1]) and out["b"][1] == 6.0


@pytest.mark.parametrize(
    ("step", "msg"),
    [
        (pa.array([0.0, 1.5]), "must hold integers; row 1 holds 1.5"),
        (pa.array([0, None], pa.int64()), "1 null value"),
        (pa.array(["0", "x"]), "non-numeric value 'x' at row 1"),
        (pa.array([0.0, math.nan]), "must hold integers"),
        (pa.array([[1], [2]]), "must hold integers, got type list"),
    ],
)
def test_bad_steps_name_the_file(step, msg):
    with pytest.raises(RunFormatError, match=msg) as e:
        normalize_table(pa.table({"step": step, "loss": [1.0, 2.0]}), "run.parquet")
    assert str(e.value).startswith("run.parquet: ")


def test_float_and_string_steps_accepted():
    out = normalize_table(pa.table({"step": ["1", "0"], "loss": [1.0, 2.0]}))
    assert out.column("step").to_pylist() == [0, 1]
    out = normalize_table(pa.table({"step": [3.0, 4.0], "loss": [1.0, 2.0]}))
    assert out.column("step").type == pa.int64()


def test_missing_step_and_duplicate_columns():
    with pytest.raises(RunFormatError, match="no 'step' column"):
        normalize_table(pa.table({"loss": [1.0]}), "x.csv")
    t = pa.Table.from_arrays(
        [pa.array([0]), pa.array([1.0]), pa.array([2.0])], names=["step", "a", "a"]
    )
    with pytest.raises(RunFormatError, match="duplicate column 'a'"):
        normalize_table(t)


def test_string_metric_columns():
    t = pa.table(
        {
            "step": [0, 1, 2],
            "loss": ["1.5", "nan", None],
            "name": ["a", "b", "c"],
            "mixed": ["1.0", "oops", "2.0"],
        }
    )
    with pytest.raises(
        RunFormatError, match="column 'mixed' holds non-numeric value 'oops' at row 1"
    ):
        normalize_table(t, "f.csv")
    t = t.drop_columns(["mixed"])
    with pytest.warns(UserWarning, match=r"f.csv: dropped non-numeric column\(s\) \['name'\]"):
        out = normalize_table(t, "f.csv")
    assert out.column_names == ["step", "loss"]
    assert out.column("loss").to_pylist()[0] == 1.5 and out.column("loss").null_count == 1
    with pytest.raises(RunFormatError, match="column 'name' is not numeric"):
        normalize_table(t, "f.csv", non_numeric="error")
    with pytest.raises(ValueError, match="non_numeric"):
        normalize_table(t, non_numeric="maybe")  # type: ignore[arg-type]


def test_pivot_long_last_wins_and_order():
    long = pa.table(
        {
            "step": [0, 0, 1, 1, 0],
            "name": ["lr", "loss", "loss", "lr", "lr"],
            "value": [0.1, 2.0, None, math.nan, 0.2],
        }
    )
    out = pivot_long(long)
    assert out.column_names == ["step", "lr", "loss"]
    d = out.to_pydict()
    assert d["lr"][0] == 0.2 and math.isnan(d["lr"][1])
    assert d["loss"] == [2.0, None]
    assert str(normalize_table(long).to_pydict()) == str(out.to_pydict())


def test_pivot_long_errors():
    with pytest.raises(RunFormatError, match="'name' contains nulls"):
        pivot_long(
            pa.table({"step": [0], "name": pa.array([None], pa.string()), "value": [1.0]}),
            "l.parquet",
        )
    with pytest.raises(RunFormatError, match="'value' holds non-numeric"):
        pivot_long(pa.table({"step": [0, 1], "name": ["a", "a"], "value": ["1", "x"]}))


def test_aliases_exact_prefix_and_coalesce():
    t = pa.table(
        {
            "step": [0, 1, 2],
            "train/loss": [1.0, None, 3.0],
            "loss": [None, 2.0, 9.0],
            "grad-norm/blk0": [0.1, 0.2, 0.3],
            "learning_rate": [1e-3] * 3,
        }
    )
    out = apply_aliases(
        t, {"train/loss": "loss", "grad-norm/*": "grad_norm/*", "learning_rate": "lr"}
    )
    assert out.column_names == ["step", "loss", "grad_norm/blk0", "lr"]
    # the column already called "loss" wins where it has a value
    assert out.column("loss").to_pylist() == [1.0, 2.0, 9.0]
    assert apply_aliases(t, {}) is t
    f = alias_resolver({"a/*": "b"})
    assert f("a/x") == "b/x"


def test_table_from_records_empty():
    t = table_from_records([])
    assert t.num_rows == 0 and t.column_names == ["step"]


records = st.lists(
    st.tuples(
        st.integers(-5, 30),
        st.dictionaries(
            st.sampled_from(["loss", "lr", "grad_norm/a"]),
            st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
            max_size=3,
        ),
    ),
    max_size=40,
)


@settings(deadline=None, max_examples=60)
@given(records)
def test_records_property(recs):
    """Wide table == dict semantics (last non-None per step/name); long pivot agrees."""
    t = table_from_records(recs)
    expect: dict[int, dict[str, float]] = {}
    for step, m in recs:
        row = expect.setdefault(step, {})
        row.update({k: v for k, v in m.items() if v is not None})
    assert t.column("step").to_pylist() == sorted(expect)
    for name in t.column_names[1:]:
        got = t.column(name).to_pylist()
        for s, g in zip(sorted(expect), got, strict=True):
            want = expect[s].get(name)
            assert (g is None and want is None) or (
                g is not None
                and want is not None
                and (g == want or (math.isnan(g) and math.isnan(want)))
            )
    # the same data through the long layout
    long_rows = [(s, k, v) for s, m in recs for k, v in m.items() if v is not None]
    if long_rows:
        long = pa.table(
            {
                "step": [r[0] for r in long_rows],
                "name": [r[1] for r in long_rows],
                "value": pa.array([r[2] for r in long_rows], pa.float64()),
            }
        )
        wide = pivot_long(long)
        for name in wide.column_names[1:]:
            a = np.array(wide.column(name).to_pylist(), dtype=float)
            steps = wide.column("step").to_pylist()
            b = np.array([expect[s].get(name, np.nan) for s in steps], dtype=float)
            np.testing.assert_array_equal(a, b)


def test_no_warning_for_clean_tables():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normalize_table(pa.table({"step": [0], "loss": [1.0]}))
