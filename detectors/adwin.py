"""ADWIN (adaptive windowing), reproducing ``river.drift.ADWIN`` exactly, banked and jitted.

This is a line-by-line port of river's ``AdaptiveWindowing`` (``rust_src/adwin.rs``, itself a port
of the former ``adwin_c.pyx``) with the same floating-point operation order, so the drift indices
are identical to river's on the same stream.  The window is an exponential histogram: row ``r``
holds up to ``max_buckets + 1`` buckets of ``2**r`` points each (total and variance); when a row
overflows its two oldest buckets merge into one bucket of the next row.  Every ``clock`` points
(once the window is longer than ``grace_period``) every cut of the window into an older part
``W0`` and a newer part ``W1`` (both at least ``min_window_length`` long) is tested::

    |mean(W0) - mean(W1)| > eps_cut,
    eps_cut = sqrt(2 m var/width dd) + 2/3 dd m,  dd = ln(2 ln(width) / delta),
    m = 1/(n0 - min_window_length + 1) + 1/(n1 - min_window_length + 1)

and the oldest bucket is dropped while some cut fails.  A drift is a step on which a bucket was
dropped; like river's ``ADWIN`` the series then restarts from an empty window
(``reset_on_drift=True``; ``False`` keeps the shrunk window, as in the original algorithm).

**Score.**  ``max(0, max over the cuts tested on this step of |mean(W0) - mean(W1)| - eps_cut)``:
by how much the strongest cut exceeds its bound, in the units of the data.  It is ``0.0`` on
steps without a test (off-clock steps, grace period), and ``alarm = score > threshold`` with the
default ``threshold = 0`` is exactly river's ``drift_detected`` (for finite ``a``, ``b``:
``a - b > 0`` iff ``a > b``).  The window itself evolves independently of ``threshold``.

**State.**  ``state`` holds the window's total, variance (sum of squared deviations), width,
clock tick, number of rows in use and a drift counter; ``buf`` holds ``max_rows`` rows of
``max_buckets + 1`` bucket totals, as many bucket variances and the ``max_rows`` row counts (series
on the last axis).  The window covers at most about ``max_buckets * 2**max_rows`` points: when the
top row is full its oldest bucket is dropped (never reached with the default ``max_rows = 48``).
With ``max_buckets = 1`` river's Rust code can panic after a drift (an empty trailing row); here
empty trailing rows are dropped instead.

**Extreme values.**  A finite value that would take the window total out of the float64 range,
or whose squared deviation from the window mean overflows the variance (e.g. ``+-1e308`` among
ordinary values), never enters the window: it scores ``+inf``, alarms, and the series restarts
from an empty window (even with ``reset_on_drift=False``; river's window would hold ``inf``/``nan``
from then on).  A variance that overflows only through rounding noise (a steady stream near
``1e300``, where river's variance becomes ``inf``) saturates at the largest float64, which reads as
infinite (no cut can be significant), like river's.  Ordinary streams never get near these
limits, so the drift indices stay identical to river's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, skip_value
from ._params import Bool, Float, Int, arguments
from ._state import StateCheck

#: relative safety margin of the division-free cut screen (>> the few ulps it must cover)
SCREEN_MARGIN = 1e-12
#: a variance too large for float64 saturates here and reads as infinite (see "Extreme values")
SATURATED = np.finfo(np.float64).max
#: a deviation below this fraction of ``|x|`` is rounding noise of a huge but steady stream
ROUNDING = 1e-12

# state rows
_TOTAL, _VARIANCE, _WIDTH, _TICK, _NROWS, _NDRIFT = 0, 1, 2, 3, 4, 5
_N_FIELDS = 6


@njit(cache=True, error_model="numpy", inline="always")
def _delete_oldest(b, cap, rows, n_rows, width, total, variance):  # type: ignore[no-untyped-def]
    """Drop the oldest bucket (river's ``delete_element``); returns the new scalars."""
    cnt0 = 2 * rows * cap
    last = n_rows - 1
    n = float(1 << last)
    base = last * cap
    u = b[base]
    v = b[rows * cap + base]
    mu = u * (1.0 / n)  # == u / n exactly: n is a power of two
    width -= n
    total -= u
    mu_window = total / width
    if variance < SATURATED:
        variance -= v + n * width * (mu - mu_window) * (mu - mu_window) / (n + width)
        if not np.isfinite(variance):
            variance = SATURATED
    k = int(b[cnt0 + last])
    for j in range(k - 1):
        b[base + j] = b[base + j + 1]
        b[rows * cap + base + j] = b[rows * cap + base + j + 1]
    b[cnt0 + last] = k - 1
    while n_rows > 1 and b[cnt0 + n_rows - 1] == 0.0:
        n_rows -= 1
    return n_rows, width, total, variance


@njit(cache=True, error_model="numpy", inline="always")
def _compress(b, cap, rows, n_rows, width, total, variance):  # type: ignore[no-untyped-def]
    """Merge the two oldest buckets of every full row into the next row (river's order)."""
    vo = rows * cap
    cnt0 = 2 * vo
    idx = 0
    while True:
        if idx + 1 == rows:  # capacity reached (practically never): drop the oldest bucket
            n_rows, width, total, variance = _delete_oldest(
                b, cap, rows, n_rows, width, total, variance
            )
            break
        base = idx * cap
        n1 = float(1 << idx)
        inv = 1.0 / n1  # exact: multiplying by it equals dividing by n1 (a power of two)
        t0 = b[base]
        t1 = b[base + 1]
        v0 = b[vo + base]
        v1 = b[vo + base + 1]
        mu1 = t0 * inv
        mu2 = t1 * inv
        temp = n1 * 0.5 * (mu1 - mu2) * (mu1 - mu2)
        if idx + 1 >= n_rows:
            n_rows = idx + 2
            b[cnt0 + idx + 1] = 0.0
        kn = int(b[cnt0 + idx + 1])
        nb = base + cap + kn
        b[nb] = t0 + t1
        b[vo + nb] = min(v0 + v1 + temp, SATURATED)
        b[cnt0 + idx + 1] = kn + 1
        for j in range(cap - 2):
            b[base + j] = b[base + j + 2]
            b[vo + base + j] = b[vo + base + j + 2]
        b[cnt0 + idx] = cap - 2
        if kn + 1 < cap:
            break
        idx += 1
    return n_rows, width, total, variance


@njit(cache=True, error_model="numpy", inline="always")
def _screen_fails(u0, u1, n0, n1, a, c, k_sqrt, k_lin):  # type: ignore[no-untyped-def]
    """``True`` only if the cut certainly fails river's test (``|mean0 - mean1| <= eps_cut``).

    Division- and sqrt-free: ``g`` bounds ``|u0/n0 - u1/n1| * n0 * n1`` from above including
    every rounding error of river's own ``fl(fl(u0/n0) - fl(u1/n1))`` (the ``1e-13`` term, far
    above a few ulps), and ``k_sqrt``/``k_lin`` are the two lower bounds of ``eps_cut``
    (``sqrt(2 m var dd)`` and ``2/3 dd m`` with ``m = (a + c) / (a c)``) shrunk by
    ``SCREEN_MARGIN``, which dwarfs the few ulps of the products below.  Cuts that pass the
    screen are evaluated exactly as river does, so the decisions (and the positive part of the
    score) are bit-identical.
    """
    nn = n0 * n1
    g = abs(u0 * n1 - u1 * n0) + 1e-13 * (abs(u0) * n1 + abs(u1) * n0)
    ac = a * c
    apc = a + c
    return g * g * ac < k_sqrt * apc * nn * nn or g * ac < k_lin * apc * nn


@njit(cache=True, error_model="numpy", inline="always")
def _detect(b, cap, rows, n_rows, width, total, variance, delta, mwl):  # type: ignore[no-untyped-def]
    """Test every cut, dropping the oldest bucket while one fails (river's ``detect_change``).

    Returns ``(change, best, n_rows, width, total, variance)``; ``best`` is the largest
    ``|mean0 - mean1| - eps_cut`` over the cuts evaluated exactly (cuts rejected by the screen
    have a negative margin, so ``max(0, best)`` is the same as over all cuts).
    """
    cnt0 = 2 * rows * cap
    change = False
    best = -np.inf
    reduce_width = True
    two_thirds = 2.0 / 3.0
    while reduce_width:
        reduce_width = False
        n0 = 0.0
        n1 = width
        u0 = 0.0
        u1 = total
        d_prime = np.log(2.0 * np.log(width) / delta)
        var_w = variance / width if variance < SATURATED else np.inf
        c_lin = two_thirds * d_prime
        # Division-free screen (see _screen_fails): valid where nothing under- or overflows.
        screen = (
            1e-10 < d_prime < 1e4
            and (var_w == 0.0 or 1e-200 < var_w < 1e200)
            and width < 1e15
        )
        k_sqrt = 2.0 * var_w * d_prime * (1.0 - SCREEN_MARGIN)
        k_lin = c_lin * (1.0 - SCREEN_MARGIN)
        exit_flag = False
        for idx in range(n_rows - 1, -1, -1):
            if exit_flag:
                break
            size = float(1 << idx)
            k_cur = int(b[cnt0 + idx])
            base = idx * cap
            for k in range(k_cur):
                n0 += size
                n1 -= size
                tot = b[base + k]
                u0 += tot
                u1 -= tot
                if idx == 0 and k == k_cur - 1:
                    exit_flag = True
                    break
                if n1 >= mwl and n0 >= mwl:
                    a = n0 - mwl + 1.0
                    c = n1 - mwl + 1.0
                    if screen and _screen_fails(u0, u1, n0, n1, a, c, k_sqrt, k_lin):
                        continue
                    dm = abs((u0 / n0) - (u1 / n1))
                    m_recip = 1.0 / a + 1.0 / c
                    eps = np.sqrt(2.0 * m_recip * var_w * d_prime) + c_lin * m_recip
                    diff = dm - eps
                    if diff > best:
                        best = diff
                    if dm > eps:
                        reduce_width = True
                        change = True
                        if width > 0.0:
                            n_rows, width, total, variance = _delete_oldest(
                                b, cap, rows, n_rows, width, total, variance
                            )
                            exit_flag = True
                            break
    return change, best, n_rows, width, total, variance


class ADWINParams(NamedTuple):
    """Layout of :class:`ADWIN`'s float64 ``params`` array, in kernel order."""

    threshold: float
    freeze_on_alarm: float
    delta: float
    clock: float
    max_buckets: float
    min_window_length: float
    grace_period: float
    reset_on_drift: float
    max_rows: float


_P = indices(ADWINParams)


@njit(cache=True, error_model="numpy")
def _run_series(X, miss, i, b, st, params, scores, alarms):  # type: ignore[no-untyped-def]
    """Run series ``i`` over all steps; ``b`` is its buffer column, ``st`` its state column."""
    threshold = params[_P.threshold]
    delta = params[_P.delta]
    clock = params[_P.clock]
    cap = int(params[_P.max_buckets]) + 1
    mwl = params[_P.min_window_length]
    grace = params[_P.grace_period]
    reset = params[_P.reset_on_drift] != 0.0
    rows = int(params[_P.max_rows])
    vo = rows * cap
    cnt0 = 2 * vo
    total = st[_TOTAL]
    variance = st[_VARIANCE]
    width = st[_WIDTH]
    tick = st[_TICK]
    n_rows = int(st[_NROWS])
    n_drift = st[_NDRIFT]
    c0 = int(b[cnt0])  # row 0's bucket count, kept in a register
    for t in range(X.shape[0]):
        x = X[t, 0, i]
        if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
            continue
        inc = 0.0
        d = 0.0
        if width > 0.0:
            d = x - total / width
            inc = width * d * d / (width + 1.0)
        if not np.isfinite(total + x) or (
            not np.isfinite(variance + inc) and not abs(d) <= ROUNDING * abs(x)
        ):
            # x would take the window out of the float64 range: alarm and restart
            scores[t, i] = np.inf
            alarms[t, i] = True
            for r in range(n_rows):
                b[cnt0 + r] = 0.0
            n_rows = 1
            c0 = 0
            total = 0.0
            variance = 0.0
            width = 0.0
            tick = 0.0
            continue
        # append x to row 0 (river's insert_element)
        b[c0] = x
        b[vo + c0] = 0.0
        c0 += 1
        width += 1.0
        variance = min(variance + inc, SATURATED)
        total += x
        if c0 == cap:
            b[cnt0] = c0
            n_rows, width, total, variance = _compress(b, cap, rows, n_rows, width, total, variance)
            c0 = int(b[cnt0])
        tick += 1.0
        s = 0.0
        change = False
        if tick == clock:
            tick = 0.0
            if width > grace:
                b[cnt0] = c0
                change, best, n_rows, width, total, variance = _detect(
                    b, cap, rows, n_rows, width, total, variance, delta, mwl
                )
                c0 = int(b[cnt0])
                if best > 0.0:
                    s = best
        scores[t, i] = s
        alarms[t, i] = s > threshold
        if change:
            n_drift += 1.0
            if reset:
                for r in range(n_rows):
                    b[cnt0 + r] = 0.0
                n_rows = 1
                c0 = 0
                total = 0.0
                variance = 0.0
                width = 0.0
                tick = 0.0
    b[cnt0] = c0
    st[_TOTAL] = total
    st[_VARIANCE] = variance
    st[_WIDTH] = width
    st[_TICK] = tick
    st[_NROWS] = float(n_rows)
    st[_NDRIFT] = n_drift


@njit(cache=True, error_model="numpy")
def _kernel(X, miss, state, buf, params, scores, alarms):  # type: ignore[no-untyped-def]
    st = np.empty(_N_FIELDS)
    for i in range(X.shape[2]):
        st[:] = state[:, i]
        if X.shape[0] >= 64:
            # long batch: work on a contiguous copy of the column (much faster than strided)
            b = np.ascontiguousarray(buf[:, i])
            _run_series(X, miss, i, b, st, params, scores, alarms)
            buf[:, i] = b
        else:
            _run_series(X, miss, i, buf[:, i], st, params, scores, alarms)
        state[:, i] = st


class ADWIN(BankDetector):
    """ADWIN drift detector (river's ``drift.ADWIN``, banked): see the module docstring.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    delta
        Significance value of the cut test, in ``(0, 1)``.
    clock
        Test for a change every ``clock`` finite observations.
    max_buckets
        Buckets of each size kept before two of them are merged.
    min_window_length
        Minimum length of each sub-window of a tested cut.
    grace_period
        No test until the window is longer than this.
    threshold
        ``alarm = score > threshold`` (``0`` reproduces river's detections); must be ``>= 0``.
    reset_on_drift
        Restart from an empty window after a drift, as river's ``ADWIN`` does.
    max_rows
        Rows of the exponential histogram (window capacity ``~ max_buckets * 2**max_rows``).
    freeze_on_alarm
        Not supported (must be ``False``).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = np.concatenate([rng.normal(0.0, 1.0, 1000), rng.normal(1.0, 1.0, 1000)])
    >>> det = ADWIN()
    >>> scores, alarms = det.update_many(x)
    >>> np.flatnonzero(alarms[:, 0]).tolist()
    [1055]
    """

    parameter_constraints = {
        "threshold": Float(0.0),
        "freeze_on_alarm": Bool(only=False,
                                why="the detector drops old data after a drift instead"),
        "delta": Float(0.0, 1.0, low_open=True, high_open=True),
        "clock": Int(1),
        "max_buckets": Int(1),
        "min_window_length": Int(1),
        "grace_period": Int(0),
        "reset_on_drift": Bool(),
        "max_rows": Int(1, 62),
    }
    clock: int
    max_buckets: int
    max_rows: int
    kind = "level_shift"
    summary = (
        "Adaptive windowing with an exponential histogram (a port of river's implementation); "
        "drift indices identical to `river.drift.ADWIN`.")

    def __init__(
        self,
        n_series: int = 1,
        delta: float = 0.002,
        clock: int = 32,
        max_buckets: int = 5,
        min_window_length: int = 5,
        grace_period: int = 10,
        threshold: float = 0.0,
        reset_on_drift: bool = True,
        max_rows: int = 48,
        freeze_on_alarm: bool = False,
    ):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        state = np.zeros((_N_FIELDS, n))
        state[_NROWS] = 1.0
        return state

    def _init_buf(self, n: int) -> FloatArray:
        cap = self.max_buckets + 1
        return np.zeros((self.max_rows * (2 * cap + 1), n))

    kernel = staticmethod(_kernel)
    param_layout = ADWINParams
    state_hyperparameters = ("max_buckets", "max_rows", "clock")

    def _check_state(self, c: StateCheck) -> None:
        cap, rows = self.max_buckets + 1, self.max_rows
        st, b = c.state, c.buf
        c.integers("n_rows", st[_NROWS], 1, rows)
        counts = b[2 * rows * cap :]
        c.integers("bucket counts", counts, 0, cap - 1)
        r = np.arange(rows, dtype=np.float64)[:, None]
        n_rows = st[_NROWS][None, :]
        bad = ((r >= n_rows) & (counts != 0)) | ((r == n_rows - 1) & (r > 0) & (counts == 0))
        if bad.any():
            c.fail("bucket counts", "0 above the last row and > 0 in it", counts, bad)
        width = (counts * 2.0**r).sum(axis=0)
        c.integers("width", st[_WIDTH], 0)
        if not np.array_equal(width, st[_WIDTH]):
            c.fail("width", "the number of points in the buckets", st[_WIDTH],
                   width != st[_WIDTH])
        c.integers("tick", st[_TICK], 0, self.clock - 1)
        c.integers("n_drift", st[_NDRIFT], 0)
        c.finite("total", st[_TOTAL])
        c.not_nan("variance", st[_VARIANCE])
        c.finite("bucket totals", b[: rows * cap])
        c.not_nan("bucket variances", b[rows * cap : 2 * rows * cap])

    @property
    def width(self) -> FloatArray:
        """Number of points in the current window, per series."""
        return self._state[_WIDTH].copy()

    @property
    def total(self) -> FloatArray:
        """Sum of the points in the current window, per series."""
        return self._state[_TOTAL].copy()

    @property
    def variance(self) -> FloatArray:
        """Sum of squared deviations from the mean in the current window (river's ``variance``)."""
        return self._state[_VARIANCE].copy()

    @property
    def estimation(self) -> FloatArray:
        """Mean of the current window (``0`` when empty), per series."""
        w = self._state[_WIDTH]
        return np.where(w > 0, self._state[_TOTAL] / np.maximum(w, 1.0), 0.0)

    @property
    def n_detections(self) -> FloatArray:
        """Drifts detected so far (not cleared by the restart after a drift), per series."""
        return self._state[_NDRIFT].copy()
