"""Bounded-memory building blocks of the text importers: line streaming and chunked columns.

* :func:`open_binary` opens a local file or a URI as a binary stream (errors name the file).
* :func:`iter_lines` yields ``(line number, bytes)`` reading fixed-size blocks, so memory never
  depends on the file size: a line longer than ``max_line`` bytes is not kept (it comes back as
  ``None``, or as ``b""`` when it holds only whitespace / NUL bytes -- the zero-filled tail some
  file systems leave after a crash).
* :class:`RowChunks` turns a stream of row dicts into Arrow columns ``chunk_rows`` rows at a time,
  so only one chunk of Python objects is alive at once.

Examples
--------
>>> import io
>>> list(iter_lines(io.BytesIO(b"a\\n\\nbb\\nccc"), max_line=2))
[(1, b'a'), (2, b''), (3, b'bb'), (4, None)]
>>> rc = RowChunks(chunk_rows=2)
>>> for step, loss in [(0, 1.0), (1, None), (2, 3.0)]:
...     rc.add({"step": step, "loss": loss})
>>> rc.table().to_pydict()
{'step': [0, 1, 2], 'loss': [1.0, None, 3.0]}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import IO, Any

import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.schema import STEP, RunFormatError

__all__ = ["BLOCK_BYTES", "MAX_LINE_BYTES", "RowChunks", "iter_lines", "open_binary"]

#: bytes read per block
BLOCK_BYTES = 1 << 20
#: longest line kept (longer lines are skipped or rejected by the importer)
MAX_LINE_BYTES = 16 << 20
#: bytes that make a line blank
BLANK = b" \t\r\n\x00\x0b\x0c"


def open_binary(path: str) -> IO[bytes]:
    """A binary input stream on a local file or URI; errors are :class:`RunFormatError`."""
    try:
        if is_uri(path):
            fs, inner = pafs.FileSystem.from_uri(path)
            return fs.open_input_stream(inner)
        if os.path.isdir(path):
            raise RunFormatError(path, "cannot read (is a directory)")
        return open(path, "rb")  # the caller closes it
    except FileNotFoundError:
        raise RunFormatError(path, "cannot read (No such file or directory)") from None
    except (OSError, pa.ArrowException, ValueError) as exc:
        if isinstance(exc, RunFormatError):
            raise
        raise RunFormatError(path, f"cannot read ({exc})") from None


def iter_lines(
    stream: IO[bytes], max_line: int = MAX_LINE_BYTES, block: int = BLOCK_BYTES
) -> Iterator[tuple[int, bytes | None]]:
    """Yield ``(line number, line without its newline)`` from a binary stream.

    A line longer than ``max_line`` bytes yields ``None`` (or ``b""`` if it is blank); at most
    ``max_line + block`` bytes are held at any time.
    """
    lineno = 0
    pending: list[bytes] = []  # the start of the current line
    pending_len = 0
    over = False  # the current line is already longer than max_line
    over_blank = True
    while True:
        data = stream.read(block)
        if not data:
            break
        pieces = data.split(b"\n")
        for piece in pieces[:-1]:
            lineno += 1
            if over:
                blank = over_blank and not piece.strip(BLANK)
                over, over_blank = False, True
                yield lineno, (b"" if blank else None)
                continue
            if pending:
                pending.append(piece)
                line = b"".join(pending)
                pending, pending_len = [], 0
            else:
                line = piece
            if len(line) > max_line:
                yield lineno, (b"" if not line.strip(BLANK) else None)
            else:
                yield lineno, line
        rest = pieces[-1]
        if over:
            over_blank = over_blank and not rest.strip(BLANK)
        elif rest:
            pending.append(rest)
            pending_len += len(rest)
            if pending_len > max_line:
                over = True
                over_blank = not any(p.strip(BLANK) for p in pending)
                pending, pending_len = [], 0
    if over:
        yield lineno + 1, (b"" if over_blank else None)
    elif pending:
        line = b"".join(pending)
        yield lineno + 1, line


Converter = Callable[[str, list[Any], list[Any]], "pa.Array | None"]


def _float_column(name: str, values: list[Any], tags: list[Any]) -> pa.Array:
    return pa.array(values, type=pa.int64() if name == STEP else pa.float64())


class RowChunks:
    """Accumulate row dicts; every ``chunk_rows`` rows become one Arrow table chunk.

    Parameters
    ----------
    chunk_rows : int
        Rows of Python objects held before conversion.
    convert : callable, optional
        ``convert(name, values, tags) -> pa.Array | None`` for one column of one chunk (``None``
        values = missing; ``tags`` are the rows' tags given to :meth:`add`, e.g. line numbers);
        ``None`` from it leaves the column out of that chunk. Default: ``step`` as int64,
        everything else float64.
    """

    def __init__(self, chunk_rows: int = 65536, convert: Converter | None = None) -> None:
        self.chunk_rows = chunk_rows
        self.convert = convert or _float_column
        self.names: dict[str, None] = {}  # first-appearance order
        self.n_rows = 0
        self._rows: list[dict[str, Any]] = []
        self._tags: list[Any] = []
        self._chunks: list[pa.Table] = []

    def add(self, row: dict[str, Any], tag: Any = None) -> None:
        """Add one row (missing keys are null); ``tag`` is passed to the converter."""
        for k in row:
            if k not in self.names:
                self.names[k] = None
        self._rows.append(row)
        self._tags.append(tag)
        self.n_rows += 1
        if len(self._rows) >= self.chunk_rows:
            self.flush()

    def add_table(self, table: pa.Table) -> None:
        """Add an already converted chunk (its columns join :attr:`names`)."""
        self.flush()
        for k in table.column_names:
            if k not in self.names and k != "__rows__":
                self.names[k] = None
        self.n_rows += table.num_rows
        self._chunks.append(table)

    def flush(self) -> None:
        """Convert the buffered rows to one Arrow chunk."""
        rows, self._rows = self._rows, []
        tags, self._tags = self._tags, []
        if not rows:
            return
        present: dict[str, None] = {}
        for r in rows:
            for k in r:
                if k not in present:
                    present[k] = None
        arrays, names = [], []
        for name in present:
            arr = self.convert(name, [r.get(name) for r in rows], tags)
            if arr is not None:
                arrays.append(arr)
                names.append(name)
        self._chunks.append(pa.Table.from_arrays(arrays, names=names)
                            if arrays else pa.table({"__rows__": pa.nulls(len(rows))}))

    def table(self) -> pa.Table:
        """All rows so far as one table, columns in first-appearance order."""
        self.flush()
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return pa.table({})
        n = sum(c.num_rows for c in chunks)
        types: dict[str, pa.DataType] = {}
        for c in chunks:
            for f in c.schema:
                if f.name == "__rows__":
                    continue
                old = types.get(f.name)
                if old is None or old == f.type:
                    types[f.name] = f.type
                else:  # int64 in one chunk, float64 in another
                    types[f.name] = pa.float64()
        columns = []
        order = [k for k in self.names if k in types]
        for name in order:
            typ = types[name]
            parts = []
            for c in chunks:
                idx = c.schema.get_field_index(name)
                if idx < 0:
                    parts.append(pa.nulls(c.num_rows, typ))
                else:
                    col = c.column(idx)
                    parts.extend(col.cast(typ, safe=False).chunks if col.type != typ
                                 else col.chunks)
            columns.append(pa.chunked_array(parts, type=typ))
        del chunks
        if not columns:
            return pa.table({"__rows__": pa.nulls(n)}).drop_columns(["__rows__"])
        return pa.Table.from_arrays(columns, names=order)
