"""CSV / TSV / JSONL / JSON exports (W&B, MLflow, custom loggers) -> recorded-run table.

Step column: ``step_column`` if given, else the first present of :data:`STEP_CANDIDATES`
(``step``, ``global_step``, ``trainer/global_step``, ``train/global_step``, ``Step``, ``_step``,
``iteration``, ``iter``); other candidates stay as metric columns.

Values: an empty CSV cell / JSON ``null`` / missing key is null (not logged); ``nan``, ``NaN``,
``inf``, ``-Infinity`` (as text or as Python-JSON tokens) are NaN / ±inf. A column holding numbers
and some non-numeric text is an error naming the file, column and row; a column with no numbers
at all (run names, tags, W&B media objects) is dropped with a warning.

W&B UI exports are recognised: ``<run> - <metric>`` headers lose their common ``<run> - `` prefix
and the ``__MIN`` / ``__MAX`` envelope columns are dropped. Nested JSON objects are flattened with
``/`` (``{"train": {"loss": 1}}`` -> ``train/loss``), except W&B media objects (with ``_type``).

Examples
--------
>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "run.csv")
>>> _ = open(p, "w").write("_step,train/loss,lr\\n0,2.5,0.1\\n1,nan,\\n")
>>> read_csv(p).to_pydict()
{'step': [0, 1], 'train/loss': [2.5, nan], 'lr': [0.1, None]}
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from replay.importers import read_bytes
from replay.schema import STEP, RunFormatError, make_metadata, normalize_table

__all__ = ["STEP_CANDIDATES", "read_csv", "read_json", "read_jsonl"]

#: step column names tried in order
STEP_CANDIDATES = (
    "step",
    "global_step",
    "trainer/global_step",
    "train/global_step",
    "Step",
    "_step",
    "iteration",
    "iter",
)


def _pick_step(names: Sequence[str], step_column: str | None, source: str) -> str:
    if step_column is not None:
        if step_column not in names:
            raise RunFormatError(source, f"step column {step_column!r} not found")
        return step_column
    for cand in STEP_CANDIDATES:
        if cand in names:
            return cand
    raise RunFormatError(
        source, f"no step column (looked for {list(STEP_CANDIDATES)}; columns: {list(names)[:20]})"
    )


def _finish(table: pa.Table, step_column: str | None, source: str, fmt: str) -> pa.Table:
    names = table.column_names
    step = _pick_step(names, step_column, source)
    # W&B UI export: "<run> - metric", "<run> - metric__MIN", "<run> - metric__MAX"
    keep = [n for n in names if n == step or not n.endswith(("__MIN", "__MAX"))]
    table = table.select(keep)
    metric_names = [n for n in table.column_names if n != step]
    prefixes = {n.split(" - ", 1)[0] for n in metric_names if " - " in n}
    rename: dict[str, str] = {}
    if len(prefixes) == 1 and all(" - " in n for n in metric_names):
        rename = {n: n.split(" - ", 1)[1] for n in metric_names}
    if step != STEP:
        if STEP in table.column_names:
            rename[STEP] = "step_column_" + STEP
        rename[step] = STEP
    if rename:
        table = table.rename_columns([rename.get(n, n) for n in table.column_names])
    md = make_metadata(run={"source": source, "format": fmt})
    table = table.replace_schema_metadata(md)
    out = normalize_table(table, source)
    if out.num_columns == 1:
        raise RunFormatError(source, "no numeric metric columns")
    return out


def read_csv(
    path: str | os.PathLike[str], step_column: str | None = None, delimiter: str | None = None
) -> pa.Table:
    """Read a CSV (or TSV: ``.tsv`` or ``delimiter="\\t"``) export.

    Raises
    ------
    RunFormatError
        Unparsable CSV, no step column, text in a numeric column.
    """
    source = os.fspath(path)
    data = read_bytes(source)
    if delimiter is None:
        delimiter = "\t" if source.lower().endswith(".tsv") else ","
    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            parse_options=pacsv.ParseOptions(delimiter=delimiter),
            convert_options=pacsv.ConvertOptions(null_values=[""], strings_can_be_null=True),
        )
    except (pa.ArrowInvalid, pa.ArrowException) as exc:
        raise RunFormatError(source, f"cannot parse CSV ({exc})") from None
    return _finish(table, step_column, source, "csv")


def _flatten(obj: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "_type" not in value:
            _flatten(value, name + "/", out)
        else:
            out[name] = value


def _records_to_table(rows: list[dict[str, Any]], source: str, where: list[str]) -> pa.Table:
    """Columns from flattened rows; numbers as float64, NaN-strings parsed, text -> error/drop."""
    names: dict[str, None] = {}
    for row in rows:
        for k in row:
            names.setdefault(k, None)
    columns: dict[str, list[Any]] = {}
    dropped = []
    for name in names:
        values: list[Any] = []
        n_num = 0
        bad: tuple[int, Any] | None = None
        for i, row in enumerate(rows):
            v = row.get(name)
            if v is None:
                values.append(None)
            elif isinstance(v, bool):
                values.append(float(v))
                n_num += 1
            elif isinstance(v, (int, float)):
                values.append(v if name == STEP or isinstance(v, int) else float(v))
                n_num += 1
            elif isinstance(v, str):
                try:
                    values.append(float(v))
                    n_num += 1
                except ValueError:
                    values.append(None)
                    bad = bad or (i, v)
            else:
                values.append(None)
                bad = bad or (i, v)
        if bad is not None and n_num:
            if isinstance(bad[1], str):
                raise RunFormatError(
                    source, f"{where[bad[0]]}: column {name!r} holds non-numeric value {bad[1]!r}"
                )
            # numbers mixed with objects (e.g. media): keep the numbers
        if n_num == 0:
            dropped.append(name)
            continue
        columns[name] = values
    if dropped:
        warnings.warn(
            f"{source}: dropped non-numeric column(s) {dropped}", UserWarning, stacklevel=3
        )
    arrays = {}
    for name, values in columns.items():
        ints = all(v is None or isinstance(v, int) for v in values)
        if ints and all(v is None or abs(v) < 2**63 for v in values):
            arrays[name] = pa.array(values, type=pa.int64())
        else:
            arrays[name] = pa.array(
                [None if v is None else float(v) for v in values], type=pa.float64()
            )
    return pa.table(arrays)


def _loads(text: str, source: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RunFormatError(source, f"{where}: invalid JSON ({exc})") from None


def read_jsonl(path: str | os.PathLike[str], step_column: str | None = None) -> pa.Table:
    """Read a JSON-lines export: one JSON object per line (blank lines ignored).

    Raises
    ------
    RunFormatError
        A line that is not valid JSON or not an object (the message gives the line number), no
        step column, text in a numeric column.
    """
    source = os.fspath(path)
    text = read_bytes(source).decode("utf-8", errors="replace")
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        obj = _loads(line, source, f"line {lineno}")
        if not isinstance(obj, dict):
            raise RunFormatError(source, f"line {lineno}: expected a JSON object")
        flat: dict[str, Any] = {}
        _flatten(obj, "", flat)
        rows.append(flat)
        where.append(f"line {lineno}")
    if not rows:
        raise RunFormatError(source, "empty file")
    return _finish(_records_to_table(rows, source, where), step_column, source, "jsonl")


def read_json(path: str | os.PathLike[str], step_column: str | None = None) -> pa.Table:
    """Read a JSON file holding a list of row objects or an object of column lists.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "run.json")
    >>> _ = open(p, "w").write('{"step": [0, 1], "loss": [1.0, NaN]}')
    >>> read_json(p).to_pydict()
    {'step': [0, 1], 'loss': [1.0, nan]}
    """
    source = os.fspath(path)
    doc = _loads(read_bytes(source).decode("utf-8", errors="replace"), source, "file")
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        lengths = {len(v) for v in doc.values()}
        if len(lengths) != 1:
            raise RunFormatError(source, "column lists have different lengths")
        n = lengths.pop()
        doc = [{k: v[i] for k, v in doc.items()} for i in range(n)]
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise RunFormatError(source, "expected a list of objects or an object of column lists")
    if not doc:
        raise RunFormatError(source, "no rows")
    rows = []
    for r in doc:
        flat: dict[str, Any] = {}
        _flatten(r, "", flat)
        rows.append(flat)
    where = [f"row {i}" for i in range(len(rows))]
    return _finish(_records_to_table(rows, source, where), step_column, source, "json")
