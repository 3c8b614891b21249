"""Updates that silently never happen: a series of update sizes stuck at zero.

The torch adapters measure the update-to-weight ratio ``||w_t+1 - w_t|| / ||w_t||`` per layer
(``update_ratio/<layer>``, :mod:`stability.adapters.torch_ops.signals`).  When an optimizer
skips its step without saying so -- a loss scaler stuck at skipping, a DeepSpeed/bf16 optimizer
that drops every step on overflow, a parameter group whose LR was zeroed by a bug -- the run
goes on, the loss and gradients look alive, and the weights do not change: the ratio is exactly
zero.  :class:`UpdateStall` counts, per series, the consecutive observations at or below
``eps`` and scores that count once the series has been seen moving (``> eps``) at least once:
a layer that was updating and stopped.  A layer never seen moving (an unused parameter, a
deliberately frozen one that still gets gradients) scores 0; a single zero (the last step of a
schedule that decays to exactly 0, one routine loss-scaler overflow) stays below the default
threshold (alarm on the third zero observation in a row).

The score is the run length; ``alarm = score > threshold``.  A non-finite ratio alarms and does
not count (kernel contract); a missing one (the adapters log the ratio every few steps) is
invisible.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Float, arguments
from ._state import StateCheck

# state rows
_RUN, _MOVED = 0, 1


class StallParams(NamedTuple):
    """Layout of :class:`UpdateStall`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    eps: float


P = indices(StallParams)


@njit(cache=True, error_model="numpy")
def _stall_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    """The bank kernel (see ``detectors/_base.py``)."""
    eps, threshold, freeze = params[P.eps], params[P.threshold], params[P.freeze_on_alarm]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            still = abs(x) <= eps
            run = state[_RUN, i] + 1.0 if still else 0.0
            s = run if state[_MOVED, i] != 0.0 else 0.0
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if learns(alarm, freeze):
                state[_RUN, i] = run
                if not still:
                    state[_MOVED, i] = 1.0


class UpdateStall(BankDetector):
    """Consecutive zero updates of a series that was updating before.

    Parameters
    ----------
    n_series
        Number of series in the bank (one per layer).
    threshold
        Alarm when more than this many consecutive observations are at or below ``eps``.
    eps
        An update at or below this counts as none (``0``: exactly zero, what a skipped step
        leaves).
    freeze_on_alarm
        Do not update a series' run length while it is in alarm (then it alarms once per
        observation at the same score).

    Examples
    --------
    >>> import numpy as np
    >>> det = UpdateStall()
    >>> x = np.array([1e-3, 1e-3, 0.0, 1e-3, 0.0, 0.0, 0.0, 0.0])
    >>> scores, alarms = det.update_many(x)
    >>> scores[:, 0].tolist(), np.flatnonzero(alarms[:, 0]).tolist()
    ([0.0, 0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0], [6, 7])
    >>> UpdateStall().update_many(np.zeros(10))[1].any()   # never seen moving
    np.False_
    """

    param_layout = StallParams
    kernel = staticmethod(_stall_kernel)

    parameter_constraints = {"eps": Float(0.0)}
    kind = "stall"
    summary = (
        "Consecutive zero updates (`update_ratio` at or below `eps`) of a series that was "
        "updating before: an optimizer silently skipping its steps, a parameter group frozen by a "
        "bug. Never-moving series (unused parameters) score 0.")

    def __init__(self, n_series: int = 1, threshold: float = 2.0, eps: float = 0.0,
                 freeze_on_alarm: bool = False):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((2, n))

    def _check_state(self, c: StateCheck) -> None:
        c.integers("run", c.state[_RUN], 0)
        c.one_of("moved", c.state[_MOVED], (0.0, 1.0))

    @property
    def run_length(self) -> FloatArray:
        """Per series, the current number of consecutive still observations."""
        return self._state[_RUN].copy()
