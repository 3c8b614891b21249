"""Page-Hinkley level-shift test, reproducing ``river.drift.PageHinkley`` exactly.

For every finite observation ``x`` (river's recurrence, same floating-point order)::

    n += 1;  mean += (1 / n) * (x - mean);  dev = x - mean
    s_up   = alpha * s_up   + dev - delta;   min_up   = min(min_up, s_up)
    s_down = alpha * s_down + dev + delta;   max_down = max(max_down, s_down)

and, once ``n >= min_instances``, the Page-Hinkley statistics ``up = s_up - min_up`` and
``down = max_down - s_down``.  The score is ``up`` (``mode="up"``), ``down`` (``"down"``) or
``max(up, down)`` (``"both"``); ``alarm = score > threshold`` is river's ``drift_detected``
(river compares with ``>`` too).  Like river, the series restarts from scratch after a drift
(``reset_on_drift=True``).  Before ``min_instances`` observations the score is ``0.0``.

**Overflow.**  A finite value whose update would leave the float64 range (e.g. ``+-1e308``)
never enters the statistics: it scores ``+inf``, alarms, and the series restarts from scratch as
after a drift (even with ``reset_on_drift=False``: statistics dominated by such a value would
overflow again on the next ordinary values).  river's mean and sums would become ``inf``/``nan``
and never alarm again.  Ordinary streams never get near the range, so the drift indices stay
identical to river's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, skip_value
from ._params import Bool, Choice, Float, Int, arguments
from ._state import StateCheck

MODES = {"up": 1.0, "down": -1.0, "both": 0.0}

# state rows
_N, _MEAN, _S_UP, _S_DOWN, _MIN_UP, _MAX_DOWN = 0, 1, 2, 3, 4, 5
_N_FIELDS = 6


class PageHinkleyParams(NamedTuple):
    """Layout of :class:`PageHinkley`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    min_instances: float
    delta: float
    alpha: float
    mode: float
    reset_on_drift: float


_P = indices(PageHinkleyParams)


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    min_instances = params[_P.min_instances]
    delta = params[_P.delta]
    alpha = params[_P.alpha]
    mode = params[_P.mode]
    reset = params[_P.reset_on_drift] != 0.0
    for i in range(X.shape[2]):
        n = state[_N, i]
        mean = state[_MEAN, i]
        s_up = state[_S_UP, i]
        s_down = state[_S_DOWN, i]
        min_up = state[_MIN_UP, i]
        max_down = state[_MAX_DOWN, i]
        for t in range(X.shape[0]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            n1 = n + 1.0
            mean1 = mean + (1.0 / n1) * (x - mean)
            dev = x - mean1
            s_up1 = alpha * s_up + dev - delta
            s_down1 = alpha * s_down + dev + delta
            min_up1 = min(min_up, s_up1)
            max_down1 = max(max_down, s_down1)
            s = 0.0
            if n1 >= min_instances:
                up = s_up1 - min_up1
                down = max_down1 - s_down1
                if mode > 0.0:
                    s = up
                elif mode < 0.0:
                    s = down
                else:
                    s = max(up, down)
            overflow = not (
                np.isfinite(mean1) and np.isfinite(s_up1) and np.isfinite(s_down1)
                and np.isfinite(s)
            )
            if overflow:
                s = np.inf  # x leaves the float64 range: alarm as for a non-finite value
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if overflow or (alarm and reset):
                n = 0.0
                mean = 0.0
                s_up = 0.0
                s_down = 0.0
                min_up = np.inf
                max_down = -1.0
            else:
                n = n1
                mean = mean1
                s_up = s_up1
                s_down = s_down1
                min_up = min_up1
                max_down = max_down1
        state[_N, i] = n
        state[_MEAN, i] = mean
        state[_S_UP, i] = s_up
        state[_S_DOWN, i] = s_down
        state[_MIN_UP, i] = min_up
        state[_MAX_DOWN, i] = max_down


class PageHinkley(BankDetector):
    """Page-Hinkley test for a shift of the mean (river's ``drift.PageHinkley``, banked).

    Parameters
    ----------
    n_series
        Number of series in the bank.
    min_instances
        Number of finite observations (since the last restart) before the test is applied.
    delta
        Tolerated magnitude of change (the drift allowance subtracted at every step).
    threshold
        Page-Hinkley threshold (lambda): ``alarm = score > threshold``.
    alpha
        Forgetting factor of the cumulative sums.
    mode
        ``"up"`` (increases of the mean), ``"down"`` or ``"both"``.
    reset_on_drift
        Restart the statistics after an alarm, as river does.
    freeze_on_alarm
        Not supported (must be ``False``): after a drift the detector restarts instead.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = np.concatenate([rng.normal(0.0, 1.0, 500), rng.normal(3.0, 1.0, 500)])
    >>> det = PageHinkley()
    >>> scores, alarms = det.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [514]
    """

    parameter_constraints = {
        "freeze_on_alarm": Bool(only=False, why="the detector restarts after a drift instead"),
        "min_instances": Int(0),
        "delta": Float(0.0),
        "alpha": Float(0.0, 1.0),
        "mode": Choice(MODES),
        "reset_on_drift": Bool(),
    }
    kind = "level_shift"
    tuning_grid = {"delta": (0.02, 0.05)}
    summary = (
        "Page-Hinkley cumulative deviation test; drift indices identical to "
        "`river.drift.PageHinkley`.")

    def __init__(
        self,
        n_series: int = 1,
        min_instances: int = 30,
        delta: float = 0.005,
        threshold: float = 50.0,
        alpha: float = 1 - 0.0001,
        mode: str = "both",
        reset_on_drift: bool = True,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        state = np.zeros((_N_FIELDS, n))
        state[_MIN_UP] = np.inf
        state[_MAX_DOWN] = -1.0
        return state

    kernel = staticmethod(_kernel)
    param_layout = PageHinkleyParams
    state_hyperparameters = ()

    def _check_state(self, c: StateCheck) -> None:
        c.integers("n", c.state[_N], 0)
        c.not_nan("mean", c.state[_MEAN])
        c.not_nan("s_up", c.state[_S_UP])
        c.not_nan("s_down", c.state[_S_DOWN])
        c.not_nan("min_up", c.state[_MIN_UP], -np.finfo(np.float64).max)
        c.not_nan("max_down", c.state[_MAX_DOWN], -np.inf, np.finfo(np.float64).max)

    @property
    def n_observations(self) -> FloatArray:
        """Finite observations since the last restart, per series."""
        return self._state[_N].copy()

    @property
    def mean(self) -> FloatArray:
        """Running mean since the last restart, per series."""
        return self._state[_MEAN].copy()
