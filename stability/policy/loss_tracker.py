"""Loss tracker: is the run measurably worse than before the episode?

Two exponentially weighted means of ``log(loss)``: a recent one (``fast``, every finite loss)
and a baseline (``base``) that only learns from steps the caller calls *quiet* -- outside an
alarm episode -- so an episode cannot drag its own reference up.  Non-finite losses are counted
(``nonfinite_run``: consecutive observed steps) and never enter either mean.

Examples
--------
>>> t = LossTracker(fast_alpha=0.5, base_alpha=0.5)
>>> for _ in range(20):
...     t.update(1.0, quiet=True)
>>> t.worse(0.1)
False
>>> for _ in range(5):
...     t.update(2.0, quiet=False)           # an episode: the baseline stays at 1.0
>>> t.worse(0.1), t.nonfinite_run
(True, 0)
>>> t.update(float("nan"), quiet=False); t.nonfinite_run, t.worse(0.1)
(1, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numba import njit

from stability._state_check import Fields


class LossTracker:
    """Recent vs pre-episode level of the training loss (see the module docstring).

    Parameters
    ----------
    fast_alpha, base_alpha : float
        Weights of the newest ``log(loss)`` in the recent mean and in the baseline.
    """

    def __init__(self, fast_alpha: float = 0.1, base_alpha: float = 0.02) -> None:
        self.fast_alpha = float(fast_alpha)
        self.base_alpha = float(base_alpha)
        self.fast = math.nan        # EW mean of log(loss), recent (nan: no loss seen)
        self.base = math.nan        # EW mean of log(loss) over quiet steps
        self.nonfinite_run = 0      # consecutive observed steps with a non-finite loss

    def update(self, loss: Any, quiet: bool) -> None:
        """Feed one step's training loss; ``quiet``: the baseline may learn from it."""
        try:
            v = float(loss)
        except (TypeError, ValueError):
            return
        if math.isnan(v) or math.isinf(v):
            self.nonfinite_run += 1
            return
        self.nonfinite_run = 0
        if v <= 0.0:
            return
        x = math.log(v)
        self.fast = x if math.isnan(self.fast) else self.fast + self.fast_alpha * (x - self.fast)
        if quiet:
            self.base = x if math.isnan(self.base) else self.base + self.base_alpha * (
                x - self.base)

    def rewind(self) -> None:
        """The weights went back to a healthy checkpoint (a rollback): the recent level restarts
        at the baseline, the pre-episode level of those weights, instead of carrying the level
        of the damaged ones into the replay (where its lagging fall would look like a return to
        the trajectory)."""
        self.fast = self.base
        self.nonfinite_run = 0

    def update_many(self, losses: Any, quiet: Any, probe: Any = None) -> Any:
        """:meth:`update` for each ``losses[k]`` (floats) with ``quiet[k]``, in order.

        The logs are the C library's ``log`` (as :func:`math.log` in :meth:`update`) and the
        two running means come from a Numba loop doing the same IEEE operations in the same
        order, so the state is the loop's bit for bit.  ``probe``: increasing indices into
        ``losses``; returns :attr:`fast` as it was just before each of them (``None`` without
        ``probe``).

        >>> a, b = LossTracker(), LossTracker()
        >>> for v, q in [(2.0, True), (float("nan"), True), (1.5, False)]:
        ...     a.update(v, q)
        >>> b.update_many([2.0, float("nan"), 1.5], [True, True, False])
        >>> (a.fast, a.base, a.nonfinite_run) == (b.fast, b.base, b.nonfinite_run)
        True
        """
        v = np.asarray(losses, dtype=np.float64)
        fin = np.isfinite(v)
        last = np.flatnonzero(fin)
        if last.size == 0:
            self.nonfinite_run += int(v.size)
        else:  # the non-finite losses after the last finite one
            self.nonfinite_run = int(v.size - 1 - last[-1])
        use = np.flatnonzero(fin & (v > 0.0))
        x = _logs(v[use])
        q = np.asarray(quiet, dtype=np.bool_)[use]
        marks = np.searchsorted(use, np.asarray([] if probe is None else probe, dtype=np.int64))
        at = np.empty(marks.size)
        self.fast, self.base = _ew_logs(x, q, self.fast, self.base, self.fast_alpha,
                                        self.base_alpha, marks, at)
        return None if probe is None else at

    def worse(self, margin: float) -> bool | None:
        """Recent loss above the baseline by more than ``margin`` (relative), or not finite.

        ``None`` when it cannot tell (no loss seen yet).
        """
        if self.nonfinite_run > 0:
            return True
        if math.isnan(self.fast) or math.isnan(self.base):
            return None
        return self.fast - self.base > math.log1p(margin)

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state (non-finite floats as strings)."""
        return {"fast": _enc(self.fast), "base": _enc(self.base), "nf_run": self.nonfinite_run}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        f = Fields("LossTracker", sd)
        fast = f.number("fast", f.get("fast", math.nan), nan=True)
        base = f.number("base", f.get("base", math.nan), nan=True)
        self.nonfinite_run = f.integer("nf_run", f.get("nf_run", 0), lo=0)
        self.fast, self.base = fast, base


def _enc(v: float) -> float | str:
    """JSON-safe float (non-finite as a string, read back by ``float``)."""
    return v if math.isfinite(v) else str(v)


@njit(cache=True, error_model="numpy")
def _logs(v):  # type: ignore[no-untyped-def]
    """``math.log`` of each (positive, finite) value: the C library's ``log``, which
    :func:`math.log` calls too (one Python call per value cost ~50 ns)."""
    out = np.empty(v.shape[0])
    for k in range(v.shape[0]):
        out[k] = math.log(v[k])
    return out


@njit(cache=True, error_model="numpy")
def _ew_logs(x, quiet, fast, base, fast_alpha, base_alpha, marks, at):  # type: ignore[no-untyped-def]
    """The running means of :meth:`LossTracker.update` over the logs ``x`` (no fastmath: the
    operations are those of the Python code); ``at[m]`` = ``fast`` before ``x[marks[m]]``."""
    m = 0
    for k in range(x.shape[0]):
        while m < marks.shape[0] and marks[m] <= k:
            at[m] = fast
            m += 1
        y = x[k]
        fast = y if fast != fast else fast + fast_alpha * (y - fast)
        if quiet[k]:
            base = y if base != base else base + base_alpha * (y - base)
    while m < marks.shape[0]:
        at[m] = fast
        m += 1
    return fast, base


class ValTracker:
    """Best validation loss so far and how long the latest points have stayed above it.

    ``worse_points`` counts consecutive validation points more than ``margin`` (relative) above
    the best one; a non-finite point counts as worse and never becomes the best.  ``train_at_best``
    is the training level (EW mean of log loss) when the best point was seen: overfitting is
    validation rising *while* training falls well below that level.

    Examples
    --------
    >>> v = ValTracker(margin=0.1)
    >>> for step, x in [(10, 2.0), (20, 1.5), (30, 1.7), (40, 1.8)]:
    ...     v.update(step, x)
    >>> v.best, v.best_step, v.worse_points
    (1.5, 20, 2)
    """

    def __init__(self, margin: float = 0.1) -> None:
        self.margin = float(margin)
        self.best = math.inf
        self.best_step = -1
        self.worse_points = 0
        self.train_at_best = math.nan

    def update(self, step: int, val: Any, train_level: float = math.nan) -> None:
        """Feed one validation point (``train_level``: the training loss level now, log units)."""
        try:
            v = float(val)
        except (TypeError, ValueError):
            return
        if not math.isfinite(v):
            self.worse_points += 1
            return
        if v < self.best:
            self.best, self.best_step, self.train_at_best = v, int(step), float(train_level)
        if v > self.best * (1.0 + self.margin):
            self.worse_points += 1
        else:
            self.worse_points = 0

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: points after it no longer count."""
        self.worse_points = 0
        if self.best_step > step:
            self.best, self.best_step, self.train_at_best = math.inf, -1, math.nan

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state."""
        return {"best": _enc(self.best), "best_step": self.best_step, "worse": self.worse_points,
                "train_at_best": _enc(self.train_at_best)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        f = Fields("ValTracker", sd)
        best = f.number("best", f.get("best", math.inf), inf=True)
        best_step = f.integer("best_step", f.get("best_step", -1), lo=-1)
        worse = f.integer("worse", f.get("worse", 0), lo=0)
        train_at_best = f.number("train_at_best", f.get("train_at_best", math.nan), nan=True)
        self.best, self.best_step, self.worse_points = best, best_step, worse
        self.train_at_best = train_at_best


class CanaryTracker:
    """Where the canary's current climb began: the step of the latest canary evaluation that
    was not above the one before it -- the last point the canary vouched for.

    A canary (:mod:`stability.adapters.guard.canary`) alarms once its climb is large, several
    evaluations after the bad data began; the weights it measured at the start of the climb are
    the last ones known good, so a data rollback goes back to a checkpoint before that step.

    Examples
    --------
    >>> c = CanaryTracker()
    >>> for step, x in [(25, 1.0), (50, 0.5), (75, 0.6), (100, 1.2), (125, 3.0)]:
    ...     c.update(step, x)
    >>> c.low_step
    50
    """

    def __init__(self) -> None:
        self.last = math.nan
        self.low_step = -1

    def update(self, step: int, value: Any) -> None:
        """Feed one canary evaluation (a non-finite one leaves the climb's start where it is)."""
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        if not math.isfinite(v):
            return
        if not v > self.last:  # (the first point, too: ``last`` is nan)
            self.low_step = int(step)
        self.last = v

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: evaluations after it no longer count."""
        if self.low_step > step:
            self.low_step = -1
        self.last = math.nan

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state."""
        return {"last": _enc(self.last), "low_step": self.low_step}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        f = Fields("CanaryTracker", sd)
        last = f.number("last", f.get("last", math.nan), nan=True)
        self.low_step = f.integer("low_step", f.get("low_step", -1), lo=-1)
        self.last = last
