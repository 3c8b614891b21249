"""Goodput accounting: how much of the compute -- and of the wall time -- moved the model forward.

**Steps.** Every optimizer step the trainer runs is counted once in ``steps``.  A step is
*productive* unless it was skipped (``skip_step``) or later thrown away by a rollback (``lost``:
the steps between the restored checkpoint and the rollback).  Steps run with a cut LR or a
tightened clip are *degraded* (still productive, but slowed down).

**Time.** :class:`GoodputTracker` is the run's one goodput ledger: the wall time it has seen is
split into buckets that add up to it (:data:`TIME_BUCKETS`):

* ``productive`` -- time of steps that count;
* ``skipped`` -- time of skipped steps;
* ``rollback`` -- time of steps later thrown away by a rollback (recompute), plus the restore;
* ``checkpoint`` -- checkpoint saves (:meth:`~GoodputTracker.note_checkpoint`);
* ``restart`` -- restarts / resume (:meth:`~GoodputTracker.note_restart`), including the work
  done since the last checkpoint that was lost at the failure;
* ``stall`` -- time beyond a normal step while no step completed (from the
  :class:`~stability.run.watchdog.StallWatchdog`);
* ``other`` -- everything else (evaluation, idle, time since the last step; see
  :meth:`~GoodputTracker.note_other` and :meth:`~GoodputTracker.sync`).

The time between two consecutive :meth:`~GoodputTracker.update` calls is the later step's time,
minus whatever was noted (checkpoint, stall, other) while it ran.  The ledger's wall time is the
time from its origin (:meth:`~GoodputTracker.start`, else the first update) to the last update
(or :meth:`~GoodputTracker.sync`), plus time noted before the origin (a restart), accumulated
over restarts through :meth:`~GoodputTracker.state_dict`.

:func:`format_goodput` renders the ledger's last record of an event log as the badput
breakdown ``stability goodput EVENTS`` prints; :class:`BulkTail` holds the steps a replay
counts in bulk until the step history is read.

Examples
--------
>>> g = GoodputTracker(clock=iter(range(0, 1000, 2)).__next__)
>>> for s in range(10):
...     g.update(s, skipped=(s == 3), degraded=(s >= 5))
>>> g.note_rollback(9, to_step=6)          # steps 7, 8, 9 are lost
>>> g.steps, g.skipped, g.lost, g.productive, g.degraded_steps
(10, 1, 3, 6, 5)
>>> round(g.fraction, 2)
0.6

In time (a clock we move by hand; a 5 s checkpoint save between steps 2 and 3):

>>> t = [0.0]
>>> g = GoodputTracker(clock=lambda: t[0])
>>> g.start()
>>> for s in range(1, 5):
...     t[0] += 10.0 + (5.0 if s == 3 else 0.0)
...     if s == 3:
...         g.note_checkpoint(5.0)
...     g.update(s)
>>> g.wall_time, g.time_buckets()["productive"], g.time_buckets()["checkpoint"]
(45.0, 40.0, 5.0)
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from stability._state_check import Fields
from stability.types import Control

STATE_VERSION = 1

#: The wall-time buckets of the ledger, in report order (they add up to the wall time).
TIME_BUCKETS = ("productive", "skipped", "rollback", "checkpoint", "restart", "stall", "other")

#: How many recent steps keep their cumulative time (for the recompute cost of a rollback; older
#: targets are priced at the mean step time).
HISTORY = 20_000


# ====== the step history, with bulk runs of steps kept lazily
# GoodputTracker keeps (step, cumulative productive time) for the last HISTORY counted steps (a
# rollback's recompute cost). A replay counts its quiet steps in bulk (update_many), tens of
# thousands at a time, and the history is read only when a rollback is counted or a step is
# marked skipped: BulkTail holds those bulk runs (their last steps only) until then, so a replay
# of quiet batches does not rebuild the 20,000 history tuples at every batch. Drained into the
# history (in order, before anything reads or appends to it), they give the deque of the
# step-by-step loop.
class BulkTail:
    """Runs of steps counted in bulk, not yet in the history deque: ``(steps, cum)`` each (the
    run's last ``maxlen`` steps, copied; the cumulative time, the same for the whole run).
    Runs wholly out of the last ``maxlen`` steps are dropped as new ones come."""

    __slots__ = ("maxlen", "runs", "n")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.runs: collections.deque[tuple[Any, float]] = collections.deque()
        self.n = 0  # steps held

    def __bool__(self) -> bool:
        return self.n > 0

    def add(self, steps: Any, cum: float) -> None:
        """Hold ``steps`` (an array or list of the run's last steps, not referenced
        elsewhere) counted at the cumulative time ``cum``."""
        runs = self.runs
        runs.append((steps, cum))
        self.n += len(steps)
        while len(runs) > 1 and self.n - len(runs[0][0]) >= self.maxlen:
            self.n -= len(runs.popleft()[0])

    def drain(self, hist: collections.deque[tuple[int, float]]) -> None:
        """Append the runs held to ``hist`` (a deque of ``maxlen`` entries), oldest first,
        and forget them."""
        for steps, cum in self.runs:
            ints = steps.tolist() if hasattr(steps, "tolist") else steps
            hist.extend(zip(ints, itertools.repeat(cum, len(ints)), strict=True))
        self.clear()

    def clear(self) -> None:
        self.runs.clear()
        self.n = 0


class GoodputTracker:
    """The goodput ledger: productive, skipped, lost and degraded steps, and wall time by bucket.

    Parameters
    ----------
    clock : callable, optional
        Wall-clock source (default :func:`time.monotonic`); the time between two consecutive
        :meth:`update` calls is attributed to the later step.
    auto_start : bool
        ``True`` (default): the first :meth:`update` starts the wall clock.  ``False``: steps
        are counted without reading the clock until :meth:`start` is called (what a
        :class:`~stability.monitor.monitor.Monitor` does: a replay or a bare ``observe()`` loop
        counts
        steps only, deterministically; the trainer adapters call :meth:`start`).

    Notes
    -----
    The ``note_*`` methods may be called from another thread (the stall watchdog does);
    :meth:`update` takes a lock only when something was noted.
    """

    def __init__(self, clock: Callable[[], float] | None = None, *,
                 auto_start: bool = True) -> None:
        self.clock = clock or time.monotonic
        self.timing = bool(auto_start)  # the wall clock is read (else steps only)
        self.steps = 0
        self.skipped = 0
        self.lost = 0
        self.lost_in_place = 0  # of ``lost``: restores that kept the position
        self.rollbacks = 0
        self.degraded_steps = 0
        self.time_total = 0.0       # step time (between updates, less what was noted)
        self.time_degraded = 0.0
        self.time_skipped = 0.0
        self.time_lost = 0.0        # step time later thrown away by rollbacks
        self.time_restore = 0.0     # rollback restores
        self.time_checkpoint = self.time_restart = self.time_stall = self.time_other = 0.0
        self.wall_time = 0.0
        self.checkpoints = self.checkpoint_failures = self.batches_skipped = 0
        self.restarts = self.stalls = 0
        self._last_dt = 0.0         # the last counted step's time (for mark_skipped)
        self._last_time: float | None = None
        self.last_step: int | None = None
        self._debt = 0.0            # noted time not yet carved out of a step interval
        self._lock = threading.Lock()
        self._cum = 0.0             # productive-so-far step time (unskipped, not lost)
        self._hist: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)
        self._bulk = BulkTail(HISTORY)  # bulk-counted steps not yet in ``_hist``
        self._cum_at_checkpoint = 0.0
        # the last rollback counted from a Control, until the trainer confirms or refuses it:
        # (step, to_step, lost steps, lost time, popped history, _cum_at_checkpoint before)
        self._requested: tuple[int, int, int, float, list[tuple[int, float]], float] | None = None

    # ------------------------------------------------------------------ steps
    def start(self) -> None:
        """Set the wall-clock origin now (else it is the first :meth:`update`) and account
        wall time from now on (also after a :meth:`load_state_dict`)."""
        self.timing = True
        if self._last_time is None:
            self._last_time = float(self.clock())

    def _close(self) -> float:
        """Close the open interval at the clock: its length less the noted time in it."""
        if not self.timing:
            return 0.0
        now = float(self.clock())
        dt = 0.0 if self._last_time is None else max(now - self._last_time, 0.0)
        self._last_time = now
        self.wall_time += dt
        if self._debt:
            with self._lock:
                carve = min(self._debt, dt)
                self._debt -= carve
            dt -= carve
        return dt

    def update(self, step: int, *, skipped: bool = False, degraded: bool = False) -> None:
        """Count one optimizer step."""
        self._requested = None  # a requested rollback is final once the next step runs
        dt = self._close() if self.timing else 0.0
        self.steps += 1
        self.time_total += dt
        if skipped:
            self.skipped += 1
            self.time_skipped += dt
        else:
            self._cum += dt
        if degraded:
            self.degraded_steps += 1
            self.time_degraded += dt
        self._last_dt = -1.0 if skipped else dt  # -1: already skipped
        self.last_step = step = int(step)
        self._history.append((step, self._cum))

    def update_many(self, steps: Any, *, skipped: bool = False, degraded: bool = False) -> None:
        """:meth:`update` for each of ``steps`` (increasing ints) in order, in bulk while the
        clock is off (replay); state and records are those of the loop."""
        n = len(steps)
        if self.timing or n == 0:
            for s in steps:
                self.update(int(s), skipped=skipped, degraded=degraded)
            return
        self._requested = None
        self.steps += n
        self.time_total += 0.0
        if skipped:
            self.skipped += n
            self.time_skipped += 0.0
        else:
            self._cum += 0.0
        if degraded:
            self.degraded_steps += n
            self.time_degraded += 0.0
        self._last_dt = -1.0 if skipped else 0.0
        tail = steps[-HISTORY:]
        if isinstance(tail, np.ndarray):  # copied: the caller's array may change
            self.last_step = tail[-1].item()
            self._bulk.add(tail.copy(), self._cum)
        else:
            ints = tail.tolist() if hasattr(tail, "tolist") else [int(s) for s in tail]
            self.last_step = ints[-1]
            self._bulk.add(ints, self._cum)

    @property
    def _history(self) -> collections.deque[tuple[int, float]]:
        """``(step, cumulative productive time)`` of the last :data:`HISTORY` steps counted."""
        if self._bulk.n:
            self._bulk.drain(self._hist)
        return self._hist

    def update_from_control(self, step: int, control: Control) -> None:
        """Count one step from the ``Control`` the trainer acted on.

        Degraded = LR cut (``lr_factor < 1``) or a policy clip in force (``clip_norm`` set).
        A rollback requested in ``control`` is counted via :meth:`note_rollback`, as requested;
        until the next step the trainer may replace that count with the rollback it really did
        (:meth:`rollback_done`) or withdraw it (:meth:`cancel_rollback`).  The monitor feeds
        the ledger so (live and in replay): an adapter never counts a rollback twice.
        """
        skipped = control.skip_step
        degraded = control.lr_factor < 1.0 or control.clip_norm is not None
        if self.timing or type(step) is not int:
            self.update(step, skipped=skipped, degraded=degraded)
        else:  # update(), inlined with the clock off (dt = 0.0, the same additions)
            self._requested = None
            self.steps += 1
            self.time_total += 0.0
            if skipped:
                self.skipped += 1
                self.time_skipped += 0.0
            else:
                self._cum += 0.0
            if degraded:
                self.degraded_steps += 1
                self.time_degraded += 0.0
            self._last_dt = -1.0 if skipped else 0.0
            self.last_step = step
            self._history.append((step, self._cum))
        if control.rollback_to is not None:
            self.note_rollback(step, control.rollback_to, _requested=True)

    def mark_skipped(self, step: int) -> bool:
        """The trainer did not apply the update of ``step``, the last counted step, although
        its ``Control`` did not ask to skip (another rank did): count it as skipped now.

        Returns whether it changed anything (``False`` if already skipped or not the last).
        """
        if self.last_step != int(step) or self._last_dt < 0 or not self._history:
            return False
        dt, self._last_dt = self._last_dt, -1.0
        self.skipped += 1
        self.time_skipped += dt
        self._cum -= dt
        self._history[-1] = (self.last_step, self._cum)
        return True

    def cancel_rollback(self, step: int) -> bool:
        """Withdraw the rollback counted from the ``Control`` of ``step`` (the trainer could
        not carry it out); returns whether there was one to withdraw.

        Only the latest requested rollback, before the next :meth:`update`, can be withdrawn.
        """
        req = self._requested
        if req is None or req[0] != int(step):
            return False
        self._requested = None
        _, _, n, lost, popped, cum_at = req
        self.rollbacks -= 1
        self.lost -= n
        self.time_lost -= lost
        self._cum += lost
        self._cum_at_checkpoint = cum_at
        self._history.extend(reversed(popped))
        return True

    def rollback_done(self, step: int, to_step: int, seconds: float = 0.0) -> None:
        """The trainer rolled back at ``step`` to ``to_step`` in ``seconds`` of restore time.

        Replaces the rollback counted from this step's ``Control`` (the checkpoint restored
        may be older than the one requested), or counts it when none was requested here
        (e.g. another rank asked): each rollback is counted exactly once.
        """
        self.cancel_rollback(step)
        self.note_rollback(step, to_step, seconds)

    def note_lost_in_place(self, n: int) -> None:
        """``n`` of the steps a rollback just lost were lost by a restore that kept the
        position (the step counter and scheduler were not rewound; still counted in ``lost``).

        Examples
        --------
        >>> g = GoodputTracker(auto_start=False)
        >>> g.note_rollback(9, to_step=6); g.note_lost_in_place(3)
        >>> g.lost, g.lost_in_place
        (3, 3)
        """
        self.lost_in_place += max(int(n), 0)

    def note_rollback(self, step: int, to_step: int, seconds: float = 0.0, *,
                      _requested: bool = False) -> None:
        """A rollback at ``step`` restored the state of ``to_step``: ``step - to_step`` are lost.

        Their (unskipped) step time moves to the ``rollback`` bucket, with ``seconds`` spent
        restoring.
        """
        self.rollbacks += 1
        self.lost += max(int(step) - int(to_step), 0)
        n = max(int(step) - int(to_step), 0)
        cum_before, cum_at_before = self._cum, self._cum_at_checkpoint
        hist, popped = self._history, None
        popped_all: list[tuple[int, float]] = []
        while hist and hist[-1][0] > to_step:
            popped = hist.pop()
            popped_all.append(popped)
        if popped is not None and hist:           # the target is inside the history
            lost = self._cum - hist[-1][1]
        elif popped is not None:                  # older: price the rest at the mean step time
            lost = self._cum - popped[1] + self._mean_step() * (popped[0] - int(to_step))
        else:                                     # no history (after a restore)
            lost = self._mean_step() * n if not hist else 0.0
        lost = min(max(lost, 0.0), self._cum)
        self.time_lost += lost
        self._cum -= lost
        self._cum_at_checkpoint = min(self._cum_at_checkpoint, self._cum)
        self._requested = ((int(step), int(to_step), n, cum_before - self._cum, popped_all,
                            cum_at_before) if _requested else None)
        self._note("time_restore", seconds)

    def _mean_step(self) -> float:
        n = self.steps - self.skipped
        return (self.time_total - self.time_skipped) / n if n > 0 else 0.0

    # ------------------------------------------------------------------ time not in steps
    def _note(self, bucket: str, seconds: float) -> None:
        s = float(seconds)
        if not math.isfinite(s) or s <= 0.0:
            return
        with self._lock:
            setattr(self, bucket, getattr(self, bucket) + s)
            if self._last_time is None:
                self.wall_time += s       # before the origin: a closed interval of its own
            else:
                self._debt += s           # inside the open interval: carved out of it

    def note_checkpoint(self, seconds: float) -> None:
        """A checkpoint save took ``seconds`` (of the current interval)."""
        self.checkpoints += 1
        self._cum_at_checkpoint = self._cum
        self._note("time_checkpoint", seconds)

    def note_checkpoint_failed(self) -> None:
        """A checkpoint save failed (training went on)."""
        self.checkpoint_failures += 1

    def note_batch_skipped(self, n: int = 1) -> None:
        """``n`` batches were skipped without a step (a rollback asked to skip bad data)."""
        self.batches_skipped += max(int(n), 0)

    def note_restart(self, seconds: float, lost_s: float = 0.0) -> None:
        """A restart / resume took ``seconds``; ``lost_s`` of work since the last checkpoint
        was lost at the failure (both in the ``restart`` bucket).

        Called before the first step after a resume, the time is added to the wall time (it
        happened before this process's clock origin); later, it is carved out of the open
        interval like a checkpoint.
        """
        self.restarts += 1
        self._note("time_restart", float(seconds) + max(float(lost_s), 0.0))

    def note_stall(self, seconds: float) -> None:
        """``seconds`` beyond a normal step went by without a step completing."""
        self.stalls += 1
        self._note("time_stall", seconds)

    def note_other(self, seconds: float) -> None:
        """``seconds`` of the current interval were neither a step nor overhead (evaluation)."""
        self._note("time_other", seconds)

    def sync(self) -> None:
        """Close the books now: the time since the last update (less what was noted in it) is
        ``other`` (call at the end of a run, or before a :meth:`record` between steps)."""
        if self._last_time is None:
            return
        self.time_other += self._close()

    @property
    def unsaved_s(self) -> float:
        """Productive step time since the last :meth:`note_checkpoint` (lost at a failure now)."""
        return max(self._cum - self._cum_at_checkpoint, 0.0)

    # ------------------------------------------------------------------ results
    @property
    def productive(self) -> int:
        """Steps that count: not skipped, not lost to a rollback."""
        return max(self.steps - self.skipped - self.lost, 0)

    @property
    def fraction(self) -> float:
        """``productive / steps`` (``nan`` before the first step)."""
        return self.productive / self.steps if self.steps else math.nan

    def time_buckets(self) -> dict[str, float]:
        """Wall time by bucket (:data:`TIME_BUCKETS`); the values add up to :attr:`wall_time`
        (less noted time not yet inside a closed interval)."""
        productive = max(self.time_total - self.time_skipped - self.time_lost, 0.0)
        return {"productive": productive, "skipped": self.time_skipped,
                "rollback": self.time_lost + self.time_restore,
                "checkpoint": self.time_checkpoint, "restart": self.time_restart,
                "stall": self.time_stall, "other": self.time_other}

    @property
    def time_fraction(self) -> float:
        """Productive share of the wall time (``nan`` before any time was seen)."""
        return self.time_buckets()["productive"] / self.wall_time if self.wall_time else math.nan

    def summary(self) -> dict[str, Any]:
        """All numbers as a JSON-compatible dict (what the event log records)."""
        buckets = self.time_buckets()
        w = self.wall_time
        return {
            "steps": self.steps, "productive": self.productive, "skipped": self.skipped,
            "lost_to_rollback": self.lost, "lost_in_place": self.lost_in_place,
            "rollbacks": self.rollbacks,
            "degraded_steps": self.degraded_steps, "checkpoints": self.checkpoints,
            "checkpoint_failures": self.checkpoint_failures,
            "batches_skipped": self.batches_skipped, "restarts": self.restarts,
            "stalls": self.stalls, "goodput": None if not self.steps else self.fraction,
            "goodput_time": None if not w else buckets["productive"] / w, "wall_time_s": w,
            "time_s": buckets,
            "time_fraction": {k: (v / w if w else None) for k, v in buckets.items()},
            "time_total_s": self.time_total, "time_degraded_s": self.time_degraded,
            "time_skipped_s": self.time_skipped,
        }

    def record(self) -> dict[str, Any]:
        """An event-log record: ``{"type": "goodput", "step": ..., **summary()}``."""
        return {"type": "goodput", "step": self.last_step, **self.summary()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION, "steps": self.steps, "skipped": self.skipped,
                "lost": self.lost, "lost_in_place": self.lost_in_place, "rollbacks": self.rollbacks,
                "degraded_steps": self.degraded_steps, "time_total": self.time_total,
                "time_degraded": self.time_degraded, "time_skipped": self.time_skipped,
                "last_step": self.last_step, "time_lost": self.time_lost,
                "time_restore": self.time_restore, "time_checkpoint": self.time_checkpoint,
                "time_restart": self.time_restart, "time_stall": self.time_stall,
                "time_other": self.time_other, "wall_time": self.wall_time + self._debt,
                "checkpoints": self.checkpoints, "restarts": self.restarts,
                "checkpoint_failures": self.checkpoint_failures,
                "batches_skipped": self.batches_skipped,
                "stalls": self.stalls, "cum": self._cum,
                "cum_at_checkpoint": self._cum_at_checkpoint}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the wall-clock origin restarts at the next update).

        Rollbacks to steps before the restore price the lost steps at the mean step time.
        Every field is checked first (``ValueError`` naming it; the tracker is then unchanged):
        counts are non-negative ints, times finite and non-negative.
        """
        f = Fields("GoodputTracker", sd)
        f.version(STATE_VERSION)
        vals: dict[str, Any] = {
            k: f.integer(k, f.get(k, 0), lo=0)
            for k in ("steps", "skipped", "lost", "lost_in_place", "rollbacks", "degraded_steps",
                      "checkpoints", "restarts", "stalls", "checkpoint_failures",
                      "batches_skipped")}
        for k in ("time_total", "time_degraded", "time_skipped", "time_lost", "time_restore",
                  "time_checkpoint", "time_restart", "time_stall", "time_other"):
            vals[k] = f.number(k, f.get(k, 0.0), lo=0.0)
        vals["wall_time"] = f.number("wall_time", f.get("wall_time", vals["time_total"]), lo=0.0)
        cum = f.number("cum", f.get("cum", max(
            vals["time_total"] - vals["time_skipped"] - vals["time_lost"], 0.0)), lo=0.0)
        cum_at = f.number("cum_at_checkpoint", f.get("cum_at_checkpoint", cum), lo=0.0)
        last_step = f.opt_integer("last_step")
        for k, v in vals.items():
            setattr(self, k, v)
        self.last_step = last_step
        self._last_time = None
        self._cum, self._cum_at_checkpoint = cum, cum_at
        self._debt = 0.0
        self._hist.clear()
        self._bulk.clear()
        self._requested = None
        self._last_dt = -1.0

    def __repr__(self) -> str:
        return (f"GoodputTracker(steps={self.steps}, productive={self.productive}, "
                f"skipped={self.skipped}, lost={self.lost}, degraded={self.degraded_steps})")


# ====== text rendering of the ledger (``stability goodput EVENTS``)
def _hms(s: float) -> str:
    s = float(s)
    if 0 < s < 1:
        return f"{1000 * s:.1f}ms"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def format_goodput(records: Iterable[Mapping[str, Any]], width: int = 30) -> str:
    """The badput breakdown of an event log, as text (``stability goodput EVENTS``).

    Uses the last ``goodput`` record (the ledger is cumulative, across restarts too) and counts
    ``stall`` records.

    Examples
    --------
    >>> g = GoodputTracker(clock=iter([0.0, 10.0, 20.0, 35.0]).__next__)
    >>> g.start(); g.update(1); g.note_checkpoint(5.0); g.update(2); g.update(3)
    >>> print(format_goodput([g.record()]))  # doctest: +NORMALIZE_WHITESPACE
    goodput at step 3: 100.0% of steps productive (3 of 3), 85.7% of wall time
    wall time 35.0s (1 checkpoints, 0 restarts, 0 rollbacks, 0 stalls)
      productive        30.0s   85.7%  ##########################
      skipped            0.0s    0.0%
      rollback           0.0s    0.0%
      checkpoint         5.0s   14.3%  ####
      restart            0.0s    0.0%
      stall              0.0s    0.0%
      other              0.0s    0.0%
    """
    last: Mapping[str, Any] | None = None
    n_stalls = 0
    for r in records:
        if r.get("type") == "goodput":
            last = r
        elif r.get("type") == "stall":
            n_stalls += 1
    if last is None:
        return "no goodput records (log GoodputTracker.record() to the event log)"
    steps = int(last.get("steps", 0) or 0)
    prod = int(last.get("productive", 0) or 0)
    gp = last.get("goodput")
    head = (f"goodput at step {last.get('step')}: "
            + (f"{100 * float(gp):.1f}% of steps productive ({prod} of {steps})"
               if gp is not None else "no steps"))
    times = last.get("time_s")
    wall = float(last.get("wall_time_s", 0.0) or 0.0)
    if not isinstance(times, Mapping) or wall <= 0:
        return head
    lines = [head + f", {100 * times.get('productive', 0.0) / wall:.1f}% of wall time",
             f"wall time {_hms(wall)} ({last.get('checkpoints', 0)} checkpoints, "
             f"{last.get('restarts', 0)} restarts, {last.get('rollbacks', 0)} rollbacks, "
             f"{max(int(last.get('stalls', 0) or 0), n_stalls)} stalls)"]
    for name in TIME_BUCKETS:
        v = float(times.get(name, 0.0) or 0.0)
        frac = v / wall
        bar = "#" * int(round(frac * width))
        lines.append(f"  {name:<12} {_hms(v):>9} {100 * frac:6.1f}%  {bar}".rstrip())
    return "\n".join(lines)
