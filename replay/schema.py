"""The declared Arrow schema of a recorded run, its metadata, and validation.

A recorded run is a **wide** table: one ``step`` column (``int64``, the optimizer step) and one
``float64`` column per metric (``loss``, ``grad_norm/<layer>``, ...). Two kinds of "no number" are
kept apart everywhere:

* **null**: the metric was *not logged* on that step (e.g. ``val_loss`` between evaluations);
* **NaN**: the metric *was logged and was NaN* (a diverged loss). Detectors treat the two
  differently.

A **long** table (``step: int64, name: string, value: float64``) is accepted and pivoted to wide.

The schema metadata key ``b"stability"`` holds JSON ``{"schema_version": 1, "monitor_config": ...,
"run": {...}}``.

Validation rules (:func:`normalize_table`):

* ``step`` must exist, be integer-valued (integer type, or float/string holding whole numbers) and
  never null, else :class:`RunFormatError`.
* Numeric metric columns (ints, floats, bools, decimals) are cast to ``float64``; nulls stay null.
* String columns whose values all parse as numbers (``"1.5"``, ``"nan"``, ``"inf"``) are converted.
* A string column with *some* numbers and some non-numeric text is an error naming the file, the
  column, the row and the value (a metric column holding text is a broken export, not something to
  guess about).
* Columns holding no numbers at all (run names, file names, nested objects) are **dropped with a
  warning** (``non_numeric="drop"``, the default) or rejected (``non_numeric="error"``).
* Rows are sorted by step (stable); several rows for the same step are merged, the last non-null
  value per column winning.

The column parsers behind these rules (and :class:`RunFormatError`, :data:`STEP`) live in
:mod:`replay.columns`; this module re-exports them.

Examples
--------
>>> t = table_from_records([(2, {"loss": 1.5}), (1, {"loss": float("nan"), "lr": 0.1})])
>>> t.column_names
['step', 'loss', 'lr']
>>> t.column("step").to_pylist(), t.column("lr").to_pylist()
([1, 2], [0.1, None])
>>> read_metadata(t.schema)["schema_version"]
1
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.columns import (
    STEP,
    NonNumeric,
    RunFormatError,
    _sort_and_merge,
    _step_array,
    _to_float,
)

__all__ = [
    "alias_resolver",
    "METADATA_KEY",
    "SCHEMA_VERSION",
    "STEP",
    "RunFormatError",
    "apply_aliases",
    "is_long_format",
    "make_metadata",
    "normalize_table",
    "pivot_long",
    "read_metadata",
    "run_schema",
    "table_from_records",
]

#: version of the on-disk layout written by this module
SCHEMA_VERSION = 1
#: schema-metadata key holding the JSON run metadata
METADATA_KEY = b"stability"


# --------------------------------------------------------------------------- metadata


def make_metadata(
    monitor_config: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None
) -> dict[bytes, bytes]:
    """Schema metadata for a recorded run.

    Parameters
    ----------
    monitor_config : mapping or None
        The monitor configuration (JSON data) the run was recorded with.
    run : mapping or None
        Free-form run information (name, model, hyperparameters, source file, ...).

    Returns
    -------
    dict
        ``{b"stability": <JSON bytes>}``, ready for ``pa.Schema.with_metadata``.

    Examples
    --------
    >>> make_metadata(run={"name": "r1"})[b"stability"]
    b'{"schema_version": 1, "monitor_config": null, "run": {"name": "r1"}}'
    """
    doc = {
        "schema_version": SCHEMA_VERSION,
        "monitor_config": None if monitor_config is None else dict(monitor_config),
        "run": {} if run is None else dict(run),
    }
    return {METADATA_KEY: json.dumps(doc, default=str).encode()}


def read_metadata(schema: pa.Schema, source: object = "<table>") -> dict[str, Any] | None:
    """Return the decoded ``b"stability"`` metadata of ``schema``, or None when absent.

    Raises
    ------
    RunFormatError
        If the metadata is not valid JSON or has a newer ``schema_version``.

    Examples
    --------
    >>> read_metadata(pa.schema([("step", pa.int64())])) is None
    True
    """
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise RunFormatError(
            source, f"metadata {METADATA_KEY!r} is not valid JSON ({exc})"
        ) from None
    if not isinstance(doc, dict):
        raise RunFormatError(source, f"metadata {METADATA_KEY!r} is not a JSON object")
    version = doc.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise RunFormatError(
            source, f"schema_version {version!r} is newer than this library ({SCHEMA_VERSION})"
        )
    doc.setdefault("monitor_config", None)
    doc.setdefault("run", {})
    return doc


def run_schema(
    metric_names: Iterable[str], metadata: Mapping[bytes, bytes] | None = None
) -> pa.Schema:
    """The wide schema: ``step`` int64 then one float64 column per metric.

    Examples
    --------
    >>> run_schema(["loss", "grad_norm/blk0"]).types
    [DataType(int64), DataType(double), DataType(double)]
    """
    fields = [pa.field(STEP, pa.int64(), nullable=False)]
    fields += [pa.field(n, pa.float64()) for n in metric_names]
    return pa.schema(fields, metadata=dict(metadata) if metadata else None)


# --------------------------------------------------------------------------- building tables


def table_from_records(
    records: Iterable[tuple[int, Mapping[str, float | None]]],
    metadata: Mapping[bytes, bytes] | None = None,
) -> pa.Table:
    """Build a wide run table from ``(step, {name: value})`` records.

    Records for the same step are merged (the last non-null value wins); rows come out sorted by
    step; columns in order of first appearance. ``None`` means "not logged" (null).

    Examples
    --------
    >>> t = table_from_records([(0, {"loss": 1.0}), (0, {"val_loss": 2.0}), (1, {"loss": None})])
    >>> t.to_pydict()
    {'step': [0, 1], 'loss': [1.0, None], 'val_loss': [2.0, None]}
    """
    rows: dict[int, dict[str, float | None]] = {}
    names: dict[str, None] = {}
    for step, metrics in records:
        row = rows.setdefault(int(step), {})
        for name, value in metrics.items():
            names.setdefault(name, None)
            if value is not None:
                row[name] = value
    steps = sorted(rows)
    arrays = [pa.array(steps, type=pa.int64())]
    for name in names:
        arrays.append(pa.array([rows[s].get(name) for s in steps], type=pa.float64()))
    md = dict(metadata) if metadata else make_metadata()
    return pa.Table.from_arrays(arrays, schema=run_schema(names, md))


def is_long_format(schema: pa.Schema) -> bool:
    """True if ``schema`` is the long layout ``step, name, value`` (``name`` not numeric: a
    wide run whose only metrics are called ``name`` and ``value`` stays wide).

    Examples
    --------
    >>> is_long_format(pa.schema([("step", pa.int64()), ("name", pa.string()),
    ...                           ("value", pa.float64())]))
    True
    """
    if set(schema.names) != {STEP, "name", "value"}:
        return False
    t = schema.field(schema.names.index("name")).type
    return not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t))


def pivot_long(table: pa.Table, source: object = "<table>") -> pa.Table:
    """Pivot a long ``step, name, value`` table to the wide layout (last non-null value per cell).

    Examples
    --------
    >>> long = pa.table({"step": [0, 0, 1], "name": ["loss", "lr", "loss"],
    ...                  "value": [1.0, 0.1, float("nan")]})
    >>> pivot_long(long).to_pydict()
    {'step': [0, 1], 'loss': [1.0, nan], 'lr': [0.1, None]}
    """
    steps = _step_array(table.column(STEP), source)
    names_col = table.column("name")
    if pc.any(pc.is_null(names_col)).as_py():
        raise RunFormatError(source, "long format: column 'name' contains nulls")
    names_col = names_col.cast(pa.string())
    values = _to_float(table.column("value"), "value", source, "error")
    if values is None:  # pragma: no cover - non_numeric="error" never returns None
        raise RunFormatError(source, "long format: column 'value' is not numeric")
    enc = pc.dictionary_encode(names_col).combine_chunks()
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    names = enc.dictionary.to_pylist()
    vals = values.to_numpy(zero_copy_only=False)
    valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
    ustep, sidx = np.unique(steps, return_inverse=True)
    n, m = len(ustep), len(names)
    # a null value is "not logged": it never overrides a logged one
    key = (codes * n + sidx)[valid]
    kept = np.flatnonzero(valid)
    # last logged occurrence of every (name, step) cell
    rev_keys, rev_first = np.unique(key[::-1], return_index=True)
    last = kept[len(key) - 1 - rev_first]
    dense = np.full(m * n, np.nan)
    mask = np.zeros(m * n, dtype=bool)
    dense[rev_keys] = vals[last]
    mask[rev_keys] = True
    # columns ordered by first appearance
    _, first_pos = np.unique(codes, return_index=True)
    order = np.argsort(first_pos, kind="stable")
    arrays = [pa.array(ustep, type=pa.int64())]
    for c in order:
        sl = slice(int(c) * n, (int(c) + 1) * n)
        arrays.append(pa.array(dense[sl], mask=~mask[sl], type=pa.float64()))
    md = table.schema.metadata or make_metadata()
    return pa.Table.from_arrays(arrays, schema=run_schema([names[c] for c in order], md))


# --------------------------------------------------------------------------- validation


def normalize_table(
    table: pa.Table,
    source: object = "<table>",
    non_numeric: NonNumeric = "drop",
    sort: bool = True,
) -> pa.Table:
    """Validate ``table`` and return it in the declared schema (see the module docstring).

    Parameters
    ----------
    table : pa.Table
        Wide or long table.
    source : object
        Name used in error messages (file path or URI).
    non_numeric : {"drop", "error"}
        What to do with columns holding no numbers at all.
    sort : bool
        Sort rows by step and merge duplicate steps (skip when the caller knows they are sorted
        and unique).

    Returns
    -------
    pa.Table
        ``step`` int64 (non-null) and float64 metric columns; metadata preserved or created.

    Raises
    ------
    RunFormatError
        No ``step`` column, non-integer or null steps, text in a numeric column.

    Examples
    --------
    >>> t = pa.table({"step": [1.0, 0.0], "loss": ["2.5", "nan"], "note": ["a", "b"]})
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     normalize_table(t).to_pydict()
    {'step': [0, 1], 'loss': [nan, 2.5]}
    >>> normalize_table(pa.table({"loss": [1.0]}))
    Traceback (most recent call last):
    ...
    replay.schema.RunFormatError: <table>: no 'step' column (columns: ['loss'])
    """
    if non_numeric not in ("drop", "error"):
        raise ValueError(f"non_numeric must be 'drop' or 'error'. Got {non_numeric!r} instead.")
    if STEP not in table.column_names:
        raise RunFormatError(source, f"no 'step' column (columns: {table.column_names[:20]})")
    if table.column_names.count(STEP) > 1:
        raise RunFormatError(source, "more than one 'step' column")
    if is_long_format(table.schema):
        return pivot_long(table, source)
    if not sort and _is_canonical(table.schema):  # fast path for streamed batches
        nulls = table.column(STEP).null_count
        if nulls:
            raise RunFormatError(source, f"column 'step' has {nulls} null value(s)")
        md = table.schema.metadata
        if not md or METADATA_KEY not in md:
            return table.replace_schema_metadata({**(md or {}), **make_metadata()})
        return table
    steps = _step_array(table.column(STEP), source)
    names: list[str] = []
    arrays: list[pa.ChunkedArray] = []
    dropped: list[str] = []
    seen: set[str] = set()
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name == STEP:
            continue
        if name in seen:
            raise RunFormatError(source, f"duplicate column {name!r}")
        seen.add(name)
        conv = _to_float(col, name, source, non_numeric)
        if conv is None:
            dropped.append(name)
            continue
        names.append(name)
        arrays.append(conv)
    if dropped:
        warnings.warn(
            f"{source}: dropped non-numeric column(s) {dropped}", UserWarning, stacklevel=2
        )
    md = table.schema.metadata
    if not md or METADATA_KEY not in md:
        md = {**(md or {}), **make_metadata()}
    else:
        read_metadata(table.schema, source)  # validates
    out = pa.Table.from_arrays(
        [pa.chunked_array([pa.array(steps, type=pa.int64())]), *arrays],
        schema=run_schema(names, md),
    )
    if sort:
        out = _sort_and_merge(out, steps)
    return out


def alias_resolver(aliases: Mapping[str, str]) -> Callable[[str], str]:
    """A function mapping a raw column name to its canonical name: the monitor's own
    :class:`stability.monitor.binding.Aliases` over ``aliases`` alone (exact names first, then keys
    ending
    in ``/*`` rewrite a prefix, longest prefix first).

    Examples
    --------
    >>> f = alias_resolver({"train/loss": "loss", "grad-norm/*": "grad_norm/*"})
    >>> f("train/loss"), f("grad-norm/blk0"), f("lr")
    ('loss', 'grad_norm/blk0', 'lr')
    """
    from stability.monitor.binding import Aliases

    return Aliases(aliases, defaults=False)


def apply_aliases(table: pa.Table, aliases: Mapping[str, str]) -> pa.Table:
    """Rename columns through ``aliases`` (raw name -> canonical name, see :func:`alias_resolver`).

    When several columns map to the same name they are coalesced: per row, the first non-null value
    in column order wins (a column already carrying the canonical name comes first).

    Examples
    --------
    >>> t = pa.table({"step": [0, 1], "train/loss": [1.0, None], "loss": [None, 2.0]})
    >>> apply_aliases(t, {"train/loss": "loss"}).to_pydict()
    {'step': [0, 1], 'loss': [1.0, 2.0]}
    """
    if not aliases:
        return table
    resolve = alias_resolver(aliases)
    groups: dict[str, list[int]] = {}
    raw_names = table.column_names  # a fresh list per call: fetch it once (linear, not quadratic)
    for i, name in enumerate(raw_names):
        target = STEP if name == STEP else resolve(name)
        lst = groups.setdefault(target, [])
        if target == name:
            lst.insert(0, i)
        else:
            lst.append(i)
    if all(len(v) == 1 and raw_names[v[0]] == k for k, v in groups.items()):
        return table
    names, cols = [], []
    for target, idx in groups.items():
        names.append(target)
        if len(idx) == 1:
            cols.append(table.column(idx[0]))
        else:
            cols.append(pc.coalesce(*[table.column(i) for i in idx]))
    fields = [pa.field(n, c.type, nullable=(n != STEP)) for n, c in zip(names, cols, strict=True)]
    return pa.Table.from_arrays(cols, schema=pa.schema(fields, metadata=table.schema.metadata))


# --------------------------------------------------------------------------- helpers


def _is_canonical(schema: pa.Schema) -> bool:
    """``step`` int64 first, then unique float64 columns (metadata not checked)."""
    names = schema.names
    if not names or names[0] != STEP or len(set(names)) != len(names):
        return False
    return schema.types[0] == pa.int64() and all(t == pa.float64() for t in schema.types[1:])
