"""Ratio of each new value to a reference level (window mean / median, EW mean, initial max).

The score of a step is the ratio ``x / reference``, where the reference is computed from the
values accepted *before* the step (test-then-train).  With ``patience = p`` the score is the
**minimum ratio over the last ``p`` scored steps**, so ``score > threshold`` exactly when the
ratio exceeded the threshold on each of those ``p`` steps.  The score does not depend on the
threshold, so threshold sweeps on precomputed scores remain exact.

Industry rules as parameter choices (they use ``>=``; this package alarms on ``score >
threshold``, which differs only when the ratio equals the threshold exactly -- pass
``np.nextafter(t, 0.0)`` to reproduce ``>= t`` bit for bit):

* "loss >= 2x the window mean for 5 steps, window 100":
  ``RatioToMean(window=100, threshold=2.0, patience=5, reference="mean")``
* "loss >= 3x the 10-step mean": ``RatioToMean(window=10, threshold=3.0, patience=1,
  reference="mean")``
* "loss >= 10x the max of the first 100 values":
  ``RatioToMean(window=100, threshold=10.0, reference="initial_max")``

The default (``window=100, threshold=2.0, patience=3, reference="median"``) uses the window
*median*: a window mean that contains one 100x spike is inflated for the next ``window`` steps,
so the mean rule goes blind right after the first spike; and a patience of 3 reacts two steps
sooner than 5 while still ignoring one- and two-step blips of heavy-tailed gradient norms.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Choice, Int, arguments
from ._state import StateCheck
from .robust import sorted_median, sorted_push

#: Largest accepted ``window``: the ring buffer is allocated per series up front (a
#: hostile config must fail validation, not exhaust memory).
MAX_WINDOW = 1_000_000

#: reference modes -> kernel code
REFERENCES = {"mean": 0.0, "median": 1.0, "ewm": 2.0, "initial_max": 3.0}
_MEAN, _MEDIAN, _EWM, _INITIAL_MAX = 0, 1, 2, 3
#: a non-positive reference is replaced by this (the detector is meant for positive signals)
TINY = 1e-300

# state rows: ring write position, accepted values, EW mean / running max, ratio-ring position
_POS, _COUNT, _REF, _RPOS = 0, 1, 2, 3
_N_FIELDS = 4
# buf rows: [0, window) value ring ("mean"/"median"), [window, 2 window) the ring sorted
# ("median"), then `patience` recent ratios


class RatioParams(NamedTuple):
    """Layout of :class:`RatioToMean`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    warmup: float
    patience: float
    reference: float


_P = indices(RatioParams)


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    freeze = params[_P.freeze_on_alarm] != 0.0
    window = int(params[_P.window])
    warmup = params[_P.warmup]
    patience = int(params[_P.patience])
    mode = int(params[_P.reference])
    has_ring = mode == _MEAN or mode == _MEDIAN
    off = 2 * window if mode == _MEDIAN else (window if has_ring else 0)
    alpha = 2.0 / (window + 1.0)
    # series by series (they are independent): the column views are made once per series
    for i in range(X.shape[2]):
        ring = buf[:window, i]
        # the ring sorted ("median"), in a contiguous copy (sorted_push), stored back below
        srt = np.empty(window if mode == _MEDIAN else 0)
        if mode == _MEDIAN:
            srt[:] = buf[window:2 * window, i]
        recent = buf[off:off + patience, i]  # the last `patience` ratios
        # the series' state in registers over the steps (positions checked in range on load)
        count = state[_COUNT, i]
        ref_s = state[_REF, i]
        pos = int(state[_POS, i])
        rpos = int(state[_RPOS, i])
        for t in range(X.shape[0]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            ratio = 0.0
            if count >= warmup and count > 0.0:
                if mode == _MEAN:
                    n_valid = int(min(count, window))
                    acc = 0.0
                    for j in range(n_valid):
                        acc += ring[j]
                    ref = acc / n_valid
                elif mode == _MEDIAN:
                    ref = sorted_median(srt, int(min(count, window)))
                else:
                    ref = ref_s
                ratio = x / max(ref, TINY)
            recent[rpos] = ratio
            rpos = rpos + 1 if rpos + 1 < patience else 0  # (rpos + 1) % patience
            s = ratio
            for j in range(patience):
                s = min(s, recent[j])
            alarm = s > threshold
            scores[t, i] = s
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                continue
            if has_ring:
                if mode == _MEDIAN:
                    n_valid = int(min(count, window))
                    sorted_push(srt, n_valid, window, ring[pos], x)
                ring[pos] = x
                pos = pos + 1 if pos + 1 < window else 0  # (pos + 1) % window
            elif mode == _EWM:
                a = max(alpha, 1.0 / (count + 1.0))
                ref_s += a * (x - ref_s)
            elif count == 0.0:
                ref_s = x
            elif count < window:
                ref_s = max(ref_s, x)
            count = count + 1.0
        state[_COUNT, i] = count
        state[_REF, i] = ref_s
        state[_POS, i] = pos
        state[_RPOS, i] = rpos
        if mode == _MEDIAN:
            buf[window:2 * window, i] = srt


def _default_warmup(det: RatioToMean) -> int:
    """The window (at most 30 values for the EW mean, which needs no full window)."""
    return min(det.window, 30) if det.reference == "ewm" else det.window


def _max_warmup(det: RatioToMean) -> float:
    """A window reference needs its window filled at the latest; the EW mean has none."""
    return math.inf if det.reference == "ewm" else det.window


class RatioToMean(BankDetector):
    """Ratio of each value to a reference level of the same series, with patience.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    window
        Number of values the reference is built from: the last ``window`` values
        (``"mean"``, ``"median"``), an exponentially weighted mean with span ``window``
        (``alpha = 2 / (window + 1)``, ``"ewm"``), or the first ``window`` values
        (``"initial_max"``).
    threshold
        Alarm when the score (a ratio) exceeds this value.
    patience
        Number of consecutive scored steps the ratio must exceed the threshold; the score is
        the minimum ratio over the last ``patience`` scored steps (missing and non-finite steps
        are not scored and neither break nor extend a streak).
    reference
        ``"median"`` (window median, default), ``"mean"`` (window mean), ``"ewm"`` or
        ``"initial_max"`` (max of the first ``window`` values, then fixed).
    warmup
        Number of accepted values before any score is emitted (score ``0.0`` before).
        ``None`` means ``window`` for every reference but ``"ewm"`` and ``min(window, 30)``
        for ``"ewm"``.
    freeze_on_alarm
        Do not add a value to the reference when it raised an alarm.

    Notes
    -----
    Meant for positive signals (loss, gradient norm): a non-positive reference is replaced by
    ``1e-300``.  Non-finite values alarm with score ``+inf`` and never enter the reference;
    missing values score ``nan`` and change nothing.

    Examples
    --------
    "loss >= 2x the mean of the last 100 values for 5 steps":

    >>> import numpy as np
    >>> rule = RatioToMean(window=100, threshold=2.0, patience=5, reference="mean")
    >>> x = np.ones(200)
    >>> x[150:160] = 3.0
    >>> scores, alarms = rule.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [154, 155, 156, 157, 158, 159]
    >>> float(scores[154, 0]) > 2.0 > float(scores[153, 0])
    True

    After a single 100x spike the window mean is inflated and the mean rule misses a sustained
    2.5x rise; the default (window median, patience 3) ignores the one-step spike and catches
    the rise on its third step:

    >>> x = np.ones(300)
    >>> x[120] = 100.0
    >>> x[150:160] = 2.5
    >>> rule.reset()
    >>> bool(rule.update_many(x)[1].any())
    False
    >>> np.flatnonzero(RatioToMean().update_many(x)[1][:, 0]).tolist()
    [152, 153, 154, 155, 156, 157, 158, 159]
    """

    parameter_constraints = {
        "window": Int(1, MAX_WINDOW),
        "patience": Int(1),
        "reference": Choice(REFERENCES),
        "warmup": Int(1, _max_warmup, derive=_default_warmup),
    }
    window: int
    patience: int
    reference: str
    tuning_grid = {"window": (20, 100)}
    summary = (
        "x / reference (window median or mean, EW mean, or max of the first N values) that must "
        'exceed the threshold for `patience` steps. Covers "2× window mean for 5 steps", "3× the '
        '10-step mean", "10× the max of the first 100".')

    def __init__(
        self,
        n_series: int = 1,
        window: int = 100,
        threshold: float = 2.0,
        patience: int = 3,
        reference: str = "median",
        warmup: int | None = None,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((_N_FIELDS, n))

    def _init_buf(self, n: int) -> FloatArray:
        ring = {"mean": self.window, "median": 2 * self.window}.get(self.reference, 0)
        return np.zeros((ring + self.patience, n))

    kernel = staticmethod(_kernel)
    param_layout = RatioParams
    state_hyperparameters = ("window", "patience", "reference")

    def _check_state(self, c: StateCheck) -> None:
        st, w = c.state, self.window
        c.integers("count", st[_COUNT], 0)
        c.integers("ratio position", st[_RPOS], 0, self.patience - 1)
        ring = {"mean": w, "median": 2 * w}.get(self.reference, 0)
        if ring:
            c.integers("position", st[_POS], 0, w - 1)
            bad = st[_POS] != np.mod(st[_COUNT], w)
            if bad.any():
                c.fail("position", "the count modulo the window", st[_POS], bad)
            c.finite("window values", c.buf[:ring])
            if self.reference == "median":
                c.sorted_copy("sorted window", c.buf[:w], c.buf[w:ring], st[_COUNT], w)
        else:
            c.integers("position", st[_POS], 0, 0)
        c.not_nan("reference", st[_REF])
        c.not_nan("recent ratios", c.buf[ring:])

    @property
    def count(self) -> FloatArray:
        """Number of values accepted into each series' reference so far."""
        return self._state[_COUNT].copy()
