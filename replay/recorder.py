"""Record a run from a training loop into closed Parquet part files.

A Parquet file without its footer is unreadable, so :class:`RunRecorder` never keeps a file open:
it buffers rows in memory and writes a complete, closed ``part-NNNNNN.parquet`` every ``part_steps``
logged steps (and after ``flush_seconds`` if given). A ``kill -9`` therefore loses at most the rows
logged since the last part; a normal exit, an exception propagating through ``with``, or
interpreter shutdown (``atexit``) flushes the rest.

Integrity guarantees (``tests/reliability/test_recorder_integrity.py``):

* **Several writers, no lost rows.** Each part is written to a hidden temporary file named after
  the writer and then *claimed*: hard-linked to the first free ``part-NNNNNN.parquet`` name
  (``os.link`` fails instead of overwriting), so two recorders on one directory -- threads or
  processes -- never replace each other's parts. The reader merges every part by step. Each live
  writer holds an advisory lock (``fcntl.flock``) on its ``.writer-<id>.lock`` file; a recorder
  that finds another live writer says so once (:attr:`RunRecorder.other_writers`).
* **Stale temporary files are removed on open**, unless they belong to a writer that is still
  alive (its lock is held).
* **Bad input never raises and never poisons the buffer.** A step that is not an integer in the
  int64 range, a metric name that is not a UTF-8-encodable ``str``, a reserved name (``step``), a
  value that is not a real number, or ``metrics`` that is not a mapping is skipped, counted in
  :attr:`RunRecorder.skipped` and warned about once; the other metrics and later rows are kept.
* **A full or read-only disk never stops training and never grows memory without bound.** A
  failed part stays queued (as a compact Arrow table) and is retried with exponential backoff
  (1 s to 60 s), one part per retry -- a retry never rewrites what was already queued as one big
  file (nor are small ``flush_seconds`` parts cut while writes fail). Queued rows are capped at
  ``max_buffer_bytes`` (plus one part); beyond that the oldest queued part is dropped and counted
  in :attr:`RunRecorder.rows_dropped` (reported once per outage and at close). ``close`` raises
  if the last rows cannot be written, but ``__exit__`` never replaces an exception raised in the
  ``with`` body: it reports the recorder's failure as a ``RuntimeWarning`` and lets the user's
  exception propagate.

Parts carry Parquet page checksums, which the reader verifies, so a corrupted byte is an error
naming the file rather than silently wrong data. Every part carries the full schema known when its
rows were cut (new metric names may appear at any step; earlier parts simply lack them and the
reader fills nulls) and the ``b"stability"`` metadata.

Values: ``float``, ``int``, NumPy scalars, 0-d arrays/tensors and anything with ``__float__`` are
recorded (NaN and inf kept as they are); ``None`` means "not logged"; anything else (strings,
complex numbers, lists, multi-element tensors, ints beyond the float64 range) is skipped with one
warning per metric name.

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
import contextlib
import errno
import logging
import os
import re
import secrets
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from detectors.validation import check_int, check_opt_float
from replay.schema import STEP, make_metadata, run_schema

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, no stale-file reaping
    fcntl = None

__all__ = ["PART_PATTERN", "RESERVED_NAMES", "RunRecorder", "part_name"]

_log = logging.getLogger(__name__)

#: metric names the recorder refuses: they are columns of the run schema itself
RESERVED_NAMES = frozenset({STEP})

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_SKIP_KEYS = 1000  # distinct (reason, subject) pairs kept in ``skipped``


#: file names of closed parts
PART_PATTERN = re.compile(r"^part-(\d+)\.parquet$")

_WRITER_LOCK = re.compile(r"^\.writer-(\d+-[0-9a-f]+)\.lock(\.new)?$")
_TMP = re.compile(r"^\.part-\d+\.(\d+-[0-9a-f]+)\.tmp$")
_LEGACY_TMP = re.compile(r"^\.part-\d+\.parquet\.(\d+)\.tmp$")  # written by older versions
_RETRY_MIN_S, _RETRY_MAX_S = 1.0, 60.0
_LINK_UNSUPPORTED = frozenset(
    {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}
)

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
        Created if missing. If it already holds parts (a resumed run, or another live writer),
        new parts take the next free numbers; nothing is overwritten.
    part_steps : int
        Rows (distinct logged steps) per part file.
    metadata : mapping, optional
        ``{"monitor_config": {...}, "run": {...}}`` stored as the ``b"stability"`` schema metadata
        of every part. Other keys are put under ``"run"``.
    flush_seconds : float, optional
        Also write a part when this many seconds passed since the last one (checked in ``log``).
    compression : str
        Parquet codec (default ``"zstd"``).
    max_buffer_bytes : int
        While parts cannot be written (full or read-only disk), queued rows are kept up to this
        many bytes of Arrow data plus the newest part; older queued parts are dropped and counted
        in :attr:`rows_dropped`.
    max_metrics : int
        Distinct metric names accepted; further new names are skipped (see :attr:`skipped`).

    Attributes
    ----------
    writer_id : str
        ``"<pid>-<random hex>"``, names this writer's lock and temporary files.
    other_writers : int
        Live writers found on the directory when this one opened.
    parts_written : int
        Parts this recorder wrote.
    rows_dropped : int
        Rows lost because the disk kept failing (memory cap, or not writable at close).
    write_error : BaseException or None
        The last part-write error while it persists (``None`` once a part is written again).

    Notes
    -----
    ``log`` may be called from several threads (calls are serialised). Consecutive ``log`` calls
    for the same step are merged into one row (e.g. train metrics then ``val_loss``); a step lower
    than the previous one (after a rollback) starts a new row and the reader keeps the last value
    per step (parts in part-number order, i.e. the order they were written in).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        part_steps: int = 1000,
        metadata: Mapping[str, Any] | None = None,
        flush_seconds: float | None = None,
        compression: str = "zstd",
        *,
        max_buffer_bytes: int = 64 << 20,
        max_metrics: int = 10_000,
    ) -> None:
        owner = "RunRecorder"
        self.part_steps = check_int(owner, "part_steps", part_steps, 1)
        self.max_buffer_bytes = check_int(owner, "max_buffer_bytes", max_buffer_bytes, 0)
        self.max_metrics = check_int(owner, "max_metrics", max_metrics, 1)
        # inf: never on time (as None)
        self.flush_seconds = check_opt_float(owner, "flush_seconds", flush_seconds, 0.0,
                                             low_open=True)
        self.directory = Path(directory)
        self.compression = compression
        md = dict(metadata or {})
        run = dict(md.pop("run", None) or {})
        monitor_config = md.pop("monitor_config", None)
        run.update(md)
        self._metadata = make_metadata(monitor_config, run)
        self.directory.mkdir(parents=True, exist_ok=True)  # a path under a file fails here
        self._pid = os.getpid()
        self.writer_id = f"{self._pid}-{secrets.token_hex(4)}"
        self._mutex = threading.RLock()
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None
        self.other_writers = 0
        self._take_writer_lock()
        try:
            listing = os.listdir(self.directory)
        except OSError:
            listing = []
        self._reap_stale(listing)
        self._next_part = _max_part(listing) + 1  # a hint: claiming a name never overwrites
        self._use_link = hasattr(os, "link")
        self._seq = 0  # temporary-file counter
        self._names: dict[str, None] = {}  # ordered set of accepted metric names
        self._steps: list[int] = []
        self._rows: list[dict[str, float]] = []
        self._last_step: int | None = None
        self._pending: deque[pa.Table] = deque()  # cut parts not yet on disk, oldest first
        self._pending_bytes = 0
        self._pending_rows = 0
        self._skipped: dict[tuple[str, str], int] = {}
        self._last_flush = time.monotonic()
        self._failing = False  # parts are failing to be written (reported once per outage)
        self._failures = 0  # consecutive failed part writes (backoff exponent)
        self._retry_at = 0.0
        self._dropping = False  # the memory cap dropped rows in this outage (reported once)
        self._closed = False
        self.parts_written = 0
        self.rows_dropped = 0
        self.write_error: BaseException | None = None
        atexit.register(self._atexit_close)

    # ------------------------------------------------------------------ public API

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step``. Never raises: bad input is skipped and counted.

        Parameters
        ----------
        step : int
            Training step (anything ``int()`` accepts exactly, e.g. a NumPy integer), in the
            int64 range.
        metrics : mapping
            ``{name: value}``; ``None`` values are "not logged".
        """
        with self._mutex:
            if self._closed:
                self._skip("closed", "", lambda: "the recorder is closed; rows logged after "
                           "close() are dropped")
                return
            s = step if type(step) is int and _INT64_MIN <= step <= _INT64_MAX else _as_step(step)
            if s is None:
                self._skip("bad_step", type(step).__name__, lambda: f"step {_short(step)} is "
                           "not an integer in the int64 range; the row was skipped")
                return
            if type(metrics) is not dict and not isinstance(metrics, Mapping):
                self._skip("bad_metrics", type(metrics).__name__, lambda: "metrics must be a "
                           f"mapping, got {type(metrics).__name__}; the row was skipped")
                return
            if s == self._last_step:
                row = self._rows[-1]
            else:
                if self._pending:  # a backlog from a failing disk: oldest first
                    self._drain_some()
                if len(self._rows) >= self.part_steps:
                    self._cut()
                    self._drain_some()
                row = {}
                self._rows.append(row)
                self._steps.append(s)
                self._last_step = s
            names = self._names
            try:
                for name, value in metrics.items():
                    if type(value) is float:
                        f: float = value
                    elif value is None:
                        continue
                    else:
                        conv = self._convert(name, value)
                        if conv is None:
                            continue
                        f = conv
                    if name in names or self._admit(name):
                        row[name] = f
            except Exception as exc:  # a mapping that fails while iterated (changed size, ...)
                err = f"{type(exc).__name__}: {_text(exc)}"
                self._skip("bad_metrics", type(exc).__name__, lambda: f"iterating the metrics "
                           f"failed ({err}); the rest of the row was skipped")
            if (
                self.flush_seconds is not None
                and not self._failing  # no point in cutting small parts that cannot be written
                and time.monotonic() - self._last_flush >= self.flush_seconds
            ):
                self._cut()
                self._drain_some()

    def flush(self) -> None:
        """Write the buffered rows as closed parts now (no-op when nothing is buffered).

        Raises
        ------
        OSError
            A part could not be written (e.g. a full disk); the rows stay buffered (bounded by
            ``max_buffer_bytes``) and are retried later.
        """
        with self._mutex:
            if self._closed:
                return
            self._cut()
            self._drain(None, raise_errors=True)

    def close(self) -> None:
        """Flush and stop recording. Idempotent; also called at interpreter exit.

        Raises
        ------
        OSError
            The buffered rows could not be written; they are lost (the message says how many).
        """
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._atexit_close)
            try:
                self._cut()
                self._drain(None, raise_errors=True)
            except OSError as exc:
                lost = self._pending_rows
                self._clear_pending()
                earlier = self.rows_dropped
                self.rows_dropped += lost
                extra = (
                    f" ({earlier} earlier row(s) were dropped while parts could not be written)"
                    if earlier
                    else ""
                )
                raise OSError(
                    exc.errno,
                    f"RunRecorder({str(self.directory)!r}): could not write the last {lost} "
                    f"buffered row(s) on close: {exc}{extra}",
                ) from exc
            finally:
                self._release_writer_lock()
            if self.rows_dropped:
                _log.warning(
                    "RunRecorder(%r): closed; %d row(s) were dropped while parts could not be "
                    "written", str(self.directory), self.rows_dropped,
                )

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def locked(self) -> bool:
        """True while this writer holds its ``.writer-<id>.lock`` (False on a directory where no
        lock file can be created, on Windows, and after :meth:`close`)."""
        return self._lock_fd is not None

    @property
    def buffered_rows(self) -> int:
        """Rows logged but not yet on disk (queued parts included)."""
        return self._pending_rows + len(self._rows)

    @property
    def buffered_bytes(self) -> int:
        """Estimated memory of the queued parts (Arrow buffers plus per-part objects; the rows
        of the part being filled are not included)."""
        return self._pending_bytes

    @property
    def skipped(self) -> dict[tuple[str, str], int]:
        """What ``log`` skipped: ``{(reason, subject): count}``.

        Reasons: ``"bad_step"`` (subject: the step's type), ``"bad_metrics"`` (the type),
        ``"bad_name"`` (``ascii()`` of the name), ``"reserved_name"`` (the name),
        ``"bad_value"`` (the metric name), ``"too_many_metrics"``, ``"closed"``, and ``"other"``
        once :data:`_MAX_SKIP_KEYS` distinct pairs are held.
        """
        return dict(self._skipped)

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # flush even while an exception propagates; never swallow it (return None) and never
        # replace it with the recorder's own failure
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:
            warnings.warn(
                f"{close_exc} (reported as a warning: {exc_type.__name__ if exc_type else 'an'} "
                "exception raised in the 'with' block propagates)",
                RuntimeWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return (
            f"RunRecorder({str(self.directory)!r}, part_steps={self.part_steps}, "
            f"buffered={self.buffered_rows}, parts_written={self.parts_written})"
        )

    # ------------------------------------------------------------------ buffering and writing

    def _cut(self) -> None:
        """Turn the rows being filled into a queued Arrow part (never raises)."""
        self._last_flush = time.monotonic()
        rows, steps = self._rows, self._steps
        self._rows, self._steps, self._last_step = [], [], None
        if not rows:
            return
        try:
            schema = run_schema(list(self._names), self._metadata)
            # from_pylist converts in C++ (10x faster than per-column lists); absent keys -> null
            metrics = pa.Table.from_pylist(rows, schema=pa.schema(list(schema)[1:]))
            table = pa.Table.from_arrays(
                [pa.array(steps, type=pa.int64()), *metrics.columns], schema=schema
            )
        except Exception as exc:  # unreachable after validation; never poison the buffer
            self.rows_dropped += len(rows)
            _log.error("RunRecorder(%r): could not convert %d row(s) to Arrow (%s: %s); they "
                       "were dropped", str(self.directory), len(rows), type(exc).__name__, exc)
            return
        self._pending.append(table)
        self._pending_bytes += _cost(table)
        self._pending_rows += table.num_rows
        self._enforce_cap()

    # ------------------------------------------------------------------ input validation

    def _skip(self, reason: str, subject: str, message: Callable[[], str], stacklevel: int = 3
              ) -> None:
        """Count a skipped input; warn the first time a (reason, subject) pair is seen."""
        key = (reason, subject)
        n = self._skipped.get(key)
        if n is not None:
            self._skipped[key] = n + 1
            return
        if len(self._skipped) >= _MAX_SKIP_KEYS:
            other = ("other", "")
            first = other not in self._skipped
            self._skipped[other] = self._skipped.get(other, 0) + 1
            if first:
                warnings.warn(
                    f"RunRecorder: {_MAX_SKIP_KEYS} kinds of bad input skipped; further ones are "
                    "counted under ('other', '') without a warning",
                    UserWarning,
                    stacklevel=stacklevel,
                )
            return
        self._skipped[key] = 1
        warnings.warn(f"RunRecorder: {message()}", UserWarning, stacklevel=stacklevel)

    def _convert(self, name: Any, value: Any) -> float | None:
        problem = ""
        if isinstance(value, (str, bytes, complex)) or _is_complex(value):
            pass
        else:
            try:
                return float(value)
            except Exception as exc:  # TypeError, OverflowError, a raising __float__, ...
                problem = f" ({type(exc).__name__}: {_text(exc)})"
        self._skip("bad_value", _subject(name), lambda: f"metric {_short(name)} has a "
                   f"non-numeric value of type {type(value).__name__}{problem}; skipped (warned "
                   "once per metric)", stacklevel=4)
        return None

    def _admit(self, name: Any) -> bool:
        """Validate a metric name seen for the first time; True adds it to the schema."""
        if not isinstance(name, str):
            self._skip("bad_name", _subject(name), lambda: "metric names must be str, got "
                       f"{_short(name)} ({type(name).__name__}); skipped", stacklevel=4)
            return False
        if name in RESERVED_NAMES:
            self._skip("reserved_name", name, lambda: f"metric name {name!r} is reserved for "
                       "the run schema; its values are skipped (log it under another name)",
                       stacklevel=4)
            return False
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            self._skip("bad_name", ascii(name)[:80], lambda: f"metric name {ascii(name)[:80]} "
                       "is not valid Unicode (a lone surrogate?); its values are skipped",
                       stacklevel=4)
            return False
        if len(self._names) >= self.max_metrics:
            self._skip("too_many_metrics", "", lambda: f"more than max_metrics="
                       f"{self.max_metrics} distinct metric names; new names are skipped "
                       f"(first: {name!r})", stacklevel=4)
            return False
        self._names[name] = None
        return True

    # ------------------------------------------------------------------ spill queue and writing

    def _enforce_cap(self) -> None:
        dropped = 0
        while self._pending_bytes > self.max_buffer_bytes and len(self._pending) > 1:
            dropped += self._pop_pending().num_rows
        if dropped:
            self.rows_dropped += dropped
            if not self._dropping:
                self._dropping = True
                _log.warning(
                    "RunRecorder(%r): parts cannot be written and the queued rows reached "
                    "max_buffer_bytes=%d; dropping the oldest queued rows (%d so far, counted in "
                    "rows_dropped; reported once per outage)",
                    str(self.directory), self.max_buffer_bytes, self.rows_dropped,
                )

    def _pop_pending(self) -> pa.Table:
        table = self._pending.popleft()
        self._pending_bytes -= _cost(table)
        self._pending_rows -= table.num_rows
        return table

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._pending_bytes = self._pending_rows = 0

    def _drain_some(self) -> None:
        """From ``log``: write up to two queued parts, unless a failed write is backing off."""
        if self._failing and time.monotonic() < self._retry_at:
            return
        self._drain(2, raise_errors=False)

    def _drain(self, limit: int | None, raise_errors: bool) -> None:
        """Write queued parts oldest first; stop at the first failure (which stays queued)."""
        written = 0
        while self._pending and (limit is None or written < limit):
            table = self._pending[0]
            try:
                final = self._write_part(table)
            except OSError as exc:  # pyarrow's IO errors are OSErrors too
                self._write_failed(exc)
                if raise_errors:
                    raise
                return
            except Exception as exc:  # not an IO problem: this part can never be written
                self._pop_pending()
                self.rows_dropped += table.num_rows
                _log.error("RunRecorder(%r): could not write %d row(s) (%s: %s); they were "
                           "dropped", str(self.directory), table.num_rows,
                           type(exc).__name__, exc)
                continue
            self._pop_pending()
            written += 1
            self.parts_written += 1
            if self._failing:
                self._failing = self._dropping = False
                self._failures = 0
                self.write_error = None
                _log.info("RunRecorder(%r): writing parts again (%s; %d row(s) still queued)",
                          str(self.directory), final, self._pending_rows)

    def _write_failed(self, exc: OSError) -> None:
        self.write_error = exc
        self._failures += 1
        delay = min(_RETRY_MAX_S, _RETRY_MIN_S * 2.0 ** min(self._failures - 1, 16))
        self._retry_at = time.monotonic() + delay
        if not self._failing:
            self._failing = True
            _log.warning(
                "RunRecorder(%r): cannot write a part (%s); keeping up to %d bytes of rows in "
                "memory and retrying with backoff, one part per retry (reported once)",
                str(self.directory), exc, self.max_buffer_bytes,
            )

    def _write_part(self, table: pa.Table) -> str:
        """Write ``table`` to a private temporary file and claim the next free part name."""
        self._seq += 1
        tmp = self.directory / f".part-{self._seq:06d}.{self.writer_id}.tmp"
        try:
            pq.write_table(table, tmp, compression=self.compression, write_page_checksum=True)
            return self._claim(tmp)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the write error is the one to report
            raise

    def _claim(self, tmp: Path) -> str:
        """Publish ``tmp`` under the first free part name at or after ``_next_part``.

        ``os.link`` fails when the name exists, so no writer ever replaces another's part; on a
        filesystem without hard links, the existence check and ``os.replace`` run under the
        directory's ``.lock``.
        """
        idx = self._next_part
        misses = 0
        while self._use_link:
            final = self.directory / part_name(idx)
            try:
                os.link(tmp, final)
            except FileExistsError:
                idx += 1
                misses += 1
                if misses % 64 == 0:  # far behind another writer: jump to the end
                    idx = max(idx, self._max_part() + 1)
                continue
            except OSError as exc:
                if exc.errno not in _LINK_UNSUPPORTED:
                    raise
                self._use_link = False
                break
            self._next_part = idx + 1
            with contextlib.suppress(OSError):
                tmp.unlink()  # if this fails the part is published; the name is reaped later
            return final.name
        with self._directory_lock():
            while (self.directory / part_name(idx)).exists():
                idx += 1
                misses += 1
                if misses % 64 == 0:
                    idx = max(idx, self._max_part() + 1)
            final = self.directory / part_name(idx)
            os.replace(tmp, final)
        self._next_part = idx + 1
        return final.name

    def _max_part(self) -> int:
        try:
            return _max_part(os.listdir(self.directory))
        except OSError:
            return -1

    # ------------------------------------------------------------------ locks and stale files

    def _take_writer_lock(self) -> None:
        """Create and lock ``.writer-<id>.lock`` (renamed into place already locked, so a reaper
        never sees it unlocked while this writer lives). Failure only disables the lock."""
        if fcntl is None:  # pragma: no cover - Windows
            return
        for attempt in range(3):
            if attempt:  # another writer's reaper took our file before we locked it
                self.writer_id = f"{self._pid}-{secrets.token_hex(4)}"
            final = self.directory / f".writer-{self.writer_id}.lock"
            new = final.with_name(final.name + ".new")
            try:
                fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                _log.warning("RunRecorder(%r): cannot create a writer lock file (%s); recording "
                             "without one", str(self.directory), exc)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.replace(new, final)
            except OSError as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    new.unlink()
                if isinstance(exc, FileNotFoundError) and attempt < 2:
                    continue
                _log.warning("RunRecorder(%r): cannot take a writer lock (%s); recording "
                             "without one", str(self.directory), exc)
                return
            self._lock_fd, self._lock_path = fd, final
            return

    def _release_writer_lock(self) -> None:
        fd, path = self._lock_fd, self._lock_path
        self._lock_fd = self._lock_path = None
        if fd is None or path is None:
            return
        with contextlib.suppress(OSError):
            path.unlink()  # while still holding the lock
        with contextlib.suppress(OSError):
            os.close(fd)

    def _reap_stale(self, names: list[str]) -> None:
        """Remove lock and temporary files of writers that are gone; count the live ones.

        ``names`` is one listing of the directory: a temporary file in it was created after its
        writer's lock file, so that lock file is in the listing too.
        """
        live = {self.writer_id}
        others = 0
        for name in names:
            m = _WRITER_LOCK.match(name)
            if m is None or m.group(1) == self.writer_id:
                continue
            if _lock_is_live(self.directory / name) is not False:
                live.add(m.group(1))
                others += m.group(2) is None
        removed = 0
        for name in names:
            m = _TMP.match(name)
            if m is not None:
                stale = m.group(1) not in live
            else:
                m = _LEGACY_TMP.match(name)
                stale = m is not None and not _pid_alive(int(m.group(1)))
            if stale:
                try:
                    (self.directory / name).unlink()
                    removed += 1
                except OSError:
                    pass
        if removed:
            _log.info("RunRecorder(%r): removed %d stale temporary file(s) of writers that are "
                      "gone", str(self.directory), removed)
        self.other_writers = others
        if others:
            _log.warning(
                "RunRecorder(%r): %d other live writer(s) on this directory; every part is "
                "claimed under its own name, so no rows are lost, and readers merge all parts by "
                "step (for the same step and metric the part written last wins)",
                str(self.directory), others,
            )

    @contextlib.contextmanager
    def _directory_lock(self) -> Iterator[None]:
        """Exclusive advisory lock on the directory's ``.lock`` (filesystems without links)."""
        if fcntl is None:  # pragma: no cover - Windows
            yield
            return
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _atexit_close(self) -> None:
        if os.getpid() != self._pid:  # a forked child does not own the parent's rows
            return
        try:
            self.close()
        except Exception as exc:
            _log.error("%s", exc)


def _as_step(step: Any) -> int | None:
    """``step`` as an int in the int64 range, or None."""
    if type(step) is int:
        return step if _INT64_MIN <= step <= _INT64_MAX else None
    if isinstance(step, bool):
        return None
    try:
        i = int(step)
        exact = bool(i == step)
    except Exception:
        return None
    return i if exact and _INT64_MIN <= i <= _INT64_MAX else None


def _is_complex(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    return getattr(dtype, "kind", "") == "c" or getattr(dtype, "is_complex", False) is True


def _subject(name: Any) -> str:
    return name if isinstance(name, str) and name.isprintable() else ascii(name)[:80]


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    return text if len(text) <= 80 else text[:77] + "..."


def _short(obj: Any) -> str:
    try:
        text = ascii(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _cost(table: pa.Table) -> int:
    """Memory of a queued part: its Arrow buffers plus the Python/Arrow objects around them."""
    return int(table.nbytes) + 1024 + 128 * table.num_columns


def _max_part(names: list[str]) -> int:
    return max(
        (int(m.group(1)) for m in map(PART_PATTERN.match, names) if m is not None), default=-1
    )


def _lock_is_live(path: Path) -> bool | None:
    """True if a writer holds ``path``'s lock, False if not (the file is then removed), None
    when it cannot be told."""
    if fcntl is None:  # pragma: no cover - Windows
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        with contextlib.suppress(OSError):
            path.unlink()  # removed while we hold its lock: its writer is gone
        return False
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process never writes the legacy names
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True
