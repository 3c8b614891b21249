"""Small-bank loops of :class:`detectors.activation.ActivationShift`'s kernel.

A replay runs a few layers (series) over many steps: :func:`_shift_series3` (three features,
the ``default`` preset's mean / std / abs-max) runs series by series with each layer's
statistics in registers, :func:`_shift_layers` (any number of features, and every single
step) layer by layer.  Both give the same bits as the feature-major loop of wide banks
(``_shift_kernel`` in :mod:`detectors.activation`) and as its plain twin.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import LOG_FLOOR, MEAN_AD_SCALE
from ._kernel import indices, learns

# ActivationShift state rows, per feature j: 3*j + field
_LOC, _SCALE, _COUNT = 0, 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _floored_scale(loc: float, scale: float, log_space: bool, min_scale: float) -> float:
    floor = min_scale if log_space else min_scale * abs(loc)
    return max(scale * MEAN_AD_SCALE, floor, 1e-300)


class ShiftParams(NamedTuple):
    """Layout of :class:`ActivationShift`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    alpha: float
    warmup: float
    min_scale: float
    clip: float
    aggregate: float
    # followed by one log-space flag per feature: params[_AS_LOG0 + j]


_P_SHIFT = indices(ShiftParams)
#: index of feature 0's log-space flag, after the fixed fields
_AS_LOG0 = len(ShiftParams._fields)


@njit(cache=True, error_model="numpy")
def _shift_layers(X, miss, state, params, scores, alarms, ys):  # type: ignore[no-untyped-def]
    """:func:`_shift_kernel` layer by layer (``ys``: scratch for one layer's transformed
    inputs, ``k`` values).  Kept for small banks (replays): their rows are too short for the
    feature-major loops, and the interleaved layers hide the latency of each feature's update.
    A feature's floored scale is computed once per step (the score's, reused by the clip of
    its update) and the warm-up weight's division is skipped in the steady state."""
    threshold = params[_P_SHIFT.threshold]
    freeze = params[_P_SHIFT.freeze_on_alarm] != 0.0
    alpha = params[_P_SHIFT.alpha]
    warmup = params[_P_SHIFT.warmup]
    min_scale = params[_P_SHIFT.min_scale]
    clip = params[_P_SHIFT.clip]
    use_max = params[_P_SHIFT.aggregate] != 0.0
    do_clip = clip < np.inf
    debias_until = 2.0 / alpha + 2.0  # as in _shift_kernel
    k = X.shape[1]
    n = X.shape[2]
    logs = np.empty(k, dtype=np.bool_)
    for j in range(k):
        logs[j] = params[_AS_LOG0 + j] != 0.0
    # per feature: its floored scale on this step (set where it was scored: present, count
    # >= warmup and > 0 -- exactly where its update is clipped)
    fs = np.empty(k)
    for t in range(X.shape[0]):
        for i in range(n):
            # one pass over the features: present, finite, transformed and (past its warm-up)
            # scored; a non-finite present feature ends it (the layer scores inf)
            present = 0
            bad = False
            acc = 0.0
            m = 0
            for j in range(k):
                if miss[t, j, i]:
                    continue
                present += 1
                x = X[t, j, i]
                if not np.isfinite(x):
                    bad = True
                    break
                y = math.log(max(x, LOG_FLOOR)) if logs[j] else x
                ys[j] = y
                count = state[3 * j + _COUNT, i]
                if count == 0.0 or count < warmup:
                    continue
                loc = state[3 * j + _LOC, i]
                f = _floored_scale(loc, state[3 * j + _SCALE, i], logs[j], min_scale)
                fs[j] = f
                z = abs(y - loc) / f
                if use_max:
                    acc = max(acc, z)
                else:
                    acc += z * z
                m += 1
            if present == 0:
                scores[t, i] = np.nan
                alarms[t, i] = False
                continue
            if bad:
                scores[t, i] = np.inf
                alarms[t, i] = True
                continue
            if m == 0:
                score = 0.0
            elif use_max:
                score = acc
            else:
                score = math.sqrt(acc / m)
            alarm = score > threshold
            scores[t, i] = score
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            for j in range(k):
                if miss[t, j, i]:
                    continue
                y = ys[j]
                count = state[3 * j + _COUNT, i]
                if count == 0.0:
                    state[3 * j + _LOC, i] = y
                    state[3 * j + _SCALE, i] = 0.0
                    state[3 * j + _COUNT, i] = 1.0
                    continue
                loc = state[3 * j + _LOC, i]
                scale = state[3 * j + _SCALE, i]
                r = y - loc
                if count >= warmup and do_clip:
                    lim = clip * fs[j]
                    r = min(max(r, -lim), lim)
                a = alpha if count >= debias_until else max(alpha, 1.0 / (count + 1.0))
                state[3 * j + _LOC, i] = loc + a * r
                state[3 * j + _SCALE, i] = (1.0 - a) * scale + a * abs(r)
                state[3 * j + _COUNT, i] = count + 1.0


#: steps per block of the series-major loop (a block's inputs stay in cache)
SERIES_BLOCK = 256


@njit(cache=True, error_model="numpy", inline="always")
def _learn(y, loc, scale, count, f, warmup, alpha, debias_until, clip, do_clip):  # type: ignore[no-untyped-def]
    """One feature's update (``f``: its floored scale on this step where it was scored)."""
    if count == 0.0:
        return y, 0.0, 1.0
    r = y - loc
    if count >= warmup and do_clip:
        lim = clip * f
        r = min(max(r, -lim), lim)
    a = alpha if count >= debias_until else max(alpha, 1.0 / (count + 1.0))
    return loc + a * r, (1.0 - a) * scale + a * abs(r), count + 1.0


@njit(cache=True, error_model="numpy")
def _shift_series3(X, miss, state, params, scores, alarms):  # type: ignore[no-untyped-def]
    """:func:`_shift_layers` for three features, series by series in blocks of
    :data:`SERIES_BLOCK` steps with each layer's statistics in registers."""
    threshold = params[_P_SHIFT.threshold]
    freeze = params[_P_SHIFT.freeze_on_alarm] != 0.0
    alpha = params[_P_SHIFT.alpha]
    warmup = params[_P_SHIFT.warmup]
    min_scale = params[_P_SHIFT.min_scale]
    clip = params[_P_SHIFT.clip]
    use_max = params[_P_SHIFT.aggregate] != 0.0
    do_clip = clip < np.inf
    debias_until = 2.0 / alpha + 2.0
    g0 = params[_AS_LOG0] != 0.0
    g1 = params[_AS_LOG0 + 1] != 0.0
    g2 = params[_AS_LOG0 + 2] != 0.0
    n_steps = X.shape[0]
    for t0 in range(0, n_steps, SERIES_BLOCK):
        t1 = min(t0 + SERIES_BLOCK, n_steps)
        for i in range(X.shape[2]):
            l0, s0, c0 = state[_LOC, i], state[_SCALE, i], state[_COUNT, i]
            l1, s1, c1 = state[3 + _LOC, i], state[3 + _SCALE, i], state[3 + _COUNT, i]
            l2, s2, c2 = state[6 + _LOC, i], state[6 + _SCALE, i], state[6 + _COUNT, i]
            for t in range(t0, t1):
                p0 = not miss[t, 0, i]
                p1 = not miss[t, 1, i]
                p2 = not miss[t, 2, i]
                if not (p0 or p1 or p2):
                    scores[t, i] = np.nan
                    alarms[t, i] = False
                    continue
                x0 = X[t, 0, i] if p0 else 0.0
                x1 = X[t, 1, i] if p1 else 0.0
                x2 = X[t, 2, i] if p2 else 0.0
                if not (np.isfinite(x0) and np.isfinite(x1) and np.isfinite(x2)):
                    scores[t, i] = np.inf
                    alarms[t, i] = True
                    continue
                y0 = math.log(max(x0, LOG_FLOOR)) if g0 and p0 else x0
                y1 = math.log(max(x1, LOG_FLOOR)) if g1 and p1 else x1
                y2 = math.log(max(x2, LOG_FLOOR)) if g2 and p2 else x2
                acc = 0.0
                m = 0
                f0 = f1 = f2 = 0.0
                if p0 and c0 != 0.0 and c0 >= warmup:
                    f0 = _floored_scale(l0, s0, g0, min_scale)
                    z = abs(y0 - l0) / f0
                    acc = max(acc, z) if use_max else acc + z * z
                    m += 1
                if p1 and c1 != 0.0 and c1 >= warmup:
                    f1 = _floored_scale(l1, s1, g1, min_scale)
                    z = abs(y1 - l1) / f1
                    acc = max(acc, z) if use_max else acc + z * z
                    m += 1
                if p2 and c2 != 0.0 and c2 >= warmup:
                    f2 = _floored_scale(l2, s2, g2, min_scale)
                    z = abs(y2 - l2) / f2
                    acc = max(acc, z) if use_max else acc + z * z
                    m += 1
                if m == 0:
                    score = 0.0
                elif use_max:
                    score = acc
                else:
                    score = math.sqrt(acc / m)
                alarm = score > threshold
                scores[t, i] = score
                alarms[t, i] = alarm
                if not learns(alarm, freeze):
                    continue
                if p0:
                    l0, s0, c0 = _learn(y0, l0, s0, c0, f0, warmup, alpha, debias_until, clip,
                                        do_clip)
                if p1:
                    l1, s1, c1 = _learn(y1, l1, s1, c1, f1, warmup, alpha, debias_until, clip,
                                        do_clip)
                if p2:
                    l2, s2, c2 = _learn(y2, l2, s2, c2, f2, warmup, alpha, debias_until, clip,
                                        do_clip)
            state[_LOC, i], state[_SCALE, i], state[_COUNT, i] = l0, s0, c0
            state[3 + _LOC, i], state[3 + _SCALE, i], state[3 + _COUNT, i] = l1, s1, c1
            state[6 + _LOC, i], state[6 + _SCALE, i], state[6 + _COUNT, i] = l2, s2, c2
