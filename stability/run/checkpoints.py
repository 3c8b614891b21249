"""The checkpoint ledger: which checkpoints exist, which are healthy, which go, what a rollback
restores.

A :class:`CheckpointLedger` records every checkpoint the trainer takes (step, path or id, the
health flag at save time, a reason, and ``covers_step`` -- the last optimizer step whose update
the saved state contains).  It is also told about alarm steps (:meth:`CheckpointLedger.note_alarm`;
the policy does this for every step it responds to).  A checkpoint counts as *healthy* only if it
was flagged healthy when saved **and** no noted alarm lies within ``margin`` steps of its
``covers_step`` (either side: detectors fire with a delay, so a state saved just before an alarm
may already be damaged).  :meth:`CheckpointLedger.latest_healthy_before` therefore never returns
a damaged state.

It is the run's **one** registry of checkpoints.  The adapters' stores
(:class:`~stability.adapters.torch_ops.checkpoint_store.CheckpointStore`, the HF / Lightning trainer
stores) only do the file IO: they :meth:`~CheckpointLedger.attach` themselves as the ledger's
:class:`CheckpointFiles`, register what they write, and let the ledger decide what is pruned
(:meth:`~CheckpointLedger.prune`, :meth:`~CheckpointLedger.retention`) and what a rollback
targets.  Every record that leaves the ledger (pruned, rewound, replaced, forgotten) is handed to
the attached files object to delete, so a file and its record always go together; a record whose
file is gone is dropped (with a warning) the moment a query meets it, so a rollback never targets
a missing checkpoint.

Examples
--------
>>> led = CheckpointLedger(margin=5)
>>> for s in (100, 200, 300):
...     _ = led.add(s, f"ckpt-{s}")
>>> led.note_alarm(297)                       # the 300 checkpoint is within 5 steps of an alarm
>>> led.latest_healthy_before(310).step
200
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from stability._state_check import Fields

__all__ = ["CheckpointFiles", "CheckpointLedger", "CheckpointRecord", "keep_last_plan",
           "retention_plan"]

logger = logging.getLogger("stability.checkpoints")

STATE_VERSION = 1

#: Path prefix of checkpoints held in memory (``"memory:step-<N>"``): never a file.
MEMORY_PREFIX = "memory:"


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint the trainer saved.

    ``data_position`` is the index of the next batch to read after restoring it (0 when
    unknown); ``managed`` says whether the store that wrote it may delete it under retention
    (``False``: it belongs to the trainer's or the user's own schedule, e.g. HF's
    ``checkpoint-N`` directories, and is only forgotten).
    """

    step: int
    path: str
    healthy: bool = True
    reason: str = ""
    covers_step: int = -1  #: last step whose update the state contains (-1: same as ``step``)
    data_position: int = 0
    managed: bool = False

    @property
    def covers(self) -> int:
        """``covers_step``, defaulting to ``step``."""
        return self.step if self.covers_step < 0 else self.covers_step

    @property
    def in_memory(self) -> bool:
        """Whether the checkpoint is an in-memory copy (``path`` starts ``"memory:"``)."""
        return self.path.startswith(MEMORY_PREFIX)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointRecord:
        return cls(int(d["step"]), str(d["path"]), bool(d.get("healthy", True)),
                   str(d.get("reason", "")), int(d.get("covers_step", -1)),
                   int(d.get("data_position", 0)), bool(d.get("managed", False)))


@runtime_checkable
class CheckpointFiles(Protocol):
    """What the ledger asks of the store holding the checkpoints (the file IO side)."""

    def exists(self, rec: CheckpointRecord) -> bool:
        """Whether the checkpoint of ``rec`` can still be restored (its file is there)."""
        ...

    def delete(self, rec: CheckpointRecord) -> None:
        """``rec`` left the ledger: delete its file if the store manages it (never raises)."""
        ...


def retention_plan(
    steps: Iterable[int], keep_last: int = 3, interval: int = 1000, growth: float = 2.0
) -> list[int]:
    """Steps to delete so recent checkpoints stay dense and older ones sparse.

    The ``keep_last`` newest are kept; older ones are grouped by age (relative to the newest) into
    buckets ``[0, interval)``, ``[interval, interval*growth)``,
    ``[interval*growth, interval*growth^2)``, ... and only the oldest checkpoint of each bucket
    is kept.  The number kept grows like ``keep_last + log(span / interval) / log(growth)``.

    Examples
    --------
    >>> retention_plan(range(0, 1100, 100), keep_last=2, interval=100, growth=2.0)
    [100, 200, 400, 500, 600, 800]
    """
    if keep_last < 0 or interval < 1 or not growth > 1.0:
        raise ValueError("retention_plan needs keep_last >= 0, interval >= 1 and growth > 1.")
    ordered = sorted(set(int(s) for s in steps), reverse=True)
    if not ordered:
        return []
    newest = ordered[0]
    oldest_in_bucket: dict[int, int] = {}
    for s in ordered[keep_last:]:
        age = newest - s
        b = 0 if age < interval else 1 + int(math.floor(math.log(age / interval, growth) + 1e-12))
        oldest_in_bucket[b] = s  # iterating newest -> oldest: the last write is the oldest
    keep = set(ordered[:keep_last]) | set(oldest_in_bucket.values())
    return sorted(s for s in ordered if s not in keep)


def keep_last_plan(records: Iterable[CheckpointRecord], keep: int,
                   protect: Iterable[int] = (),
                   healthy: Callable[[CheckpointRecord], bool] | None = None) -> list[int]:
    """Steps to delete: all but the ``keep`` newest healthy checkpoints, the newest unhealthy
    (emergency) one and the ``protect`` ones (rollback targets still needed).

    ``healthy(rec)`` decides health (default: the flag saved with the record).

    Examples
    --------
    >>> recs = [CheckpointRecord(s, f"c{s}", healthy=s != 30) for s in (10, 20, 30, 40)]
    >>> keep_last_plan(recs, keep=1), keep_last_plan(recs, keep=1, protect={10})
    ([10, 20], [20])
    """
    if keep < 0:
        raise ValueError(f"The 'keep' parameter of keep_last_plan must be >= 0. Got {keep}.")
    ok = healthy if healthy is not None else (lambda r: r.healthy)
    ordered = sorted(records, key=lambda r: r.step)
    good = [r.step for r in ordered if ok(r)]
    kept = set(int(s) for s in protect)
    kept.update(good[max(len(good) - keep, 0):] if keep else [])
    kept.update([r.step for r in ordered if not ok(r)][-1:])
    return [r.step for r in ordered if r.step not in kept]


class CheckpointLedger:
    """Record of checkpoints and alarm steps; answers "where can I roll back to?".

    Parameters
    ----------
    margin : int
        A checkpoint is unhealthy if a noted alarm lies within ``margin`` steps of the step it
        covers; a rollback target for onset ``o`` must cover a step ``< o - margin``.

    Notes
    -----
    A checkpoint's identity is its ``step``: adding a record for a step the ledger already has
    replaces the old one.  A store attached with :meth:`attach` is told about every record that
    leaves the ledger (and deletes the file); the ledger state (:meth:`state_dict`) is data only.

    Examples
    --------
    >>> led = CheckpointLedger()
    >>> _ = led.add(10, "a"); _ = led.add(20, "b", healthy=False, reason="emergency")
    >>> led.latest_healthy_before(25).path
    'a'
    >>> CheckpointLedger.from_state_dict(led.state_dict()).records == led.records
    True
    """

    def __init__(self, margin: int = 0) -> None:
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"The 'margin' parameter of CheckpointLedger must be an int >= 0. "
                             f"Got {margin!r} instead.")
        self.margin = margin
        self.records: list[CheckpointRecord] = []
        self._alarms: list[list[int]] = []  # sorted, disjoint closed intervals of alarm steps
        self.files: CheckpointFiles | None = None  # the store doing the file IO (not state)

    # ------------------------------------------------------------------ the store
    def attach(self, files: CheckpointFiles) -> None:
        """Make ``files`` the store of this ledger's checkpoints (replaces any other)."""
        self.files = files

    def detach(self, files: CheckpointFiles) -> None:
        """Undo :meth:`attach` (only if ``files`` is the attached store)."""
        if self.files is files:
            self.files = None

    def _release(self, recs: Iterable[CheckpointRecord]) -> None:
        """Records left the ledger: the store deletes their files (failures only logged)."""
        files = self.files
        if files is None:
            return
        for r in recs:
            try:
                files.delete(r)
            except Exception:  # bookkeeping must never kill the run
                logger.warning("could not delete the checkpoint of step %d (%s)", r.step,
                               r.path, exc_info=True)

    def _exists(self, rec: CheckpointRecord) -> bool:
        files = self.files
        if files is None:
            return True
        try:
            return bool(files.exists(rec))
        except Exception:  # a failing probe: treat as present, the restore will tell
            logger.debug("checkpoint probe failed for step %d", rec.step, exc_info=True)
            return True

    # ------------------------------------------------------------------ recording
    def add(self, step: int, path: str, healthy: bool = True, reason: str = "",
            covers_step: int | None = None, *, data_position: int = 0,
            managed: bool = False) -> CheckpointRecord:
        """Record a checkpoint (kept sorted by covered step); returns the record.

        A record of the same ``step`` is replaced (its file deleted if the path differs).
        """
        rec = CheckpointRecord(int(step), str(path), bool(healthy), str(reason),
                               -1 if covers_step is None else int(covers_step),
                               int(data_position), bool(managed))
        old = [r for r in self.records if r.step == rec.step]
        if old:
            self.records = [r for r in self.records if r.step != rec.step]
            self._release(r for r in old if r.path != rec.path)
        keys = [r.covers for r in self.records]
        self.records.insert(bisect.bisect_right(keys, rec.covers), rec)
        return rec

    def note_alarm(self, step: int, end: int | None = None) -> None:
        """Note that alarms fired on steps ``step .. end`` (inclusive; idempotent)."""
        lo, hi = int(step), int(step if end is None else end)
        iv = self._alarms
        i = bisect.bisect_left(iv, [lo, lo])
        if i > 0 and iv[i - 1][1] >= lo - 1:
            i -= 1
        j = i
        while j < len(iv) and iv[j][0] <= hi + 1:
            lo, hi = min(lo, iv[j][0]), max(hi, iv[j][1])
            j += 1
        iv[i:j] = [[lo, hi]]

    def forget(self, step: int) -> list[CheckpointRecord]:
        """Drop the record of the checkpoint of ``step`` (its file is deleted by the attached
        store if it manages it); returns the dropped records."""
        gone = [r for r in self.records if r.step == int(step)]
        if gone:
            self.records = [r for r in self.records if r.step != int(step)]
            self._release(gone)
        return gone

    def rewind(self, to_step: int) -> list[CheckpointRecord]:
        """Forget everything after ``to_step`` (a rollback restarted the step count there).

        Returns the dropped records: checkpoints of the abandoned timeline (the attached store
        deletes the ones it manages).
        """
        dropped = [r for r in self.records if r.covers > to_step]
        self.records = [r for r in self.records if r.covers <= to_step]
        self._alarms = [[a, min(b, to_step)] for a, b in self._alarms if a <= to_step]
        self._release(dropped)
        return dropped

    # ------------------------------------------------------------------ queries
    def get(self, step: int) -> CheckpointRecord | None:
        """The record of ``step`` if it exists and its checkpoint is still there."""
        for rec in self.records:
            if rec.step == int(step):
                return rec if self._present(rec) else None
        return None

    def _present(self, rec: CheckpointRecord) -> bool:
        """``rec``'s checkpoint is there; if not, the record is dropped with a warning."""
        if self._exists(rec):
            return True
        (logger.info if rec.in_memory else logger.warning)(
            "checkpoint of step %d (%s) is gone: dropped from the ledger, never a rollback "
            "target", rec.step, rec.path)
        self.records = [r for r in self.records if r is not rec]
        self._release([rec])
        return False

    def verify(self) -> list[CheckpointRecord]:
        """Drop (with a warning) every record whose checkpoint is gone; returns them."""
        gone = [r for r in list(self.records) if not self._exists(r)]
        for r in gone:
            self._present(r)
        return gone

    def alarm_near(self, step: int, margin: int | None = None) -> bool:
        """``True`` if a noted alarm lies in ``[step - margin, step + margin]``."""
        m = self.margin if margin is None else margin
        lo, hi = step - m, step + m
        i = bisect.bisect_right(self._alarms, [hi, math.inf]) - 1
        return i >= 0 and self._alarms[i][1] >= lo

    def is_healthy(self, rec: CheckpointRecord, margin: int | None = None) -> bool:
        """Flagged healthy at save time and no noted alarm within ``margin`` of its step."""
        return rec.healthy and not self.alarm_near(rec.covers, margin)

    def latest_healthy_before(self, step: int, margin: int | None = None
                              ) -> CheckpointRecord | None:
        """The latest healthy checkpoint covering a step ``< step - margin`` (``None`` if none).

        A candidate whose checkpoint is gone (the attached store cannot find it) is dropped
        from the ledger on the way, so the answer is always restorable.
        """
        m = self.margin if margin is None else margin
        for rec in reversed(list(self.records)):
            if rec.covers < step - m and self.is_healthy(rec, m) and self._present(rec):
                return rec
        return None

    # ------------------------------------------------------------------ retention
    def prune(self, keep: int, protect: Iterable[int] = (), margin: int | None = None
              ) -> list[CheckpointRecord]:
        """Keep-last retention over the *managed* records; the others are dropped and deleted.

        Kept: the ``keep`` newest healthy ones (:meth:`is_healthy` with ``margin``), the newest
        unhealthy (emergency) one, the steps in ``protect`` (rollback targets still needed) and
        every unmanaged record.  Returns the dropped records.
        """
        managed = [r for r in self.records if r.managed]
        doomed = set(keep_last_plan(managed, keep, protect,
                                    lambda r: self.is_healthy(r, margin)))
        out = [r for r in managed if r.step in doomed]
        if out:
            gone = {id(r) for r in out}
            self.records = [r for r in self.records if id(r) not in gone]
            self._release(out)
        return out

    def retention(self, keep_last: int = 3, interval: int = 1000, growth: float = 2.0
                  ) -> list[CheckpointRecord]:
        """Records to delete (see :func:`retention_plan`); they are removed from the ledger
        (and deleted by the attached store if it manages them).

        The latest healthy checkpoint is always kept (it is the rollback target).
        """
        protect = self.latest_healthy_before(2**62)
        doomed = set(retention_plan([r.covers for r in self.records], keep_last, interval, growth))
        out = [r for r in self.records if r.covers in doomed and r is not protect]
        gone = {id(r) for r in out}
        self.records = [r for r in self.records if id(r) not in gone]
        if self.records:
            first = self.records[0].covers - self.margin
            self._alarms = [iv for iv in self._alarms if iv[1] >= first]
        self._release(out)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION, "margin": self.margin,
                "records": [r.to_dict() for r in self.records],
                "alarms": [list(iv) for iv in self._alarms]}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore the records and alarm steps of :meth:`state_dict` output.

        This ledger's ``margin`` wins (use :meth:`from_state_dict` for the snapshot's).  Every
        field is checked first (``ValueError`` naming it; the ledger is then unchanged);
        records are re-sorted and alarm intervals re-merged, so the ledger's invariants hold
        whatever order the snapshot lists them in (of two records of one step the later wins).
        Nothing is deleted: the attached store reconciles the records with its files
        (:meth:`verify`).
        """
        f = Fields("CheckpointLedger", sd)
        f.version(STATE_VERSION)
        records: dict[int, CheckpointRecord] = {}
        for i, r in enumerate(f.seq("records", None, f.get("records", []))):
            g = Fields("CheckpointLedger", r, f"records[{i}].")
            rec = CheckpointRecord(
                g.integer("step"), g.text("path"), g.flag("healthy", True), g.text("reason", ""),
                g.integer("covers_step", g.get("covers_step", -1), lo=-1),
                g.integer("data_position", g.get("data_position", 0), lo=0),
                g.flag("managed", False))
            records[rec.step] = rec
        alarms = []
        for i, iv in enumerate(f.seq("alarms", None, f.get("alarms", []))):
            lo, hi = f.seq(f"alarms[{i}]", 2, iv)
            lo, hi = f.integer(f"alarms[{i}][0]", lo), f.integer(f"alarms[{i}][1]", hi)
            if hi < lo:
                f.fail(f"alarms[{i}]", "an interval [first, last] with first <= last", iv)
            alarms.append((lo, hi))
        self.records = sorted(records.values(), key=lambda r: r.covers)
        self._alarms = []
        for lo, hi in sorted(alarms):
            self.note_alarm(lo, hi)

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any]) -> CheckpointLedger:
        """A ledger with the snapshot's own ``margin``, then loaded."""
        f = Fields("CheckpointLedger", sd)
        led = cls(f.integer("margin", f.get("margin", 0), lo=0))
        led.load_state_dict(sd)
        return led

    def __len__(self) -> int:
        return len(self.records)
