"""Healthy-checkpoint bookkeeping: which checkpoint may a rollback restore, which may be deleted.

A :class:`CheckpointLedger` records every checkpoint the trainer takes (step, path or id, the
health flag at save time, a reason, and ``covers_step`` -- the last optimizer step whose update
the saved state contains).  It is also told about alarm steps (:meth:`CheckpointLedger.note_alarm`;
the policy does this for every step it responds to).  A checkpoint counts as *healthy* only if it
was flagged healthy when saved **and** no noted alarm lies within ``margin`` steps of its
``covers_step`` (either side: detectors fire with a delay, so a state saved just before an alarm
may already be damaged).  :meth:`CheckpointLedger.latest_healthy_before` therefore never returns
a damaged state.

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
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ._state_check import Fields

STATE_VERSION = 1


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint the trainer saved."""

    step: int
    path: str
    healthy: bool = True
    reason: str = ""
    covers_step: int = -1  #: last step whose update the state contains (-1: same as ``step``)

    @property
    def covers(self) -> int:
        """``covers_step``, defaulting to ``step``."""
        return self.step if self.covers_step < 0 else self.covers_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointRecord:
        return cls(int(d["step"]), str(d["path"]), bool(d.get("healthy", True)),
                   str(d.get("reason", "")), int(d.get("covers_step", -1)))


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


class CheckpointLedger:
    """Record of checkpoints and alarm steps; answers "where can I roll back to?".

    Parameters
    ----------
    margin : int
        A checkpoint is unhealthy if a noted alarm lies within ``margin`` steps of the step it
        covers; a rollback target for onset ``o`` must cover a step ``< o - margin``.

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

    # ------------------------------------------------------------------ recording
    def add(self, step: int, path: str, healthy: bool = True, reason: str = "",
            covers_step: int | None = None) -> CheckpointRecord:
        """Record a checkpoint (kept sorted by covered step); returns the record."""
        rec = CheckpointRecord(int(step), str(path), bool(healthy), str(reason),
                               -1 if covers_step is None else int(covers_step))
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

    def forget(self, step: int) -> None:
        """Drop the records of the checkpoint of ``step`` (it was deleted by retention)."""
        self.records = [r for r in self.records if r.step != int(step)]

    def rewind(self, to_step: int) -> list[CheckpointRecord]:
        """Forget everything after ``to_step`` (a rollback restarted the step count there).

        Returns the dropped records (checkpoints of the abandoned timeline, which the caller may
        delete).
        """
        dropped = [r for r in self.records if r.covers > to_step]
        self.records = [r for r in self.records if r.covers <= to_step]
        self._alarms = [[a, min(b, to_step)] for a, b in self._alarms if a <= to_step]
        return dropped

    # ------------------------------------------------------------------ queries
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
        """The latest healthy checkpoint covering a step ``< step - margin`` (``None`` if none)."""
        m = self.margin if margin is None else margin
        for rec in reversed(self.records):
            if rec.covers < step - m and self.is_healthy(rec, m):
                return rec
        return None

    def retention(self, keep_last: int = 3, interval: int = 1000, growth: float = 2.0
                  ) -> list[CheckpointRecord]:
        """Records to delete (see :func:`retention_plan`); they are removed from the ledger.

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
        whatever order the snapshot lists them in.
        """
        f = Fields("CheckpointLedger", sd)
        f.version(STATE_VERSION)
        records = []
        for i, r in enumerate(f.seq("records", None, f.get("records", []))):
            g = Fields("CheckpointLedger", r, f"records[{i}].")
            records.append(CheckpointRecord(
                g.integer("step"), g.text("path"), g.flag("healthy", True), g.text("reason", ""),
                g.integer("covers_step", g.get("covers_step", -1), lo=-1)))
        alarms = []
        for i, iv in enumerate(f.seq("alarms", None, f.get("alarms", []))):
            lo, hi = f.seq(f"alarms[{i}]", 2, iv)
            lo, hi = f.integer(f"alarms[{i}][0]", lo), f.integer(f"alarms[{i}][1]", hi)
            if hi < lo:
                f.fail(f"alarms[{i}]", "an interval [first, last] with first <= last", iv)
            alarms.append((lo, hi))
        self.records = sorted(records, key=lambda r: r.covers)
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
