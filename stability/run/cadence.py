"""Checkpoint cadence: how often to save, given what a save costs and how often the job fails.

Model (Daly 2006, exact for exponential failures): work is cut into intervals of ``tau`` seconds,
each followed by a save of ``C`` seconds; failures arrive at rate ``1 / M`` (mean time between
failures ``M``) at any moment -- during work, saves and restarts alike; a failure costs a restart
of ``R`` seconds and the work since the last completed save.  The expected wall time of one
interval is ``M e^(R/M) (e^((tau + C)/M) - 1)``, so the expected goodput (useful work / wall
time) of an interval ``tau`` is::

    goodput(tau) = tau / (M e^(R/M) (e^((tau + C)/M) - 1))

Its maximiser does not depend on ``R``: ``tau* = M (1 + W0(-e^-(1 + C/M)))`` (Lambert W, solved
here by bisection); Young's first-order optimum ``sqrt(2 C M)`` is its small-``C/M`` limit.

Risk-adaptive cadence: while warnings are open the failure (or rollback) hazard is higher;
:meth:`CadenceAdvisor.advise` with ``warnings_open=True`` divides the MTBF by ``open_hazard``,
which shortens the interval by about ``sqrt(open_hazard)``.

Examples
--------
>>> a = advise(save_cost_s=60.0, mtbf_s=6 * 3600.0, restart_s=300.0, step_time_s=2.0)
>>> round(a.young_s), round(a.interval_s), a.interval_steps
(1610, 1570, 785)
>>> round(a.expected_goodput, 3), round(goodput(a.young_s, 60.0, 6 * 3600.0, 300.0), 3)
(0.915, 0.914)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from detectors.validation import check_float, check_opt_float


def _check(owner: str, name: str, v: Any, positive: bool = True) -> float:
    """A finite float ``> 0`` (``>= 0`` unless ``positive``)."""
    return check_float(owner, name, v, 0.0, low_open=positive, high_open=True)


def expected_interval_time(tau: float, save_cost_s: float, mtbf_s: float,
                           restart_s: float = 0.0) -> float:
    """Expected wall time to complete ``tau`` seconds of work plus its save (exact, exponential).

    >>> round(expected_interval_time(100.0, 10.0, 1e12), 3)   # no failures: tau + C
    110.0
    """
    m = mtbf_s
    x = (tau + save_cost_s) / m
    return m * math.exp(restart_s / m) * math.expm1(x)


def goodput(tau: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected goodput (useful work / wall time) of checkpointing every ``tau`` seconds of work.

    ``0`` for ``tau <= 0`` (nothing is ever saved).
    """
    if tau <= 0:
        return 0.0
    try:
        return tau / expected_interval_time(tau, save_cost_s, mtbf_s, restart_s)
    except OverflowError:
        return 0.0


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate (``M`` when ``C >= 2 M``)."""
    c, m = save_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    r = math.sqrt(c / (2 * m))
    return math.sqrt(2 * c * m) * (1 + r / 3 + r * r / 9) - c


def optimal_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The exact maximiser of :func:`goodput` (independent of the restart cost).

    Solves ``e^x (1 - x + C/M) = 1`` for ``x = (tau + C) / M`` in ``(C/M, 1 + C/M)``.
    """
    c = save_cost_s / mtbf_s
    if c == 0:
        return 0.0
    lo, hi = c, 1.0 + c                      # f(lo) > 0 > f(hi)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        f = math.exp(mid) * (1.0 - mid + c) - 1.0
        if f > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15 * max(hi, 1e-300):
            break
    return max(mtbf_s * 0.5 * (lo + hi) - save_cost_s, 0.0)


@dataclass(frozen=True)
class Advice:
    """A checkpoint interval and what it buys.

    ``interval_s`` is the exact optimum, ``interval_steps`` the same in steps (given a step
    time), ``expected_goodput`` its goodput, ``young_s`` / ``young_goodput`` Young's
    ``sqrt(2 C M)`` and its goodput, ``curve`` ``(tau, goodput)`` pairs around the optimum.
    """

    interval_s: float
    interval_steps: int | None
    expected_goodput: float
    young_s: float
    young_goodput: float
    save_cost_s: float
    mtbf_s: float
    restart_s: float
    hazard: float = 1.0
    curve: tuple[tuple[float, float], ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (the curve as two lists)."""
        return {"interval_s": self.interval_s, "interval_steps": self.interval_steps,
                "expected_goodput": self.expected_goodput, "young_s": self.young_s,
                "young_goodput": self.young_goodput, "save_cost_s": self.save_cost_s,
                "mtbf_s": self.mtbf_s, "restart_s": self.restart_s, "hazard": self.hazard,
                "curve_tau_s": [t for t, _ in self.curve],
                "curve_goodput": [g for _, g in self.curve]}


def advise(save_cost_s: float, mtbf_s: float, restart_s: float = 0.0, *,
           step_time_s: float | None = None, hazard: float = 1.0,
           curve_points: int = 41) -> Advice:
    """The goodput-optimal checkpoint interval.

    Parameters
    ----------
    save_cost_s : float
        Measured cost of one checkpoint save (seconds the training is held up).
    mtbf_s : float
        Observed mean time between failures (interruptions, crashes, preemptions).
    restart_s : float
        Time from a failure to training again (scheduling, start-up, loading the checkpoint).
    step_time_s : float, optional
        Seconds per step, to give the interval in steps as well.
    hazard : float
        Failure-rate multiplier (> 1 while warnings are open): the MTBF used is
        ``mtbf_s / hazard``.
    curve_points : int
        Points of the goodput curve, log-spaced from ``tau* / 10`` to ``10 tau*``.
    """
    c = _check("advise", "save_cost_s", save_cost_s)
    m0 = _check("advise", "mtbf_s", mtbf_s)
    r = _check("advise", "restart_s", restart_s, positive=False)
    h = _check("advise", "hazard", hazard)
    st = check_opt_float("advise", "step_time_s", step_time_s, 0.0, low_open=True,
                         high_open=True)
    m = m0 / h
    tau = optimal_interval(c, m)
    steps = None if st is None else max(1, int(round(tau / st)))
    y = young_interval(c, m)
    n = max(int(curve_points), 2)
    curve = tuple((t, goodput(t, c, m, r)) for t in
                  (tau * 10.0 ** (-1.0 + 2.0 * i / (n - 1)) for i in range(n)))
    return Advice(interval_s=tau, interval_steps=steps, expected_goodput=goodput(tau, c, m, r),
                  young_s=y, young_goodput=goodput(y, c, m, r), save_cost_s=c, mtbf_s=m,
                  restart_s=r, hazard=h, curve=curve)


class CadenceAdvisor:
    """Online cadence advice from measured save costs and observed failures.

    The MTBF estimate is ``(exposure + prior_mtbf_s) / (failures + 1)`` -- the prior counts as
    one failure-free MTBF of exposure, so a young run without failures is not told to never
    save.  The save cost is the mean of the measured saves.

    Parameters
    ----------
    prior_mtbf_s : float
        MTBF assumed before any failure was seen (e.g. the cluster's).
    restart_s : float
        Restart cost (updated by :meth:`note_restart`).
    step_time_s : float, optional
        Seconds per step (for ``interval_steps``).
    open_hazard : float
        Failure-rate multiplier while warnings are open.

    Examples
    --------
    >>> adv = CadenceAdvisor(prior_mtbf_s=24 * 3600.0, step_time_s=1.0)
    >>> adv.note_save(30.0); adv.note_time(12 * 3600.0); adv.note_failure()
    >>> round(adv.mtbf_s)
    64800
    >>> calm, risky = adv.advise(), adv.advise(warnings_open=True)
    >>> calm.interval_steps > risky.interval_steps
    True
    """

    def __init__(self, prior_mtbf_s: float = 24 * 3600.0, restart_s: float = 0.0,
                 step_time_s: float | None = None, open_hazard: float = 4.0) -> None:
        owner = "CadenceAdvisor"
        self.prior_mtbf_s = _check(owner, "prior_mtbf_s", prior_mtbf_s)
        self.restart_s = _check(owner, "restart_s", restart_s, positive=False)
        self.step_time_s = check_opt_float(owner, "step_time_s", step_time_s, 0.0,
                                           low_open=True, high_open=True)
        self.open_hazard = _check(owner, "open_hazard", open_hazard)
        self.saves = 0
        self.save_time = 0.0
        self.failures = 0
        self.exposure_s = 0.0

    def note_save(self, seconds: float) -> None:
        """A save took ``seconds``."""
        self.saves += 1
        self.save_time += max(float(seconds), 0.0)

    def note_failure(self) -> None:
        """The job failed (crash, preemption, hang killed by the scheduler)."""
        self.failures += 1

    def note_restart(self, seconds: float) -> None:
        """A restart took ``seconds`` (kept as the restart cost)."""
        self.restart_s = max(float(seconds), 0.0)

    def note_time(self, seconds: float) -> None:
        """``seconds`` of running time (exposure to failures) went by."""
        self.exposure_s += max(float(seconds), 0.0)

    @property
    def mtbf_s(self) -> float:
        return (self.exposure_s + self.prior_mtbf_s) / (self.failures + 1)

    @property
    def save_cost_s(self) -> float:
        """Mean measured save cost (``nan`` before the first save)."""
        return self.save_time / self.saves if self.saves else math.nan

    def advise(self, warnings_open: bool = False) -> Advice:
        """:func:`advise` with the current estimates (raises before the first measured save)."""
        if not self.saves:
            raise ValueError("no save measured yet: call note_save(seconds) first")
        return advise(max(self.save_cost_s, 1e-9), self.mtbf_s, self.restart_s,
                      step_time_s=self.step_time_s,
                      hazard=self.open_hazard if warnings_open else 1.0)

    def should_checkpoint(self, seconds_since_save: float, warnings_open: bool = False) -> bool:
        """Whether the advised interval has elapsed (``False`` before a save was measured)."""
        if not self.saves:
            return False
        return seconds_since_save >= self.advise(warnings_open).interval_s
