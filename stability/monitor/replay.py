"""Batch replay of a recorded run through the monitor: table decoding (the replay methods are
:class:`stability.monitor.monitor.Monitor`'s own, its "replay" section).

The table is decoded column by column straight from its buffers (Arrow tables are read by duck
typing: float64 data as zero-copy views, validity bitmaps unpacked into present masks; the
runtime never imports pyarrow), then processed in chunks of rows: each bank gets its
``(rows, n_inputs, n_series)`` input in one copy per value and runs its batch kernel once per
chunk.  The per-step tail (alarms, policy, goodput, decision, event log) is
:meth:`Monitor._finish_step`, the same method :meth:`~stability.monitor.monitor.Monitor.observe`
ends
with, so a replay gives the decisions of a step-by-step ``observe()`` loop bit for bit.  Steps
on which nothing happens -- no alarm, no policy in force, no LR/loss to follow -- skip that tail:
they are counted in bulk (goodput ledger, counters, gradient history) and their decisions are
built only when read (:class:`Decisions`).  The chunk loop and the tail are
:class:`stability.monitor.monitor.Replay`'s; a stream of tables (:meth:`Monitor.replay_stream`)
keeps its chunk blocks from table to table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stability.monitor.decisions import Decisions
from stability.monitor.io import ARROW_NUMERIC, table_columns

__all__ = ["CHUNK_VALUES", "Column", "Decisions", "decode_table", "merge_columns"]

#: values per replay chunk (rows per chunk = this / bound signals, at least 1024): the banks'
#: inputs and outputs of one chunk stay in cache and memory stays bounded on long runs
CHUNK_VALUES = 1 << 20

#: a decoded column: float64 values (a read-only view where possible; undefined where not
#: present) and the present mask (``None``: present on every row)
Column = tuple[np.ndarray, "np.ndarray | None"]


# ---------------------------------------------------------------------------- decoding
def _arrow_array(arr: Any) -> Column:
    """Values and present mask of one Arrow array (duck-typed; float64 data zero-copy)."""
    n = len(arr)
    if n == 0:
        return np.zeros(0), None
    if str(arr.type) != "double":
        arr = arr.cast("float64")
    bufs = arr.buffers()
    off = int(arr.offset)
    vals = np.frombuffer(bufs[1], dtype=np.float64, count=off + n)[off:]
    if not arr.null_count:
        return vals, None
    bits = np.unpackbits(np.frombuffer(bufs[0], dtype=np.uint8), count=off + n,
                         bitorder="little")[off:]
    return vals, bits.view(np.bool_)


def _arrow_column(col: Any) -> Column:
    chunks = getattr(col, "chunks", None)
    if chunks is not None:  # a ChunkedArray (Table column)
        col = chunks[0] if len(chunks) == 1 else col.combine_chunks()
    return _arrow_array(col)


def decode_table(data: Any) -> tuple[np.ndarray, list[tuple[str, Column]]]:
    """``(steps, [(name, (values, present)), ...])`` of a table (see
    :func:`stability.monitor.io.table_columns` for what is accepted and what counts as missing).
    """
    if not (type(data).__module__.startswith("pyarrow") and hasattr(data, "column_names")):
        steps, cols = table_columns(data)
        return steps, [(n, (v, None if p.all() else p)) for n, v, p in cols]
    names = list(data.column_names)
    if "step" not in names:
        raise ValueError("replay: the table has no 'step' column.")
    scol = data.column(names.index("step"))
    if scol.null_count:
        raise ValueError("replay: the 'step' column contains nulls.")
    one = scol.chunk(0) if getattr(scol, "num_chunks", 0) == 1 else scol
    if str(scol.type) == "int64" and not hasattr(one, "num_chunks"):
        steps = one.to_numpy()  # a view: int64 steps need no check or conversion
    else:  # the step checks and conversions of table_columns, on the step column alone
        steps, _ = table_columns({"step": np.asarray(scol.to_numpy(zero_copy_only=False))})
    out = []
    for k, name in enumerate(names):
        if name == "step":
            continue
        col = data.column(k)
        if str(col.type) in ARROW_NUMERIC:
            out.append((str(name), _arrow_column(col)))
    return steps, out


def merge_columns(a: Column, b: Column) -> Column:
    """Two columns bound to one slot: ``b`` wins where present (as a later metric would)."""
    va, pa_ = a
    vb, pb = b
    if pb is None:
        return vb, None
    vals = np.where(pb, vb, va)
    return vals, (None if pa_ is None else pa_ | pb)


