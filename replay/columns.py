"""Column parsing for recorded runs: the step column, metric columns, duplicate steps.

The low-level half of :func:`replay.schema.normalize_table` (rules in :mod:`replay.schema`):

* ``step`` to ``int64``, exactly: integers must fit in int64 (never wrapped), floats and strings
  must hold whole numbers (floats up to 2**53); otherwise a :class:`RunFormatError` naming the row
  and the value;
* metric columns to ``float64`` (text parsed, columns without numbers reported as droppable);
* rows stable-sorted by step, duplicate steps merged (last non-null value per column).

:class:`RunFormatError` and :data:`STEP` are defined here, below everything that raises or names
them, and re-exported by :mod:`replay.schema`, their public home.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: name of the step column
STEP = "step"

NonNumeric = Literal["drop", "error"]


class RunFormatError(ValueError):
    """A run file (or table) that cannot be read as a recorded run.

    The message always starts with the source (file name, URI or ``<table>``).

    Examples
    --------
    >>> str(RunFormatError("run.parquet", "no 'step' column"))
    "run.parquet: no 'step' column"
    """

    def __init__(self, source: object, problem: str) -> None:
        self.source = str(source)
        self.problem = problem
        super().__init__(f"{self.source}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        # picklable (errors raised in worker processes reach the parent intact)
        return (type(self), (self.source, self.problem))

    # public home (tracebacks and pickles name it there): replay.schema re-exports it
    __module__ = "replay.schema"


#: largest step accepted from an integer column (int64)
INT64_MAX = 2**63 - 1
#: largest step accepted from a float column: beyond 2**53 a float cannot hold every integer
MAX_FLOAT_STEP = 2**53

_STEP_RULE = "int64 range; as floats, whole numbers up to 2**53"


def _bad_step(source: object, row: int, value: object) -> RunFormatError:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return RunFormatError(
        source, f"column 'step' must hold integers; row {row} holds {text} ({_STEP_RULE})"
    )


def _step_array(col: pa.ChunkedArray | pa.Array, source: object) -> np.ndarray:
    """``step`` as an int64 NumPy array, or a clear error naming the row and the value.

    Integer columns must fit in int64 (a ``uint64`` above 2**63 - 1 is an error, never wrapped to
    a negative step); float and decimal columns must hold finite whole numbers of magnitude at
    most 2**53; string columns are parsed as integers (exactly) or floats (same rule).
    """
    if col.null_count:
        raise RunFormatError(source, f"column 'step' has {col.null_count} null value(s)")
    typ = col.type
    if pa.types.is_integer(typ):
        if pa.types.is_unsigned_integer(typ) and typ.bit_width == 64 and len(col):
            big = np.asarray(col.to_numpy(), dtype=np.uint64) > np.uint64(INT64_MAX)
            if big.any():
                i = int(np.argmax(big))
                raise _bad_step(source, i, col[i].as_py())
        return np.asarray(col.cast(pa.int64()).to_numpy(), dtype=np.int64)
    if pa.types.is_floating(typ) or pa.types.is_decimal(typ):
        f = np.asarray(col.cast(pa.float64(), safe=False).to_numpy(), dtype=np.float64)
    elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return _parse_steps(col.to_pylist(), source)
    else:
        raise RunFormatError(source, f"column 'step' must hold integers, got type {typ}")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(f) | (f != np.round(f)) | (np.abs(f) > MAX_FLOAT_STEP)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad_step(source, i, col[i].as_py())
    return f.astype(np.int64)


def _parse_steps(values: list[Any], source: object) -> np.ndarray:
    """Step strings -> int64: ``"12"`` exactly (int64 range), ``"12.0"`` / ``"1e3"`` as floats."""
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        text = str(v).strip()
        try:
            n = int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise RunFormatError(
                    source, f"column 'step' holds non-numeric value {v!r} at row {i}"
                ) from None
            if not (math.isfinite(f) and f.is_integer() and abs(f) <= MAX_FLOAT_STEP):
                raise _bad_step(source, i, v) from None
            n = int(f)
        if not -INT64_MAX - 1 <= n <= INT64_MAX:
            raise _bad_step(source, i, v)
        out[i] = n
    return out


def _parse_strings(values: list[Any], name: str, source: object) -> np.ndarray:
    out = np.empty(len(values))
    for i, v in enumerate(values):
        if v is None:
            out[i] = np.nan
            continue
        try:
            out[i] = float(v)
        except ValueError:
            raise RunFormatError(
                source, f"column {name!r} holds non-numeric value {v!r} at row {i}"
            ) from None
    return out


def _to_float(
    col: pa.ChunkedArray | pa.Array, name: str, source: object, non_numeric: NonNumeric
) -> pa.ChunkedArray | None:
    """Cast a metric column to float64; None means "no numbers here, drop it"."""
    if isinstance(col, pa.Array):
        col = pa.chunked_array([col])
    typ = col.type
    if pa.types.is_floating(typ) or pa.types.is_integer(typ) or pa.types.is_decimal(typ):
        # an integer above 2**53 (or a wide decimal) becomes the nearest float: a metric value,
        # not an identifier, so rounding is the right reading (a safe cast would raise)
        return col.cast(pa.float64(), safe=False)
    if pa.types.is_boolean(typ):
        return col.cast(pa.int8()).cast(pa.float64())
    if pa.types.is_null(typ):
        return pa.chunked_array([pa.nulls(len(col), pa.float64())])
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        values = col.to_pylist()
        parsed: list[float | None] = []
        first_bad: tuple[int, str] | None = None
        n_num = 0
        for i, v in enumerate(values):
            if v is None or v == "":
                parsed.append(None)
                continue
            try:
                parsed.append(float(v))
                n_num += 1
            except ValueError:
                parsed.append(None)
                if first_bad is None:
                    first_bad = (i, v)
        if first_bad is None:
            return pa.chunked_array([pa.array(parsed, type=pa.float64())])
        if n_num:
            raise RunFormatError(
                source,
                f"column {name!r} holds non-numeric value {first_bad[1]!r} at row {first_bad[0]}",
            )
    if non_numeric == "error":
        raise RunFormatError(source, f"column {name!r} is not numeric (type {typ})")
    return None


def _sort_and_merge(table: pa.Table, steps: np.ndarray) -> pa.Table:
    """Stable-sort rows by step; merge duplicate steps (last non-null value per column)."""
    if len(steps) < 2:
        return table
    d = np.diff(steps)
    if (d > 0).all():
        return table
    if not (d >= 0).all():
        order = np.argsort(steps, kind="stable")
        table = table.take(pa.array(order))
        steps = steps[order]
        d = np.diff(steps)
        if (d > 0).all():
            return table
    # duplicates: group_by keeps first-appearance order without threads
    metrics = [n for n in table.column_names if n != STEP]
    agg = table.group_by(STEP, use_threads=False).aggregate(
        [(n, "last", pc.ScalarAggregateOptions(skip_nulls=True)) for n in metrics]
    )
    cols = [agg.column(STEP)] + [agg.column(f"{n}_last") for n in metrics]
    return pa.Table.from_arrays(cols, schema=table.schema)
