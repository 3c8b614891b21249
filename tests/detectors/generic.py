"""Generic checks every BankDetector must pass (imported by the per-detector test modules)."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from detectors._base import BankDetector

Factory = Callable[[int], BankDetector]


def stream(det: BankDetector, *inputs: np.ndarray, missing: np.ndarray | None = None):
    """Loop of update(): returns (scores, alarms) of shape (T, n)."""
    t = inputs[0].shape[0]
    scores = np.empty((t, det.n_series))
    alarms = np.empty((t, det.n_series), dtype=bool)
    for k in range(t):
        m = None if missing is None else missing[k]
        alarms[k] = det.update(*(x[k] for x in inputs), missing=m)
        scores[k] = det.score
    return scores, alarms


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a, b)  # NaN == NaN here; bit-exact otherwise


def check_stream_equals_batch(factory: Factory, *inputs: np.ndarray, missing=None) -> None:
    n = inputs[0].shape[1]
    s1, a1 = stream(factory(n), *inputs, missing=missing)
    s2, a2 = factory(n).update_many(*inputs, missing=missing)
    assert_same(s1, s2)
    assert_same(a1, a2)


def check_state_roundtrip(factory: Factory, *inputs: np.ndarray, split: int, via_json=False):
    n = inputs[0].shape[1]
    full = factory(n)
    s_full, a_full = full.update_many(*inputs)
    first = factory(n)
    first.update_many(*(x[:split] for x in inputs))
    sd = first.state_dict()
    if via_json:
        sd = json.loads(
            json.dumps(sd, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else o)
        )
    second = factory(n)
    second.load_state_dict(sd)
    s2, a2 = second.update_many(*(x[split:] for x in inputs))
    assert_same(s_full[split:], s2)
    assert_same(a_full[split:], a2)


def check_split_batches(factory: Factory, *inputs: np.ndarray, splits=(1, 7, 50)) -> None:
    """update_many over chunks equals one update_many over everything."""
    n = inputs[0].shape[1]
    s_full, a_full = factory(n).update_many(*inputs)
    det = factory(n)
    parts_s, parts_a = [], []
    edges = [0, *[s for s in splits if s < inputs[0].shape[0]], inputs[0].shape[0]]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        s, a = det.update_many(*(x[lo:hi] for x in inputs))
        parts_s.append(s)
        parts_a.append(a)
    assert_same(s_full, np.concatenate(parts_s))
    assert_same(a_full, np.concatenate(parts_a))


def check_threshold_monotone(factory_thr: Callable[[float], BankDetector], *inputs, thresholds):
    """Without freeze_on_alarm, a lower threshold never yields fewer alarms."""
    counts = [int(factory_thr(t).update_many(*inputs)[1].sum()) for t in sorted(thresholds)]
    assert all(c1 >= c2 for c1, c2 in zip(counts[:-1], counts[1:], strict=True)), counts


def check_streaming_contract(
    factory: Factory, x: np.ndarray, splits: tuple[int, ...], json_split: int = 123
) -> None:
    """The checks every single-input detector shares: stream == batch (with every 7th value of
    series 1 missing), split batches, and state round trips at ``splits`` and via JSON."""
    miss = np.zeros_like(x, dtype=bool)
    miss[::7, 1] = True
    check_stream_equals_batch(factory, x, missing=miss)
    check_split_batches(factory, x)
    for split in splits:
        check_state_roundtrip(factory, x, split=split)
    check_state_roundtrip(factory, x, split=json_split, via_json=True)


#: a row of a stream of ``t`` rows, relative to ``t``: ``(num, den)`` is row ``num * t // den``,
#: ``(num, den, plus)`` is row ``num * t // den + plus``
Row = tuple[int, ...]


def _row(at: Row, t: int) -> int:
    return at[0] * t // at[1] + (at[2] if len(at) > 2 else 0)


def make_noisy_stream(seed: int, t: int = 400, n: int = 3, offset: float = 0.0, *,
                 log: bool = True, sigma: float = 0.1,
                 steps: tuple[tuple[Row, float], ...] = (),
                 spikes: tuple[tuple[Row, int, float, int], ...] = (),
                 sets: tuple[tuple[Row, int, float], ...] = ()) -> np.ndarray:
    """A ``(t, n)`` test stream (``n >= 3``) with level steps, spikes and non-finite values.

    Built in this order: ``z ~ N(0, sigma)`` (``default_rng(seed)``); each step ``(at, size)``
    adds ``size`` from row ``at`` on; ``x = exp(z) + offset`` (``log``) or ``z + offset``;
    each spike ``(at, col, factor, length)`` multiplies ``length`` rows from ``at`` of ``col``
    by ``factor``; then ``x[t//3, 1] = nan``, ``x[t//4, 2] = inf``, ``x[t//5, 2] = -inf``;
    finally each ``(at, col, value)`` of ``sets`` is written.

    >>> make_noisy_stream(0, t=12, sets=(((1, 6), 1, 0.0),))[[2, 3, 4], [1, 2, 1]]
    array([ 0., inf, nan])
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, sigma, (t, n))
    k = np.arange(t)[:, None]
    for at, size in steps:
        x = x + size * (k >= _row(at, t))
    x = (np.exp(x) if log else x) + offset
    for at, col, factor, length in spikes:
        r = _row(at, t)
        x[r : r + length, col] *= factor
    x[t // 3, 1] = np.nan
    x[t // 4, 2] = np.inf
    x[t // 5, 2] = -np.inf
    for at, col, value in sets:
        x[_row(at, t), col] = value
    return x
