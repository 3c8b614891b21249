"""Part files of :class:`replay.recorder.RunRecorder`: the full-disk spill queue, publishing parts.

Split out of ``replay/recorder.py`` (pure move). :class:`PartFilesMixin` holds the queue of cut
parts not yet on disk (capped at ``max_buffer_bytes``, retried with backoff), writing a part to a
private temporary file and claiming the first free ``part-NNNNNN.parquet`` name, the per-writer
advisory lock and the removal of stale temporary files; see the module docstring of
``replay.recorder`` for the guarantees. Log records keep the ``replay.recorder`` logger name.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, no stale-file reaping
    fcntl = None

__all__ = ["PART_PATTERN", "PartFilesMixin", "part_name"]

#: file names of closed parts
PART_PATTERN = re.compile(r"^part-(\d+)\.parquet$")

_WRITER_LOCK = re.compile(r"^\.writer-(\d+-[0-9a-f]+)\.lock(\.new)?$")
_TMP = re.compile(r"^\.part-\d+\.(\d+-[0-9a-f]+)\.tmp$")
_LEGACY_TMP = re.compile(r"^\.part-\d+\.parquet\.(\d+)\.tmp$")  # written by older versions
_RETRY_MIN_S, _RETRY_MAX_S = 1.0, 60.0
_LINK_UNSUPPORTED = frozenset(
    {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}
)

_log = logging.getLogger("replay.recorder")  # the recorder's logger, as before the split


def part_name(index: int) -> str:
    """File name of part ``index``.

    Examples
    --------
    >>> part_name(3)
    'part-000003.parquet'
    """
    return f"part-{index:06d}.parquet"


class PartFilesMixin:
    """Spill queue, part publishing, writer lock and stale-file reaping of ``RunRecorder``."""

    directory: Path
    compression: str
    max_buffer_bytes: int
    writer_id: str
    other_writers: int
    parts_written: int
    rows_dropped: int
    write_error: BaseException | None
    _pid: int
    _lock_fd: int | None
    _lock_path: Path | None
    _next_part: int
    _use_link: bool
    _seq: int
    _pending: deque[pa.Table]
    _pending_bytes: int
    _pending_rows: int
    _failing: bool
    _failures: int
    _retry_at: float
    _dropping: bool

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

