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

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from replay.importers._files import read_bytes
from replay.importers._stream import (
    BLANK,
    BLOCK_BYTES,
    MAX_LINE_BYTES,
    RowChunks,
    iter_lines,
    open_binary,
)
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


class _Columns:
    """Per-column conversion of JSON / CSV values, chunk by chunk, with file-wide bookkeeping.

    A column holding numbers and some non-numeric *text* is an error naming the file, the
    place (line or row) and the column; a column holding no number at all is dropped with one
    warning; objects (W&B media) beside numbers are ignored.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.n_num: dict[str, int] = {}
        self.bad_text: dict[str, tuple[Any, str]] = {}

    def _check(self, name: str) -> None:
        if self.n_num.get(name) and name in self.bad_text:
            where, value = self.bad_text[name]
            text = value if len(value) <= 40 else value[:37] + "..."
            what = f"column {name!r} holds non-numeric value {text!r}"
            if str(where).startswith("row "):  # CSV / JSON rows: "... at row 3"
                raise RunFormatError(self.source, f"{what} at {where}")
            raise RunFormatError(self.source, f"{where}: {what}")

    def convert(self, name: str, values: list[Any], tags: list[Any]) -> pa.Array | None:
        """One chunk of one column -> int64 (all integers) or float64 array; None = no numbers."""
        out: list[Any] = []
        ints = True
        n_num = 0
        for v, tag in zip(values, tags, strict=True):
            if v is None:
                out.append(None)
                continue
            if isinstance(v, bool):
                out.append(float(v))
                ints = False
            elif isinstance(v, int):
                if -(2**63) <= v < 2**63:
                    out.append(v)
                else:
                    try:
                        out.append(float(v))
                    except OverflowError:
                        raise RunFormatError(
                            self.source, f"{tag}: column {name!r} holds an integer beyond the "
                            f"float range ({str(v)[:20]}..., {len(str(v))} digits)"
                        ) from None
                    ints = False
            elif isinstance(v, float):
                out.append(v)
                ints = False
            elif isinstance(v, str):
                f = _parse_number(v)
                if f is None:
                    out.append(None)
                    if name not in self.bad_text and v.strip():
                        self.bad_text[name] = (tag, v)
                    continue
                out.append(f)
                ints = False
            else:  # an object (W&B media, list): not a number
                out.append(None)
                continue
            n_num += 1
        if n_num:
            self.n_num[name] = self.n_num.get(name, 0) + n_num
        self._check(name)
        if not n_num:
            return None
        if ints:
            return pa.array(out, type=pa.int64())
        return pa.array([None if x is None else float(x) for x in out], type=pa.float64())

    def arrow(self, name: str, arr: pa.Array, first_row: int) -> pa.Array | None:
        """One CSV column chunk (strings) -> int64 / float64; text rows reported by row."""
        if pa.types.is_null(arr.type) or arr.null_count == len(arr):
            return None
        for typ in (pa.int64(), pa.float64()):
            try:
                out = pc.cast(arr, typ)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            self.n_num[name] = self.n_num.get(name, 0) + len(out) - out.null_count
            self._check(name)
            return out
        tags = [f"row {first_row + i}" for i in range(len(arr))]
        return self.convert(name, arr.to_pylist(), tags)

    def warn_dropped(self, names: Sequence[str]) -> None:
        dropped = [n for n in names if not self.n_num.get(n)]
        if dropped:
            warnings.warn(
                f"{self.source}: dropped non-numeric column(s) {dropped}", UserWarning,
                stacklevel=4,
            )


def _parse_number(v: str) -> float | None:
    text = v.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        low = text.lower()
        if low in ("true", "false"):
            return 1.0 if low == "true" else 0.0
        return None


def _header(source: str, stream: Any, parse: pacsv.ParseOptions, block: int) -> list[str]:
    """Column names of a CSV (one block is parsed); duplicates are an error."""
    reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=block),
                            parse_options=parse)
    try:
        names = list(reader.schema.names)
    finally:
        reader.close()
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise RunFormatError(source, f"duplicate column {n!r} in the CSV header")
        seen.add(n)
    return names


def read_csv(
    path: str | os.PathLike[str], step_column: str | None = None, delimiter: str | None = None
) -> pa.Table:
    """Read a CSV (or TSV: ``.tsv`` or ``delimiter="\\t"``) export.

    The file is streamed in blocks of 1 MiB (or 256 header lengths for wide files, at most 64 MiB)
    through pyarrow's streaming CSV reader, every column read as text and converted block by
    block, so memory grows with the numbers kept, not with the file size.

    Raises
    ------
    RunFormatError
        Unparsable or non-UTF-8 CSV, duplicate header names, no step column, text in a numeric
        column.
    """
    source = os.fspath(path)
    if delimiter is None:
        delimiter = "\t" if source.lower().endswith(".tsv") else ","
    parse = pacsv.ParseOptions(delimiter=delimiter)
    cols = _Columns(source)
    chunks = RowChunks()
    try:
        with open_binary(source) as fh:
            # blocks of >= 256 rows (a wide table in 1 MiB blocks would cost columns x blocks,
            # i.e. quadratic in the column count), at most 64 MiB
            width = len(fh.readline(MAX_LINE_BYTES))
        block = min(max(BLOCK_BYTES, 256 * width), 64 << 20)
        with open_binary(source) as fh:
            names = _header(source, fh, parse, block)
        with open_binary(source) as fh:
            reader = pacsv.open_csv(
                fh,
                read_options=pacsv.ReadOptions(block_size=block),
                parse_options=parse,
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names},
                    null_values=[""],
                    strings_can_be_null=True,
                ),
            )
            row = 0
            for batch in reader:
                arrays, kept = [], []
                for name, arr in zip(names, batch.columns, strict=True):
                    conv = cols.arrow(name, arr, row)
                    if conv is not None:
                        arrays.append(conv)
                        kept.append(name)
                row += batch.num_rows
                chunks.add_table(pa.Table.from_arrays(arrays, names=kept) if arrays
                                 else pa.table({"__rows__": pa.nulls(batch.num_rows)}))
    except (pa.ArrowInvalid, pa.ArrowException) as exc:
        raise RunFormatError(source, f"cannot parse CSV ({exc})") from None
    except UnicodeDecodeError as exc:
        raise RunFormatError(source, f"not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise RunFormatError(source, f"cannot read ({exc})") from None
    chunks.names = dict.fromkeys(names)  # header order
    cols.warn_dropped(names)
    return _finish(chunks.table(), step_column, source, "csv")


def _flatten(obj: Mapping[str, Any], prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise RecursionError("nested too deeply")
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "_type" not in value:
            _flatten(value, name + "/", out, depth + 1)
        else:
            out[name] = value


#: deepest nesting of objects flattened into column names
_MAX_DEPTH = 64


def _loads(text: str | bytes, source: str, where: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise RunFormatError(source, f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise RunFormatError(source, f"{where}: invalid JSON ({exc})") from None


def _flat_row(obj: Mapping[str, Any], source: str, where: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    try:
        _flatten(obj, "", flat)
    except RecursionError:
        raise RunFormatError(
            source, f"{where}: objects nested more than {_MAX_DEPTH} levels deep"
        ) from None
    return flat


def read_jsonl(path: str | os.PathLike[str], step_column: str | None = None) -> pa.Table:
    """Read a JSON-lines export: one JSON object per line (blank lines ignored).

    The file is streamed line by line and converted to Arrow columns 65,536 rows at a time, so
    memory grows with the rows kept, not with the file size. Lines holding only whitespace or NUL
    bytes (the zero-filled tail some file systems leave after a crash) count as blank.

    Raises
    ------
    RunFormatError
        A line that is not valid JSON, not an object, nested too deeply or longer than 16 MiB
        (the message gives the line number), no step column, text in a numeric column.
    """
    source = os.fspath(path)
    cols = _Columns(source)
    chunks = RowChunks(convert=cols.convert)
    with open_binary(source) as fh:
        try:
            for lineno, line in iter_lines(fh):
                where = f"line {lineno}"
                if line is None:
                    raise RunFormatError(
                        source, f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB (not JSON lines?)"
                    )
                if not line.strip(BLANK):
                    continue
                obj = _loads(line.decode("utf-8", errors="replace"), source, where)
                if not isinstance(obj, dict):
                    raise RunFormatError(source, f"{where}: expected a JSON object")
                chunks.add(_flat_row(obj, source, where), where)
        except OSError as exc:
            raise RunFormatError(source, f"cannot read ({exc})") from None
    if not chunks.n_rows:
        raise RunFormatError(source, "empty file")
    table = chunks.table()
    cols.warn_dropped(list(chunks.names))
    return _finish(table, step_column, source, "jsonl")


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
    cols = _Columns(source)
    chunks = RowChunks(convert=cols.convert)
    for i, r in enumerate(doc):
        chunks.add(_flat_row(r, source, f"row {i}"), f"row {i}")
    del doc
    table = chunks.table()
    cols.warn_dropped(list(chunks.names))
    return _finish(table, step_column, source, "json")
