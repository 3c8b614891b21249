"""Histogram drift: the Population Stability Index of a sliding window against a reference.

:class:`HistogramDrift` -- per series, a *reference* window (the first ``window`` finite values
after ``warmup``, optionally refreshed) against the sliding *current* window, compared by the
Population Stability Index on ``n_bins`` bins whose edges are the reference's quantiles.  PSI
depends only on ranks relative to the reference, so it is scale and offset invariant and sees
drifts too slow for a z-score (the running location follows those).  Registered with
:class:`~detectors.activation.ActivationShift` as the activation-shift family
(:mod:`detectors.activation` re-exports it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Float, Int, arguments
from ._state import StateCheck

# state rows
_H_COUNT, _H_NREF, _H_POS, _H_NCUR, _H_SCORE, _H_SINCE = 0, 1, 2, 3, 4, 5
_H_FIELDS = 6


@njit(cache=True, error_model="numpy", inline="always")
def _bin_of(x: float, buf, e0: int, nb: int, i: int) -> int:  # type: ignore[no-untyped-def]
    """Bin of ``x``: 0 below the reference minimum, ``nb + 1`` above its maximum, otherwise
    ``1 +`` the number of interior (quantile) edges ``<= x``."""
    if x < buf[e0, i]:
        return 0
    if x > buf[e0 + nb, i]:
        return nb + 1
    lo = 1
    hi = nb
    while lo < hi:
        mid = (lo + hi) // 2
        if buf[e0 + mid, i] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, error_model="numpy")
def _build_reference(buf, i, w, nb):  # type: ignore[no-untyped-def]
    """Edges (min, quantiles, max) from the reference; reference and current bin counts."""
    e0 = 2 * w
    r0 = e0 + nb + 1
    c0 = r0 + nb + 2
    srt = np.sort(buf[0:w, i].copy())
    buf[e0, i] = srt[0]
    for j in range(1, nb):
        buf[e0 + j, i] = srt[(j * w) // nb]
    buf[e0 + nb, i] = srt[w - 1]
    for b in range(nb + 2):
        buf[r0 + b, i] = 0.0
        buf[c0 + b, i] = 0.0
    for r in range(w):
        buf[r0 + _bin_of(buf[r, i], buf, e0, nb, i), i] += 1.0


@njit(cache=True, error_model="numpy")
def _psi(buf, i, w, nb, smoothing, b_add, b_del):  # type: ignore[no-untyped-def]
    """PSI of the current counts (+1 in ``b_add``, -1 in ``b_del``) against the reference."""
    r0 = 2 * w + nb + 1
    c0 = r0 + nb + 2
    denom = w + (nb + 2) * smoothing
    out = 0.0
    for b in range(nb + 2):
        c = buf[c0 + b, i]
        if b == b_add:
            c += 1.0
        if b == b_del:
            c -= 1.0
        p = (c + smoothing) / denom
        q = (buf[r0 + b, i] + smoothing) / denom
        out += (p - q) * math.log(p / q)
    return out


class HistogramParams(NamedTuple):
    """Layout of :class:`HistogramDrift`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    n_bins: float
    warmup: float
    stride: float
    refresh: float
    smoothing: float


_P_HISTOGRAM = indices(HistogramParams)


@njit(cache=True, error_model="numpy")
def _hist_kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P_HISTOGRAM.threshold]
    freeze = params[_P_HISTOGRAM.freeze_on_alarm] != 0.0
    w = int(params[_P_HISTOGRAM.window])
    nb = int(params[_P_HISTOGRAM.n_bins])
    warmup = params[_P_HISTOGRAM.warmup]
    stride = int(params[_P_HISTOGRAM.stride])
    refresh = int(params[_P_HISTOGRAM.refresh])
    smoothing = params[_P_HISTOGRAM.smoothing]
    e0 = 2 * w
    c0 = e0 + (nb + 1) + (nb + 2)
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            if state[_H_COUNT, i] < warmup:
                state[_H_COUNT, i] += 1.0
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            nref = int(state[_H_NREF, i])
            if nref < w:
                buf[nref, i] = x
                state[_H_NREF, i] = nref + 1.0
                state[_H_COUNT, i] += 1.0
                if nref + 1 == w:
                    _build_reference(buf, i, w, nb)
                scores[t, i] = 0.0
                alarms[t, i] = False
                continue
            b_new = _bin_of(x, buf, e0, nb, i)
            ncur = int(state[_H_NCUR, i])
            pos = int(state[_H_POS, i])
            if ncur < w:
                # filling the current window: no score yet, nothing to freeze
                buf[w + pos, i] = x
                buf[c0 + b_new, i] += 1.0
                state[_H_POS, i] = (pos + 1) % w
                state[_H_NCUR, i] = ncur + 1.0
                state[_H_COUNT, i] += 1.0
                if ncur + 1 < w:
                    scores[t, i] = 0.0
                    alarms[t, i] = False
                    continue
                since = state[_H_SINCE, i]
                score = _psi(buf, i, w, nb, smoothing, -1, -1)
                scores[t, i] = score
                alarms[t, i] = score > threshold
                state[_H_SCORE, i] = score
                state[_H_SINCE, i] = since + 1.0
                continue
            b_old = _bin_of(buf[w + pos, i], buf, e0, nb, i)
            since = state[_H_SINCE, i]
            if since % stride == 0.0:
                score = _psi(buf, i, w, nb, smoothing, b_new, b_old)
            else:
                score = state[_H_SCORE, i]
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            buf[w + pos, i] = x
            buf[c0 + b_old, i] -= 1.0
            buf[c0 + b_new, i] += 1.0
            state[_H_POS, i] = (pos + 1) % w
            state[_H_COUNT, i] += 1.0
            state[_H_SCORE, i] = score
            state[_H_SINCE, i] = since + 1.0
            if refresh > 0 and (since + 1.0) % refresh == 0.0:
                for r in range(w):
                    buf[r, i] = buf[w + r, i]
                _build_reference(buf, i, w, nb)
                for r in range(w):
                    buf[c0 + _bin_of(buf[w + r, i], buf, e0, nb, i), i] += 1.0


class HistogramDrift(BankDetector):
    """Population Stability Index of a sliding window against a reference window.

    Per series: after ``warmup`` finite values, the next ``window`` finite values form the
    reference; its order statistics at ``j / n_bins`` give ``n_bins - 1`` bin edges, and two
    more bins catch values below the reference's minimum or above its maximum (so a constant
    reference still sees a level change, and leaving the reference's range counts).  The last
    ``window`` finite values form the current window, and once it is full every step is scored
    with ``PSI = sum_b (p_b - q_b) * log(p_b / q_b)`` over the ``n_bins + 2`` bins, where
    ``p``/``q`` are the current/reference bin fractions with ``smoothing`` pseudo-counts per bin
    (so an empty bin is finite).  The current value is part of the scored window; it enters the
    window unless the series is in alarm with ``freeze_on_alarm``.  With ``stride > 1`` the PSI
    is recomputed every ``stride`` steps and carried in between; with ``refresh > 0`` the
    reference is replaced by the current window every ``refresh`` scored steps (drift *rate*
    rather than drift since the start).

    Rule of thumb for PSI: < 0.1 stable, 0.1-0.25 moderate, > 0.25 a shift; sampling noise alone
    gives about ``2 * (n_bins + 1) / window``.  The default threshold (1.0) flags only large
    distribution changes.  Caveat: raw per-layer activation statistics trend through training
    (a GPT's block std grows ~5x), so against a fixed early reference PSI saturates on clean
    runs too; use it on stationary signals, on a refreshed reference, or with a high threshold.

    Parameters
    ----------
    n_series
        Number of series.
    window
        Size of the reference and of the current window.
    n_bins
        Number of quantile bins.
    warmup
        Finite values skipped before the reference starts (early training is a transient).
    threshold
        Alarm when PSI exceeds this.
    stride
        Recompute the PSI every ``stride`` steps (carry the last score in between).
    refresh
        Replace the reference by the current window every ``refresh`` scored steps (0 = never).
    smoothing
        Pseudo-count added to every bin of both histograms.
    freeze_on_alarm
        Do not push values into the current window while the series is in alarm.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(1)
    >>> x = rng.normal(0.0, 1.0, 1200)
    >>> x[700:] += np.linspace(0.0, 3.0, 500)        # slow drift: 0.006 sigma per step
    >>> det = HistogramDrift(window=200, n_bins=10, threshold=1.0)
    >>> scores, alarms = det.update_many(x)
    >>> bool(alarms[:700].any()), 800 < int(np.argmax(alarms[:, 0])) < 1100
    (False, True)
    """

    parameter_constraints = {
        "window": Int(2),
        "n_bins": Int(2, "window"),
        "warmup": Int(0),
        "stride": Int(1),
        "refresh": Int(0),
        "smoothing": Float(0.0, low_open=True),
    }
    window: int
    n_bins: int
    kind = "activation_shift"
    summary = (
        "PSI between a reference window and the current window on reference-quantile bins, for "
        "drifts too slow for z-scores. Not bound by default: activation statistics trend during "
        "healthy training.")

    def __init__(
        self,
        n_series: int = 1,
        window: int = 200,
        n_bins: int = 10,
        warmup: int = 0,
        threshold: float = 1.0,
        stride: int = 1,
        refresh: int = 0,
        smoothing: float = 0.5,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_H_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        # reference values, current ring, edges (min, quantiles, max), reference counts,
        # current counts (n_bins + 2 bins each: two out-of-range bins)
        return np.zeros((2 * self.window + 3 * self.n_bins + 5, n))

    kernel = staticmethod(_hist_kernel)
    param_layout = HistogramParams
    state_hyperparameters = ("window", "n_bins")

    def _check_state(self, c: StateCheck) -> None:
        st, w, nb = c.state, self.window, self.n_bins
        c.integers("count", st[_H_COUNT], 0)
        c.integers("n_reference", st[_H_NREF], 0, w)
        c.integers("position", st[_H_POS], 0, w - 1)
        c.integers("n_current", st[_H_NCUR], 0, w)
        c.not_nan("score", st[_H_SCORE])
        c.integers("since", st[_H_SINCE], 0)
        c.finite("windows", c.buf[: 2 * w])
        c.not_nan("edges", c.buf[2 * w : 2 * w + nb + 1])
        c.integers("bin counts", c.buf[2 * w + nb + 1 :], 0)

    @property
    def edges(self) -> FloatArray:
        """Reference min, quantile edges and max per series, ``(n_bins + 1, n_series)``."""
        e0 = 2 * self.window
        return self._buf[e0 : e0 + self.n_bins + 1].copy()
