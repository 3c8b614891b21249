"""Coherent one-step jumps across a bank of series (several layers moving at once).

A silent fault inside the network -- an activation blown up by a bad kernel or a corrupted
hidden state, a scaled block output -- shows in no loss curve at first, but it multiplies the
gradients (and the next update) of every layer around it *in the same step*.  A noisy layer
alone also jumps now and then; several layers jumping together by far more than their typical
step-to-step change is what a healthy run rarely does.

:class:`CoherentJump` scores each series like :class:`~detectors.lr_jump.LRJump`: the change
of ``log x`` since the series' previous value against an EW mean of its recent ``|dlog x|``
(test-then-train; after warm-up each update is winsorised at ``clip`` times the scale).  The
*coherence* is a cross-series reduction: with ``r_i`` the raw jump score of series ``i`` and
``r_(k)`` the ``k``-th largest raw score among the series scored on the step (``k =
min_series``, or all of them when fewer are logged), series ``i`` scores ``min(r_i, r_(k))``:
it alarms exactly when it jumped by more than ``threshold`` typical changes *and* at least
``min_series`` series did.  The maximum over the bank is ``r_(k)``, so a threshold sweep on
precomputed scores stays exact.  A rise is measured from the higher of the previous value and
the series' usual level (a winsorised EW mean of ``log x`` that follows rises at
``level_alpha`` and falls ten times slower, at ``level_alpha_down``), so a series coming back
after a collapse -- gradients returning after an fp16 underflow -- is not a jump.  A bank of a
single series with ``level_alpha = 0`` is :class:`~detectors.lr_jump.LRJump`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns
from ._params import Choice, Float, Int, arguments
from ._state import StateCheck

DIRECTIONS = {"up": 1.0, "down": -1.0, "both": 0.0}

# state rows: previous log value, has-previous flag, typical |dlog x|, accepted changes,
# level (winsorised slow EW mean of log x)
_PREV, _HAS, _TYP, _COUNT, _LEVEL = 0, 1, 2, 3, 4
_N_FIELDS = 5


class CoherentJumpParams(NamedTuple):
    """Layout of :class:`CoherentJump`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    warmup: float
    min_delta: float
    clip: float
    direction: float
    min_series: float
    level_alpha: float
    level_alpha_down: float


_P = indices(CoherentJumpParams)


@njit(cache=True, error_model="numpy", inline="always")
def _raw_score(has, prev, count, typ, level, x, y, warmup, min_delta, direction, use_level):  # type: ignore[no-untyped-def]
    """Raw jump score of a finite ``x`` (``y = log x`` when ``x > 0``) against a series'
    state values (0 while warming up, without a previous value or for ``x <= 0``), and
    ``dlog x`` (``nan``: no change).

    With ``use_level`` a rise counts from ``max(prev, level)`` and a fall from
    ``min(prev, level)``: a series coming back to its usual level after a collapse (or a
    spike) does not jump.  (Scalars in and out: an array argument of an inlined helper costs
    a reference-count call pair on every use.)"""
    if x <= 0.0 or has == 0.0:
        return 0.0, np.nan
    d = y - prev
    if count < warmup:
        return 0.0, d
    scale = max(typ, min_delta, 1e-300)
    hi, lo = prev, prev
    if use_level:
        hi = max(prev, level)
        lo = min(prev, level)
    if direction > 0.0:
        return (y - hi) / scale, d
    if direction < 0.0:
        return (lo - y) / scale, d
    return max((y - hi) / scale, (lo - y) / scale), d


@njit(cache=True, error_model="numpy")
def _kth_largest(vals, n, k):  # type: ignore[no-untyped-def]
    """The ``k``-th largest of ``vals[:n]`` (``k <= n``); ``vals`` is reordered."""
    for a in range(k):
        best = a
        for b in range(a + 1, n):
            if vals[b] > vals[best]:
                best = b
        vals[a], vals[best] = vals[best], vals[a]
    return vals[k - 1]


@njit(cache=True, error_model="numpy", inline="always")
def _debias_until(rate):  # type: ignore[no-untyped-def]
    """From this count on ``max(rate, 1 / (count + 1))`` (and ``1 / (count + 2)``) is exactly
    ``rate``: ``1 / (count + 1) < rate / 2`` in real arithmetic and rounding is monotone
    (``inf`` for ``rate == 0``, or where ``2 / rate`` overflows)."""
    return 2.0 / rate + 2.0 if rate > 0.0 else np.inf


#: banks of at least this many series learn in branch-free loops, one state row per loop
#: (vectorised); smaller ones series by series
VECTOR_FROM = 32


@njit(cache=True, error_model="numpy")
def _score_rows(X, miss, state, scores, alarms, ys, dlog, t, warmup, min_delta, direction,  # type: ignore[no-untyped-def]
                use_level):
    """The raw scores of step ``t`` of :func:`_kernel` for a large bank, in the score slots
    (``nan`` / ``inf`` and their alarms where a value is missing / not finite), and ``dlog``:
    :func:`_raw_score` for every series in branch-free loops, one output row per loop."""
    n = X.shape[2]
    x_t, m_t, s_t, a_t = X[t, 0], miss[t, 0], scores[t], alarms[t]
    prev, has, typ = state[_PREV], state[_HAS], state[_TYP]
    count, level = state[_COUNT], state[_LEVEL]
    for i in range(n):
        x = x_t[i]
        y = ys[i]
        pv = prev[i]
        scale = max(typ[i], min_delta, 1e-300)
        hi = max(pv, level[i]) if use_level else pv
        lo = min(pv, level[i]) if use_level else pv
        if direction > 0.0:
            r = (y - hi) / scale
        elif direction < 0.0:
            r = (lo - y) / scale
        else:
            r = max((y - hi) / scale, (lo - y) / scale)
        r = r if (x > 0.0) & (has[i] != 0.0) & (count[i] >= warmup) else 0.0
        s_t[i] = r if (not m_t[i]) & np.isfinite(x) else (np.nan if m_t[i] else np.inf)
    for i in range(n):
        dlog[i] = ys[i] - prev[i] if (x_t[i] > 0.0) & (has[i] != 0.0) else np.nan
    for i in range(n):
        a_t[i] = (not m_t[i]) & (not np.isfinite(x_t[i]))


@njit(cache=True, error_model="numpy")
def _learn_rows(X, miss, state, scores, alarms, ys, dlog, go, t, kth, threshold, freeze,  # type: ignore[no-untyped-def]
                alpha, warmup, min_delta, clip, level_alpha, level_down, typ_until, up_until,
                down_until):
    """The end of step ``t`` of :func:`_kernel` for a large bank: the same scores, alarms and
    state as its series-by-series loop, computed for every series and stored where they
    apply (``scores[t]`` holds the raw scores, ``dlog`` the changes of the scored series)."""
    n = X.shape[2]
    do_clip = clip < np.inf
    x_t, m_t, s_t, a_t = X[t, 0], miss[t, 0], scores[t], alarms[t]
    prev, has, typ = state[_PREV], state[_HAS], state[_TYP]
    count, level = state[_COUNT], state[_LEVEL]
    for i in range(n):
        s_t[i] = min(s_t[i], kth) if (not m_t[i]) & np.isfinite(x_t[i]) else s_t[i]
    for i in range(n):
        a_t[i] = s_t[i] > threshold if (not m_t[i]) & np.isfinite(x_t[i]) else a_t[i]
    for i in range(n):
        on = (not m_t[i]) & np.isfinite(x_t[i]) & (x_t[i] > 0.0)
        go[i] = 1.0 if on & learns(s_t[i] > threshold, freeze) else 0.0
    for i in range(n):  # level first: its clip limit is the typical change before the step
        c = count[i]
        lv = level[i]
        y = ys[i]
        dl = y - lv
        if do_clip:
            lim = clip * max(typ[i], min_delta, 1e-300)
            dl = min(max(dl, -lim), lim) if c >= warmup else dl
        inv = 1.0 / (c + 2.0)
        up = level_alpha if c >= up_until else max(level_alpha, inv)
        down = level_down if c >= down_until else max(level_down, inv)
        moved = lv + (up if dl >= 0.0 else down) * dl
        first = y if c == 0.0 else lv
        level[i] = (first if np.isnan(dlog[i]) else moved) if go[i] != 0.0 else lv
    for i in range(n):  # typical |dlog x|
        c = count[i]
        tp = typ[i]
        ad = abs(dlog[i])
        if do_clip:
            ad = min(ad, clip * max(tp, min_delta, 1e-300)) if c >= warmup else ad
        a = alpha if c >= typ_until else max(alpha, 1.0 / (c + 1.0))
        typ[i] = tp + a * (ad - tp) if (go[i] != 0.0) & (not np.isnan(dlog[i])) else tp
    for i in range(n):
        c = count[i]
        count[i] = c + 1.0 if (go[i] != 0.0) & (not np.isnan(dlog[i])) else c
    for i in range(n):
        prev[i] = ys[i] if go[i] != 0.0 else prev[i]
    for i in range(n):
        off = (not m_t[i]) & np.isfinite(x_t[i]) & (x_t[i] <= 0.0)
        has[i] = 0.0 if off else (1.0 if go[i] != 0.0 else has[i])


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    """The bank kernel (see ``detectors/_base.py``).  ``X`` may carry a log row
    (``(T, 2, n)``: :meth:`~detectors._base.BankDetector.uses_log_row`)."""
    threshold = params[_P.threshold]
    freeze = params[_P.freeze_on_alarm] != 0.0
    alpha = params[_P.alpha]
    warmup = params[_P.warmup]
    min_delta = params[_P.min_delta]
    clip = params[_P.clip]
    direction = params[_P.direction]
    min_series = int(params[_P.min_series])
    level_alpha = params[_P.level_alpha]
    level_down = params[_P.level_alpha_down]
    use_level = level_alpha > 0.0
    typ_until = _debias_until(alpha)
    up_until = _debias_until(level_alpha)
    down_until = _debias_until(level_down)
    n = X.shape[2]
    has_logs = X.shape[1] == 2  # a log row (BankDetector.uses_log_row)
    # one scratch block per call: log x of the row (each computed once: scored, then learned),
    # dlog x, and the pool of raw scores the k-th largest is taken from; the raw scores
    # themselves wait in the row's score slots
    work = np.empty((4, n))
    ys = work[0]
    dlog = work[1]
    pool = work[2]
    go = work[3]  # large banks: 1.0 where the series learns on the step
    for t in range(X.shape[0]):
        # the logs first, in a loop of their own: a libm call inside the scoring loop would
        # push its live values through the stack on every series
        if has_logs:  # the caller's log row: log x where x > 0
            for i in range(n):
                ys[i] = X[t, 1, i] if X[t, 0, i] > 0.0 else 0.0
        else:
            for i in range(n):
                x = X[t, 0, i]
                ys[i] = math.log(x) if x > 0.0 else 0.0
        m = 0
        top1 = -np.inf  # the two largest raw scores (exact for min_series <= 2: no nan here)
        top2 = -np.inf
        if n >= VECTOR_FROM:
            _score_rows(X, miss, state, scores, alarms, ys, dlog, t, warmup, min_delta,
                        direction, use_level)
        for i in range(n):
            x = X[t, 0, i]
            if n >= VECTOR_FROM:  # scored above: pool them
                if (not miss[t, 0, i]) and np.isfinite(x):
                    r = scores[t, i]
                    pool[m] = r
                    m += 1
                    if r > top1:
                        top2 = top1
                        top1 = r
                    elif r > top2:
                        top2 = r
            elif miss[t, 0, i]:
                scores[t, i] = np.nan
                alarms[t, i] = False
            elif not np.isfinite(x):
                scores[t, i] = np.inf
                alarms[t, i] = True
            else:
                r, dlog[i] = _raw_score(state[_HAS, i], state[_PREV, i], state[_COUNT, i],
                                        state[_TYP, i], state[_LEVEL, i], x, ys[i], warmup,
                                        min_delta, direction, use_level)
                scores[t, i] = r
                alarms[t, i] = False
                pool[m] = r
                m += 1
                if r > top1:
                    top2 = top1
                    top1 = r
                elif r > top2:
                    top2 = r
        if m == 0:
            continue
        kk = min(min_series, m)
        # raw scores are finite (finite state, finite logs, scale >= 1e-300) and never -0.0:
        # the k-th largest value does not depend on how it is found
        if kk == 1:
            kth = top1
        elif kk == 2:
            kth = top2
        else:
            kth = _kth_largest(pool, m, kk)
        if n >= VECTOR_FROM:
            _learn_rows(X, miss, state, scores, alarms, ys, dlog, go, t, kth, threshold, freeze,
                        alpha, warmup, min_delta, clip, level_alpha, level_down, typ_until,
                        up_until, down_until)
            continue
        for i in range(n):
            if miss[t, 0, i]:
                continue
            x = X[t, 0, i]
            if not np.isfinite(x):
                continue
            s = min(scores[t, i], kth)
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if x <= 0.0:
                state[_HAS, i] = 0.0  # "off" (e.g. a frozen layer): no log, no change
                continue
            if not learns(alarm, freeze):
                continue
            y = ys[i]
            if not np.isnan(dlog[i]):
                typ = state[_TYP, i]
                count = state[_COUNT, i]
                lim = clip * max(typ, min_delta, 1e-300)
                ad = abs(dlog[i])
                dl = y - state[_LEVEL, i]
                if count >= warmup and clip < np.inf:
                    ad = min(ad, lim)
                    dl = min(max(dl, -lim), lim)
                a = alpha if count >= typ_until else max(alpha, 1.0 / (count + 1.0))
                state[_TYP, i] = typ + a * (ad - typ)
                if dl >= 0.0:
                    rate = level_alpha if count >= up_until else max(level_alpha,
                                                                      1.0 / (count + 2.0))
                else:
                    rate = level_down if count >= down_until else max(level_down,
                                                                       1.0 / (count + 2.0))
                state[_LEVEL, i] += rate * dl
                state[_COUNT, i] = count + 1.0
            elif state[_COUNT, i] == 0.0:
                state[_LEVEL, i] = y
            state[_PREV, i] = y
            state[_HAS, i] = 1.0


class CoherentJump(BankDetector):
    """One-step jump of ``log x`` in at least ``min_series`` series of the bank at once.

    ``r_i = dlog(x_i) / max(typical_i, min_delta)`` (sign by ``direction``), where
    ``typical_i`` is an EW mean of the series' ``|dlog x|`` (debiased; after warm-up each update
    is winsorised at ``clip`` times the current scale, so a jump does not blind the detector to
    the next one).  With ``level_alpha > 0`` a rise is measured from ``max(prev, level)`` and
    a fall from ``min(prev, level)``, ``level`` a slow EW mean of ``log x`` (winsorised the same
    way): returning to the usual level is not a jump.  Series ``i`` scores ``min(r_i,
    r_(k))``, ``r_(k)`` the ``k``-th largest raw score of the step (``k = min_series``, capped
    at the number of series scored on the step).

    Parameters
    ----------
    n_series
        Number of series (e.g. one per layer).
    alpha
        Weight of the newest ``|dlog x|`` in the typical change (memory ~ ``1/alpha`` steps).
    warmup
        Changes seen by a series before it scores (``0.0`` before).
    threshold
        Alarm when the jump exceeds this many typical changes in at least ``min_series``
        series.
    min_delta
        Floor of the typical ``|dlog x|`` (log units).
    clip
        Winsorise updates of the typical change at ``clip * scale`` (``inf`` disables).
    direction
        ``"up"`` (default), ``"down"`` or ``"both"``.
    min_series
        How many series must jump together (``1``: every series on its own).
    level_alpha
        Weight of a newest ``log x`` above the usual level in that level (memory ~
        ``1/level_alpha`` steps); ``0`` measures jumps from the previous value only.
    level_alpha_down
        The same for a value below the level: a slow level remembers where a series was before
        it collapsed, so coming back is not a jump.
    freeze_on_alarm
        Do not update a series' statistics on a step it is in alarm.

    Notes
    -----
    Non-finite values alarm with score ``+inf`` and never enter the state (nor the
    ``k``-th-largest pool); missing values score ``nan``; a value ``<= 0`` scores ``0`` and
    clears the series' previous value (the next positive value starts afresh).

    Examples
    --------
    Three layers' gradient norms; at step 300 two of them jump 6x together, at step 200 one
    jumps 6x alone:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> g = np.exp(rng.normal(0.0, 0.1, (400, 3)))
    >>> g[200, 0] *= 6.0
    >>> g[300, :2] *= 6.0
    >>> scores, alarms = CoherentJump(n_series=3).update_many(g)
    >>> np.flatnonzero(alarms.any(axis=1)).tolist()
    [300]
    >>> np.flatnonzero(CoherentJump(3, min_series=1).update_many(g)[1].any(axis=1)).tolist()
    [200, 300]
    """

    input_names = ("x",)

    parameter_constraints = {
        "alpha": Float(0.0, 1.0, low_open=True),
        "warmup": Int(0),
        "min_delta": Float(0.0),
        "clip": Float(0.0, low_open=True),
        "direction": Choice(DIRECTIONS),
        "min_series": Int(1),
        "level_alpha": Float(0.0, 1.0),
        "level_alpha_down": Float(0.0, 1.0),
    }
    summary = (
        "A one-step rise of log x far beyond each series' typical step-to-step change in at least "
        "`min_series` series of the bank at once (several layers' gradients bursting together: an "
        "activation spike inside the network); a rise counts from the series' usual level when "
        "that is higher, so coming back after a collapse is not a jump.")

    def __init__(
        self,
        n_series: int = 1,
        alpha: float = 0.05,
        warmup: int = 20,
        threshold: float = 10.0,
        min_delta: float = 0.01,
        clip: float = 4.0,
        direction: str = "up",
        min_series: int = 2,
        level_alpha: float = 0.05,
        level_alpha_down: float = 0.005,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    def uses_log_row(self) -> bool:  # see BankDetector
        return type(self).kernel is _kernel  # not a subclass's own kernel

    kernel = staticmethod(_kernel)
    param_layout = CoherentJumpParams
    state_hyperparameters = ()

    def _check_state(self, c: StateCheck) -> None:
        c.finite("prev", c.state[_PREV])
        c.one_of("has", c.state[_HAS], (0.0, 1.0))
        c.finite("typ", c.state[_TYP], 0.0)
        c.integers("count", c.state[_COUNT], 0)
        c.finite("level", c.state[_LEVEL])
