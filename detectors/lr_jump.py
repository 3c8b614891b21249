"""Learning-rate jumps: a schedule bug shows as one LR change far beyond the typical one.

* :class:`LRJump` (input ``lr``) -- ``|dlog lr|`` against the recent typical ``|dlog lr|``:
  warm-up, cosine, linear and constant schedules change the LR smoothly, so a factor-of-10 jump
  in one step is hundreds of typical changes.  Step-decay drops are benign *decreases*; by
  default only increases are scored (``direction="up"``).

A non-positive LR (a schedule that starts or ends at 0) is "off": it is never put in a log and it
scores 0.

Part of the LR / loss family (:mod:`detectors.lr_loss` re-exports it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Choice, Float, Int, arguments
from ._state import StateCheck

DIRECTIONS = {"up": 1.0, "down": -1.0, "both": 0.0}

# LRJump state rows
_J_PREV, _J_HAS, _J_TYP, _J_COUNT = 0, 1, 2, 3
_J_FIELDS = 4


class LRJumpParams(NamedTuple):
    """Layout of :class:`LRJump`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    warmup: float
    min_delta: float
    clip: float
    direction: float


_P_LRJUMP = indices(LRJumpParams)


@njit(cache=True, error_model="numpy")
def _jump_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_LRJUMP.threshold]
    freeze = params[_P_LRJUMP.freeze_on_alarm] != 0.0
    alpha = params[_P_LRJUMP.alpha]
    warmup = params[_P_LRJUMP.warmup]
    min_delta = params[_P_LRJUMP.min_delta]
    clip = params[_P_LRJUMP.clip]
    direction = params[_P_LRJUMP.direction]
    # series by series (they are independent): the state in registers over the steps, and the
    # log of a value equal to the last one logged reused (a constant LR logs once per call)
    for i in range(X.shape[2]):
        prev = state[_J_PREV, i]
        has = state[_J_HAS, i]
        typ = state[_J_TYP, i]
        count = state[_J_COUNT, i]
        last_x = np.nan
        last_y = np.nan
        for t in range(X.shape[0]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            if x <= 0.0:
                has = 0.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            if x != last_x:
                last_x = x
                last_y = math.log(x)
            y = last_y
            if has == 0.0:
                prev = y
                has = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            d = y - prev
            scale = max(typ, min_delta, 1e-300)
            if count < warmup:
                s = 0.0
            elif direction > 0.0:
                s = d / scale
            elif direction < 0.0:
                s = -d / scale
            else:
                s = abs(d) / scale
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            ad = abs(d)
            if count >= warmup and clip < np.inf:
                ad = min(ad, clip * scale)
            a = max(alpha, 1.0 / (count + 1.0))
            typ = typ + a * (ad - typ)
            count = count + 1.0
            prev = y
        state[_J_PREV, i] = prev
        state[_J_HAS, i] = has
        state[_J_TYP, i] = typ
        state[_J_COUNT, i] = count


class LRJump(BankDetector):
    """Abrupt learning-rate change relative to the schedule's recent typical change.

    ``score = dlog(lr) / max(typical, min_delta)`` (sign by ``direction``), where ``typical``
    is an EW mean of ``|dlog lr|`` (debiased; after warm-up each update is winsorised at ``clip``
    times the current scale, so a jump does not blind the detector to the next one).

    Parameters
    ----------
    n_series
        Number of series (e.g. one per parameter group).
    alpha
        Weight of the newest ``|dlog lr|`` in the typical change (memory ~ ``1/alpha`` steps).
    warmup
        LR changes seen before scoring.
    threshold
        Alarm when the jump exceeds this many typical changes.  With the floor ``min_delta =
        0.01`` the default 10 means: on a constant LR, any jump above ``exp(0.1) = +10.5 %``.
    min_delta
        Floor of the typical ``|dlog lr|`` (log units): the resolution below which LR changes
        are never considered abrupt.
    clip
        Winsorise updates of the typical change at ``clip * scale`` (``inf`` disables).
    direction
        ``"up"`` (default: schedule bugs that multiply the LR; step-decay drops are benign),
        ``"down"`` or ``"both"``.
    freeze_on_alarm
        Do not update the statistics on a step in alarm (the reference LR stays the pre-jump
        one, so a permanent jump keeps alarming).

    Examples
    --------
    >>> import numpy as np
    >>> steps = np.arange(1000)
    >>> lr = 1e-3 * np.minimum(1.0, (steps + 1) / 100) * 0.5 * (1 + np.cos(np.pi * steps / 1000))
    >>> lr[600:650] *= 25.0                       # schedule bug: x25 for 50 steps
    >>> lr[800:] *= 0.1                           # benign step decay
    >>> scores, alarms = LRJump().update_many(lr)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [600]
    """

    input_names = ("lr",)

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(0),
        "min_delta": Float(0.0),
        "clip": Float(0.0, low_open=True),
        "direction": Choice(DIRECTIONS),
    }
    kind = "lr_loss_anomaly"
    summary = (
        "A change of log LR far beyond the schedule's typical step-to-step change (schedule bugs; "
        "increases by default, so step decays are benign).")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.05,
        warmup: int = 5,
        threshold: float = 10.0,
        min_delta: float = 0.01,
        clip: float = 4.0,
        direction: str = "up",
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_J_FIELDS, n))

    kernel = staticmethod(_jump_kernel)
    param_layout = LRJumpParams
    state_hyperparameters = ()

    def _check_state(self, c: StateCheck) -> None:
        c.finite("prev", c.state[_J_PREV])
        c.one_of("has", c.state[_J_HAS], (0.0, 1.0))
        c.finite("typ", c.state[_J_TYP], 0.0)
        c.integers("count", c.state[_J_COUNT], 0)
