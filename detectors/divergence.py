"""Train/validation divergence: a growing generalisation gap, and validation spikes.

Validation loss arrives every N steps (missing in between).  Both detectors work in log space
and score only on steps where a validation value is present (``nan`` elsewhere).

:class:`TrainValDivergence` keeps an EW mean of the log train loss (debiased) and, at each
validation point ``k``, forms the increments since the previous validation point::

    dv_k = log(val_k) - log(val_{k-1})          # validation change
    dm_k = m_k - m_{k-1}                        # smoothed log-train change
    u_k  = dv_k - max(dm_k, 0)  = min(dv_k, dv_k - dm_k)

``u_k`` is the growth of the gap ``log(val) - m`` *capped by the validation change itself*: it is
positive only when validation rises, and a rise that the train loss shares (both going up:
global instability, not over-fitting) is discounted.  (The raw gap also grows on healthy runs,
because the smoothed train loss lags behind a falling loss; capping by ``dv`` removes that.)
The score is the t-statistic of the mean of the last ``n_points`` increments::

    score = mean(u) * sqrt(n) / max(sd(u), min_scale)

so a *sustained* rise -- several increases in a row, even each as small as the noise -- scores
high, while isolated bumps do not.  ``min_scale`` (log units) keeps tiny, perfectly regular
drifts on a plateau from producing large t-values.

:class:`ValSpike` scores one validation point against the previous one:
``(log(val_k) - log(val_{k-1})) / scale`` with ``scale = 1.4826 * median |dv|`` over the last
``window`` validation increments (floored at ``min_scale``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, MAD_SCALE, BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Float, Int, arguments
from ._state import StateCheck

# TrainValDivergence state rows
_TM, _TCOUNT, _PREV_V, _PREV_M, _NVAL, _POS, _NINC, _HAS_M = 0, 1, 2, 3, 4, 5, 6, 7
_TV_FIELDS = 8


class TrainValParams(NamedTuple):
    """Layout of :class:`TrainValDivergence`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    n_points: float
    warmup: float
    min_scale: float


_P_TRAINVAL = indices(TrainValParams)


@njit(cache=True, error_model="numpy")
def _tv_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_TRAINVAL.threshold]
    freeze = params[_P_TRAINVAL.freeze_on_alarm] != 0.0
    alpha = params[_P_TRAINVAL.alpha]
    m_pts = int(params[_P_TRAINVAL.n_points])
    warmup = params[_P_TRAINVAL.warmup]
    min_scale = params[_P_TRAINVAL.min_scale]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            has_l = not miss[t, 0, i]
            has_v = not miss[t, 1, i]
            if (has_l and not np.isfinite(X[t, 0, i])) or (has_v and not np.isfinite(X[t, 1, i])):
                scores[t, i] = np.inf
                alarms[t, i] = True
                continue
            # tentative train update (committed unless frozen)
            tm = state[_TM, i]
            tc = state[_TCOUNT, i]
            if has_l:
                y = math.log(max(X[t, 0, i], LOG_FLOOR))
                if tc == 0.0:
                    tm = y
                else:
                    a = max(alpha, 1.0 / (tc + 1.0))
                    tm = tm + a * (y - tm)
                tc = tc + 1.0
            if not has_v:
                state[_TM, i] = tm
                state[_TCOUNT, i] = tc
                scores[t, i] = np.nan
                alarms[t, i] = False
                continue
            v = math.log(max(X[t, 1, i], LOG_FLOOR))
            nval = state[_NVAL, i]
            if nval == 0.0:
                state[_TM, i] = tm
                state[_TCOUNT, i] = tc
                state[_PREV_V, i] = v
                state[_PREV_M, i] = tm
                state[_HAS_M, i] = 1.0 if tc > 0.0 else 0.0
                state[_NVAL, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            dv = v - state[_PREV_V, i]
            has_m = tc > 0.0 and state[_HAS_M, i] != 0.0
            dm = tm - state[_PREV_M, i] if has_m else 0.0
            u = dv - max(dm, 0.0)
            pos = int(state[_POS, i])
            ninc = state[_NINC, i]
            n = int(min(ninc + 1.0, m_pts))
            if ninc + 1.0 < warmup:
                score = 0.0
            else:
                # the window: u plus the n - 1 most recent stored increments
                s = u
                for r in range(1, n):
                    s += buf[(pos - r) % m_pts, i]
                mean = s / n
                ss = (u - mean) * (u - mean)
                for r in range(1, n):
                    d = buf[(pos - r) % m_pts, i] - mean
                    ss += d * d
                sd = math.sqrt(ss / (n - 1)) if n > 1 else 0.0
                score = mean * math.sqrt(n) / max(sd, min_scale, 1e-300)
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            state[_TM, i] = tm
            state[_TCOUNT, i] = tc
            buf[pos, i] = u
            state[_POS, i] = (pos + 1) % m_pts
            state[_NINC, i] = ninc + 1.0
            state[_PREV_V, i] = v
            state[_PREV_M, i] = tm
            state[_HAS_M, i] = 1.0 if tc > 0.0 else 0.0
            state[_NVAL, i] = nval + 1.0


class TrainValDivergence(BankDetector):
    """Sustained growth of the validation/train gap (over-fitting) at validation points.

    Inputs are ``loss`` (every step) and ``val_loss`` (every N steps, missing otherwise).  The
    train loss is smoothed by an EW mean in log space; at every validation point the gap
    increment ``u = dv - max(dm, 0)`` (see the module docstring) enters a window of the last
    ``n_points`` increments, and the score is the t-statistic of their mean.  Only validation
    steps are scored (``nan`` on the others); a non-finite train or validation value scores
    ``+inf`` and is not used.

    Parameters
    ----------
    n_series
        Number of series (e.g. one per validation set sharing a train loss).
    alpha
        Weight of the newest train loss in the EW mean of ``log(loss)`` (debiased: plain average
        while ``count < 1/alpha``).  0.05 smooths minibatch noise over ~20 steps yet follows
        the loss closely between evaluations.
    n_points
        Number of validation increments in the t-statistic (5 = six evaluations).
    warmup
        Validation increments needed before scoring (at least 2 for a standard deviation).
    threshold
        Alarm when the t-statistic exceeds this.  For stationary validation noise the
        increments are anti-correlated and the statistic's spread is only ~0.45, so 3 is far
        in the tail; clean public runs stay below 0.1 (their validation keeps falling).
    min_scale
        Floor of the increments' standard deviation, in log units (0.005 = 0.5 %).
    freeze_on_alarm
        Do not update the statistics on a validation step in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> T = 2000
    >>> steps = np.arange(T)
    >>> train = np.exp(-steps / 800.0 + rng.normal(0.0, 0.05, T))
    >>> val = 1.05 * np.exp(-steps / 800.0)
    >>> val[1000:] = val[1000] * np.exp((steps[1000:] - 1000) / 2000.0)   # over-fitting
    >>> val_logged = np.where(steps % 50 == 0, val, np.nan)
    >>> missing = np.stack([np.zeros(T, bool), np.isnan(val_logged)], axis=1)[:, :, None]
    >>> det = TrainValDivergence()
    >>> scores, alarms = det.update_many(train, val_logged, missing=missing)
    >>> first = int(np.argmax(alarms[:, 0]))
    >>> bool(alarms[:1000].any()), 1000 < first <= 1250
    (False, True)
    """

    n_inputs = 2
    input_names = ("loss", "val_loss")

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "n_points": Int(2),
        "warmup": Int(2),
        "min_scale": Float(0.0),
    }
    n_points: int
    kind = "train_val_divergence"
    summary = (
        "At each validation point, the rise of log val loss not shared by the smoothed train "
        "loss; scores the t-statistic of its recent mean (a growing generalisation gap).")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.05,
        n_points: int = 5,
        warmup: int = 4,
        threshold: float = 3.0,
        min_scale: float = 0.005,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_TV_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        return np.zeros((self.n_points, n))

    kernel = staticmethod(_tv_kernel)
    param_layout = TrainValParams
    state_hyperparameters = ("n_points",)

    def _check_state(self, c: StateCheck) -> None:
        st = c.state
        for row, field in ((_TM, "train_mean"), (_PREV_V, "prev_val"), (_PREV_M, "prev_train")):
            c.finite(field, st[row])
        for row, field in ((_TCOUNT, "train_count"), (_NVAL, "n_val"), (_NINC, "n_increments")):
            c.integers(field, st[row], 0)
        c.integers("position", st[_POS], 0, self.n_points - 1)
        c.one_of("has_train", st[_HAS_M], (0.0, 1.0))
        c.finite("increments", c.buf)

    @property
    def smoothed_train(self) -> FloatArray:
        """EW mean of ``log(loss)`` per series."""
        return self._state[_TM].copy()


# ValSpike state rows
_VS_PREV, _VS_NVAL, _VS_POS, _VS_NINC = 0, 1, 2, 3
_VS_FIELDS = 4


class ValSpikeParams(NamedTuple):
    """Layout of :class:`ValSpike`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    warmup: float
    min_scale: float


_P_VALSPIKE = indices(ValSpikeParams)


@njit(cache=True, error_model="numpy")
def _vs_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_VALSPIKE.threshold]
    freeze = params[_P_VALSPIKE.freeze_on_alarm] != 0.0
    w = int(params[_P_VALSPIKE.window])
    warmup = params[_P_VALSPIKE.warmup]
    min_scale = params[_P_VALSPIKE.min_scale]
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            v = math.log(max(x, LOG_FLOOR))
            nval = state[_VS_NVAL, i]
            if nval == 0.0:
                state[_VS_PREV, i] = v
                state[_VS_NVAL, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            dv = v - state[_VS_PREV, i]
            ninc = int(state[_VS_NINC, i])
            if ninc < warmup:
                score = 0.0
            else:
                n = min(ninc, w)
                med = np.median(buf[:n, i])
                score = dv / max(MAD_SCALE * med, min_scale, 1e-300)
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            pos = int(state[_VS_POS, i])
            buf[pos, i] = abs(dv)
            state[_VS_POS, i] = (pos + 1) % w
            state[_VS_NINC, i] = ninc + 1.0
            state[_VS_PREV, i] = v
            state[_VS_NVAL, i] = nval + 1.0


class ValSpike(BankDetector):
    """Spike of a validation point relative to the previous validation points (log space).

    ``score = (log(val_k) - log(val_{k-1})) / max(1.4826 * median(|dv|), min_scale)``, the
    median over the last ``window`` validation increments: a robust "how many typical
    eval-to-eval changes did validation just jump up".  Only steps with a validation value are
    scored; the others are missing (``nan``).  Falling validation gives negative scores.

    Parameters
    ----------
    n_series
        Number of series.
    window
        Number of past validation increments in the robust scale.
    warmup
        Validation increments needed before scoring.
    threshold
        Alarm when the score exceeds this.
    min_scale
        Floor of the scale in log units (0.01 = 1 %).
    freeze_on_alarm
        Do not update the statistics on a validation point in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> val = np.exp(-np.arange(30) / 100.0 + rng.normal(0.0, 0.01, 30))
    >>> val[20] *= 1.5
    >>> scores, alarms = ValSpike().update_many(val)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [20]
    """

    input_names = ("val_loss",)

    parameter_constraints = {
        "window": Int(1),
        "warmup": Int(1),
        "min_scale": Float(0.0),
    }
    window: int
    kind = "train_val_divergence"
    summary = (
        "A validation point far above previous ones (robust scale of recent changes).")

    def __init__(
        self,
        n_series: int = 1,
        window: int = 8,
        warmup: int = 3,
        threshold: float = 6.0,
        min_scale: float = 0.01,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_VS_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        return np.zeros((self.window, n))

    kernel = staticmethod(_vs_kernel)
    param_layout = ValSpikeParams
    state_hyperparameters = ("window",)

    def _check_state(self, c: StateCheck) -> None:
        st = c.state
        c.finite("prev", st[_VS_PREV])
        c.integers("n_val", st[_VS_NVAL], 0)
        c.integers("n_increments", st[_VS_NINC], 0)
        c.integers("position", st[_VS_POS], 0, self.window - 1)
        c.finite("increments", c.buf, 0.0)
