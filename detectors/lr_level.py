"""The LR past a stable level: loss volatility while the LR is above the last stable one.

* :class:`LRLevelInstability` (inputs ``loss``, ``lr``) -- the volatility (EW variance of
  ``dlog loss``) relative to its baseline, scored only while the LR is above ``margin`` times the
  highest LR at which the loss was seen stable.

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

# LRLevelInstability state rows
_L_PREV, _L_MEAN, _L_VAR, _L_BASE, _L_MAXLR, _L_COUNT, _L_LR, _L_PEAKED = 0, 1, 2, 3, 4, 5, 6, 7
_L_FIELDS = 8


class LRLevelParams(NamedTuple):
    """Layout of :class:`LRLevelInstability`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    base_alpha: float
    warmup: float
    margin: float
    stable_ratio: float
    min_var: float


_P_LRLEVEL = indices(LRLevelParams)


@njit(cache=True, error_model="numpy")
def _level_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_LRLEVEL.threshold]
    freeze = params[_P_LRLEVEL.freeze_on_alarm] != 0.0
    alpha = params[_P_LRLEVEL.alpha]
    base_alpha = params[_P_LRLEVEL.base_alpha]
    warmup = params[_P_LRLEVEL.warmup]
    margin = params[_P_LRLEVEL.margin]
    stable_ratio = params[_P_LRLEVEL.stable_ratio]
    min_var = params[_P_LRLEVEL.min_var]
    # series by series (they are independent): the state in registers over the steps
    for i in range(X.shape[2]):
        prev = state[_L_PREV, i]
        mean = state[_L_MEAN, i]
        var = state[_L_VAR, i]
        base = state[_L_BASE, i]
        maxlr = state[_L_MAXLR, i]
        count = state[_L_COUNT, i]
        plr = state[_L_LR, i]
        pk = state[_L_PEAKED, i]
        for t in range(X.shape[0]):
            loss = X[t, 0, i]
            lr = X[t, 1, i]
            if skip_pair(miss[t, 0, i], miss[t, 1, i], loss, lr, scores, alarms, t, i):
                continue
            y = math.log(max(loss, LOG_FLOOR))
            if count == 0.0:
                prev = y
                maxlr = lr
                plr = lr
                count = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            d = y - prev
            a = max(alpha, 1.0 / count)
            dd = d - mean
            new_mean = mean + a * dd
            new_var = (1.0 - a) * (var + a * dd * dd)
            ratio = new_var / max(base, min_var, 1e-300)
            prev_lr = plr  # the LR that produced this loss change
            peaked = pk != 0.0 or lr <= prev_lr
            warm = count >= warmup and peaked
            if warm and prev_lr > margin * maxlr:
                score = ratio
            else:
                score = 0.0
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            prev = y
            mean = new_mean
            var = new_var
            if not warm:
                b = max(base_alpha, 1.0 / count)
                base = base + b * (new_var - base)
                maxlr = max(maxlr, lr)
            else:
                # winsorised: the baseline follows slow growth of the noise (log-loss noise
                # grows as the loss falls) but an instability cannot drag it up quickly
                v_in = min(new_var, stable_ratio * max(base, min_var))
                base = base + base_alpha * (v_in - base)
                if ratio <= stable_ratio:
                    maxlr = max(maxlr, prev_lr)
            plr = lr
            pk = 1.0 if peaked else 0.0
            count = count + 1.0
        state[_L_PREV, i] = prev
        state[_L_MEAN, i] = mean
        state[_L_VAR, i] = var
        state[_L_BASE, i] = base
        state[_L_MAXLR, i] = maxlr
        state[_L_COUNT, i] = count
        state[_L_LR, i] = plr
        state[_L_PEAKED, i] = pk


class LRLevelInstability(BankDetector):
    """Loss volatility relative to its baseline while the LR is above the highest stable LR.

    Volatility is the EW variance (``alpha``) of ``dlog loss``; the baseline is a slow EW mean
    (``base_alpha``) of that variance, updated only on *stable* steps (volatility ratio <=
    ``stable_ratio``; every step during warm-up).  The highest LR seen on a stable step is the
    "stable LR level".  Then::

        score = volatility / baseline   if lr_prev > margin * max_stable_lr   else 0

    where ``lr_prev`` is the LR of the previous step, the one whose update produced this step's
    loss change (and the LR recorded as stable when the change was calm).  The scoring starts
    after ``warmup`` steps *and* once the LR has stopped rising (the end of the schedule's
    warm-up: every LR of a warm-up ramp is new, and the loss noise in log space naturally grows
    while the loss falls).

    so a loss that becomes noisy only once the LR exceeds every level at which it was calm
    (a re-warm to a too-high peak, an LR multiplied by a bug) scores high, while ordinary noise
    at known LR levels scores 0.  ``stable_ratio`` is independent of ``threshold`` so the state
    never depends on the threshold.

    Parameters
    ----------
    n_series
        Number of series.
    alpha
        Weight of the newest ``dlog loss`` in the volatility (memory ~ ``1/alpha`` steps).
    base_alpha
        Weight of the newest volatility in the baseline (slow).
    warmup
        Steps during which the baseline and the stable LR level are learnt unconditionally and
        nothing is scored.
    margin
        The LR must exceed ``margin`` times the highest stable LR to be scored.
    stable_ratio
        A step is stable when volatility / baseline <= ``stable_ratio``.
    min_var
        Floor of the baseline variance (``dlog loss`` units squared).
    threshold
        Alarm when the volatility ratio exceeds this (4 = twice the baseline's std).
    freeze_on_alarm
        Do not update the statistics on a step in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> T = 1000
    >>> lr = np.full(T, 1e-3)
    >>> lr[600:] = np.linspace(1e-3, 2e-2, 400)               # re-warm to a 20x peak
    >>> noise = np.where(lr > 5e-3, 0.3, 0.02)                 # loss gets noisy past 5e-3
    >>> loss = np.exp(rng.normal(0.0, 1.0, T) * noise)
    >>> scores, alarms = LRLevelInstability().update_many(loss, lr)
    >>> onset, first = int(np.argmax(lr > 5e-3)), int(np.argmax(alarms[:, 0]))
    >>> bool(alarms[:onset].any()), first - onset < 40     # stable up to 5e-3; margin 1.2
    (False, True)
    """

    n_inputs = 2
    input_names = ("loss", "lr")

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "base_alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(1),
        "margin": Float(1.0),
        "stable_ratio": Float(0.0, low_open=True),
        "min_var": Float(0.0),
    }
    kind = "lr_loss_anomaly"
    summary = (
        "Loss volatility relative to its baseline, once the LR exceeds the highest LR seen while "
        "the loss was calm (LR too high).")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.05,
        base_alpha: float = 0.01,
        warmup: int = 100,
        threshold: float = 4.0,
        margin: float = 1.2,
        stable_ratio: float = 2.0,
        min_var: float = 1e-8,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_L_FIELDS, n))

    kernel = staticmethod(_level_kernel)
    param_layout = LRLevelParams
    state_hyperparameters = ()

    def _check_state(self, c: StateCheck) -> None:
        st = c.state
        for row, field in ((_L_PREV, "prev"), (_L_MEAN, "mean"), (_L_MAXLR, "max_lr"),
                           (_L_LR, "lr")):
            c.finite(field, st[row])
        c.not_nan("var", st[_L_VAR], 0.0)
        c.not_nan("base", st[_L_BASE], 0.0)
        c.integers("count", st[_L_COUNT], 0)
        c.one_of("peaked", st[_L_PEAKED], (0.0, 1.0))

    @property
    def max_stable_lr(self) -> FloatArray:
        """Highest LR seen on a stable step, per series."""
        return self._state[_L_MAXLR].copy()
