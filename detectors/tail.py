"""Spike z-score calibrated to the run's own tail, with a prior for the first steps.

:class:`TailZScore` scores ``log(x)`` (or ``x``) against an exponentially weighted mean and
variance exactly as :class:`~detectors.ewma.EWMAZScore` does (same recurrence, same debiased
warm-up, same winsorised updates), and adds two rules:

Per-run tail calibration
    Each series tracks a high quantile ``q`` (level ``tail_q``, 0.999 by default) of its own
    healthy spike events with a stochastic-approximation quantile tracker: ``q -= tail_rate *
    (1 - tail_q)`` at every score at or below ``q``; scores above ``q`` open a spike *event*
    (scores above it less than ``tail_gap`` quiet scores apart are one event), and when the
    event closes without any of its scores having alarmed, it was a healthy spike: ``q +=
    tail_rate * tail_q``.  Never below the reference, only after warm-up.  An event that
    alarmed does not count at all -- a fault does not raise the bar, not even with its first,
    still sub-threshold scores -- and a building excursion is one event.  With the defaults a
    healthy spike lifts ``q`` by about 1 and it sinks back by 1 per 1000 scores.  The
    reference ``tail_ref`` is the same quantile of a standard normal score (3.09 for 0.999).
    The reported score is the raw z divided by ``max(1, min(tail_max, q / tail_ref))``: on a
    smooth run (Gaussian-like noise, ``q`` at the reference) it is the plain z; on a spiky run
    -- small-batch SGD, whose loss spikes now and then by 5-8 sigma without anything being
    wrong -- the same z counts for less, in proportion to how far that run's own tail lies
    above a Gaussian's.  A z of 7 on a run whose healthy spikes reached 4.6 scores 4.7; on a
    smooth run it scores 7.  The factor is capped at ``tail_max`` (3): a run cannot calibrate
    itself blind.

Priors for the first steps (no blind start)
    With ``prior_std > 0`` a series scores from its third finite value on instead of after
    ``warmup`` values: until the warm-up is over its variance is the prior blended with what it
    has seen, ``(prior_n * prior_std**2 + n * var) / (prior_n + n)``.  ``prior_std`` is the
    typical step-to-step variation of the signal in this kind of run (log units in log space),
    so a log that starts a few rows before an event is not blind.  ``prior_std = 0`` (default):
    silent during warm-up, as EWMAZScore.

Test-then-train: every score uses the state before the value is learnt; an alarmed value does
not move the quantile tracker (nor the statistics with ``freeze_on_alarm``).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Bool, Choice, Float, Int, arguments
from ._state import StateCheck
from .ewma import DIRECTIONS, ew_update

# state rows
_MEAN, _VAR, _COUNT, _Q, _ABOVE = 0, 1, 2, 3, 4
_N_FIELDS = 5
#: a prior needs this many values before scoring (a level and one step from it)
PRIOR_MIN_COUNT = 2.0


def tail_reference(tail_q: float) -> float:
    """The ``tail_q`` quantile of a standard normal score: a calibration's reference (3.09 for
    0.999)."""
    return NormalDist().inv_cdf(tail_q)


class TailZParams(NamedTuple):
    """Layout of :class:`TailZScore`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    warmup: float
    log_space: float
    min_std: float
    direction: float  # DIRECTIONS value
    clip: float
    tail_q: float
    tail_rate: float
    tail_ref: float
    tail_max: float
    prior_std: float
    prior_n: float
    tail_gap: float


P = indices(TailZParams)


@njit(cache=True, error_model="numpy", inline="always")
def _std(var, mean, count, params):  # type: ignore[no-untyped-def]
    """The scale a value is scored against: the variance, blended with the prior while
    warming up, floored at ``min_std`` (relative to ``|mean|`` in linear space)."""
    warmup, prior, n0 = params[P.warmup], params[P.prior_std], params[P.prior_n]
    if prior > 0.0 and count < warmup:
        var = (n0 * prior * prior + count * var) / (n0 + count)
    floor = params[P.min_std] if params[P.log_space] != 0.0 else params[P.min_std] * abs(mean)
    return max(math.sqrt(var), floor, 1e-300)


@njit(cache=True, error_model="numpy", inline="always")
def tail_factor(q, ref, tail_max):  # type: ignore[no-untyped-def]
    """What a raw score is divided by: ``q`` against the reference ``ref``, within ``[1,
    tail_max]`` (1 = a Gaussian-like tail, or no calibration)."""
    return max(1.0, min(tail_max, q / ref))


@njit(cache=True, error_model="numpy", inline="always")
def track_tail(s, alarm, q, event, tail_q, rate, ref, gap):  # type: ignore[no-untyped-def]
    """One step of the quantile tracker of healthy spike *events*; returns ``(q, event)``.

    A score above ``q`` (raw score ``s``) opens an event, or keeps the open one going; the
    event closes after ``gap`` scores in a row at or below ``q``, and only then, if none of its
    scores alarmed, is it a healthy spike: ``q`` moves up by ``rate * tail_q``.  Every score
    at or below ``q`` moves it down by ``rate * (1 - tail_q)``; never below ``ref``.  So a
    fault never raises the bar -- not even its first scores below the alarm threshold, nor a
    noisy build-up that dips below ``q`` for fewer than ``gap`` scores -- and a building
    excursion is one event.  ``event``: 0 = none open; ``+k`` = open, ``k`` quiet scores left
    to close it, no alarm yet; ``-k`` = open and alarmed.
    """
    if s > q or alarm:
        return q, -gap if (alarm or event < 0.0) else gap
    q = q - rate * (1.0 - tail_q)
    if event != 0.0:
        left = abs(event) - 1.0
        if left <= 0.0:
            if event > 0.0:
                q = q + rate * tail_q
            event = 0.0
        else:
            event = left if event > 0.0 else -left
    return max(q, ref), event


@njit(cache=True, error_model="numpy", inline="always")
def taint_event(event, gap):  # type: ignore[no-untyped-def]
    """The open event after an alarm that was not learnt (``freeze_on_alarm``): alarmed."""
    return -gap if event == 0.0 else -abs(event)


@njit(cache=True, error_model="numpy", inline="always")
def _scores(y, mean, var, count, q, params):  # type: ignore[no-untyped-def]
    """``(raw, calibrated)`` directional scores of ``y`` against the state (0 while silent)."""
    warmup = params[P.warmup]
    scoring = count >= warmup or (params[P.prior_std] > 0.0 and count >= PRIOR_MIN_COUNT)
    if count == 0.0 or not scoring:
        return 0.0, 0.0
    z = (y - mean) / _std(var, mean, count, params)
    d = params[P.direction]
    s = z if d > 0.0 else (-z if d < 0.0 else abs(z))
    return s, s / tail_factor(q, params[P.tail_ref], params[P.tail_max])


@njit(cache=True, error_model="numpy", inline="always")
def _learn(y, s, alarm, mean, var, count, q, above, params):  # type: ignore[no-untyped-def]
    """The state after learning ``y`` (raw score ``s``): quantile tracker, then the
    winsorised, debiased EW mean / variance.  Returns ``(mean, var, count, q, above)``.

    The tracker counts healthy spike *events* (:func:`track_tail`; ``above`` is the open
    event): an excursion above ``q`` lifts it once, when it is over, and not at all if it
    alarmed."""
    if count == 0.0:
        return y, 0.0, 1.0, q, 0.0
    warmup = params[P.warmup]
    if count >= warmup:
        q, above = track_tail(s, alarm, q, above, params[P.tail_q], params[P.tail_rate],
                              params[P.tail_ref], params[P.tail_gap])
        clip = params[P.clip]
        if clip < np.inf:
            std = _std(var, mean, count, params)
            y = min(max(y, mean - clip * std), mean + clip * std)
    a = max(params[P.alpha], 1.0 / (count + 1.0))
    m2, v2 = ew_update(mean, var, y, a)
    return m2, v2, count + 1.0, q, above


@njit(cache=True, error_model="numpy")
def _tail_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    """The bank kernel (see ``detectors/_base.py``)."""
    log_space = params[P.log_space] != 0.0
    threshold, freeze = params[P.threshold], params[P.freeze_on_alarm]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            y = math.log(max(x, LOG_FLOOR)) if log_space else x
            mean, var, count, q = state[_MEAN, i], state[_VAR, i], state[_COUNT, i], state[_Q, i]
            raw, s = _scores(y, mean, var, count, q, params)
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if learns(alarm, freeze):
                m2, v2, c2, q2, a2 = _learn(y, raw, alarm, mean, var, count, q,
                                            state[_ABOVE, i], params)
                state[_MEAN, i], state[_VAR, i], state[_COUNT, i] = m2, v2, c2
                state[_Q, i], state[_ABOVE, i] = q2, a2
            elif count >= params[P.warmup]:
                state[_ABOVE, i] = taint_event(state[_ABOVE, i], params[P.tail_gap])


class TailZScore(BankDetector):
    """EWMA z-score divided by the run's own tail factor; optional prior for the first steps.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    alpha, warmup, log_space, min_std, direction, clip
        As :class:`~detectors.ewma.EWMAZScore` (debiased warm-up always on).
    threshold
        Alarm when the calibrated score exceeds this.
    tail_q
        Level of the tracked quantile of the run's healthy scores (in ``(0.5, 1)``).
    tail_rate
        Step of the quantile tracker (score units).
    tail_max
        Largest factor the calibration may divide a score by (``1`` = no calibration).
    prior_std
        Typical step-to-step variation of the signal (log units in log space); ``0`` = no
        prior (silent for ``warmup`` values).
    prior_n
        Weight of the prior, in values.
    tail_gap
        Quiet scores (at or below ``q``) that close a spike event: scores above ``q`` less
        than ``tail_gap`` quiet scores apart are one event, one lift of ``q`` when it closes
        (none if it alarmed), so a fault that builds up noisily, dipping below ``q`` now and
        then, does not raise its own bar step by step.  ``1``: an event closes at its first
        quiet score.
    freeze_on_alarm
        Do not update a series' statistics while it is in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> smooth = np.exp(0.05 * np.sin(0.7 * np.arange(400)))
    >>> spiky = smooth.copy()
    >>> spiky[50::20] *= np.exp(0.3)         # a healthy 6-sigma spike every 20 steps
    >>> smooth[390] = spiky[390] = np.exp(0.5)  # the same spike in both
    >>> float(TailZScore().update_many(smooth)[0][390, 0]) > 6.0
    True
    >>> float(TailZScore().update_many(spiky)[0][390, 0]) < 6.0
    True
    """

    param_layout = TailZParams
    kernel = staticmethod(_tail_kernel)
    state_hyperparameters = ("log_space",)

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(0),
        "log_space": Bool(),
        "min_std": Float(0.0),
        "direction": Choice(DIRECTIONS),
        "clip": Float(0.0, low_open=True),
        "tail_q": Float(0.5, 1.0, low_open=True, high_open=True),
        "tail_rate": Float(0.0),
        "tail_max": Float(1.0),
        "prior_std": Float(0.0),
        "prior_n": Float(0.0, low_open=True),
        "tail_gap": Int(1, 1_000_000),
    }
    direction: str
    tail_q: float
    tail_max: float
    tuning_grid = {"tail_q": (0.99, 0.999)}
    summary = (
        "EWMA z-score of `log(x)` divided by the run's own tail factor: a high quantile of the "
        "series' healthy scores against a Gaussian's (a z of 7 on a spiky small-batch SGD run "
        "counts for less than on a smooth LLM run); with `prior_std` it scores from the third "
        "value, its variance blended with the prior while warming up (no blind start).")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.02,
        warmup: int = 30,
        threshold: float = 6.0,
        log_space: bool = True,
        min_std: float = 0.01,
        direction: str = "up",
        clip: float = 4.0,
        tail_q: float = 0.999,
        tail_rate: float = 1.0,
        tail_max: float = 3.0,
        prior_std: float = 0.0,
        prior_n: float = 20.0,
        freeze_on_alarm: bool = False,
        tail_gap: int = 1,
    ):
        super().__init__(**arguments(locals()))

    @property
    def tail_ref(self) -> float:
        """The ``tail_q`` quantile of a standard normal score (the calibration's reference)."""
        return tail_reference(self.tail_q)

    def _init_state(self, n: int) -> FloatArray:
        state = np.zeros((_N_FIELDS, n))
        state[_Q] = self.tail_ref
        return state

    #: version 2: the last row is the open spike event (0, +k, -k; see :func:`track_tail`);
    #: version 1 held "the previous score was above q" (0 / 1), whose lift had already been
    #: made at the event's start: it loads as an open event that will not lift again (-1)
    state_version = 2
    legacy_state_rows = {1: _N_FIELDS}

    def _upgrade_rows(self, version: int, state: FloatArray) -> FloatArray:
        if version == 1:
            state[_ABOVE] = -np.abs(state[_ABOVE])
        return state

    def _check_state(self, c: StateCheck) -> None:
        c.not_nan("mean", c.state[_MEAN])
        c.not_nan("var", c.state[_VAR], 0.0)
        c.integers("count", c.state[_COUNT], 0)
        c.finite("q", c.state[_Q], 0.0)
        c.integers("event", c.state[_ABOVE], -np.inf)

    @property
    def tail_factor(self) -> FloatArray:
        """Per series, what a raw z-score is divided by (1 = a Gaussian-like tail)."""
        q = self._state[_Q]
        return np.maximum(1.0, np.minimum(self.tail_max, q / self.tail_ref))
