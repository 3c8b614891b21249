"""Over-fitting within a few validation points: the generalisation gap grows at every one.

Inputs are the train loss (every step) and the validation loss (every N steps, missing
otherwise).  The train loss is smoothed by a debiased EW mean ``m`` of ``log(loss)``; at each
validation point ``k`` the gap ``g_k = log(val_k) - m_k`` is formed and its increment since the
previous validation point::

    d_k = g_k - g_{k-1} = (log val_k - log val_{k-1}) - (m_k - m_{k-1})

The score is the *smallest* increment over the last ``n_points - 1`` intervals (a paired sign
test on the last ``n_points`` validation points) in units of the run's own noise of those
increments::

    score = min(d_{k-n_points+2}, ..., d_k) / max(sigma_d, min_scale)

so ``score > threshold`` means the gap grew by more than ``threshold`` noise units in *every*
one of the last ``n_points - 1`` intervals.  ``sigma_d`` is measured on the run itself, from
the second differences of the gap (``d_k - d_{k-1}``), which a steady trend does not move: for
independent noise of scale ``s`` on each gap value the increments have scale ``sqrt(2) s`` and
the second differences ``sqrt(6) s``, so ``sigma_d = 1.2533 * mean|d_k - d_{k-1}| / sqrt(3)``
(an EW mean with weight ``noise_alpha``, debiased).  Two rules keep the estimate to the
run's noise and off its events: the first increment (which spans the start of training, where
the train loss falls fastest and its EW mean has the least history) gives no second difference,
and a second difference enters winsorised at ``noise_clip`` times the current estimate (once it
is positive), so the kink where a steady trend turns into over-fitting -- one large second
difference -- moves the estimate by a bounded step instead of inflating it at the very point
the growth starts.  A run whose validation set is small (or
whose train loss is noisy) has a large ``sigma_d`` and needs a proportionally larger, still
persistent, growth; a steadily over-fitting run does not raise its own bar.  ``min_scale``
(log units) is the floor for quiet runs: with ``threshold = 2`` and ``min_scale = 0.02`` a run
whose noise is below 2 % per interval alarms on a growth of more than 4 % per interval, as the
first version of this detector did on every run.

The statistic is the signature of a model that memorises: the train loss falls (the data loader
stuck on a small subset, repeated data) while the validation loss rises or stalls.  Train and
validation rising together (an instability) leave the gap unchanged and do not score; a single
bump does not either.  Compared with :class:`~detectors.divergence.TrainValDivergence` (a
t-statistic of validation rises, capped by the train change) it also catches a validation loss
that merely stops improving while the train loss keeps falling fast, and it decides after
``n_points`` validation points (4 by default) instead of needing a long stretch of increments.

Only validation steps are scored (``nan`` elsewhere).  The first validation points (fewer than
``max(warmup, n_points)`` seen) score ``0.0``; so does a validation point that arrives before
any train loss.  A non-finite train or validation value scores ``+inf``, alarms and enters no
statistic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, MEAN_AD_SCALE, BankDetector, FloatArray
from ._kernel import indices, learns
from ._params import Float, Int, arguments
from ._state import StateCheck

# state rows: train EW mean/count, previous gap, validation points seen, ring position, stored
# increments; (state version 2) EW mean |second difference of the gap| and its count
_TM, _TCOUNT, _PREV_G, _NVAL, _POS, _NINC, _NOISE, _NNOISE = 0, 1, 2, 3, 4, 5, 6, 7
_N_FIELDS = 8
#: Gaussian scale of the increments per mean |second difference| (see the module docstring)
NOISE_SCALE = MEAN_AD_SCALE / math.sqrt(3.0)
#: validation points learnt before a second difference counts as noise: the first one is the
#: change from the first increment (start of training) to the second, a transient
FIRST_NOISE_POINT = 3.0


class OverfitParams(NamedTuple):
    """Layout of :class:`OverfitGap`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    n_points: float
    warmup: float
    min_scale: float
    noise_alpha: float
    noise_clip: float


_P = indices(OverfitParams)


@njit(cache=True, error_model="numpy", inline="always")
def _learn_noise(dd, noise, nn, noise_alpha, noise_clip):  # type: ignore[no-untyped-def]
    """The debiased EW mean of ``|second difference|`` after learning ``dd``, winsorised at
    ``noise_clip`` times the current (positive) estimate; returns ``(noise, count)``."""
    if noise > 0.0:
        dd = min(dd, noise_clip * noise)
    a = max(noise_alpha, 1.0 / (nn + 1.0))
    return noise + a * (dd - noise), nn + 1.0


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    freeze = params[_P.freeze_on_alarm] != 0.0
    alpha = params[_P.alpha]
    n_inc = int(params[_P.n_points]) - 1  # increments in the window (= rows of buf)
    warmup = params[_P.warmup]
    min_scale = params[_P.min_scale]
    noise_alpha = params[_P.noise_alpha]
    noise_clip = params[_P.noise_clip]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            has_l = not miss[t, 0, i]
            has_v = not miss[t, 1, i]
            if (has_l and not np.isfinite(X[t, 0, i])) or (has_v and not np.isfinite(X[t, 1, i])):
                scores[t, i] = np.inf
                alarms[t, i] = True
                continue
            tm = state[_TM, i]
            tc = state[_TCOUNT, i]
            if has_l:
                y = math.log(max(X[t, 0, i], LOG_FLOOR))
                if tc == 0.0:
                    tm = y
                else:
                    tm = tm + max(alpha, 1.0 / (tc + 1.0)) * (y - tm)
                tc = tc + 1.0
            if not has_v or tc == 0.0:
                state[_TM, i] = tm
                state[_TCOUNT, i] = tc
                scores[t, i] = np.nan if not has_v else 0.0
                alarms[t, i] = False
                continue
            g = math.log(max(X[t, 1, i], LOG_FLOOR)) - tm
            nval = state[_NVAL, i]
            if nval == 0.0:
                state[_TM, i] = tm
                state[_TCOUNT, i] = tc
                state[_PREV_G, i] = g
                state[_NVAL, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            d = g - state[_PREV_G, i]
            pos = int(state[_POS, i])
            ninc = state[_NINC, i]
            if ninc + 1.0 < n_inc or nval + 1.0 < warmup:
                score = 0.0
            else:
                score = d
                for r in range(1, n_inc):
                    score = min(score, buf[(pos - r) % n_inc, i])
                sigma = NOISE_SCALE * state[_NOISE, i]
                score = score / max(sigma, min_scale, 1e-300)
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            state[_TM, i] = tm
            state[_TCOUNT, i] = tc
            state[_PREV_G, i] = g
            state[_NVAL, i] = nval + 1.0
            if nval >= FIRST_NOISE_POINT:  # a second difference: the noise, free of a trend
                state[_NOISE, i], state[_NNOISE, i] = _learn_noise(
                    abs(d - buf[(pos - 1) % n_inc, i]), state[_NOISE, i], state[_NNOISE, i],
                    noise_alpha, noise_clip)
            buf[pos, i] = d
            state[_POS, i] = (pos + 1) % n_inc
            state[_NINC, i] = min(ninc + 1.0, float(n_inc))


class OverfitGap(BankDetector):
    """The train/validation gap grows at each of the last ``n_points`` validation points.

    See the module docstring for the statistic.  Alarm kind ``train_val_divergence``.

    Parameters
    ----------
    n_series
        Number of series (e.g. one per validation set sharing a train loss).
    alpha
        Weight of the newest train loss in the EW mean of ``log(loss)`` (debiased: a plain
        average while ``count < 1/alpha``).  0.2 follows the train loss within ~5 steps, so the
        lag of a smoothed, falling train loss does not pass for a growing gap.
    n_points
        Validation points in the sign test (``n_points - 1`` increments; 4 = a decision at the
        4th validation point of a rising gap).
    warmup
        Validation points seen before the first score (at least ``n_points`` are needed anyway).
    threshold
        Alarm when the gap grew by more than this many noise units (``max(sigma_d,
        min_scale)``) in every interval of the window.
    min_scale
        Floor of the increments' noise scale, in log units (0.02 ~ 2 %): on a quiet run the
        rule is a growth of more than ``threshold * min_scale`` per interval.
    noise_alpha
        Weight of the newest second difference in the EW mean that measures the run's noise
        (debiased: a plain average while ``count < 1/noise_alpha``).
    noise_clip
        A second difference enters the noise estimate winsorised at this many times the current
        estimate (``inf``: not winsorised): the kink at the onset of over-fitting is not noise.
    freeze_on_alarm
        Do not update the statistics on a validation step in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> steps = np.arange(600)
    >>> train = np.exp(-steps / 400.0)
    >>> val = 1.05 * np.exp(-steps / 400.0)
    >>> train[300:] = train[300] * np.exp(-(steps[300:] - 300) / 60.0)  # memorising from 300
    >>> val[300:] = val[300]                                         # val stops improving
    >>> val_logged = np.where(steps % 20 == 0, val, np.nan)
    >>> missing = np.stack([np.zeros(600, bool), np.isnan(val_logged)], axis=1)[:, :, None]
    >>> scores, alarms = OverfitGap().update_many(train, val_logged, missing=missing)
    >>> first = int(np.argmax(alarms[:, 0]))
    >>> bool(alarms[:300].any()), 300 < first <= 300 + 4 * 20
    (False, True)
    """

    n_inputs = 2
    input_names = ("loss", "val_loss")

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "n_points": Int(2),
        "warmup": Int(0),
        "min_scale": Float(0.0),
        "noise_alpha": Float(0.0, 1.0, low_open=True),
        "noise_clip": Float(1.0),
    }
    n_points: int
    kind = "train_val_divergence"
    tuning_grid = {"alpha": (0.1, 0.2, 0.3), "n_points": (3, 4)}
    summary = (
        "The train/validation gap grew at each of the last 4 validation points (train falling, "
        "val rising or stalled: memorisation), each time by more than `threshold` times the "
        "run's own noise of that growth (measured from its second differences).")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.2,
        n_points: int = 4,
        warmup: int = 5,
        threshold: float = 2.0,
        min_scale: float = 0.02,
        noise_alpha: float = 0.1,
        noise_clip: float = 3.0,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        return np.zeros((self.n_points - 1, n))

    kernel = staticmethod(_kernel)
    param_layout = OverfitParams
    state_hyperparameters = ("n_points",)
    #: version 2 added the noise rows; a version 1 snapshot loads with no noise measured yet
    #: (the scale is ``min_scale`` until the run's own noise is learnt)
    state_version = 2
    legacy_state_rows = {1: 6}

    def _check_state(self, c: StateCheck) -> None:
        k = self.n_points - 1
        c.finite("train_mean", c.state[_TM])
        c.integers("train_count", c.state[_TCOUNT], 0)
        c.finite("previous_gap", c.state[_PREV_G])
        c.integers("n_val", c.state[_NVAL], 0)
        c.integers("position", c.state[_POS], 0, k - 1)
        c.integers("n_increments", c.state[_NINC], 0, k)
        c.finite("noise", c.state[_NOISE], 0.0)
        c.integers("noise_count", c.state[_NNOISE], 0)
        c.finite("increments", c.buf)
