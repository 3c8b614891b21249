"""Durable, append-only event log (JSON Lines).

Every record is one JSON object on one line with at least ``type``, ``step`` and ``time`` (Unix
seconds).  Each append is a single ``os.write`` on a file opened with ``O_APPEND`` -- no user-space
buffer, so a record is in the kernel as soon as :meth:`EventLog.append` returns and survives the
process being killed right after.  Critical records (critical alarms, checkpoints, rollbacks,
stops, and anything appended with ``critical=True``) are also ``fsync``-ed, so they survive a
machine crash too: by a background syncer thread, in groups (every critical record appended
while an ``fsync`` runs is covered by the next one), so a storm of critical records costs the
training loop one ``os.write`` each and never waits for the disk (:meth:`EventLog.wait_synced`
waits for durability; :meth:`EventLog.close` always ends with an ``fsync``).
``fsync="always"`` fsyncs every record in the caller's thread (the user asked for it).

Alarm storms cost bounded bytes and time (:class:`AlarmStormBound`): a step writes at most
``max_alarms_per_step`` alarm records and an episode (alarm steps within ``episode_gap`` steps of
each other) at most ``max_alarms_per_episode``; the alarms past either bound are written as one
``alarms_coalesced`` record per step (their count, per kind and severity, and the first few
signals).  A 1,000-step all-NaN storm at 512 layers is a few thousand records, not millions.

Only event logs are ever appended to: an existing non-empty regular file that does not start
like a record this module writes (``{"type":"``) -- a checkpoint, a config, the job's metrics
file -- is refused with ``ValueError`` and left untouched.

Opening an existing log cuts a torn last record (a line without its newline, left by a crash in the
middle of a write), so records appended after a restart never follow half a line; a short write
(disk full) is truncated away for the same reason.

One schema, live and replayed: ``replay --events`` writes the same records
(:func:`decision_records`; with ``run_id`` and without ``time``, a replay has no wall clock):

==================  ==========================================================================
``type``            fields
==================  ==========================================================================
``alarm``           ``step``, ``kind``, ``signal``, ``score``, ``threshold``, ``severity``,
                    ``detector``, ``cause``, ``message`` (:meth:`Alarm.to_dict`)
``intervention``    ``step``, ``intervention`` (its type: ``reduce_lr``, ``stop``, ...),
                    ``reason``, ``cause`` and the intervention's own fields
``goodput``         ``step`` and the goodput ledger's record
``info``            ``step``, ``message`` (e.g. input a replay skipped)
==================  ==========================================================================

Write failures (read-only directory, full disk, ...) are reported once through :mod:`logging` and
never raise into the training loop, unless ``strict=True``.  Appending to a closed log drops the
record with a one-time warning (``append`` returns ``False``); it never raises.

Examples
--------
>>> import tempfile, os
>>> from stability.types import Alarm
>>> path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
>>> with EventLog(path) as log:
...     ok = log.alarm(Alarm(3, "loss_spike", "loss", 9.0, 6.0, "warning", "ewma_z"))
...     ok = log.info(4, "hello", lr=0.1)
>>> [(e["type"], e["step"]) for e in read_events(path)]
[('alarm', 3), ('info', 4)]
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from detectors.validation import check_bool, check_choice
from stability.config.sections import FSYNC_MODES
from stability.types import Alarm, Intervention

logger = logging.getLogger("stability.events")

#: ``errors`` modes of :func:`iter_events`
ERRORS_MODES = ("raise", "skip")

#: Intervention types that are always fsynced.
CRITICAL_TYPES = frozenset({"checkpoint", "rollback", "stop"})

#: How every record this module writes begins (the test that a file is an event log).
RECORD_HEAD = b'{"type":"'

#: seconds the idle syncer thread waits for work before it exits (restarted on demand)
SYNCER_IDLE_S = 5.0


def _clean(v: Any) -> Any:
    """Make ``v`` strict-JSON serialisable (non-finite floats become strings)."""
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, Mapping):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or isinstance(v, (str, int, bool)):
        return v
    if hasattr(v, "to_dict"):
        return _clean(v.to_dict())
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def is_critical(record: Mapping[str, Any]) -> bool:
    """Whether a record must be fsynced.

    >>> is_critical({"type": "alarm", "severity": "critical"}), is_critical({"type": "info"})
    (True, False)
    """
    if record.get("critical"):
        return True
    t = record.get("type")
    if t in CRITICAL_TYPES:
        return True
    if t == "alarm" and record.get("severity") == "critical":
        return True
    return t == "intervention" and record.get("intervention") in CRITICAL_TYPES


class AlarmStormBound:
    """How many alarm records a step and an episode may write; the rest is counted per step.

    >>> b = AlarmStormBound(max_alarms_per_step=2, max_alarms_per_episode=3, episode_gap=10)
    >>> [b.admit(s) for s in (1, 1, 1, 2, 2, 50)]
    [True, True, False, True, False, True]
    """

    def __init__(self, max_alarms_per_step: int = 64, max_alarms_per_episode: int = 2048,
                 episode_gap: int = 100) -> None:
        if max_alarms_per_step < 1 or max_alarms_per_episode < 1 or episode_gap < 0:
            raise ValueError("AlarmStormBound needs max_alarms_per_step >= 1, "
                             "max_alarms_per_episode >= 1 and episode_gap >= 0.")
        self.max_step = int(max_alarms_per_step)
        self.max_episode = int(max_alarms_per_episode)
        self.gap = int(episode_gap)
        self._step: int | None = None
        self._in_step = 0
        self._in_episode = 0

    def admit(self, step: int) -> bool:
        """Whether an alarm of ``step`` gets its own record (else it is coalesced)."""
        if self._step is None or abs(step - self._step) > self.gap:
            self._in_episode = 0  # a new episode
        if step != self._step:
            self._in_step = 0
        self._step = step
        if self._in_step >= self.max_step or self._in_episode >= self.max_episode:
            return False
        self._in_step += 1
        self._in_episode += 1
        return True


class EventLog:
    """Append-only JSONL event log.

    Parameters
    ----------
    path : str or os.PathLike
        The file; parent directories are created.  Appends to an existing file.
    fsync : {"critical", "always", "never"}
        When to ``fsync`` after a write.
    strict : bool
        Raise ``OSError`` on write failures instead of reporting them once through logging.
    clock : callable, optional
        Time source for the ``time`` field (default :func:`time.time`).
    storm : AlarmStormBound, optional
        The bounds on alarm records per step and per episode (default: 64 and 2048).
    """

    def __init__(self, path: str | os.PathLike[str], fsync: str = "critical",
                 strict: bool = False, clock: Any = None,
                 storm: AlarmStormBound | None = None) -> None:
        self.fsync = check_choice("EventLog", "fsync", fsync, FSYNC_MODES)
        self.strict = check_bool("EventLog", "strict", strict)
        self.path = os.fspath(path)
        self.clock = clock or time.time
        self.n_written = 0
        self.n_dropped = 0
        self._fd: int | None = None
        self._reported = False
        self._closed = False
        self._warned_closed = False
        self._lock = threading.Lock()
        self._sync = threading.Condition()  # the syncer: _dirty / _synced / _syncer
        self._dirty = 0   # critical records written (a counter: the syncer covers a prefix)
        self._synced = 0  # ... of which fsynced
        self._syncer: threading.Thread | None = None
        self.n_fsyncs = 0
        self.storm = storm if storm is not None else AlarmStormBound()
        self.n_coalesced = 0  # alarms written only as a count
        self._held: dict[str, Any] | None = None  # the current step's coalesced alarms
        self._open()

    def _open(self) -> None:
        try:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            self._fail(e)
            return
        try:
            self._check_is_event_log(self._fd)
            self._drop_torn_tail(self._fd)
        except OSError as e:
            self._fail(e)
        except ValueError:
            os.close(self._fd)
            self._fd = None
            raise

    def _check_is_event_log(self, fd: int) -> None:
        """Refuse (``ValueError``, file untouched) an existing non-empty regular file that is
        not an event log: appending would corrupt it and cutting a "torn tail" destroy it."""
        import stat

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return
        with open(self.path, "rb") as f:  # (the log's own descriptor is write-only)
            head = f.read(len(RECORD_HEAD))
        if head != RECORD_HEAD:
            raise ValueError(
                f"{self.path} is not a stability event log (it does not start with "
                f"{RECORD_HEAD.decode()!r}); refusing to append to it. Give the event log a "
                "file of its own.")

    def _drop_torn_tail(self, fd: int) -> None:
        """Cut a torn last record (no final newline: a write cut short by a crash).

        Appending after it would turn the torn record into a corrupt line in the middle of the
        file, which :func:`iter_events` rejects.  The file is scanned backwards in 64 KiB blocks
        for the last newline, however long the torn record is (a file without any newline is
        one torn record and is emptied).
        """
        size = os.fstat(fd).st_size
        if size == 0:
            return
        block = 65536
        keep = 0
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            end = size
            while end > 0:
                start = max(0, end - block)
                f.seek(start)
                cut = f.read(end - start).rfind(b"\n")
                if cut >= 0:
                    keep = start + cut + 1
                    break
                end = start
        os.ftruncate(fd, keep)
        logger.warning("stability event log %s: dropped a torn last record (%d bytes) left by "
                       "an interrupted write.", self.path, size - keep)

    def _fail(self, e: OSError) -> None:
        if self.strict:
            raise e
        if not self._reported:
            self._reported = True
            logger.error("stability event log %s cannot be written (%s); events are being "
                         "dropped (reported once).", self.path, e)

    # ------------------------------------------------------------------ writing
    def append(self, record: Mapping[str, Any], critical: bool | None = None) -> bool:
        """Append one record; returns ``True`` if it reached the file.

        ``type`` defaults to ``"info"``, ``step`` to ``None`` and ``time`` to now.
        """
        rec: dict[str, Any] = {"type": "info", "step": None}
        rec.update(record)
        rec.setdefault("time", self.clock())
        crit = is_critical(rec) if critical is None else critical
        line = (json.dumps(_clean(rec), allow_nan=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._closed:  # never raise into the training loop: drop, warn once
                self.n_dropped += 1
                if not self._warned_closed:
                    self._warned_closed = True
                    logger.warning("stability event log %s: append after close(); the record "
                                   "is dropped (reported once).", self.path)
                return False
            if self._fd is None:
                self.n_dropped += 1
                return False
            done = 0
            try:
                view = memoryview(line)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
                    done += n
                if self.fsync == "always":
                    os.fsync(self._fd)
                    self.n_fsyncs += 1
                elif crit and self.fsync == "critical":
                    self._request_sync()
            except OSError as e:
                if 0 < done < len(line):  # a short write (disk full): do not leave half a record
                    try:
                        os.ftruncate(self._fd, os.fstat(self._fd).st_size - done)
                    except OSError:
                        pass
                self.n_dropped += 1
                self._fail(e)
                return False
            self.n_written += 1
            return True

    def alarm(self, alarm: Alarm, **extra: Any) -> bool:
        """Append an ``alarm`` record -- or, past the storm bounds, count it in the step's
        ``alarms_coalesced`` record (written before the next record of another kind or step).
        """
        step = int(alarm.step)
        if self._held is not None and self._held["step"] != step:
            self._write_held()
        if self.storm.admit(step):
            return self.append(alarm_record(alarm.to_dict(), **extra))
        self._hold(alarm)
        return True

    def _hold(self, alarm: Alarm) -> None:
        h = self._held
        if h is None:
            h = self._held = {"type": "alarms_coalesced", "step": int(alarm.step), "count": 0,
                              "kinds": {}, "severity": {}, "signals": []}
        h["count"] += 1
        h["kinds"][alarm.kind] = h["kinds"].get(alarm.kind, 0) + 1
        h["severity"][alarm.severity] = h["severity"].get(alarm.severity, 0) + 1
        if len(h["signals"]) < 8:
            h["signals"].append(alarm.signal)
        self.n_coalesced += 1

    def _write_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.append(held, critical="critical" in held["severity"])

    def append_unheld(self, record: Mapping[str, Any], critical: bool | None = None) -> bool:
        """:meth:`append` after writing the coalesced alarms held for the current step."""
        self._write_held()
        return self.append(record, critical)

    def intervention(self, iv: Intervention, **extra: Any) -> bool:
        """Append an ``intervention`` record (``intervention`` holds the intervention type)."""
        return self.append_unheld(intervention_record(iv.to_dict(), **extra))

    def goodput(self, step: int, stats: Mapping[str, Any]) -> bool:
        """Append a ``goodput`` record."""
        return self.append_unheld({"type": "goodput", "step": step, **stats})

    def info(self, step: int | None, message: str, **extra: Any) -> bool:
        """Append an ``info`` record."""
        return self.append_unheld({"type": "info", "step": step, "message": message, **extra})

    # ------------------------------------------------------------------ the syncer
    def _request_sync(self) -> None:
        """A critical record was written: the syncer thread fsyncs it (with any others)."""
        with self._sync:
            self._dirty += 1
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_loop, daemon=True,
                                                name="stability-event-log-fsync")
                self._syncer.start()
            self._sync.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._sync:
                if self._synced >= self._dirty:
                    self._sync.wait(SYNCER_IDLE_S)
                if self._synced >= self._dirty:  # idle (or closed): exit, restarted on demand
                    self._syncer = None
                    return
                target = self._dirty
            self._fsync_now()
            with self._sync:
                self._synced = max(self._synced, target)
                self._sync.notify_all()

    def _fsync_now(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                os.fsync(self._fd)
                self.n_fsyncs += 1
            except OSError as e:
                self._fail(e)

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until every critical record written so far is fsynced; ``True`` if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._sync:
            while self._synced < self._dirty:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._sync.wait(left)
        return True

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """``fsync`` the file now (every append is already written through to the kernel)."""
        self._write_held()
        with self._sync:
            target = self._dirty
        self._fsync_now()
        with self._sync:
            self._synced = max(self._synced, target)
            self._sync.notify_all()

    def close(self) -> None:
        """Flush and close; idempotent."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)
        with self._sync:
            self._sync.notify_all()  # an idle syncer exits

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventLog({self.path!r}, written={self.n_written}, dropped={self.n_dropped})"


def alarm_record(alarm: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The ``alarm`` record of an alarm (:meth:`Alarm.to_dict` output)."""
    return {"type": "alarm", **alarm, **extra}


def intervention_record(iv: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The ``intervention`` record of an intervention (``Intervention.to_dict`` output)."""
    d = dict(iv)
    d["intervention"] = d.pop("type")
    return {"type": "intervention", **d, **extra}


def decision_records(decision: Mapping[str, Any], **extra: Any) -> Iterator[dict[str, Any]]:
    """The event records of one decision (``Decision.to_dict`` output): its alarms, its
    interventions and one ``info`` record per skipped input -- the live log's schema.

    >>> from stability.types import Alarm, Decision, SkipStep
    >>> d = Decision(7, (Alarm(7, "loss_spike", "loss", 9.0, 6.0, "warning", "ewma_z"),),
    ...              (SkipStep(7, "L1"),))
    >>> [(r["type"], r.get("intervention")) for r in decision_records(d.to_dict(), run_id="a")]
    [('alarm', None), ('intervention', 'skip_step')]
    """
    step = decision.get("step")
    for a in decision.get("alarms", ()) or ():
        yield alarm_record(a, **extra)
    for iv in decision.get("interventions", ()) or ():
        yield intervention_record(iv, **extra)
    for msg in decision.get("skipped", ()) or ():
        yield {"type": "info", "step": step, "message": f"skipped: {msg}", **extra}


def iter_events(path: str | os.PathLike[str], errors: str = "raise") -> Iterator[dict[str, Any]]:
    """Yield the records of an event log in order.

    A torn (incomplete or unparsable) *last* line -- a write interrupted by a crash -- is
    skipped silently.  A bad line elsewhere raises ``ValueError`` (``errors="raise"``) or is
    skipped with a warning (``errors="skip"``).
    """
    check_choice("iter_events", "errors", errors, ERRORS_MODES)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    for i, raw in enumerate(lines[: last + 1]):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == last:
                return
            if errors == "raise":
                raise ValueError(f"{os.fspath(path)}:{i + 1}: corrupt event record ({e}).") from e
            logger.warning("%s:%d: skipping corrupt event record (%s).", os.fspath(path), i + 1, e)
            continue
        yield rec


def read_events(path: str | os.PathLike[str], errors: str = "raise") -> list[dict[str, Any]]:
    """All records of an event log (see :func:`iter_events`)."""
    return list(iter_events(path, check_choice("read_events", "errors", errors, ERRORS_MODES)))
