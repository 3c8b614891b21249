"""Loss rising with the learning rate: rolling correlation of loss and LR changes.

* :class:`LRLossCorrelation` (inputs ``loss``, ``lr``) -- rolling Pearson correlation, over the
  last ``window`` steps, of the change of the smoothed log loss with the previous step's change
  of log LR (the LR of step ``t`` shows in the loss of step ``t + 1``), gated so that it only
  counts when the LR went *up* over the window by ``min_lr_ratio`` and the loss went up too.

A non-positive LR (a schedule that starts or ends at 0) is "off": it is never put in a log and it
contributes no LR change.

Part of the LR / loss family (:mod:`detectors.lr_loss` re-exports it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, BankDetector, FloatArray
from ._kernel import indices, learns, skip_pair
from ._params import Float, Int, arguments
from ._state import StateCheck

# LRLossCorrelation state rows
_C_Y, _C_COUNT, _C_LR1, _C_LR2, _C_POS, _C_N = 0, 1, 2, 3, 4, 5
_C_FIELDS = 6


class LRCorrParams(NamedTuple):
    """Layout of :class:`LRLossCorrelation`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    alpha: float
    min_lr_ratio: float
    min_lr_std: float
    min_loss_std: float


_P_LRCORR = indices(LRCorrParams)


@njit(cache=True, error_model="numpy")
def _corr_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_LRCORR.threshold]
    freeze = params[_P_LRCORR.freeze_on_alarm] != 0.0
    w = int(params[_P_LRCORR.window])
    alpha = params[_P_LRCORR.alpha]
    log_ratio = math.log(params[_P_LRCORR.min_lr_ratio])
    min_lr_std = params[_P_LRCORR.min_lr_std]
    min_loss_std = params[_P_LRCORR.min_loss_std]
    # series by series (they are independent): the state in registers over the steps; the log
    # of an LR equal to the last one logged is reused (``log`` is a pure function: the same
    # bits), so a constant LR is logged once per call and a schedule once per step
    for i in range(X.shape[2]):
        # how many of the stored LR changes are not zero (a constant LR stores zeros): counted
        # once per call, then kept up to date as changes are stored
        nonzero = 0
        for k in range(w):
            nonzero += int(buf[k, i] != 0.0)
        yc = state[_C_Y, i]
        count = state[_C_COUNT, i]
        lr1 = state[_C_LR1, i]
        lr2 = state[_C_LR2, i]
        pos = int(state[_C_POS, i])
        n = int(state[_C_N, i])
        x1 = np.nan  # the two LRs last logged and their logs
        g1 = np.nan
        x2 = np.nan
        g2 = np.nan
        for t in range(X.shape[0]):
            loss = X[t, 0, i]
            lr = X[t, 1, i]
            if skip_pair(miss[t, 0, i], miss[t, 1, i], loss, lr, scores, alarms, t, i):
                continue
            y = math.log(max(loss, LOG_FLOOR))
            if count == 0.0:
                yc = y
                lr1 = lr
                count = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            y_prev = yc
            a_w = max(alpha, 1.0 / (count + 1.0))
            y_new = y_prev + a_w * (y - y_prev)
            b = y_new - y_prev
            if count >= 2.0 and lr1 > 0.0 and lr2 > 0.0:
                if lr1 == x1:
                    l1 = g1
                elif lr1 == x2:
                    l1 = g2
                else:
                    l1 = math.log(lr1)
                if lr2 == x1:
                    l2 = g1
                elif lr2 == x2:
                    l2 = g2
                else:
                    l2 = math.log(lr2)
                x1, g1, x2, g2 = lr1, l1, lr2, l2
                a = l1 - l2
            else:
                a = 0.0
            score = 0.0
            # every LR change of the window is zero but this step's: the sum of the changes
            # is this step's (up to the sign of a zero, which no comparison sees), and below
            # the gate the score is 0 whatever the sums -- skip them
            quiet = nonzero - int(buf[pos, i] != 0.0) == 0 and not a >= log_ratio
            if count >= 2.0 and n + 1 >= w and not quiet:
                # window = the w - 1 stored pairs before pos, plus (a, b)
                # r = 1 .. w - 1 is k = (pos - r) % w: pos - 1 down to 0, then w - 1 down to
                # pos + 1 -- two plain descending loops, the same order of additions
                sa = a
                sb = b
                for k in range(pos - 1, -1, -1):
                    sa += buf[k, i]
                    sb += buf[w + k, i]
                for k in range(w - 1, pos, -1):
                    sa += buf[k, i]
                    sb += buf[w + k, i]
                if sa >= log_ratio and sb > 0.0:
                    ma = sa / w
                    mb = sb / w
                    caa = (a - ma) * (a - ma)
                    cbb = (b - mb) * (b - mb)
                    cab = (a - ma) * (b - mb)
                    for k in range(pos - 1, -1, -1):
                        da = buf[k, i] - ma
                        db = buf[w + k, i] - mb
                        caa += da * da
                        cbb += db * db
                        cab += da * db
                    for k in range(w - 1, pos, -1):
                        da = buf[k, i] - ma
                        db = buf[w + k, i] - mb
                        caa += da * da
                        cbb += db * db
                        cab += da * db
                    sda = max(math.sqrt(caa / w), min_lr_std, 1e-300)
                    sdb = max(math.sqrt(cbb / w), min_loss_std, 1e-300)
                    score = (cab / w) / (sda * sdb)
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            if count >= 2.0:
                nonzero += int(a != 0.0) - int(buf[pos, i] != 0.0)
                buf[pos, i] = a
                buf[w + pos, i] = b
                pos = (pos + 1) % w
                n = min(n + 1, w)
            yc = y_new
            lr2 = lr1
            lr1 = lr
            count = count + 1.0
        state[_C_Y, i] = yc
        state[_C_COUNT, i] = count
        state[_C_LR1, i] = lr1
        state[_C_LR2, i] = lr2
        state[_C_POS, i] = pos
        state[_C_N, i] = n


class LRLossCorrelation(BankDetector):
    """Rolling correlation of loss changes with the preceding LR changes, gated on LR increases.

    Per step ``t``: ``a_t = log lr_{t-1} - log lr_{t-2}`` and ``b_t = m_t - m_{t-1}`` with ``m``
    the EW mean of ``log(loss)`` (``alpha``, debiased).  Over the last ``window`` pairs (the
    current one included)::

        score = cov(a, b) / (max(sd(a), min_lr_std) * max(sd(b), min_loss_std))
                if sum(a) >= log(min_lr_ratio) and sum(b) > 0 else 0

    i.e. the Pearson correlation (shrunk towards 0 when either series barely moves), counted
    only when the LR rose by at least ``min_lr_ratio`` over the window *and* the smoothed loss
    rose too.  Warm-up (LR rising, loss falling) and step decays (LR falling) are gated out; a
    spike in the LR followed by a spike in the loss gives a correlation near 1 for ``window``
    steps.  Gradual LR ramps correlate weakly step by step: :class:`LRLevelInstability` covers
    those.

    Parameters
    ----------
    n_series
        Number of series.
    window
        Number of (dlog lr, dloss) pairs in the correlation.
    alpha
        Weight of the newest log loss in the smoothed loss.
    min_lr_ratio
        The LR must have risen by this factor over the window for a non-zero score.
    min_lr_std
        Floor of the standard deviation of ``dlog lr`` (smooth schedules: correlation ~ 0).
    min_loss_std
        Floor of the standard deviation of the smoothed-loss change.
    threshold
        Alarm when the gated correlation exceeds this (it lies in [-1, 1]).
    freeze_on_alarm
        Do not update the window on a step in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> lr = np.full(400, 1e-3)
    >>> lr[300:] = 3e-2                            # LR x30 at step 300 ...
    >>> loss = np.exp(rng.normal(0.0, 0.02, 400))
    >>> loss[301:] *= 4.0                          # ... and the loss jumps right after
    >>> scores, alarms = LRLossCorrelation().update_many(loss, lr)
    >>> bool(alarms[:301].any()), int(np.argmax(alarms[:, 0]))
    (False, 301)
    """

    n_inputs = 2
    input_names = ("loss", "lr")

    parameter_constraints = {
        "window": Int(2),
        "alpha": Float(0.0, 1.0, low_open=True),
        "min_lr_ratio": Float(1.0),
        "min_lr_std": Float(0.0),
        "min_loss_std": Float(0.0),
    }
    window: int
    kind = "lr_loss_anomaly"
    summary = (
        "Rolling correlation of loss increases with LR increases, gated on the LR really rising.")

    def __init__(
        self,
        n_series: int = 1,
        window: int = 50,
        alpha: float = 0.1,
        min_lr_ratio: float = 1.5,
        min_lr_std: float = 0.01,
        min_loss_std: float = 1e-4,
        threshold: float = 0.5,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_C_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        return np.zeros((2 * self.window, n))

    kernel = staticmethod(_corr_kernel)
    param_layout = LRCorrParams
    state_hyperparameters = ("window",)

    def _check_state(self, c: StateCheck) -> None:
        w = self.window
        c.finite("y", c.state[_C_Y])
        c.integers("count", c.state[_C_COUNT], 0)
        c.finite("lr1", c.state[_C_LR1])
        c.finite("lr2", c.state[_C_LR2])
        c.integers("position", c.state[_C_POS], 0, w - 1)
        c.integers("n", c.state[_C_N], 0, w)
        c.finite("pairs", c.buf)
