"""Windowed z-score over a ring buffer: median/MAD (robust) or mean/std.

Each new value is scored against the last ``window`` accepted values *before* it is added
(test-then-train)::

    robust=True:   z = (y - median) / (1.4826 * MAD)
    robust=False:  z = (y - mean) / std            (population std, ddof=0)

with ``y = log(x)`` when ``log_space``.  The industry rule "6 sigma over the last 128 values" is
``RobustZScore(window=128, robust=False, threshold=6.0, log_space=False)``.  The default (median
and MAD of log values) is not inflated by the spikes it is looking for: a mean/std window that
contains one 100x spike has a huge std for the next ``window`` steps and misses the second one.

With ``robust=True`` a sorted copy of the window is kept beside the ring (one binary search and
a short shift per step); the median is then read off directly and the MAD found by a binary
search over the sorted deviations on either side of it, so a step costs ``O(log window)``
comparisons plus ``O(window)`` simple moves, and windows up to a few thousand values are
cheap.  Both equal ``np.median`` on the window bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import MAD_SCALE, BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Bool, Choice, Float, Int, arguments
from ._state import StateCheck
from .ewma import DIRECTIONS, LOG_FLOOR
from .tail import tail_factor, tail_reference, taint_event, track_tail

#: Largest accepted ``window``: the ring buffer is allocated per series up front (a
#: hostile config must fail validation, not exhaust memory).
MAX_WINDOW = 1_000_000

#: consistency constant: 1.4826 * MAD estimates the std of a normal distribution

# state rows: next write position in the ring, number of valid values in the ring (<= window);
# (state version 2) the tail calibration's quantile tracker and its "previous score above" flag
_POS, _COUNT, _Q, _ABOVE = 0, 1, 2, 3
_N_FIELDS = 4


# The helpers take one series' sorted values as a 1-D column view (``buf[window:, i]``), made
# once per series and kernel call: indexing a 1-D view compiles to one stride per access,
# where ``buf[off + j, i]`` pays the 2-D address arithmetic on every move of the shift.


@njit(cache=True, error_model="numpy", inline="always")
def _upper_bound(col: FloatArray, n: int, v: float) -> int:
    """First ``j`` in ``[0, n)`` with ``col[j] > v`` (``n`` if none).

    Branch-free (the halving depends on ``n`` only, each step is a conditional move): a
    search over a window of noisy values mispredicts half of its branches otherwise.
    """
    if n == 0:
        return 0
    base = 0
    m = n
    while m > 1:
        half = m // 2
        base = base + half if col[base + half - 1] <= v else base
        m -= half
    return base + 1 if col[base] <= v else base


@njit(cache=True, error_model="numpy", inline="always")
def _lower_bound(col: FloatArray, n: int, v: float) -> int:
    """First ``j`` in ``[0, n)`` with ``col[j] >= v`` (``n`` if none); branch-free as
    :func:`_upper_bound`."""
    if n == 0:
        return 0
    base = 0
    m = n
    while m > 1:
        half = m // 2
        base = base + half if col[base + half - 1] < v else base
        m -= half
    return base + 1 if col[base] < v else base


@njit(cache=True, error_model="numpy", inline="always")
def _move_up(col: FloatArray, lo: int, hi: int) -> None:
    """``col[lo + 1:hi + 1] = col[lo:hi]`` (``lo <= hi``), top down, eight values per block
    (all loaded before any is stored: the block's loads and stores overlap): an
    element-by-element backward loop is not vectorised and costs ~2.5 ns a value."""
    j = hi
    while j - 8 >= lo:
        a0, a1, a2, a3 = col[j - 8], col[j - 7], col[j - 6], col[j - 5]
        a4, a5, a6, a7 = col[j - 4], col[j - 3], col[j - 2], col[j - 1]
        col[j - 7], col[j - 6], col[j - 5], col[j - 4] = a0, a1, a2, a3
        col[j - 3], col[j - 2], col[j - 1], col[j] = a4, a5, a6, a7
        j -= 8
    while j > lo:
        col[j] = col[j - 1]
        j -= 1


@njit(cache=True, error_model="numpy", inline="always")
def _move_down(col: FloatArray, lo: int, hi: int) -> None:
    """``col[lo:hi] = col[lo + 1:hi + 1]`` (``lo <= hi``), bottom up, as :func:`_move_up`."""
    j = lo
    while j + 8 <= hi:
        a0, a1, a2, a3 = col[j + 1], col[j + 2], col[j + 3], col[j + 4]
        a4, a5, a6, a7 = col[j + 5], col[j + 6], col[j + 7], col[j + 8]
        col[j], col[j + 1], col[j + 2], col[j + 3] = a0, a1, a2, a3
        col[j + 4], col[j + 5], col[j + 6], col[j + 7] = a4, a5, a6, a7
        j += 8
    while j < hi:
        col[j] = col[j + 1]
        j += 1


#: windows up to this length find the two positions of a push by counting (a branch-free scan
#: the compiler vectorises: no chain of dependent loads through values the previous push just
#: moved), longer ones by binary search
COUNT_UP_TO = 4096


@njit(cache=True, error_model="numpy")
def sorted_push(col: FloatArray, count: int, window: int, old: float, y: float) -> None:
    """Insert ``y`` into the sorted column ``col[:count]``.

    When the window is full (``count == window``) the value ``old`` that leaves the ring is
    removed in the same pass, so the column keeps ``window`` values.  ``col`` should be
    contiguous (the full-window positions are counted in one vectorised pass then).
    """
    if count < window:
        q = _upper_bound(col, count, y)
        _move_up(col, q, count)
        col[q] = y
        return
    if count <= COUNT_UP_TO:
        # first value >= old and first value > y: the number of values < old and <= y
        r = 0
        q = 0
        for j in range(count):
            v = col[j]
            r += v < old
            q += v <= y
    else:
        r = _lower_bound(col, count, old)
        q = _upper_bound(col, count, y)
    if y >= old:
        _move_down(col, r, q - 1)
        col[q - 1] = y
    else:
        _move_up(col, q, r)
        col[q] = y


@njit(cache=True, error_model="numpy")
def sorted_median(col: FloatArray, n: int) -> float:
    """Median of the sorted column ``col[:n]`` (``n >= 1``); equals ``np.median``."""
    k = n // 2
    if n % 2 == 1:
        return col[k]
    return (col[k - 1] + col[k]) / 2.0


@njit(cache=True, error_model="numpy", inline="always")
def _left_count(col: FloatArray, n: int, m: float, jr: int, k: int) -> int:
    """How many of the ``k + 1`` smallest ``|v - m|`` come from left of ``jr`` (see
    :func:`_kth_deviations`).

    Taking ``a`` from the left list and ``k + 1 - a`` from the right one, the answer is the first
    ``a`` in ``[lo, hi)`` where the left list's next deviation is not the smaller one (``hi`` if
    none): found branch-free, as :func:`_upper_bound`.
    """
    lo = max(0, k + 1 - (n - jr))
    hi = min(k + 1, jr)
    if lo < hi:
        span = hi - lo
        while span > 1:
            half = span // 2
            a = lo + half - 1
            lo = lo + half if m - col[jr - 1 - a] < col[jr + k - a] - m else lo
            span -= half
        lo = lo + 1 if m - col[jr - 1 - lo] < col[jr + k - lo] - m else lo
    return lo


@njit(cache=True, error_model="numpy", inline="always")
def _kth_deviations(col: FloatArray, n: int, m: float, jr: int, k: int) -> tuple[float, float]:
    """``k``-th and ``(k - 1)``-th smallest (from 0) of ``|v - m|`` over the sorted column
    (``1 <= k < n``), ``jr`` = first ``v >= m``.

    The deviations left of ``m`` (``m - v`` for ``v`` at ``jr - 1, jr - 2, ...``) and right of it
    (``v - m`` at ``jr, jr + 1, ...``) are two sorted lists (rounding is monotone); the ``k + 1``
    smallest are found by a binary search for how many of them come from the left list.  The
    ``k``-th is the largest of those, the ``(k - 1)``-th the largest once that one is removed
    (one search for both).
    """
    lo = _left_count(col, n, m, jr, k)
    # the k + 1 smallest: lo from the left (the largest m - col[jr - lo]), b = k + 1 - lo from
    # the right (the largest col[jr + k - lo] - m)
    b = k + 1 - lo
    lmax = m - col[jr - lo] if lo > 0 else -np.inf
    rmax = col[jr + k - lo] - m if b > 0 else -np.inf
    if lo > 0 and (b == 0 or lmax >= rmax):  # the largest is the left one: drop it
        d = max(m - col[jr - lo + 1] if lo > 1 else -np.inf, rmax)
        return lmax, d
    d = max(lmax, col[jr + k - lo - 1] - m if b > 1 else -np.inf)
    return rmax, d


@njit(cache=True, error_model="numpy", inline="always")
def _kth_deviation(col: FloatArray, n: int, m: float, jr: int, k: int) -> float:
    """``k``-th smallest (from 0) of ``|v - m|`` (:func:`_kth_deviations` for ``k = 0`` too)."""
    lo = _left_count(col, n, m, jr, k)
    d = -np.inf
    if lo > 0:
        d = m - col[jr - lo]
    if lo <= k:
        d = max(d, col[jr + k - lo] - m)
    return d


@njit(cache=True, error_model="numpy")
def sorted_mad(col: FloatArray, n: int, m: float) -> float:
    """Median of ``|v - m|`` over the sorted column ``col[:n]`` (``n >= 1``), ``m`` its median.

    Equals ``np.median(np.abs(v - m))`` bit for bit; ``O(log n)`` (see :func:`_kth_deviations`).
    The first value ``>= m`` is found next to the middle (``col[k - 1] <= m <= col[k]``) unless
    values tie with the median or the mean of the middle pair overflows.
    """
    k = n // 2
    if col[k] >= m and (k == 0 or col[k - 1] < m):
        jr = k
    elif col[k] >= m:
        jr = _lower_bound(col, k, m)
    else:
        jr = _lower_bound(col, n, m)
    if n % 2 == 1:
        return _kth_deviation(col, n, m, jr, k)
    cur, prev = _kth_deviations(col, n, m, jr, k)
    return (prev + cur) / 2.0


class RobustParams(NamedTuple):
    """Layout of :class:`RobustZScore`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    window: float
    warmup: float
    robust: float
    log_space: float
    min_std: float
    direction: float
    tail_q: float
    tail_rate: float
    tail_ref: float
    tail_max: float
    tail_gap: float


_P = indices(RobustParams)


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    threshold = params[_P.threshold]
    freeze = params[_P.freeze_on_alarm] != 0.0
    window = int(params[_P.window])
    warmup = params[_P.warmup]
    robust = params[_P.robust] != 0.0
    log_space = params[_P.log_space] != 0.0
    min_std = params[_P.min_std]
    direction = params[_P.direction]
    tail_q, tail_rate = params[_P.tail_q], params[_P.tail_rate]
    tail_ref, tail_max = params[_P.tail_ref], params[_P.tail_max]
    tail_gap = params[_P.tail_gap]
    # series by series (they are independent): the column views are made once per series
    for i in range(X.shape[2]):
        ring = buf[:window, i]
        # the ring sorted (robust only), in a contiguous copy (sorted_push), stored back below
        srt = np.empty(window if robust else 0)
        if robust:
            srt[:] = buf[window:, i]
        pos = int(state[_POS, i])  # ring position and fill, kept in registers over the steps
        count = int(state[_COUNT, i])
        q, above = state[_Q, i], state[_ABOVE, i]
        for t in range(X.shape[0]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            y = math.log(max(x, LOG_FLOOR)) if log_space else x
            s = 0.0
            scoring = count >= warmup and count > 0
            if scoring:
                if robust:
                    center = sorted_median(srt, count)
                    spread = MAD_SCALE * sorted_mad(srt, count, center)
                else:
                    acc = 0.0
                    for j in range(count):
                        acc += ring[j]
                    center = acc / count
                    acc = 0.0
                    for j in range(count):
                        d = ring[j] - center
                        acc += d * d
                    spread = math.sqrt(acc / count)
                floor = min_std if log_space else min_std * abs(center)
                z = (y - center) / max(spread, floor, 1e-300)
                if direction > 0.0:
                    s = z
                elif direction < 0.0:
                    s = -z
                else:
                    s = abs(z)
            cal = s / tail_factor(q, tail_ref, tail_max)
            alarm = cal > threshold
            scores[t, i] = cal
            alarms[t, i] = alarm
            if not learns(alarm, freeze):
                if scoring:
                    above = taint_event(above, tail_gap)
                continue
            if scoring:
                q, above = track_tail(s, alarm, q, above, tail_q, tail_rate, tail_ref, tail_gap)
            if robust:
                sorted_push(srt, count, window, ring[pos], y)
            ring[pos] = y
            pos = pos + 1 if pos + 1 < window else 0  # (pos + 1) % window: pos < window
            if count < window:
                count += 1
        state[_POS, i] = pos
        state[_COUNT, i] = count
        state[_Q, i], state[_ABOVE, i] = q, above
        if robust:
            buf[window:, i] = srt


def _default_warmup(det: RobustZScore) -> int:
    """A quarter of the window (at least 2; 1 for a window of 1)."""
    return max(2, det.window // 4) if det.window >= 2 else 1


class RobustZScore(BankDetector):
    """Z-score of each new value against the last ``window`` values (median/MAD or mean/std).

    Parameters
    ----------
    n_series
        Number of series in the bank.
    window
        Length of the ring buffer of past values (per series).
    warmup
        Number of values the window must hold before any score is emitted (score ``0.0``
        before).  ``None`` means ``max(2, window // 4)``.
    threshold
        Alarm when the score exceeds this many (robust) standard deviations.
    robust
        ``True``: centre = median, spread = ``1.4826 * MAD``.  ``False``: mean and population
        standard deviation of the window.
    log_space
        Score ``log(x)`` instead of ``x`` (values <= 0 are floored at 1e-30): multiplicative
        spikes of positive signals (loss, gradient norm) become additive.
    min_std
        Noise floor for the spread: absolute in log space (0.01 ~ a 1 % change), relative to
        ``|centre|`` in linear space.  Keeps constant streams from alarming on round-off.
    direction
        ``"up"`` (spikes), ``"down"`` or ``"both"``.
    freeze_on_alarm
        Do not add a value to the window when it raised an alarm.
    tail_q, tail_rate, tail_max, tail_gap
        Per-run tail calibration, the rule of :class:`~detectors.tail.TailZScore`: each series
        tracks the ``tail_q`` quantile ``q`` of its own healthy spike events (raw scores; an
        excursion above ``q`` -- scores above it less than ``tail_gap`` quiet scores apart --
        lifts it by ``tail_rate * tail_q`` once, when it is over, and not at all if any of its
        scores alarmed; it sinks by ``tail_rate * (1 - tail_q)`` per quiet score) and the
        reported score is the raw z divided by ``max(1, min(tail_max, q / tail_ref))``,
        ``tail_ref`` the same quantile of a standard normal score.  A spiky run (small-batch
        SGD) raises its own bar, a smooth one keeps the plain z.  ``tail_max = 1`` (default):
        no calibration, the plain z.

    Notes
    -----
    The ring buffer is the detector's ``buf`` (rows ``[0, window)``, in log space when
    ``log_space``; with ``robust`` rows ``[window, 2 * window)`` hold the same values sorted);
    ``state`` holds the next write position, the number of valid values and (state version 2)
    the tail tracker ``q`` and its open spike event.  A version-1 snapshot
    loads uncalibrated (``q = tail_ref``).
    Non-finite values alarm with score ``+inf`` and never enter the window; missing values
    (``missing=True``) score ``nan`` and change nothing.

    Examples
    --------
    >>> import numpy as np
    >>> det = RobustZScore(window=64, threshold=8.0)
    >>> rng = np.random.default_rng(0)
    >>> x = np.exp(rng.normal(0.0, 0.05, 200))
    >>> x[[120, 130]] = [20.0, 8.0]
    >>> scores, alarms = det.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [120, 130]

    The mean/std window ("6 sigma over 128 steps") lets the first spike mask the second:

    >>> six_sigma = RobustZScore(window=128, robust=False, threshold=6.0, log_space=False)
    >>> np.flatnonzero(six_sigma.update_many(x)[1][:, 0]).tolist()
    [120]
    """

    parameter_constraints = {
        "window": Int(1, MAX_WINDOW),
        "warmup": Int(1, "window", derive=_default_warmup),
        "robust": Bool(),
        "log_space": Bool(),
        "min_std": Float(0.0),
        "direction": Choice(DIRECTIONS),
        "tail_q": Float(0.5, 1.0, low_open=True, high_open=True),
        "tail_rate": Float(0.0),
        "tail_max": Float(1.0),
        "tail_gap": Int(1, 1_000_000),
    }
    window: int
    robust: bool
    tail_q: float
    tail_max: float
    tuning_grid = {"window": (32, 128), "min_std": (0.01, 0.05, 0.1)}
    summary = (
        "median/MAD z-score over a ring buffer; a spike does not inflate the MAD, so repeated "
        'spikes keep alarming. "6σ over 128" is `window=128, robust=False, threshold=6, '
        "log_space=False`.")

    def __init__(
        self,
        n_series: int = 1,
        window: int = 128,
        warmup: int | None = None,
        threshold: float = 8.0,
        robust: bool = True,
        log_space: bool = True,
        min_std: float = 0.01,
        direction: str = "up",
        freeze_on_alarm: bool = False,
        tail_q: float = 0.999,
        tail_rate: float = 1.0,
        tail_max: float = 1.0,
        tail_gap: int = 1,
    ):
        super().__init__(**arguments(locals()))

    @property
    def tail_ref(self) -> float:
        """The ``tail_q`` quantile of a standard normal score (the calibration's reference)."""
        return tail_reference(self.tail_q)

    @property
    def tail_factor(self) -> FloatArray:
        """Per series, what a raw z-score is divided by (1 = a Gaussian-like tail)."""
        q = self._state[_Q]
        return np.maximum(1.0, np.minimum(self.tail_max, q / self.tail_ref))

    def _init_state(self, n: int) -> FloatArray:
        state = np.zeros((_N_FIELDS, n))
        state[_Q] = self.tail_ref
        return state

    def _init_buf(self, n: int) -> FloatArray:
        return np.zeros((2 * self.window if self.robust else self.window, n))

    kernel = staticmethod(_kernel)
    param_layout = RobustParams
    state_hyperparameters = ("window", "robust", "log_space")
    #: version 2 added the tail tracker rows; a version 1 snapshot loads uncalibrated
    state_version = 2
    legacy_state_rows = {1: 2}

    def _check_state(self, c: StateCheck) -> None:
        w = self.window
        c.ring("window", c.state[_POS], c.state[_COUNT], w)
        c.finite("window values", c.buf)
        c.finite("q", c.state[_Q], 0.0)
        c.integers("event", c.state[_ABOVE], -np.inf)
        if self.robust:
            c.sorted_copy("sorted window", c.buf[:w], c.buf[w:], c.state[_COUNT], w)

    @property
    def count(self) -> FloatArray:
        """Number of values currently in each series' window."""
        return self._state[_COUNT].copy()
