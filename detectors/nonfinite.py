"""Non-finite guard: NaN, +inf or -inf in any element of any signal.

Non-finite metrics are a signal, not noise: the guard alarms on every non-finite element and
keeps a per-series count of non-finite observations (a NaN streak length is in the state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, BoolArray, FloatArray
from ._kernel import indices
from ._params import Bool, Float, arguments
from ._state import StateCheck

# state rows: total non-finite count, current streak, last kind (1 nan, 2 +inf, 3 -inf)
_TOTAL, _STREAK, _LAST = 0, 1, 2
_N_FIELDS = 3


class NonFiniteParams(NamedTuple):
    """Layout of :class:`NonFiniteGuard`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float


_P = indices(NonFiniteParams)


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    n = X.shape[2]
    quiet_alarm = 0.0 > threshold
    for t in range(X.shape[0]):
        # the common row, every value finite or missing, in branch-free loops the compiler
        # vectorises: streaks of the present values end, their scores are 0; missing values
        # score nan and keep their state
        x_t = X[t, 0]
        m_t = miss[t, 0]
        usual = True
        for i in range(n):
            usual &= m_t[i] | np.isfinite(x_t[i])
        if usual:
            streak = state[_STREAK]
            s_t = scores[t]
            a_t = alarms[t]
            for i in range(n):
                m = m_t[i]
                streak[i] = streak[i] if m else 0.0
                s_t[i] = np.nan if m else 0.0
                a_t[i] = (not m) & quiet_alarm
            continue
        for i in range(n):
            if miss[t, 0, i]:
                scores[t, i] = np.nan
                alarms[t, i] = False
                continue
            x = X[t, 0, i]
            if np.isnan(x):
                code = 1.0
            elif x == np.inf:
                code = 2.0
            elif x == -np.inf:
                code = 3.0
            else:
                code = 0.0
            if code != 0.0:
                state[_TOTAL, i] += 1.0
                state[_STREAK, i] += 1.0
                state[_LAST, i] = code
                scores[t, i] = code
            else:
                state[_STREAK, i] = 0.0
                scores[t, i] = 0.0
            alarms[t, i] = scores[t, i] > threshold


class NonFiniteGuard(BankDetector):
    """Alarm on every NaN / +inf / -inf element.

    The score is ``0`` for a finite value, ``1`` for NaN, ``2`` for +inf and ``3`` for -inf
    (``nan`` when the value was not logged).

    Parameters
    ----------
    n_series
        Number of series in the bank.
    threshold
        ``alarm = score > threshold``; must lie in ``[0, 1)`` so that every non-finite value
        alarms and no finite one does (``0.5`` by default).  Accepted so that
        ``NonFiniteGuard(**g.get_params())`` rebuilds a guard.
    freeze_on_alarm
        Must be ``False``: the guard has no statistics to freeze.

    Examples
    --------
    >>> import numpy as np
    >>> g = NonFiniteGuard(n_series=3)
    >>> g.update(np.array([1.0, np.nan, -np.inf])).tolist()
    [False, True, True]
    >>> g.score.tolist()
    [0.0, 1.0, 3.0]
    >>> g.streak.tolist()
    [0.0, 1.0, 1.0]
    >>> NonFiniteGuard(**g.get_params()).get_params() == g.get_params()
    True
    """

    #: the threshold is not a tuning knob (any value in [0, 1) gives the same alarms)
    fixed_threshold: ClassVar[bool] = True

    parameter_constraints = {
        "threshold": Float(0.0, 1.0, high_open=True),
        "freeze_on_alarm": Bool(only=False, why="the guard has no statistics to freeze"),
    }
    kind = "nonfinite"
    summary = (
        "Alarms on every NaN/±inf element. Keeps the count and the current streak.")

    def __init__(self, n_series: int = 1, threshold: float = 0.5, freeze_on_alarm: bool = False):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    kernel = staticmethod(_kernel)
    param_layout = NonFiniteParams
    state_hyperparameters = ()

    def _check_state(self, c: StateCheck) -> None:
        c.integers("total", c.state[_TOTAL], 0)
        c.integers("streak", c.state[_STREAK], 0)
        c.one_of("last", c.state[_LAST], (0.0, 1.0, 2.0, 3.0))

    def update_finite_many(self, present: Sequence[Any], scores: FloatArray,
                           alarms: BoolArray, written: bool = False) -> None:
        """:meth:`update_many_array` for a batch known to hold only finite or missing values
        (the replay's usual chunk), from the present masks alone: no input block to fill.

        ``present[i]``: series ``i``'s present mask over the batch's rows, or ``True``
        (present on every row) / ``False`` (never).  ``written``: the columns of the series
        given as ``True`` / ``False`` already hold their scores and alarms (this method wrote
        them into the same arrays last time).  Scores, alarms and state are the kernel's.
        """
        quiet = bool(0.0 > self._params_arr[int(_P.threshold)])
        streak = self._state[_STREAK]
        for i, p in enumerate(present):
            if p is True or p is False:
                if not written:
                    scores[:, i] = 0.0 if p else np.nan
                    alarms[:, i] = quiet and p
                if p:
                    streak[i] = 0.0
            else:
                scores[:, i] = np.where(p, 0.0, np.nan)
                np.logical_and(p, quiet, out=alarms[:, i])
                if p.any():
                    streak[i] = 0.0
        self._score1[0] = scores[-1]
        self._alarm1[0] = alarms[-1]

    @property
    def streak(self) -> FloatArray:
        """Current run length of consecutive non-finite observations per series."""
        return self._state[_STREAK].copy()

    @property
    def total(self) -> FloatArray:
        """Total non-finite observations per series."""
        return self._state[_TOTAL].copy()
