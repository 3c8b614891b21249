"""Read recorded runs: one Parquet file, a directory of parts, a glob, or a filesystem URI.

:func:`read_run` returns one validated wide table (sorted by step, duplicate steps merged);
:func:`iter_batches` streams record batches row group by row group with bounded memory, all in
the same unified schema (a column that appears only in later parts is null before it appears).

Sources:

* a local ``.parquet`` file, or a directory of ``part-*.parquet`` files (the recorder's output;
  other ``*.parquet`` files are used when there are no parts), read in part order;
* a glob (``runs/*/part-*.parquet``);
* any URI :func:`pyarrow.fs.FileSystem.from_uri` understands (``file://``, ``s3://``, ``gs://``,
  ``hdfs://``, ...), globs included.

Column names go through an alias table (raw name -> canonical name; keys ending in ``/*`` rewrite
a prefix), the monitor's rules. By default the table is
``stability.monitor.binding.DEFAULT_ALIASES`` (the
monitor's: one table for live runs, replay and tuning); ``aliases`` is merged on top
(mapping a name to itself disables a default), ``default_aliases=False`` turns the defaults off.
``columns`` selects by canonical name (``step`` is always included).

Every failure (missing file, truncated or corrupted Parquet, bad schema) raises
:class:`replay.schema.RunFormatError` naming the file.

Examples
--------
>>> import tempfile, os
>>> import pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "r.parquet")
>>> pq.write_table(pa.table({"step": [0, 1], "train/loss": [2.0, 1.5]}), p)
>>> read_run(p).to_pydict()
{'step': [0, 1], 'loss': [2.0, 1.5]}
"""

from __future__ import annotations

import collections
import fnmatch
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from replay._paths import is_uri
from replay.schema import (
    METADATA_KEY,
    STEP,
    RunFormatError,
    alias_resolver,
    apply_aliases,
    is_long_format,
    make_metadata,
    normalize_table,
    run_schema,
)
from stability.monitor.binding import DEFAULT_ALIASES

__all__ = ["default_aliases", "iter_batches", "list_sources", "read_run", "read_schema"]

#: read-buffer bytes per column of a streamed read (:func:`_open` ``stream=True``): small,
#: so that the buffers (one per column read) stay in the allocator's reused pages; a larger
#: data page is read past the buffer
STREAM_BUFFER = 1 << 17

_PART = re.compile(r"part-(\d+)\.parquet$")
_GLOB_CHARS = set("*?[")


def default_aliases() -> dict[str, str]:
    """The default alias table: the monitor's (:data:`stability.monitor.binding.DEFAULT_ALIASES`).

    Examples
    --------
    >>> default_aliases()["train/loss"], default_aliases()["lr-AdamW"]
    ('loss', 'lr')
    """
    return dict(DEFAULT_ALIASES)


@dataclass(frozen=True)
class _Source:
    fs: pafs.FileSystem
    path: str  # path inside fs
    display: str  # what error messages show


def list_sources(path: str | os.PathLike[str]) -> list[str]:
    """The Parquet files ``path`` resolves to, in read order (for display / parallel work).

    Examples
    --------
    >>> list_sources("/nonexistent/run.parquet")
    Traceback (most recent call last):
    ...
    replay.schema.RunFormatError: /nonexistent/run.parquet: no such file or directory
    """
    return [s.display for s in _resolve(path)]


def _resolve(path: str | os.PathLike[str]) -> list[_Source]:
    text = os.fspath(path)
    if is_uri(text):
        try:
            fs, inner = pafs.FileSystem.from_uri(text)
        except (pa.ArrowException, ValueError, OSError) as exc:
            raise RunFormatError(text, f"cannot open URI ({exc})") from None
        prefix = text[: text.index("://") + 3]
        scheme = prefix[:-3].lower()

        def show(p: str) -> str:
            return f"file://{p}" if scheme == "file" else f"{prefix}{p}"

    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(text)

        def show(p: str) -> str:
            return p

    paths = _expand(fs, inner, text)
    return [_Source(fs, p, show(p)) for p in paths]


def _expand(fs: pafs.FileSystem, inner: str, display: str) -> list[str]:
    if any(c in _GLOB_CHARS for c in inner):
        parts = inner.split("/")
        k = next(i for i, p in enumerate(parts) if any(c in _GLOB_CHARS for c in p))
        base = "/".join(parts[:k]) or "/"
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
        except (pa.ArrowException, OSError) as exc:
            raise RunFormatError(display, f"cannot list {base!r} ({exc})") from None
        matches = sorted(
            i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, inner)
        )
        if not matches:
            raise RunFormatError(display, "glob matched no files")
        return _order_parts(matches)
    try:
        info = fs.get_file_info(inner)
    except (pa.ArrowException, OSError) as exc:
        raise RunFormatError(display, f"cannot stat ({exc})") from None
    if info.type == pafs.FileType.NotFound:
        raise RunFormatError(display, "no such file or directory")
    if info.type == pafs.FileType.File:
        return [inner]
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=False))
    files = [i for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")]
    parts = [i.path for i in files if _PART.match(i.base_name)]
    if not parts:
        parts = [i.path for i in files if i.base_name.endswith(".parquet")]
    if not parts:
        raise RunFormatError(display, "directory holds no part-*.parquet or *.parquet files")
    return _order_parts(sorted(parts))


def _order_parts(paths: list[str]) -> list[str]:
    def key(p: str) -> tuple[str, int, str]:
        d, _, base = p.rpartition("/")
        m = _PART.match(base)
        return (d, int(m.group(1)) if m else -1, base)

    return sorted(paths, key=key)


def _open(src: _Source, stream: bool = False) -> pq.ParquetFile:
    """Open a Parquet file; ``stream=True`` turns off pre-buffering, which would otherwise cache
    every column chunk read so far (the whole file by the end of ``iter_batches``)."""
    try:
        f = src.fs.open_input_file(src.path)
    except (pa.ArrowException, OSError) as exc:
        raise RunFormatError(src.display, f"cannot open ({exc})") from None
    try:
        # pages written with checksums (the recorder's) are verified: a flipped byte is an error
        if stream:
            return pq.ParquetFile(
                f, pre_buffer=False, buffer_size=STREAM_BUFFER, page_checksum_verification=True
            )
        return pq.ParquetFile(f, page_checksum_verification=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        f.close()
        raise RunFormatError(
            src.display, f"not a readable Parquet file (truncated or corrupted?): {exc}"
        ) from None


def read_schema(
    path: str | os.PathLike[str],
    aliases: Mapping[str, str] | None = None,
    *,
    default_aliases: bool = True,
) -> pa.Schema:
    """The unified wide schema of a run (footers only, no data read).

    Examples
    --------
    >>> import tempfile, os
    >>> import pyarrow.parquet as pq
    >>> p = os.path.join(tempfile.mkdtemp(), "r.parquet")
    >>> pq.write_table(pa.table({"step": [0], "lr": [0.1]}), p)
    >>> read_schema(p).names
    ['step', 'lr']
    """
    _, schema, _ = _plan(_resolve(path), _alias_table(aliases, default_aliases), None)
    return schema


def _alias_table(aliases: Mapping[str, str] | None, use_default: bool) -> dict[str, str]:
    table = default_aliases() if use_default else {}
    if aliases:
        table.update(aliases)
    return table


def _plan(
    sources: list[_Source], aliases: Mapping[str, str], columns: Sequence[str] | None
) -> tuple[list[tuple[_Source, list[str], bool]], pa.Schema, dict[bytes, bytes]]:
    """Read every file's footer (one file open at a time); return (file, raw columns to read,
    is long format) per file and the unified output schema."""
    plan = []
    skipped: dict[str, list[str]] = {}  # file -> non-numeric columns dropped from it
    resolve = alias_resolver(aliases)
    names: dict[str, None] = {}
    metadata: dict[bytes, bytes] | None = None
    for src in sources:
        pf = _open(src)
        try:
            schema = pf.schema_arrow
            long_names = _long_names(pf, src) if is_long_format(schema) else []
        finally:
            pf.close()
        if STEP not in schema.names:
            raise RunFormatError(src.display, f"no 'step' column (columns: {schema.names[:20]})")
        legacy = _legacy_step_metric(schema)
        if legacy:
            warnings.warn(
                f"{src.display}: dropped a metric named 'step' (written by an older recorder; "
                "the first 'step' column is the step)",
                UserWarning,
                stacklevel=3,
            )
        names_seen = [n for n in schema.names if not (legacy and n == STEP)]
        if len(set(names_seen)) != len(names_seen):
            dup = collections.Counter(names_seen).most_common(1)[0][0]
            raise RunFormatError(src.display, f"duplicate column {dup!r}")
        if metadata is None and schema.metadata and METADATA_KEY in schema.metadata:
            metadata = {METADATA_KEY: schema.metadata[METADATA_KEY]}
        if is_long_format(schema):
            raw = list(schema.names)
            for n in long_names:
                canon = resolve(str(n))
                if columns is None or canon in columns:
                    names.setdefault(canon, None)
        else:
            raw = []
            for n in schema.names:
                if n == STEP:
                    continue
                canon = resolve(n)
                if columns is not None and canon not in columns:
                    continue
                if not _numeric_like(schema.field(n).type):
                    skipped.setdefault(src.display, []).append(n)
                    continue
                raw.append(n)
                names.setdefault(canon, None)
            raw = [STEP, *raw]
        plan.append((src, raw, is_long_format(schema)))
    if skipped:
        msg = "; ".join(f"{f}: dropped non-numeric column(s) {c}" for f, c in skipped.items())
        warnings.warn(msg, UserWarning, stacklevel=3)
    if columns is not None:
        ordered = [c for c in columns if c in names and c != STEP]
    else:
        ordered = list(names)
    md = metadata or make_metadata(run={"source": sources[0].display if sources else None})
    return plan, run_schema(ordered, md), md


def _legacy_step_metric(schema: pa.Schema) -> bool:
    """A recorder part from before ``step`` was a reserved metric name: ``step`` int64 first
    (the step), a second ``step`` column later (the user's metric)."""
    return (
        schema.names.count(STEP) > 1
        and schema.names[0] == STEP
        and pa.types.is_integer(schema.types[0])
        and METADATA_KEY in (schema.metadata or {})
    )


def _first_step_only(table: pa.Table) -> pa.Table:
    """Drop every ``step`` column after the first one of a :func:`_legacy_step_metric` part."""
    names = table.column_names
    if names.count(STEP) < 2 or names[0] != STEP or not pa.types.is_integer(table.schema.types[0]):
        return table
    return table.select([0] + [i for i, n in enumerate(names) if n != STEP])


def _long_names(pf: pq.ParquetFile, src: _Source) -> list[str]:
    try:
        return [str(n) for n in pf.read(columns=["name"]).column("name").unique().to_pylist()]
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise RunFormatError(
            src.display, f"cannot read Parquet data (truncated or corrupted?): {exc}"
        ) from None


def _numeric_like(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_decimal(t)
        or pa.types.is_null(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Reorder/extend ``table`` to ``schema`` (missing columns = null)."""
    n = table.num_rows
    cols = []
    present = set(table.column_names)  # once: column_names builds a new list per call
    for field in schema:
        if field.name in present:
            cols.append(table.column(field.name))
        else:
            cols.append(pa.chunked_array([pa.nulls(n, field.type)]))
    return pa.Table.from_arrays(cols, schema=schema)


def iter_batches(
    path: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    batch_rows: int = 65536,
    aliases: Mapping[str, str] | None = None,
    *,
    default_aliases: bool = True,
) -> Iterator[pa.RecordBatch]:
    """Stream a run as record batches of at most ``batch_rows`` rows, in the unified schema.

    Memory stays bounded by about one row group (files are read without pre-buffering: 30M rows
    x 3 columns in 1M-row groups stream at ~195 MB peak RSS including the interpreter, against
    ~800 MB with pyarrow's default pre-buffering). Rows come in
    file order
    (parts in part order); they are not re-sorted and duplicate steps are not merged across
    batches (use :func:`read_run` for that). Long-format files are pivoted whole.

    Parameters
    ----------
    path : str or PathLike
        File, directory of parts, glob or URI.
    columns : sequence of str, optional
        Canonical names to read (``step`` always included).
    batch_rows : int
        Maximum rows per batch.
    aliases : mapping, optional
        Extra aliases (raw name -> canonical name), on top of the defaults.
    default_aliases : bool
        Use the default alias table.

    Yields
    ------
    pa.RecordBatch

    Examples
    --------
    >>> import tempfile, os
    >>> import pyarrow.parquet as pq
    >>> p = os.path.join(tempfile.mkdtemp(), "r.parquet")
    >>> pq.write_table(pa.table({"step": list(range(10)), "loss": [1.0] * 10}), p)
    >>> [b.num_rows for b in iter_batches(p, batch_rows=4)]
    [4, 4, 2]
    """
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(
            "The 'batch_rows' parameter of iter_batches must be an int in the range [1, inf). "
            f"Got {batch_rows!r} instead."
        )
    amap = _alias_table(aliases, default_aliases)
    plan, schema, _ = _plan(_resolve(path), amap, columns)
    for src, raw, is_long in plan:
        pf = _open(src, stream=True)
        try:
            if is_long:
                whole = normalize_table(pf.read(), src.display, sort=True)
                whole = _select(apply_aliases(whole, amap), columns)
                batches: Iterator[pa.RecordBatch] = iter(
                    _conform(whole, schema).to_batches(max_chunksize=batch_rows)
                )
            else:
                batches = pf.iter_batches(batch_size=batch_rows, columns=raw)
            for batch in batches:
                t = _first_step_only(pa.Table.from_batches([batch]))
                t = normalize_table(t, src.display, sort=False)
                t = _conform(apply_aliases(t, amap), schema)
                yield from t.combine_chunks().to_batches(max_chunksize=batch_rows)
        except RunFormatError:
            raise
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise RunFormatError(
                src.display, f"cannot read Parquet data (truncated or corrupted?): {exc}"
            ) from None
        finally:
            pf.close()


def _select(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    if columns is None:
        return table
    present = set(table.column_names)
    keep = [STEP] + [c for c in columns if c in present and c != STEP]
    return table.select(keep)


#: a Parquet file of more rows than this is read in batches of this many rows, duplicate steps
#: merged as it goes: memory follows the run's distinct steps, not its row count (a small file
#: of millions of repeated rows -- a decompression bomb -- cannot take the reader's memory)
MERGE_ROWS = 1 << 20


def _read_merged(pf: pq.ParquetFile, raw: list[str] | None, display: str) -> pa.Table:
    """One file's rows as a normalized table (duplicate steps merged, last wins, for files
    over :data:`MERGE_ROWS` rows; smaller files are read whole, as they are)."""
    if pf.metadata.num_rows <= MERGE_ROWS:
        return normalize_table(_first_step_only(pf.read(columns=raw)), display, sort=False)
    held: list[pa.Table] = []
    rows = 0
    for batch in pf.iter_batches(batch_size=MERGE_ROWS, columns=raw):
        t = normalize_table(_first_step_only(pa.Table.from_batches([batch])), display)
        held.append(t)
        rows += t.num_rows
        if rows > 2 * MERGE_ROWS:  # merge what is held: duplicates across batches collapse
            held = [_merge_tables(held, display)]
            rows = held[0].num_rows
    return _merge_tables(held, display)


def _merge_tables(tables: list[pa.Table], display: str) -> pa.Table:
    """Tables of one file in read order -> one table sorted by step, duplicates merged."""
    if len(tables) == 1:
        return tables[0]
    md = tables[0].schema.metadata
    t = pa.concat_tables([x.replace_schema_metadata(None) for x in tables],
                         promote_options="default")
    return normalize_table(t.replace_schema_metadata(md), display)


def read_run(
    path: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    aliases: Mapping[str, str] | None = None,
    *,
    default_aliases: bool = True,
) -> pa.Table:
    """Read a whole run as one wide table sorted by step (duplicate steps merged, last wins).

    Parameters
    ----------
    path : str or PathLike
        File, directory of parts, glob or URI (see the module docstring).
    columns : sequence of str, optional
        Canonical column names to read (``step`` is always included); unknown names are ignored.
    aliases : mapping, optional
        Extra aliases (raw name -> canonical name), on top of the defaults.
    default_aliases : bool
        Use the default alias table.

    Returns
    -------
    pa.Table
        ``step`` int64 + float64 metrics, ``b"stability"`` metadata from the first file that has
        it (or a fresh one naming the source).

    Raises
    ------
    RunFormatError
        Missing, truncated or corrupted files, bad schema; the message names the file.

    Examples
    --------
    >>> import tempfile, os
    >>> import pyarrow.parquet as pq
    >>> d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"step": [1], "loss": [1.0]}), f"{d}/part-000001.parquet")
    >>> pq.write_table(pa.table({"step": [0], "lr": [0.1]}), f"{d}/part-000000.parquet")
    >>> read_run(d).to_pydict()
    {'step': [0, 1], 'lr': [0.1, None], 'loss': [None, 1.0]}
    """
    sources = _resolve(path)
    amap = _alias_table(aliases, default_aliases)
    plan, _, md = _plan(sources, amap, columns)
    tables = []
    for src, raw, _ in plan:
        pf = _open(src)
        try:
            t = _read_merged(pf, raw, src.display)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise RunFormatError(
                src.display, f"cannot read Parquet data (truncated or corrupted?): {exc}"
            ) from None
        finally:
            pf.close()
        tables.append(_select(apply_aliases(t, amap), columns))
    if len(tables) == 1:
        merged = tables[0]
    else:
        merged = pa.concat_tables(
            [t.replace_schema_metadata(None) for t in tables], promote_options="default"
        )
    merged = merged.replace_schema_metadata(md)
    return normalize_table(merged, sources[0].display if len(sources) == 1 else os.fspath(path))
