"""Record a run from a training loop into closed Parquet part files.

A Parquet file without its footer is unreadable, so :class:`RunRecorder` never keeps a file open:
it buffers rows in memory and writes a complete, closed ``part-NNNNNN.parquet`` every ``part_steps``
logged steps (and after ``flush_seconds`` if given). Each part is written to a hidden temporary
file and moved into place with :func:`os.replace`, so a reader never sees half a part. A ``kill -9``
therefore loses at most the rows logged since the last part; a normal exit, an exception
propagating through ``with``, or interpreter shutdown (``atexit``) flushes the rest.

A part that cannot be written (a full disk) never stops training: ``log`` keeps the rows in
memory, logs one warning per outage and retries ``part_steps`` rows later; ``close`` raises if
the last rows still cannot be written.  Parts carry Parquet page checksums, which the reader
verifies, so a corrupted byte is an error naming the file rather than silently wrong data.

Every part carries the full schema known when it was written (new metric names may appear at any
step; earlier parts simply lack them and the reader fills nulls) and the ``b"stability"`` metadata.

Values: ``float``, ``int``, NumPy scalars, 0-d arrays/tensors and anything with ``__float__`` are
recorded (NaN and inf kept as they are); ``None`` means "not logged"; anything else (strings,
lists, multi-element tensors) is skipped with one warning per metric name.

Overhead (measured on the shared dev VM; ``test_log_overhead_is_small`` in
``tests/replay/test_recorder.py`` prints it): ~1 µs for a one-metric ``log``, ~0.3 µs per extra
metric, i.e. 15-35 µs for a 40-metric step *including* the amortised part writes (rows -> Arrow via
``Table.from_pylist``, zstd Parquet, ~20 ms per 1000-row part).

Examples
--------
>>> import tempfile
>>> from replay.reader import read_run
>>> d = tempfile.mkdtemp()
>>> with RunRecorder(d, part_steps=2) as rec:
...     for step in range(5):
...         rec.log(step, {"loss": 1.0 / (step + 1)})
...     rec.log(5, {"loss": 0.1, "val_loss": 0.2})
>>> sorted(os.listdir(d))
['part-000000.parquet', 'part-000001.parquet', 'part-000002.parquet']
>>> read_run(d).column("val_loss").to_pylist()
[None, None, None, None, None, 0.2]
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replay.schema import make_metadata, run_schema

__all__ = ["PART_PATTERN", "RunRecorder", "part_name"]

#: file names of closed parts
PART_PATTERN = re.compile(r"^part-(\d+)\.parquet$")

_log = logging.getLogger(__name__)


def part_name(index: int) -> str:
    """File name of part ``index``.

    Examples
    --------
    >>> part_name(3)
    'part-000003.parquet'
    """
    return f"part-{index:06d}.parquet"


class RunRecorder:
    """Append-only recorder of ``(step, metrics)`` rows into a directory of Parquet parts.

    Parameters
    ----------
    directory : str or Path
        Created if missing. If it already holds parts (a resumed run), numbering continues after
        the last one; nothing is overwritten.
    part_steps : int
        Rows (distinct logged steps) per part file.
    metadata : mapping, optional
        ``{"monitor_config": {...}, "run": {...}}`` stored as the ``b"stability"`` schema metadata
        of every part. Other keys are put under ``"run"``.
    flush_seconds : float, optional
        Also write a part when this many seconds passed since the last one (checked in ``log``).
    compression : str
        Parquet codec (default ``"zstd"``).

    Notes
    -----
    Not thread-safe: call ``log`` from one thread. Consecutive ``log`` calls for the same step are
    merged into one row (e.g. train metrics then ``val_loss``); a step lower than the previous one
    (after a rollback) starts a new row and the reader keeps the last value per step.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        part_steps: int = 1000,
        metadata: Mapping[str, Any] | None = None,
        flush_seconds: float | None = None,
        compression: str = "zstd",
    ) -> None:
        if isinstance(part_steps, bool) or not isinstance(part_steps, int) or part_steps < 1:
            raise ValueError(
                "The 'part_steps' parameter of RunRecorder must be an int in the range [1, inf). "
                f"Got {part_steps!r} instead."
            )
        if flush_seconds is not None and not (
            isinstance(flush_seconds, (int, float)) and flush_seconds > 0
        ):
            raise ValueError(
                "The 'flush_seconds' parameter of RunRecorder must be a float in the range "
                f"(0, inf) or None. Got {flush_seconds!r} instead."
            )
        self.directory = Path(directory)
        self.part_steps = part_steps
        self.flush_seconds = None if flush_seconds is None else float(flush_seconds)
        self.compression = compression
        md = dict(metadata or {})
        run = dict(md.pop("run", None) or {})
        monitor_config = md.pop("monitor_config", None)
        run.update(md)
        self._metadata = make_metadata(monitor_config, run)
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = [
            int(m.group(1))
            for m in (PART_PATTERN.match(p) for p in os.listdir(self.directory))
            if m is not None
        ]
        self._next_part = max(existing, default=-1) + 1
        self._names: dict[str, None] = {}  # ordered set of metric names seen so far
        self._steps: list[int] = []
        self._rows: list[dict[str, float]] = []
        self._last_step: int | None = None
        self._warned: set[str] = set()
        self._last_flush = time.monotonic()
        self._write_at = part_steps  # buffered rows that trigger the next part write
        self._failing = False  # the last part write failed (reported once per outage)
        self._closed = False
        self.parts_written = 0
        #: the last part-write error while it persists (``None`` once a part is written again)
        self.write_error: BaseException | None = None
        atexit.register(self.close)

    # ------------------------------------------------------------------ public API

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step``.

        Parameters
        ----------
        step : int
            Training step (anything ``int()`` accepts exactly, e.g. a NumPy integer).
        metrics : mapping
            ``{name: value}``; ``None`` values are "not logged".
        """
        if self._closed:
            raise RuntimeError(f"RunRecorder({str(self.directory)!r}) is closed")
        step = _as_step(step)
        if step == self._last_step:
            row = self._rows[-1]
        else:
            if len(self._rows) >= self._write_at:
                self._try_write_part()
            row = {}
            self._rows.append(row)
            self._steps.append(step)
            self._last_step = step
        names = self._names
        for name, value in metrics.items():
            if type(value) is float:
                row[name] = value
            elif value is None:
                continue
            else:
                f = self._convert(name, value)
                if f is None:
                    continue
                row[name] = f
            if name not in names:
                if not isinstance(name, str):
                    raise TypeError(f"metric names must be str, got {name!r}")
                names[name] = None
        if (
            self.flush_seconds is not None
            and time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self._try_write_part()

    def flush(self) -> None:
        """Write the buffered rows as a closed part now (no-op when the buffer is empty).

        Raises
        ------
        OSError
            The part could not be written (e.g. a full disk); the rows stay buffered.
        """
        if self._rows:
            self._write_part()

    def close(self) -> None:
        """Flush and stop recording. Idempotent; also called at interpreter exit.

        Raises
        ------
        OSError
            The buffered rows could not be written; they are lost (the message says how many).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.flush()
        except OSError as exc:
            lost, self._rows, self._steps = len(self._rows), [], []
            raise OSError(
                exc.errno,
                f"RunRecorder({str(self.directory)!r}): could not write the last {lost} buffered "
                f"row(s) on close: {exc}",
            ) from exc

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # flush even while an exception propagates; never swallow it (return None)
        self.close()

    def __repr__(self) -> str:
        return (
            f"RunRecorder({str(self.directory)!r}, part_steps={self.part_steps}, "
            f"buffered={len(self._rows)}, parts_written={self.parts_written})"
        )

    # ------------------------------------------------------------------ internals

    def _convert(self, name: str, value: Any) -> float | None:
        if not isinstance(value, (str, bytes)):
            try:
                return float(value)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                pass
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"RunRecorder: metric {name!r} has a non-numeric value of type "
                f"{type(value).__name__}; skipped (warned once per metric)",
                UserWarning,
                stacklevel=3,
            )
        return None

    def _try_write_part(self) -> None:
        """Write a part from ``log()``: a failure never reaches the training loop.

        On an ``OSError`` (full disk, permissions, ...) the rows stay buffered, the failure is
        logged once (until a part is written again) and the write is retried when another
        ``part_steps`` rows have been buffered (or ``flush_seconds`` have passed).
        """
        try:
            self._write_part()
        except OSError as exc:  # pyarrow's IO errors are OSErrors too
            self.write_error = exc
            self._write_at = len(self._rows) + self.part_steps
            self._last_flush = time.monotonic()
            if not self._failing:
                self._failing = True
                _log.warning(
                    "RunRecorder(%r): cannot write a part (%s); keeping %d row(s) in memory and "
                    "retrying every %d steps (reported once)",
                    str(self.directory), exc, len(self._rows), self.part_steps,
                )

    def _write_part(self) -> None:
        """Write every buffered row as the next part; on error the rows stay buffered."""
        rows, steps = self._rows, self._steps
        self._last_flush = time.monotonic()
        if not rows:
            return
        names = list(self._names)
        schema = run_schema(names, self._metadata)
        # from_pylist converts in C++ (10x faster than per-column lists); absent keys -> null
        metrics = pa.Table.from_pylist(rows, schema=pa.schema(list(schema)[1:]))
        table = pa.Table.from_arrays(
            [pa.array(steps, type=pa.int64()), *metrics.columns], schema=schema
        )
        final = self.directory / part_name(self._next_part)
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        try:
            pq.write_table(table, tmp, compression=self.compression, write_page_checksum=True)
            os.replace(tmp, final)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the write error below is the one to report
            raise
        # a logged step stays mergeable only while it is buffered
        self._rows, self._steps, self._last_step = [], [], None
        self._next_part += 1
        self.parts_written += 1
        self._write_at = self.part_steps
        if self._failing:
            self._failing = False
            self.write_error = None
            _log.info(
                "RunRecorder(%r): writing parts again (%d row(s) written to %s)",
                str(self.directory), len(rows), final.name,
            )


def _as_step(step: Any) -> int:
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    try:
        i = int(step)
    except (TypeError, ValueError):
        raise TypeError(f"step must be an integer, got {step!r}") from None
    if i != step:
        raise TypeError(f"step must be an integer, got {step!r}")
    return i
