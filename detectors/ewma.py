"""EWMA z-score spike detector (optionally in log space), with warm-up and winsorised updates.

The exponentially weighted mean and variance follow Finch (2009), the same recurrence river's
``stats.EWMean`` / ``stats.EWVar`` use::

    d = y - mean;  mean += alpha * d;  var = (1 - alpha) * (var + alpha * d * d)

Industry rule "z > 2.5 with EMA 0.97 and 25 warm-up steps" is
``EWMAZScore(alpha=0.03, warmup=25, threshold=2.5, log_space=False, debias=False, clip=inf)``.
The default (log space, debiased warm-up, winsorised updates, threshold 6) is far less noisy on
heavy-tailed loss and gradient-norm streams.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, BankDetector, FloatArray
from ._kernel import indices, skip_value
from ._params import Bool, Choice, Float, Int, arguments
from ._state import StateCheck

DIRECTIONS = {"up": 1.0, "down": -1.0, "both": 0.0}

# state rows
_MEAN, _VAR, _COUNT = 0, 1, 2
_N_FIELDS = 3


class EWMAParams(NamedTuple):
    """Layout of :class:`EWMAZScore`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    warmup: float
    log_space: float
    min_std: float
    direction: float  # DIRECTIONS value
    clip: float
    debias: float


_P = indices(EWMAParams)


@njit(cache=True, error_model="numpy", inline="always")
def ew_update(mean: float, var: float, y: float, alpha: float) -> tuple[float, float]:
    """One step of the exponentially weighted mean/variance recurrence (Finch 2009)."""
    d = y - mean
    incr = alpha * d
    return mean + incr, (1.0 - alpha) * (var + d * incr)


#: banks with fewer series than this are processed series by series, each series' statistics
#: held in registers across time steps; larger banks step by step, so that the independent
#: series overlap in the CPU's pipeline.  Both orders apply the same steps to every series.
SERIES_OUTER_BELOW = 8
#: steps per tile in the series-by-series order (the log values of one tile are computed first)
TILE = 256


@njit(cache=True, error_model="numpy", inline="always")
def _step(y, mean, var, count, p, debias):  # type: ignore[no-untyped-def]
    """Score the finite value ``y`` against ``(mean, var, count)``, then update them.

    ``p`` is the tuple made by :func:`_unpack`.  ``debias`` is a compile-time constant: the
    callers use ``False`` once ``count >= p[9]``, where ``max(alpha, 1 / (count + 1))`` is
    exactly ``alpha``, so the division disappears from the steady state.
    Returns ``(score, alarm, mean, var, count)``.
    """
    threshold, freeze, alpha, warmup, log_space, min_std, direction, clip, do_clip = p[:9]
    if count == 0.0:
        return 0.0, False, y, 0.0, 1.0
    floor = min_std if log_space else min_std * abs(mean)
    std = max(math.sqrt(var), floor, 1e-300)
    z = (y - mean) / std
    if count < warmup:
        s = 0.0
    elif direction > 0.0:
        s = z
    elif direction < 0.0:
        s = -z
    else:
        s = abs(z)
    alarm = s > threshold
    if alarm and freeze:
        return s, alarm, mean, var, count
    a = max(alpha, 1.0 / (count + 1.0)) if debias else alpha
    if do_clip and count >= warmup:
        # a branch, not min/max: the bounds depend on sqrt(var), and a select would put the
        # square root on the loop-carried dependency chain.
        lo = mean - clip * std
        hi = mean + clip * std
        if lo > y or hi < y:
            y = min(max(y, lo), hi)
    m2, v2 = ew_update(mean, var, y, a)
    return s, alarm, m2, v2, count + 1.0


@njit(cache=True, error_model="numpy", inline="always")
def _unpack(params):  # type: ignore[no-untyped-def]
    alpha = params[_P.alpha]
    # From this count on max(alpha, 1 / (count + 1)) == alpha exactly: 1 / (count + 1) < alpha
    # in real arithmetic, and rounding is monotone (inf where 2 / alpha would overflow).
    debias_until = 0.0
    if params[_P.debias] != 0.0:
        debias_until = 2.0 / alpha + 2.0 if alpha > 1e-300 else np.inf
    return (
        params[_P.threshold],
        params[_P.freeze_on_alarm] != 0.0,
        alpha,
        params[_P.warmup],
        params[_P.log_space] != 0.0,
        params[_P.min_std],
        params[_P.direction],
        params[_P.clip],
        params[_P.clip] < np.inf,
        debias_until,
    )


@njit(cache=True, error_model="numpy", inline="always")
def _series_steps(X, miss, scores, alarms, i, t, t_hi, mean, var, count, p, debias):  # type: ignore[no-untyped-def]
    """Steps ``[t, t_hi)`` of series ``i``; ``scores[t, i]`` holds ``log(x)`` in log space
    until the step's score overwrites it.

    While ``debias`` it stops early once the count reaches ``p[9]``.
    Returns ``(t, mean, var, count)`` with ``t`` the first step not processed.
    """
    log_space = p[4]
    while t < t_hi:
        if debias and count >= p[9]:
            break
        x = X[t, 0, i]
        if not skip_value(miss[t, 0, i], x, scores, alarms, t, i):
            y = scores[t, i] if log_space else x
            s, a, mean, var, count = _step(y, mean, var, count, p, debias)
            scores[t, i] = s
            alarms[t, i] = a
        t += 1
    return t, mean, var, count


#: banks of at least this many series take :func:`_rows_vector` (the monitor's per-layer banks)
VECTOR_FROM = 32


@njit(cache=True, error_model="numpy")
def _rows_vector(X, miss, state, p, scores, alarms):  # type: ignore[no-untyped-def]
    """:func:`_kernel` row by row in branch-free loops, one output row per loop (vectorised):
    every series' :func:`_step` is computed, then stored where it applies."""
    threshold, freeze, alpha, warmup, log_space, min_std, direction, clip, do_clip = p[:9]
    debias_until = p[9]
    n = X.shape[2]
    work = np.empty((2, n))
    ys = work[0]  # the transformed values of the row
    ok = work[1]  # 1.0: the value is present and finite
    mean, var, count = state[_MEAN], state[_VAR], state[_COUNT]
    has_logs = X.shape[1] == 2  # a log row (BankDetector.uses_log_row)
    for t in range(X.shape[0]):
        x_t, m_t, s_t, a_t = X[t, 0], miss[t, 0], scores[t], alarms[t]
        if log_space and has_logs:
            l_t = X[t, 1]
            for i in range(n):
                x = x_t[i]
                ys[i] = l_t[i] if x > LOG_FLOOR else math.log(max(x, LOG_FLOOR))
        elif log_space:  # the logs in a loop of their own (libm calls)
            for i in range(n):
                ys[i] = math.log(max(x_t[i], LOG_FLOOR))
        else:
            for i in range(n):
                ys[i] = x_t[i]
        for i in range(n):
            ok[i] = 1.0 if (not m_t[i]) & np.isfinite(x_t[i]) else 0.0
        for i in range(n):  # the score (skip_value's nan / inf where not ok)
            mu = mean[i]
            floor = min_std if log_space else min_std * abs(mu)
            z = (ys[i] - mu) / max(math.sqrt(var[i]), floor, 1e-300)
            sz = z if direction > 0.0 else (-z if direction < 0.0 else abs(z))
            c = count[i]
            sc = 0.0 if (c == 0.0) | (c < warmup) else sz
            s_t[i] = sc if ok[i] != 0.0 else (np.nan if m_t[i] else np.inf)
        for i in range(n):
            a_t[i] = ((count[i] != 0.0) & (s_t[i] > threshold) if ok[i] != 0.0
                      else not m_t[i])
        for i in range(n):  # from here on ok[i]: the series learns
            ok[i] = 1.0 if (ok[i] != 0.0) & (not (a_t[i] & freeze)) else 0.0
        for i in range(n):  # mean and variance (ew_update of the clipped value)
            mu = mean[i]
            v = var[i]
            c = count[i]
            y = ys[i]
            if do_clip:
                floor = min_std if log_space else min_std * abs(mu)
                std = max(math.sqrt(v), floor, 1e-300)
                y = min(max(y, mu - clip * std), mu + clip * std) if c >= warmup else y
            a = max(alpha, 1.0 / (c + 1.0)) if c < debias_until else alpha
            d = y - mu
            incr = a * d
            new_mean = ys[i] if c == 0.0 else mu + incr
            new_var = 0.0 if c == 0.0 else (1.0 - a) * (v + d * incr)
            mean[i] = new_mean if ok[i] != 0.0 else mu
            work[0, i] = new_var  # ys[i] is not needed any more
        for i in range(n):
            var[i] = ys[i] if ok[i] != 0.0 else var[i]
        for i in range(n):
            count[i] = count[i] + ok[i]


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    """The bank kernel (see ``detectors/_base.py``).  ``X`` may carry a log row
    (``(T, 2, n)``: :meth:`~detectors._base.BankDetector.uses_log_row`)."""
    p = _unpack(params)
    has_logs = X.shape[1] == 2
    log_space = p[4]
    debias_until = p[9]
    t_steps = X.shape[0]
    n = X.shape[2]
    if n >= VECTOR_FROM:
        _rows_vector(X, miss, state, p, scores, alarms)
        return
    if n < SERIES_OUTER_BELOW:
        # log values of a tile of steps first, in a loop of their own: a libm call inside the
        # update loop would push every live value through the stack on each step.  They are
        # kept in the score slots of their steps (no scratch array to allocate per call): each
        # step reads its own before writing its score there.
        for i in range(n):
            mean = state[_MEAN, i]
            var = state[_VAR, i]
            count = state[_COUNT, i]
            for t_lo in range(0, t_steps, TILE):
                t_hi = min(t_lo + TILE, t_steps)
                if log_space:
                    for t in range(t_lo, t_hi):
                        # log(max(x, LOG_FLOOR)): the log row's value above the floor
                        x = X[t, 0, i]
                        scores[t, i] = (X[t, 1, i] if has_logs and x > LOG_FLOOR
                                        else math.log(max(x, LOG_FLOOR)))
                t = t_lo
                if count < debias_until:  # warm-up: the division in max(alpha, 1/(count + 1))
                    t, mean, var, count = _series_steps(
                        X, miss, scores, alarms, i, t, t_hi, mean, var, count, p, True
                    )
                _, mean, var, count = _series_steps(
                    X, miss, scores, alarms, i, t, t_hi, mean, var, count, p, False
                )
            state[_MEAN, i] = mean
            state[_VAR, i] = var
            state[_COUNT, i] = count
        return
    # the log values of a row first, in a loop of their own, in the row's score slots (see
    # above)
    for t in range(t_steps):
        if log_space:
            for i in range(n):
                x = X[t, 0, i]
                scores[t, i] = (X[t, 1, i] if has_logs and x > LOG_FLOOR
                                else math.log(max(x, LOG_FLOOR)))
        for i in range(n):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            y = scores[t, i] if log_space else x
            count = state[_COUNT, i]
            if count < debias_until:
                s, a, mean, var, count = _step(y, state[_MEAN, i], state[_VAR, i], count, p, True)
            else:
                s, a, mean, var, count = _step(y, state[_MEAN, i], state[_VAR, i], count, p, False)
            scores[t, i] = s
            alarms[t, i] = a
            state[_MEAN, i] = mean
            state[_VAR, i] = var
            state[_COUNT, i] = count


class EWMAZScore(BankDetector):
    """Exponentially weighted z-score of each new value against the running mean and std.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    alpha
        Weight of the newest observation (``1 - EMA decay``); memory is about ``1/alpha`` steps.
    warmup
        Number of finite observations before any score is emitted.
    threshold
        Alarm when the score exceeds this many (effective) standard deviations.
    log_space
        Score ``log(x)`` instead of ``x`` (values <= 0 are floored at 1e-30): multiplicative
        spikes of positive signals (loss, gradient norm) become additive.
    min_std
        Noise floor for the standard deviation: absolute in log space (0.01 ~ a 1 % change),
        relative to ``|mean|`` in linear space.  Keeps constant streams from alarming on
        round-off.
    direction
        ``"up"`` (spikes), ``"down"`` or ``"both"``.
    clip
        Winsorise updates to ``mean +- clip * std`` after warm-up, so one outlier cannot drag
        the statistics (``inf`` disables).
    debias
        Use ``alpha_eff = max(alpha, 1/count)`` so warm-up statistics are plain averages rather
        than dominated by the first value.
    freeze_on_alarm
        Do not update a series' statistics while it is in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> det = EWMAZScore(alpha=0.1, warmup=5, threshold=6.0)
    >>> rng = np.random.default_rng(0)
    >>> x = np.exp(rng.normal(0.0, 0.05, 50))
    >>> x[40] = 10.0
    >>> scores, alarms = det.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [40]
    """

    param_layout = EWMAParams

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(0),
        "log_space": Bool(),
        "min_std": Float(0.0),
        "direction": Choice(DIRECTIONS),
        "clip": Float(0.0, low_open=True),
        "debias": Bool(),
    }
    log_space: bool
    tuning_grid = {"alpha": (0.02, 0.05), "min_std": (0.01, 0.05, 0.1)}
    summary = (
        "z-score of `log(x)` against an exponentially weighted mean/variance (river's "
        "recurrence), with debiased warm-up and winsorised updates so one outlier cannot drag the "
        'statistics. "z > 2.5, EMA 0.97, 25 warm-up" is `alpha=0.03, warmup=25, threshold=2.5, '
        "log_space=False, debias=False, clip=inf`.")

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
        debias: bool = True,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    def uses_log_row(self) -> bool:  # see BankDetector
        return self.log_space and type(self).kernel is _kernel  # not a subclass's own kernel

    kernel = staticmethod(_kernel)
    state_hyperparameters = ("log_space",)

    def _check_state(self, c: StateCheck) -> None:
        c.not_nan("mean", c.state[_MEAN])
        c.not_nan("var", c.state[_VAR], 0.0)
        c.integers("count", c.state[_COUNT], 0)

    @property
    def mean(self) -> FloatArray:
        """Running (log-space if ``log_space``) mean per series."""
        return self._state[_MEAN].copy()

    @property
    def std(self) -> FloatArray:
        """Running standard deviation per series (before the ``min_std`` floor)."""
        return np.sqrt(self._state[_VAR])
