"""Learning-rate / loss anomalies: schedule bugs, loss rising with the LR, LR past a stable level.

* :class:`LRJump` (input ``lr``) -- ``|dlog lr|`` against the recent typical ``|dlog lr|``:
  warm-up, cosine, linear and constant schedules change the LR smoothly, so a factor-of-10 jump
  in one step is hundreds of typical changes.  Step-decay drops are benign *decreases*; by
  default only increases are scored (``direction="up"``).
* :class:`LRLossCorrelation` (inputs ``loss``, ``lr``) -- rolling Pearson correlation, over the
  last ``window`` steps, of the change of the smoothed log loss with the previous step's change
  of log LR (the LR of step ``t`` shows in the loss of step ``t + 1``), gated so that it only
  counts when the LR went *up* over the window by ``min_lr_ratio`` and the loss went up too.
* :class:`LRLevelInstability` (inputs ``loss``, ``lr``) -- the volatility (EW variance of
  ``dlog loss``) relative to its baseline, scored only while the LR is above ``margin`` times the
  highest LR at which the loss was seen stable.

A non-positive LR (a schedule that starts or ends at 0) is "off": it is never put in a log, it
scores 0 in :class:`LRJump` and contributes no LR change in :class:`LRLossCorrelation`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, BankDetector, FloatArray, check_float, check_int
from ._kernel import indices, learns, skip_pair, skip_value
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
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            if x <= 0.0:
                state[_J_HAS, i] = 0.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            y = math.log(x)
            if state[_J_HAS, i] == 0.0:
                state[_J_PREV, i] = y
                state[_J_HAS, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            d = y - state[_J_PREV, i]
            typ = state[_J_TYP, i]
            count = state[_J_COUNT, i]
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
            state[_J_TYP, i] = typ + a * (ad - typ)
            state[_J_COUNT, i] = count + 1.0
            state[_J_PREV, i] = y


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

    kind = "lr_loss_anomaly"
    input_names = ("lr",)
    hyperparameters = ("alpha", "warmup", "min_delta", "clip", "direction")

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
        super().__init__(n_series, threshold, freeze_on_alarm)
        name = type(self).__name__
        self.alpha = check_float(name, "alpha", alpha, 0.0, 1.0, low_open=True)
        self.warmup = check_int(name, "warmup", warmup, 0)
        self.min_delta = check_float(name, "min_delta", min_delta, 0.0)
        self.clip = check_float(name, "clip", clip, 0.0, low_open=True)
        if direction not in DIRECTIONS:
            raise ValueError(
                f"The 'direction' parameter of {name} must be one of {sorted(DIRECTIONS)}. "
                f"Got {direction!r} instead."
            )
        self.direction = direction
        self._setup()

    def _param_values(self) -> dict[str, float]:
        return {"direction": DIRECTIONS[self.direction]}

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
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            loss = X[t, 0, i]
            lr = X[t, 1, i]
            if skip_pair(miss[t, 0, i], miss[t, 1, i], loss, lr, scores, alarms, t, i):
                continue
            y = math.log(max(loss, LOG_FLOOR))
            count = state[_C_COUNT, i]
            if count == 0.0:
                state[_C_Y, i] = y
                state[_C_LR1, i] = lr
                state[_C_COUNT, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            y_prev = state[_C_Y, i]
            a_w = max(alpha, 1.0 / (count + 1.0))
            y_new = y_prev + a_w * (y - y_prev)
            b = y_new - y_prev
            lr1 = state[_C_LR1, i]
            lr2 = state[_C_LR2, i]
            a = math.log(lr1) - math.log(lr2) if (count >= 2.0 and lr1 > 0.0 and lr2 > 0.0) else 0.0
            n = int(state[_C_N, i])
            pos = int(state[_C_POS, i])
            score = 0.0
            if count >= 2.0 and n + 1 >= w:
                # window = the w - 1 stored pairs before pos, plus (a, b)
                sa = a
                sb = b
                for r in range(1, w):
                    k = (pos - r) % w
                    sa += buf[k, i]
                    sb += buf[w + k, i]
                if sa >= log_ratio and sb > 0.0:
                    ma = sa / w
                    mb = sb / w
                    caa = (a - ma) * (a - ma)
                    cbb = (b - mb) * (b - mb)
                    cab = (a - ma) * (b - mb)
                    for r in range(1, w):
                        k = (pos - r) % w
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
                buf[pos, i] = a
                buf[w + pos, i] = b
                state[_C_POS, i] = (pos + 1) % w
                state[_C_N, i] = min(n + 1.0, w)
            state[_C_Y, i] = y_new
            state[_C_LR2, i] = lr1
            state[_C_LR1, i] = lr
            state[_C_COUNT, i] = count + 1.0


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

    kind = "lr_loss_anomaly"
    n_inputs = 2
    input_names = ("loss", "lr")
    hyperparameters = ("window", "alpha", "min_lr_ratio", "min_lr_std", "min_loss_std")

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
        super().__init__(n_series, threshold, freeze_on_alarm)
        name = type(self).__name__
        self.window = check_int(name, "window", window, 2)
        self.alpha = check_float(name, "alpha", alpha, 0.0, 1.0, low_open=True)
        self.min_lr_ratio = check_float(name, "min_lr_ratio", min_lr_ratio, 1.0)
        self.min_lr_std = check_float(name, "min_lr_std", min_lr_std, 0.0)
        self.min_loss_std = check_float(name, "min_loss_std", min_loss_std, 0.0)
        self._setup()

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
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            loss = X[t, 0, i]
            lr = X[t, 1, i]
            if skip_pair(miss[t, 0, i], miss[t, 1, i], loss, lr, scores, alarms, t, i):
                continue
            y = math.log(max(loss, LOG_FLOOR))
            count = state[_L_COUNT, i]
            if count == 0.0:
                state[_L_PREV, i] = y
                state[_L_MAXLR, i] = lr
                state[_L_LR, i] = lr
                state[_L_COUNT, i] = 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            d = y - state[_L_PREV, i]
            mean = state[_L_MEAN, i]
            var = state[_L_VAR, i]
            a = max(alpha, 1.0 / count)
            dd = d - mean
            new_mean = mean + a * dd
            new_var = (1.0 - a) * (var + a * dd * dd)
            base = state[_L_BASE, i]
            ratio = new_var / max(base, min_var, 1e-300)
            prev_lr = state[_L_LR, i]  # the LR that produced this loss change
            peaked = state[_L_PEAKED, i] != 0.0 or lr <= prev_lr
            warm = count >= warmup and peaked
            if warm and prev_lr > margin * state[_L_MAXLR, i]:
                score = ratio
            else:
                score = 0.0
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            state[_L_PREV, i] = y
            state[_L_MEAN, i] = new_mean
            state[_L_VAR, i] = new_var
            if not warm:
                b = max(base_alpha, 1.0 / count)
                state[_L_BASE, i] = base + b * (new_var - base)
                state[_L_MAXLR, i] = max(state[_L_MAXLR, i], lr)
            else:
                # winsorised: the baseline follows slow growth of the noise (log-loss noise
                # grows as the loss falls) but an instability cannot drag it up quickly
                v_in = min(new_var, stable_ratio * max(base, min_var))
                state[_L_BASE, i] = base + base_alpha * (v_in - base)
                if ratio <= stable_ratio:
                    state[_L_MAXLR, i] = max(state[_L_MAXLR, i], prev_lr)
            state[_L_LR, i] = lr
            state[_L_PEAKED, i] = 1.0 if peaked else 0.0
            state[_L_COUNT, i] = count + 1.0


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

    kind = "lr_loss_anomaly"
    n_inputs = 2
    input_names = ("loss", "lr")
    hyperparameters = ("alpha", "base_alpha", "warmup", "margin", "stable_ratio", "min_var")

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
        super().__init__(n_series, threshold, freeze_on_alarm)
        name = type(self).__name__
        self.alpha = check_float(name, "alpha", alpha, 0.0, 1.0, low_open=True)
        self.base_alpha = check_float(name, "base_alpha", base_alpha, 0.0, 1.0, low_open=True)
        self.warmup = check_int(name, "warmup", warmup, 1)
        self.margin = check_float(name, "margin", margin, 1.0)
        self.stable_ratio = check_float(name, "stable_ratio", stable_ratio, 0.0, low_open=True)
        self.min_var = check_float(name, "min_var", min_var, 0.0)
        self._setup()

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
