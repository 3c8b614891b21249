"""Activation distribution shift: multivariate robust z-scores and histogram drift (PSI).

Two detectors watch per-layer activation statistics (``act_mean/<l>``, ``act_std/<l>``,
``act_absmax/<l>``, ``act_kurtosis/<l>``, ...):

* :class:`ActivationShift` -- the *k* statistics of one layer are one multivariate stream.  Each
  feature gets a robust exponentially weighted location (a winsorised, Huber-style EW mean) and
  scale (EW mean absolute deviation, times ``sqrt(pi/2)`` so it estimates a Gaussian sigma),
  in log space for positive statistics (std, abs-max, kurtosis: a scaling bug is a shift there)
  and in signed space for the mean.  The per-feature z-scores are aggregated into one score per
  layer and step: the root mean square ``sqrt(sum z_j^2 / m)`` over the ``m`` present, warmed-up
  features (a chi-like statistic normalised so that one feature alone gives its own ``|z|``),
  or the maximum ``|z_j|``.
* :class:`HistogramDrift` -- per series, a *reference* window (the first ``window`` finite values
  after ``warmup``, optionally refreshed) against the sliding *current* window, compared by the
  Population Stability Index on ``n_bins`` bins whose edges are the reference's quantiles.  PSI
  depends only on ranks relative to the reference, so it is scale and offset invariant and sees
  drifts too slow for a z-score (the running location follows those).

The histogram detector lives in :mod:`detectors.histogram` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, MEAN_AD_SCALE, BankDetector, FloatArray
from ._kernel import learns
from ._params import Choice, Flags, Float, Int, arguments
from ._shift_narrow import (
    _AS_LOG0,
    _COUNT,
    _LOC,
    _P_SHIFT,
    _SCALE,
    ShiftParams,
    _floored_scale,
    _shift_layers,
    _shift_series3,
)
from ._state import StateCheck
from .histogram import HistogramDrift as HistogramDrift

AGGREGATES = {"rms": 0.0, "max": 1.0}

#: banks of at least this many layers are updated feature by feature over all layers
#: (vectorised loops); smaller ones (a replay of a few layers) layer by layer
FEATURE_MAJOR_FROM = 32


@njit(cache=True, error_model="numpy")
def _shift_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_SHIFT.threshold]
    freeze = params[_P_SHIFT.freeze_on_alarm] != 0.0
    alpha = params[_P_SHIFT.alpha]
    warmup = params[_P_SHIFT.warmup]
    min_scale = params[_P_SHIFT.min_scale]
    clip = params[_P_SHIFT.clip]
    use_max = params[_P_SHIFT.aggregate] != 0.0
    do_clip = clip < np.inf
    # from this count on max(alpha, 1 / (count + 1)) is exactly alpha (1 / (count + 1) < alpha / 2
    # in real arithmetic, and rounding is monotone): no division in the steady state
    debias_until = 2.0 / alpha + 2.0
    k = X.shape[1]
    n = X.shape[2]
    if n < FEATURE_MAJOR_FROM and k == 3 and X.shape[0] > 1:
        _shift_series3(X, miss, state, params, scores, alarms)
        return
    if n < FEATURE_MAJOR_FROM:
        _shift_layers(X, miss, state, params, scores, alarms, np.empty(k))
        return
    # The step is done feature by feature over all layers (short, branch-light loops over
    # contiguous rows) in one scratch block: rows [0, k) the transformed inputs, then per layer
    # the sum (or maximum) of z, the number of features scored, and whether the layer is scored
    # (every present feature finite, at least one present) and then whether it learns, then
    # the update of one feature.
    work = np.empty((k + 6, n))
    ys = work[:k]
    acc = work[k]
    cnt = work[k + 1]
    go = work[k + 2]
    new_loc_j = work[k + 3]  # a feature's updated statistics, before they are stored
    new_scale_j = work[k + 4]
    step = work[k + 5]  # 1.0 where the feature learns on this step, else 0.0
    for t in range(X.shape[0]):
        sc_t = scores[t]
        al_t = alarms[t]
        # the transformed inputs first, in loops of their own (a libm call inside the scoring
        # loop would push its live values through the stack)
        for j in range(k):
            xj = X[t, j]
            yj = ys[j]
            if params[_AS_LOG0 + j] != 0.0:
                for i in range(n):
                    yj[i] = math.log(max(xj[i], LOG_FLOOR))
            else:
                for i in range(n):
                    yj[i] = xj[i]
        for i in range(n):
            acc[i] = 0.0
            cnt[i] = 0.0
            go[i] = 1.0
        for j in range(k):
            xj = X[t, j]
            mj = miss[t, j]
            for i in range(n):
                if not mj[i]:
                    cnt[i] += 1.0
                    if not np.isfinite(xj[i]):
                        go[i] = 0.0
        for i in range(n):
            if cnt[i] == 0.0:  # every feature missing
                sc_t[i] = np.nan
                al_t[i] = False
                go[i] = 0.0
            elif go[i] == 0.0:  # a present feature is not finite
                sc_t[i] = np.inf
                al_t[i] = True
            cnt[i] = 0.0
        # scoring and learning are branch-free loops (everything computed, then selected or
        # stored back unchanged): the compiler vectorises them
        for j in range(k):
            log_j = params[_AS_LOG0 + j] != 0.0
            mj = miss[t, j]
            yj = ys[j]
            loc_j = state[3 * j + _LOC]
            scale_j = state[3 * j + _SCALE]
            count_j = state[3 * j + _COUNT]
            for i in range(n):
                count = count_j[i]
                ok = (not mj[i]) & (go[i] != 0.0) & (count != 0.0) & (count >= warmup)
                loc = loc_j[i]
                z = abs(yj[i] - loc) / _floored_scale(loc, scale_j[i], log_j, min_scale)
                if use_max:
                    acc[i] = max(acc[i], z) if ok else acc[i]
                else:
                    acc[i] = acc[i] + z * z if ok else acc[i]
                cnt[i] = cnt[i] + 1.0 if ok else cnt[i]
        # the layers' scores (in acc; 0 where no feature was scored), then stored where the
        # layer was scored, one row per loop
        if use_max:
            for i in range(n):
                acc[i] = acc[i] if cnt[i] != 0.0 else 0.0
        else:
            for i in range(n):
                m = cnt[i]
                acc[i] = math.sqrt(acc[i] / max(m, 1.0)) if m != 0.0 else 0.0
        for i in range(n):
            sc_t[i] = acc[i] if go[i] != 0.0 else sc_t[i]
        for i in range(n):
            al_t[i] = acc[i] > threshold if go[i] != 0.0 else al_t[i]
        for i in range(n):
            go[i] = 1.0 if (go[i] != 0.0) & learns(acc[i] > threshold, freeze) else 0.0
        for j in range(k):
            log_j = params[_AS_LOG0 + j] != 0.0
            mj = miss[t, j]
            yj = ys[j]
            loc_j = state[3 * j + _LOC]
            scale_j = state[3 * j + _SCALE]
            count_j = state[3 * j + _COUNT]
            for i in range(n):
                y = yj[i]
                loc = loc_j[i]
                scale = scale_j[i]
                count = count_j[i]
                r = y - loc
                if do_clip:
                    lim = clip * _floored_scale(loc, scale, log_j, min_scale)
                    r = min(max(r, -lim), lim) if count >= warmup else r
                a = alpha if count >= debias_until else max(alpha, 1.0 / (count + 1.0))
                new_loc = loc + a * r
                new_scale = (1.0 - a) * scale + a * abs(r)
                if count == 0.0:  # the first value
                    new_loc = y
                    new_scale = 0.0
                new_loc_j[i] = new_loc
                new_scale_j[i] = new_scale
            # then stored where the feature learns, in loops that each write one row (a loop
            # storing to several rows of one array is not vectorised)
            for i in range(n):
                step[i] = 1.0 if (not mj[i]) & (go[i] != 0.0) else 0.0
            for i in range(n):
                loc_j[i] = new_loc_j[i] if step[i] != 0.0 else loc_j[i]
            for i in range(n):
                scale_j[i] = new_scale_j[i] if step[i] != 0.0 else scale_j[i]
            for i in range(n):
                count_j[i] = count_j[i] + step[i]


class ActivationShift(BankDetector):
    """Per-layer activation-statistics shift score from per-feature robust z-scores.

    Series are layers; the ``n_features`` inputs are statistics of that layer (by default
    mean, std, abs-max and kurtosis).  Each feature keeps a robust EW location (updates
    winsorised at ``clip`` scales after warm-up, so one outlier moves it by at most
    ``alpha * clip`` scales) and an EW mean absolute deviation; ``z_j = |y_j - loc_j| / scale_j``
    with ``y_j = log(x_j)`` where ``log_space[j]`` is set.  The layer's score aggregates the
    ``z_j`` of the features present on this step and past their warm-up (RMS by default).

    A missing feature is skipped (neither scored nor updated); all features missing gives
    ``nan``; any non-finite present feature gives ``+inf`` and the layer's state is untouched.

    Parameters
    ----------
    n_series
        Number of layers.
    n_features
        Number of statistics per layer (the detector's inputs).
    log_space
        Per feature (or one bool for all): score ``log(x)`` (positive, scale-like statistics)
        instead of ``x`` (signed statistics such as the mean).  Default ``(False, True, True,
        True)`` matches mean / std / abs-max / kurtosis.
    alpha
        Weight of the newest value in the EW location and scale (memory ~ ``1/alpha`` steps).
    warmup
        Observations of a feature before it contributes to the score.
    threshold
        Alarm when the aggregated score exceeds this many robust sigmas.
    min_scale
        Scale floor: absolute in log space (0.01 ~ 1 %), relative to ``|loc|`` in signed space.
    clip
        Winsorise updates at ``loc +- clip * scale`` after warm-up (``inf`` disables).
    aggregate
        ``"rms"`` (``sqrt(mean z^2)``: a shift in several statistics at once counts more than
        noise in one) or ``"max"`` (most sensitive to one statistic).
    freeze_on_alarm
        Do not update a layer's statistics while it is in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> T, layers = 200, 2
    >>> mean = rng.normal(0.0, 0.01, (T, layers))
    >>> std = np.exp(rng.normal(0.0, 0.02, (T, layers)))
    >>> absmax = 4.0 * std * np.exp(rng.normal(0.0, 0.05, (T, layers)))
    >>> kurt = np.exp(rng.normal(1.1, 0.03, (T, layers)))
    >>> std[150:, 1] *= 10.0; absmax[150:, 1] *= 10.0      # layer 1's input scaled at step 150
    >>> det = ActivationShift(n_series=layers)
    >>> scores, alarms = det.update_many(mean, std, absmax, kurt)
    >>> int(np.argmax(alarms[:, 1])), bool(alarms[:, 0].any())
    (150, False)
    """

    parameter_constraints = {
        "n_features": Int(1),
        "log_space": Flags("n_features"),
        "alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(0),
        "min_scale": Float(0.0),
        "clip": Float(0.0, low_open=True),
        "aggregate": Choice(AGGREGATES),
    }
    n_features: int
    log_space: tuple[bool, ...]
    kind = "activation_shift"
    summary = (
        "Per layer: robust z of each activation statistic (scale statistics in log space) "
        "aggregated by RMS into one shift score per layer and step.")

    def __init__(
        self,
        n_series: int = 1,
        n_features: int = 4,
        log_space: bool | Sequence[bool] = (False, True, True, True),
        alpha: float = 0.02,
        warmup: int = 30,
        threshold: float = 6.0,
        min_scale: float = 0.01,
        clip: float = 4.0,
        aggregate: str = "rms",
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _setup(self) -> None:
        # instance-level override of the class default (one input per feature)
        setattr(self, "n_inputs", self.n_features)  # noqa: B010
        setattr(self, "input_names", tuple(f"x{j}" for j in range(self.n_features)))  # noqa: B010
        super()._setup()

    def _extra_params(self) -> list[float]:
        return [*super()._extra_params(), *(float(bool(b)) for b in self.log_space)]

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((3 * self.n_features, n))

    kernel = staticmethod(_shift_kernel)
    param_layout = ShiftParams
    state_hyperparameters = ("n_features", "log_space")

    def _check_state(self, c: StateCheck) -> None:
        st = c.state
        c.not_nan("location", st[_LOC::3])
        c.not_nan("scale", st[_SCALE::3], 0.0)
        c.integers("count", st[_COUNT::3], 0)

    @property
    def location(self) -> FloatArray:
        """Robust running location per feature and layer, shape ``(n_features, n_series)``."""
        return self._state[_LOC::3].copy()

    @property
    def scale(self) -> FloatArray:
        """Robust sigma per feature and layer (before the floor), ``(n_features, n_series)``."""
        return self._state[_SCALE::3] * MEAN_AD_SCALE
