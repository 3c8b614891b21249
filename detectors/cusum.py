"""Two-sided tabular CUSUM (Page 1954) on standardised values.

Each finite observation ``y`` (``log x`` with ``log_space``) is standardised against a reference
mean and standard deviation *before* they are updated (test-then-train)::

    z = (y - mean) / max(std, min_std * |mean|, 1e-300)
    s_up   = max(0, s_up   + (z - k))
    s_down = max(0, s_down - (z + k))

The score is ``max(s_up, s_down)`` (``direction="both"``), ``s_up`` (``"up"``) or ``s_down``
(``"down"``), and ``alarm = score > threshold`` (the decision interval ``h``).

The reference is the plain mean / sample variance of the first ``warmup`` finite observations
(score ``0.0`` meanwhile); afterwards it follows an exponentially weighted mean/variance with
rate ``alpha`` (``alpha = 0`` freezes it: the classical chart).  With ``reset_on_alarm`` an alarm
clears both sums and restarts the warm-up, so the new level becomes the reference and every
shift alarms once; ``freeze_on_alarm`` keeps the reference still while a series is in alarm.

**Overflow.**  A finite value whose update would leave the float64 range (e.g. ``+-1e308``, or
``1e10`` against a warm-up of exact zeros, where the std is floored at ``1e-300``) never enters
the statistics: it scores ``+inf``, alarms, and the series restarts its warm-up (even without
``reset_on_alarm``: a reference dominated by such values would overflow again).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, skip_value
from ._params import Bool, Choice, Float, Int, arguments
from ._state import StateCheck
from .ewma import LOG_FLOOR, ew_update

DIRECTIONS = {"up": 1.0, "down": -1.0, "both": 0.0}

# state rows: reference mean, M2 (warm-up) / variance (after), count, upper and lower sums
_MEAN, _VAR, _COUNT, _S_UP, _S_DOWN = 0, 1, 2, 3, 4
_N_FIELDS = 5


class CUSUMParams(NamedTuple):
    """Layout of :class:`CUSUM`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    k: float
    warmup: float
    alpha: float
    min_std: float
    direction: float
    log_space: float
    reset_on_alarm: float


_P = indices(CUSUMParams)


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    freeze = params[_P.freeze_on_alarm] != 0.0
    k = params[_P.k]
    warmup = params[_P.warmup]
    alpha = params[_P.alpha]
    min_std = params[_P.min_std]
    direction = params[_P.direction]
    log_space = params[_P.log_space] != 0.0
    reset = params[_P.reset_on_alarm] != 0.0
    for i in range(X.shape[2]):
        mean = state[_MEAN, i]
        var = state[_VAR, i]
        count = state[_COUNT, i]
        s_up = state[_S_UP, i]
        s_down = state[_S_DOWN, i]
        std = max(math.sqrt(var), min_std * abs(mean), 1e-300)  # refreshed when they change
        for t in range(X.shape[0]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            y = math.log(max(x, LOG_FLOOR)) if log_space else x
            if count < warmup:
                # Welford on the warm-up window; var holds M2 until the warm-up ends
                count1 = count + 1.0
                d = y - mean
                mean1 = mean + d / count1
                var1 = var + d * (y - mean1)
                if not (np.isfinite(mean1) and np.isfinite(var1)):
                    scores[t, i] = np.inf  # overflow: alarm and restart (module docstring)
                    alarms[t, i] = True
                    mean = 0.0
                    var = 0.0
                    count = 0.0
                    continue
                count = count1
                mean = mean1
                var = var1
                if count == warmup:
                    var = var / (count - 1.0)
                    std = max(math.sqrt(var), min_std * abs(mean), 1e-300)
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            z = (y - mean) / std
            s_up1 = max(0.0, s_up + (z - k))
            s_down1 = max(0.0, s_down - (z + k))
            if direction > 0.0:
                s = s_up1
            elif direction < 0.0:
                s = s_down1
            else:
                s = max(s_up1, s_down1)
            alarm = s > threshold
            learn = alpha > 0.0 and not (alarm and (reset or freeze))
            mean1 = mean
            var1 = var
            if learn:
                mean1, var1 = ew_update(mean, var, y, alpha)
            overflow = not (
                np.isfinite(s_up1)
                and np.isfinite(s_down1)
                and np.isfinite(mean1)
                and np.isfinite(var1)
            )
            if overflow:
                s = np.inf  # x leaves the float64 range: alarm as for a non-finite value
                alarm = True
            scores[t, i] = s
            alarms[t, i] = alarm
            if overflow or (alarm and reset):
                mean = 0.0
                var = 0.0
                count = 0.0
                s_up = 0.0
                s_down = 0.0
            else:
                s_up = s_up1
                s_down = s_down1
                if learn:
                    mean = mean1
                    var = var1
                    std = max(math.sqrt(var), min_std * abs(mean), 1e-300)
        state[_MEAN, i] = mean
        state[_VAR, i] = var
        state[_COUNT, i] = count
        state[_S_UP, i] = s_up
        state[_S_DOWN, i] = s_down


class CUSUM(BankDetector):
    """Two-sided tabular CUSUM of standardised values (see the module docstring).

    Parameters
    ----------
    n_series
        Number of series in the bank.
    k
        Allowance (reference value) in standard deviations; ``k = delta / 2`` is optimal for a
        shift of ``delta`` standard deviations.
    threshold
        Decision interval ``h`` in standard deviations: ``alarm = score > threshold``.  The
        textbook ``h = 4..5`` (with ``k = 0.5``) alarms about every few hundred in-control
        steps; ``8`` is quieter on long training runs.
    warmup
        Finite observations used to estimate the reference mean and standard deviation.
    alpha
        Rate of the exponentially weighted reference after the warm-up (``0`` freezes it).
    min_std
        Floor of the reference standard deviation, relative to ``|mean|`` (absolute in log
        space is not needed: log values are already relative).  Keeps constant streams quiet.
    direction
        ``"both"`` (two-sided), ``"up"`` or ``"down"``.
    log_space
        Work on ``log(x)`` (values <= 0 floored at 1e-30): relative shifts of positive signals.
    reset_on_alarm
        Clear the sums and re-learn the reference after an alarm (one alarm per shift).
    freeze_on_alarm
        Do not update the reference while a series is in alarm (without ``reset_on_alarm``).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = np.concatenate([rng.normal(0.0, 1.0, 500), rng.normal(2.0, 1.0, 500)])
    >>> det = CUSUM()
    >>> scores, alarms = det.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [504]
    """

    parameter_constraints = {
        "k": Float(0.0),
        "warmup": Int(2),
        "alpha": Float(0.0, 1.0),
        "min_std": Float(0.0),
        "direction": Choice(DIRECTIONS),
        "log_space": Bool(),
        "reset_on_alarm": Bool(),
    }
    kind = "level_shift"
    summary = (
        "Two-sided tabular CUSUM on values standardised against a warm-up reference; catches "
        "small sustained level shifts.")

    def __init__(
        self,
        n_series: int = 1,
        k: float = 0.5,
        threshold: float = 8.0,
        warmup: int = 100,
        alpha: float = 0.0,
        min_std: float = 1e-6,
        direction: str = "both",
        log_space: bool = False,
        reset_on_alarm: bool = True,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    kernel = staticmethod(_kernel)
    param_layout = CUSUMParams
    state_hyperparameters = ("log_space", "warmup")

    def _check_state(self, c: StateCheck) -> None:
        c.not_nan("mean", c.state[_MEAN])
        c.not_nan("var", c.state[_VAR], 0.0)
        c.integers("count", c.state[_COUNT], 0)
        c.not_nan("s_up", c.state[_S_UP])
        c.not_nan("s_down", c.state[_S_DOWN])

    @property
    def mean(self) -> FloatArray:
        """Reference mean per series (running warm-up mean while warming up)."""
        return self._state[_MEAN].copy()

    @property
    def sums(self) -> tuple[FloatArray, FloatArray]:
        """Upper and lower cumulative sums ``(s_up, s_down)`` per series."""
        return self._state[_S_UP].copy(), self._state[_S_DOWN].copy()
