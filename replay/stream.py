"""A Parquet run read as a stream of record batches: :func:`replay.replay.replay_run`'s path when
the run is already in replay order (:func:`replay.replay.plan_replay` /
:func:`replay.replay.replay_stream` feed it to the monitor).

A run whose columns are already in the recorded-run schema (``step`` int64, float64 metrics)
and whose steps are strictly increasing (file after file) reads, under :func:`read_run`, to the
table of its files' rows as they are: no sort, no merge, no conversion.  Such a run is read in
record batches of about :data:`STREAM_VALUES` values (:func:`batch_rows`) and fed to one
monitor batch after batch (:meth:`stability.monitor.monitor.Monitor.replay_stream`), which gives the
decisions of the whole-table replay bit for bit.  Memory stays bounded (a batch, the steps and
the events, not the run), and the batches' buffers are reused from batch to batch instead of
being faulted in afresh.

:func:`plan_stream` decides from the footers; the steps are checked as the batches are read,
and a run found out of order (:class:`OutOfOrder`, before the batch is replayed) is replayed
anew from the whole table, as is any run :func:`plan_stream` declines (other column types, long
format, an old recorder's ``step`` metric, ...).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay.reader import _alias_table, _open, _plan, _resolve, _Source
from replay.schema import STEP, RunFormatError, alias_resolver, read_metadata

__all__ = ["ENABLED", "STREAM_VALUES", "OutOfOrder", "RunStream", "batch_rows", "plan_stream"]

#: values (rows x columns read) per streamed batch, ~32 MiB of float64: a batch is read, replayed
#: and freed while the next one reuses its pages (much larger batches are mapped afresh and
#: faulted in: a 1M-row x 44-column batch replays ~40 % slower than 100K-row ones)
STREAM_VALUES = 1 << 22

#: rows per streamed batch; ``None``: :func:`batch_rows` (tests set it)
STREAM_ROWS: int | None = None

#: stream the runs that can be (``False``: :func:`replay.replay.replay_run` reads every run whole)
ENABLED = True


def batch_rows(n_columns: int) -> int:
    """Rows per streamed batch of ``n_columns`` columns: about :data:`STREAM_VALUES` values,
    at most 1M rows, rounded to a whole number of the replay's chunks
    (:data:`stability.monitor.replay.CHUNK_VALUES`) when that is more than one chunk."""
    from stability.monitor import replay as monitor_replay

    if STREAM_ROWS is not None:
        return STREAM_ROWS
    n = max(1, n_columns)
    rows = min(1 << 20, max(1, STREAM_VALUES // n))
    chunk = max(1024, monitor_replay.CHUNK_VALUES // max(1, n - 1))
    return max(1, round(rows / chunk)) * chunk if rows > chunk else rows


class OutOfOrder(Exception):
    """A streamed run's steps are not strictly increasing (or a step is null): read it whole."""


@dataclass
class RunStream:
    """A run to stream: per file, what to read and the names it gets."""

    files: list[tuple[_Source, list[str], list[str]]]  # (file, raw columns, canonical names)
    schema: pa.Schema  # the run's unified schema (``step`` first)
    n_rows: int
    batch_rows: int

    def __post_init__(self) -> None:
        #: every step of the run, in order (int64), filled as :meth:`batches` reads them
        self.steps = np.empty(self.n_rows, dtype=np.int64)

    @property
    def names(self) -> list[str]:
        return list(self.schema.names)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The run's rows in batches of at most :attr:`batch_rows` rows, in the unified schema
        (columns a file lacks are null).

        Raises :class:`OutOfOrder` before the first batch whose steps are not strictly
        increasing (from the run's first row) or hold a null.
        """
        types = dict(zip(self.schema.names, self.schema.types, strict=True))
        at, last = 0, None
        for src, raw, canon in self.files:
            pf = _open(src, stream=True)
            rename = dict(zip(raw, canon, strict=True))
            try:
                it = pf.iter_batches(batch_size=self.batch_rows, columns=raw)
                while (batch := next(it, None)) is not None:
                    n = batch.num_rows
                    index = {rename[c]: k for k, c in enumerate(batch.schema.names)}
                    step = batch.column(index[STEP])
                    if step.null_count or at + n > self.n_rows:
                        raise OutOfOrder(src.display)
                    st = self.steps[at:at + n]
                    st[:] = step.to_numpy()
                    if n and ((last is not None and st[0] <= last)
                              or not bool(np.all(st[1:] > st[:-1]))):
                        raise OutOfOrder(src.display)
                    at += n
                    last = st[-1] if n else last
                    cols = [batch.column(index[f]) if f in index else pa.nulls(n, types[f])
                            for f in self.schema.names]
                    out = pa.RecordBatch.from_arrays(cols, schema=self.schema)
                    # no reference to this batch while the next one is read: its pages go to
                    # the next one
                    del batch, cols, step
                    yield out
                    del out
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise RunFormatError(
                    src.display, f"cannot read Parquet data (truncated or corrupted?): {exc}"
                ) from None
            finally:
                pf.close()
        if at != self.n_rows:
            raise OutOfOrder("rows")


def plan_stream(path: str | os.PathLike[str], columns: Sequence[str] | None = None,
                rows: int | None = None) -> RunStream | None:
    """The stream of a run whose :func:`replay.reader.read_run` table is its files' rows as
    they are (``columns``: as :func:`read_run`'s), or ``None``: read it whole.

    Reads the footers only.  The steps must also be strictly increasing across the files:
    :meth:`RunStream.batches` checks them as it reads (:class:`OutOfOrder`).
    ``rows``: rows per batch (default: :func:`batch_rows` of the columns read).
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sources = _resolve(path)
            amap = _alias_table(None, True)
            plan, schema, _ = _plan(sources, amap, columns)
            if caught:  # dropped columns, an old recorder's step metric: read_run says so
                return None
            resolve = alias_resolver(amap)
            files = []
            n_rows = 0
            for src, raw, is_long in plan:
                if is_long:
                    return None
                canon = [STEP] + [resolve(n) for n in raw[1:]]
                if len(set(canon)) != len(canon):  # columns coalesced by the aliases
                    return None
                pf = _open(src)
                try:
                    types = pf.schema_arrow
                    n_rows += pf.metadata.num_rows
                finally:
                    pf.close()
                if raw[:1] != [STEP] or types.field(STEP).type != pa.int64() or any(
                        types.field(n).type != pa.float64() for n in raw[1:]):
                    return None
                files.append((src, raw, canon))
            read_metadata(schema, sources[0].display)  # what read_run validates
    except (RunFormatError, pa.ArrowException, OSError, ValueError, KeyError):
        return None  # read_run gives the error
    return RunStream(files, schema, n_rows, rows or batch_rows(len(schema.names)))
