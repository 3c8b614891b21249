"""Goodput accounting: how much of the compute actually moved the model forward.

Every optimizer step the trainer runs is counted once in ``steps``.  A step is *productive*
unless it was skipped (``skip_step``) or later thrown away by a rollback (``lost``: the steps
between the restored checkpoint and the rollback).  Steps run with a cut LR or a tightened clip
are *degraded* (still productive, but slowed down); wall time is split the same way.

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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ._state_check import Fields
from .types import Control

STATE_VERSION = 1


class GoodputTracker:
    """Counters of productive, skipped, lost and degraded steps (and their wall time).

    Parameters
    ----------
    clock : callable, optional
        Wall-clock source (default :func:`time.monotonic`); the time between two consecutive
        :meth:`update` calls is attributed to the later step.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or time.monotonic
        self.steps = 0
        self.skipped = 0
        self.lost = 0
        self.rollbacks = 0
        self.degraded_steps = 0
        self.time_total = 0.0
        self.time_degraded = 0.0
        self.time_skipped = 0.0
        self._last_time: float | None = None
        self.last_step: int | None = None

    def update(self, step: int, *, skipped: bool = False, degraded: bool = False) -> None:
        """Count one optimizer step."""
        now = float(self.clock())
        dt = 0.0 if self._last_time is None else max(now - self._last_time, 0.0)
        self._last_time = now
        self.steps += 1
        self.time_total += dt
        if skipped:
            self.skipped += 1
            self.time_skipped += dt
        if degraded:
            self.degraded_steps += 1
            self.time_degraded += dt
        self.last_step = int(step)

    def update_from_control(self, step: int, control: Control) -> None:
        """Count one step from the ``Control`` the trainer acted on.

        Degraded = LR cut (``lr_factor < 1``) or a policy clip in force (``clip_norm`` set).
        A rollback requested in ``control`` is counted via :meth:`note_rollback`.
        """
        self.update(step, skipped=control.skip_step,
                    degraded=control.lr_factor < 1.0 or control.clip_norm is not None)
        if control.rollback_to is not None:
            self.note_rollback(step, control.rollback_to)

    def note_rollback(self, step: int, to_step: int) -> None:
        """A rollback at ``step`` restored the state of ``to_step``: ``step - to_step`` are lost."""
        self.rollbacks += 1
        self.lost += max(int(step) - int(to_step), 0)

    # ------------------------------------------------------------------ results
    @property
    def productive(self) -> int:
        """Steps that count: not skipped, not lost to a rollback."""
        return max(self.steps - self.skipped - self.lost, 0)

    @property
    def fraction(self) -> float:
        """``productive / steps`` (``nan`` before the first step)."""
        return self.productive / self.steps if self.steps else math.nan

    def summary(self) -> dict[str, Any]:
        """All numbers as a JSON-compatible dict (what the event log records)."""
        return {
            "steps": self.steps,
            "productive": self.productive,
            "skipped": self.skipped,
            "lost_to_rollback": self.lost,
            "rollbacks": self.rollbacks,
            "degraded_steps": self.degraded_steps,
            "goodput": None if not self.steps else self.fraction,
            "time_total_s": self.time_total,
            "time_degraded_s": self.time_degraded,
            "time_skipped_s": self.time_skipped,
        }

    def record(self) -> dict[str, Any]:
        """An event-log record: ``{"type": "goodput", "step": ..., **summary()}``."""
        return {"type": "goodput", "step": self.last_step, **self.summary()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION, "steps": self.steps, "skipped": self.skipped,
                "lost": self.lost, "rollbacks": self.rollbacks,
                "degraded_steps": self.degraded_steps, "time_total": self.time_total,
                "time_degraded": self.time_degraded, "time_skipped": self.time_skipped,
                "last_step": self.last_step}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the wall-clock origin restarts at the next update)."""
        f = Fields("GoodputTracker", sd)
        f.version(STATE_VERSION)
        counts = {k: f.integer(k, f.get(k, 0), lo=0)
                  for k in ("steps", "skipped", "lost", "rollbacks", "degraded_steps")}
        times = {k: f.number(k, f.get(k, 0.0), lo=0.0)
                 for k in ("time_total", "time_degraded", "time_skipped")}
        last_step = f.opt_integer("last_step")
        for k, v in {**counts, **times}.items():
            setattr(self, k, v)
        self.last_step = last_step
        self._last_time = None

    def __repr__(self) -> str:
        return (f"GoodputTracker(steps={self.steps}, productive={self.productive}, "
                f"skipped={self.skipped}, lost={self.lost}, degraded={self.degraded_steps})")
