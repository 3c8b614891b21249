"""Loss not decreasing: the smoothed level still at its starting level after a horizon.

A run that does not learn at all -- the LR is zero, the loss is detached from the model, the
model is frozen or badly initialised, the labels are shuffled -- keeps a loss that moves with
the batches but never goes down.  :class:`NoProgress` compares, per series, an exponentially
weighted mean of the values (debiased, memory ``1 / alpha`` values) with the mean of the first
``window`` values, once ``horizon`` values have been seen: the score is
``ew_mean / initial_mean`` and ``alarm = score > threshold`` (``0.97``: the smoothed loss is
still within 3 % of where it started).  Averaging makes it insensitive to batch noise (a noisy
small-batch loss that does go down is not flagged, a noisy one that does not is).

The rule is about the *start* of training: a monitor attached to a run already at its plateau
(a resume without state, a log replayed from the middle) would see a healthy flat loss, which
is why the ``default`` preset does not bind it (``docs/detectors.md``).  Before ``horizon``
values the score is ``0``.

**Overflow.**  A finite value whose update would leave the float64 range (e.g. ``+-1e308``)
never enters the statistics: it scores ``+inf`` and alarms, as a non-finite value does.  A
ratio beyond the float64 range (a huge level over a tiny initial one) saturates at the largest
float, so ordinary values always score finite.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Float, Int, arguments
from ._state import StateCheck

# state rows
_COUNT, _REF_SUM, _EWM = 0, 1, 2
#: a non-positive initial mean is replaced by this (the detector is meant for a positive loss)
TINY = 1e-300
#: a ratio beyond the float64 range (a huge level over a tiny initial one) scores this, finite
SATURATED = float(np.finfo(np.float64).max)


class NoProgressParams(NamedTuple):
    """Layout of :class:`NoProgress`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    horizon: float
    alpha: float


P = indices(NoProgressParams)


@njit(cache=True, error_model="numpy")
def _progress_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    """The bank kernel (see ``detectors/_base.py``)."""
    window, horizon, alpha = params[P.window], params[P.horizon], params[P.alpha]
    threshold, freeze = params[P.threshold], params[P.freeze_on_alarm]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            count = state[_COUNT, i]
            s = 0.0
            if count >= horizon and count > 0.0:
                s = state[_EWM, i] / max(state[_REF_SUM, i] / min(count, window), TINY)
                s = max(-SATURATED, min(s, SATURATED))  # a ratio past the float64 range
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            ref1 = state[_REF_SUM, i] + x if count < window else state[_REF_SUM, i]
            a = max(alpha, 1.0 / (count + 1.0))
            ewm1 = state[_EWM, i] + a * (x - state[_EWM, i])
            if not (np.isfinite(ref1) and np.isfinite(ewm1)):
                scores[t, i] = np.inf  # overflow: alarm, the value stays out (module docstring)
                alarms[t, i] = True
                continue
            state[_REF_SUM, i] = ref1
            state[_EWM, i] = ewm1
            state[_COUNT, i] = count + 1.0


class NoProgress(BankDetector):
    """Smoothed level / initial level, once ``horizon`` values have been seen.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    threshold
        Alarm when the smoothed level is above this fraction of the initial level.
    window
        Number of first values whose mean is the initial level.
    horizon
        Number of values before any score (the run's chance to start learning).
    alpha
        Weight of the newest value in the smoothed level (memory about ``1 / alpha`` values).
    freeze_on_alarm
        Do not learn a value that raised an alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> flat = 2.3 * np.exp(rng.normal(0.0, 0.1, 400))
    >>> learning = flat * np.linspace(1.0, 0.6, 400)
    >>> bool(NoProgress().update_many(learning)[1].any())
    False
    >>> int(np.flatnonzero(NoProgress().update_many(flat)[1][:, 0])[0])
    300
    """

    param_layout = NoProgressParams
    kernel = staticmethod(_progress_kernel)

    parameter_constraints = {
        "window": Int(1),
        "horizon": Int(1),
        "alpha": Float(0.0, 1.0, low_open=True),
    }
    kind = "stall"
    summary = (
        "Loss not decreasing: an EW mean of the values over the mean of the first `window`, "
        "scored once `horizon` values are seen (a run that never starts learning). Not bound by "
        "default: a run watched from its plateau is healthy.")

    def __init__(self, n_series: int = 1, threshold: float = 0.97, window: int = 50,
                 horizon: int = 300, alpha: float = 0.02, freeze_on_alarm: bool = False):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((3, n))

    def _check_state(self, c: StateCheck) -> None:
        c.integers("count", c.state[_COUNT], 0)
        c.finite("ref_sum", c.state[_REF_SUM])
        c.finite("ewm", c.state[_EWM])
