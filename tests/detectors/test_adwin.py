from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from river import drift

from detectors.adwin import ADWIN

from .generic import (
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
    check_threshold_monotone,
    make_noisy_stream,
    stream,
)
from .naive import ref_adwin

# with NUMBA_DISABLE_JIT=1 the kernel runs on NumPy scalars, which warn where Numba is silent
pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
)



def river_drifts(x, **kw):
    """Drift indices of river's ADWIN (stops where river's Rust code panics)."""
    det = drift.ADWIN(**kw)
    out = []
    for i, v in enumerate(x):
        try:
            det.update(float(v))
        except BaseException:  # pyo3 PanicException (max_buckets=1 corner case)
            return out, i
        if det.drift_detected:
            out.append(i)
    return out, len(x)


def shift_streams(seed, t=3000):
    rng = np.random.default_rng(seed)
    k = np.arange(t)
    abrupt = rng.normal(0.0, 1.0, t) + 1.5 * (k >= t // 3) - 2.0 * (k >= 2 * t // 3)
    gradual = rng.normal(0.0, 0.5, t) + np.clip((k - t / 2) / (t / 4), 0.0, 1.0) * 2.0
    bits = (rng.random(t) < np.where(k < t / 2, 0.2, 0.6)).astype(float)
    walk = np.cumsum(rng.normal(0.0, 0.05, t))
    heavy = rng.standard_t(2.0, t) + 5.0 * (k >= t // 2)
    offset = 1e8 + rng.normal(0.0, 1.0, t) + 4.0 * (k >= t // 2)
    return [abrupt, gradual, bits, walk, heavy, offset]


RIVER_CONFIGS = [
    {},
    {"clock": 1},
    {"delta": 0.1, "clock": 4, "max_buckets": 2, "min_window_length": 1, "grace_period": 0},
    {"delta": 1e-5, "clock": 7, "max_buckets": 3},
    {"delta": 0.01, "clock": 16, "max_buckets": 8, "min_window_length": 20,
     "grace_period": 100},
    {"max_buckets": 1, "clock": 4, "delta": 0.05},
]


@pytest.mark.parametrize("cfg", RIVER_CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drift_indices_equal_river(cfg, seed):
    n_drifts = 0
    for x in shift_streams(seed):
        expected, upto = river_drifts(x, **cfg)
        _, alarms = ADWIN(**cfg).update_many(x[:upto])
        assert np.flatnonzero(alarms[:, 0]).tolist() == expected
        n_drifts += len(expected)
    if cfg.get("max_buckets", 5) > 1:
        assert n_drifts > 0  # the streams do exercise the detection path


def test_window_statistics_equal_river():
    x = shift_streams(3)[0]
    ours, theirs = ADWIN(clock=1), drift.ADWIN(clock=1)
    for v in x:
        ours.update(v)
        theirs.update(v)
        if not theirs.drift_detected:  # river restarts lazily, on the next update
            assert ours.width[0] == theirs.width
            assert ours.total[0] == theirs.total
            assert ours.variance[0] == theirs.variance
            assert ours.estimation[0] == theirs.estimation


def test_bank_equals_independent_river_detectors():
    xs = shift_streams(4, t=2000)
    x = np.stack(xs, axis=1)
    cfg = {"clock": 8, "delta": 0.01}
    s_bank, a_bank = ADWIN(n_series=x.shape[1], **cfg).update_many(x)
    s_loop, a_loop = stream(ADWIN(n_series=x.shape[1], **cfg), x)
    np.testing.assert_array_equal(s_bank, s_loop)
    np.testing.assert_array_equal(a_bank, a_loop)
    for j in range(x.shape[1]):
        assert np.flatnonzero(a_bank[:, j]).tolist() == river_drifts(x[:, j], **cfg)[0]


CONFIGS = [
    {},
    {"clock": 1, "delta": 0.05, "min_window_length": 2, "grace_period": 0},
    {"clock": 3, "max_buckets": 2, "reset_on_drift": False},
    {"clock": 1, "max_buckets": 3, "max_rows": 4, "delta": 0.2},  # capacity guard in use
    {"clock": 5, "max_buckets": 1, "delta": 0.05},
]


#: N(0, 1) levels stepping up by 2 at t/2, an extra NaN on series 0
noisy_stream = partial(make_noisy_stream, t=600, log=False, sigma=1.0,
                       steps=(((1, 2), 2.0),), sets=(((1, 7), 0, np.nan),))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_reference_on_every_prefix(cfg):
    x = noisy_stream(0)
    miss = np.zeros_like(x, dtype=bool)
    miss[::11, 1] = True
    s, a = stream(ADWIN(n_series=3, **cfg), x, missing=miss)
    n_alarms = 0
    for i in range(3):
        rs, ra = ref_adwin(x[:, i], miss=miss[:, i], **cfg)
        np.testing.assert_array_equal(s[:, i], rs)  # bit-exact, including the score
        np.testing.assert_array_equal(a[:, i], ra)
        n_alarms += int(((rs > 0) & np.isfinite(rs)).sum())
    assert n_alarms > 0


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_equals_batch_and_roundtrip(cfg):
    x = noisy_stream(3)
    miss = np.zeros_like(x, dtype=bool)
    miss[::7, 1] = True
    f = lambda n: ADWIN(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, x, missing=miss)
    check_split_batches(f, x, splits=(1, 7, 50, 63, 64, 200))
    for split in (1, 17, 300, 599):
        check_state_roundtrip(f, x, split=split)
    check_state_roundtrip(f, x, split=301, via_json=True)


def test_long_batch_and_streaming_paths_agree():
    # batches >= 64 steps run on a contiguous copy of the buffer, shorter ones in place
    x = np.random.default_rng(5).normal(0.0, 1.0, (1000, 2)) + np.r_[0:1000][:, None] / 300.0
    f = lambda n: ADWIN(n_series=n, clock=4)  # noqa: E731
    check_split_batches(f, x, splits=(63, 64, 65, 500, 563))


def test_missing_and_nonfinite_never_enter_state():
    det = ADWIN(clock=1)
    det.update_many(np.arange(40.0) % 3)
    before = det.state_dict()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad)[0] and det.score[0] == np.inf
    assert not det.update(5.0, missing=[True])[0] and np.isnan(det.score[0])
    after = det.state_dict()
    np.testing.assert_array_equal(after["state"], before["state"])
    np.testing.assert_array_equal(after["buf"], before["buf"])


def test_constant_streams_and_large_offset_quiet():
    for c in (0.0, 3.0, -1e8, 1e-300):
        s, a = ADWIN(clock=1).update_many(np.full(2000, c))
        assert not a.any() and (s == 0.0).all()
    rng = np.random.default_rng(0)
    y = 1e8 + rng.normal(0.0, 1.0, 3000)
    assert not ADWIN().update_many(y)[1].any()
    y[1500:] += 3.0
    hits = np.flatnonzero(ADWIN().update_many(y)[1][:, 0])
    assert hits.size and 1500 <= hits[0] < 1700
    assert hits.tolist() == river_drifts(y)[0]


def test_score_is_margin_of_strongest_cut():
    rng = np.random.default_rng(1)
    x = np.r_[rng.normal(0, 1, 500), rng.normal(3, 1, 500)]
    s, a = ADWIN().update_many(x)
    assert (s >= 0).all()
    np.testing.assert_array_equal(a[:, 0], s[:, 0] > 0)
    off_clock = (np.arange(1000) + 1) % 32 != 0
    assert (s[off_clock, 0] == 0).all()


def test_golden_alarm_indices():
    rng = np.random.default_rng(12345)
    x = np.r_[rng.normal(0, 1, 2000), rng.normal(0.8, 1, 2000), rng.normal(-0.5, 2, 2000)]
    _, a = ADWIN().update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == GOLDEN


GOLDEN = [2079, 4031]


def test_threshold_monotone():
    x = noisy_stream(9, t=1500)
    check_threshold_monotone(
        lambda t: ADWIN(n_series=3, threshold=t, clock=4), x, thresholds=[0, 0.05, 0.2, 1, 5]
    )


def test_zero_and_one_length():
    det = ADWIN(n_series=2)
    s, a = det.update_many(np.zeros((0, 2)))
    assert s.shape == (0, 2) and a.shape == (0, 2)
    s, a = det.update_many(np.ones((1, 2)))
    assert s.shape == (1, 2) and not a.any()
    assert det.width.tolist() == [1.0, 1.0]


def test_reset_and_grow():
    x = noisy_stream(5)[:, :2]
    det = ADWIN(n_series=2, clock=4)
    s1, _ = det.update_many(x)
    det.reset()
    s2, _ = det.update_many(x)
    np.testing.assert_array_equal(s1, s2)
    a = ADWIN(n_series=2, clock=4)
    a.update_many(x[:100])
    a.grow(1)
    b = ADWIN(n_series=2, clock=4)
    b.update_many(x[:100])
    x3 = np.concatenate([x[100:], np.ones((500, 1))], axis=1)
    np.testing.assert_array_equal(a.update_many(x3)[0][:, :2], b.update_many(x[100:])[0])


def test_bad_inputs_and_threshold():
    det = ADWIN(n_series=3)
    with pytest.raises(ValueError, match=r"shape \(2,\); expected \(3,\)"):
        det.update(np.ones(2))
    with pytest.raises(ValueError, match="must be numeric"):
        det.update(["a", "b", "c"])
    with pytest.raises(ValueError, match=r"expected \(steps, 3\)"):
        det.update_many(np.ones((5, 2)))
    with pytest.raises(ValueError, match="'threshold'"):
        det.set_threshold(-1.0)
    det.set_threshold(0.5)
    assert det.params[0] == 0.5


@settings(deadline=None, max_examples=50)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=-1e6, max_value=1e6),
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0]),
        ),
        min_size=1,
        max_size=120,
    ),
    st.integers(0, 120),
    st.sampled_from([1, 2, 3, 5]),
)
def test_property_reference_stream_batch(values, split, max_buckets):
    x = np.array(values)[:, None]
    cfg = {"clock": 1, "delta": 0.2, "min_window_length": 1, "grace_period": 0,
           "max_buckets": max_buckets}
    f = lambda n: ADWIN(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, x)
    check_state_roundtrip(f, x, split=min(split, len(values)))
    s, a = f(1).update_many(x)
    rs, ra = ref_adwin(x[:, 0], **cfg)
    np.testing.assert_array_equal(s[:, 0], rs)
    np.testing.assert_array_equal(a[:, 0], ra)


@pytest.mark.parametrize("reset_on_drift", [True, False])
def test_overflowing_value_alarms_and_restarts(reset_on_drift):
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 0.1, 600)
    x[[100, 101, 300, 301]] = [1.7e308, -1.7e308, -1e308, 1e308]
    det = ADWIN(reset_on_drift=reset_on_drift)
    with np.errstate(over="ignore", invalid="ignore"):
        s, a = det.update_many(x)
    fresh = ADWIN()
    assert np.all(np.isfinite(det._state) | ~np.isfinite(fresh._state))
    over = np.flatnonzero(s[:, 0] == np.inf)
    assert over.size and a[over, 0].all() and over.max() < 310
    # after an overflow the series restarts: the rest is a fresh detector's output
    last = over.max() + 1
    s2, a2 = ADWIN(reset_on_drift=reset_on_drift).update_many(x[last:])
    np.testing.assert_array_equal(s[last:], s2)
    np.testing.assert_array_equal(a[last:], a2)



def test_huge_steady_stream_saturates_quietly():
    # river's variance becomes inf from rounding noise here; ours saturates, no alarm
    det = ADWIN()
    s, a = det.update_many(np.full(2000, 1e300))
    assert not a.any() and np.isfinite(det._state).all() and np.isfinite(det._buf).all()
    assert (det.width == 2000).all()
    s, a = det.update_many(np.ones(5))  # back to ordinary values: alarm and restart
    assert a[0, 0] and s[0, 0] == np.inf and det.width[0] == 4.0
