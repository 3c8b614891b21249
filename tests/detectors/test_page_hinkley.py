from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from river import drift

from detectors.page_hinkley import PageHinkley

from .generic import (
    check_state_roundtrip,
    check_stream_equals_batch,
    check_streaming_contract,
    check_threshold_monotone,
    make_noisy_stream,
    stream,
)
from .naive import ref_page_hinkley


def river_drifts(x, **kw):
    det = drift.PageHinkley(**kw)
    out = []
    for i, v in enumerate(x):
        det.update(float(v))
        if det.drift_detected:
            out.append(i)
    return out


def shift_streams(seed, t=3000):
    rng = np.random.default_rng(seed)
    k = np.arange(t)
    abrupt = rng.normal(0.0, 1.0, t) + 3.0 * (k >= t // 3) - 5.0 * (k >= 2 * t // 3)
    gradual = rng.normal(0.0, 0.5, t) + np.clip((k - t / 2) / (t / 4), 0.0, 1.0) * 4.0
    bits = (rng.random(t) < np.where(k < t / 2, 0.2, 0.7)).astype(float) * 10.0
    walk = np.cumsum(rng.normal(0.0, 0.3, t))
    heavy = rng.standard_t(2.0, t) + 8.0 * (k >= t // 2)
    offset = 1e8 + rng.normal(0.0, 1.0, t) - 6.0 * (k >= t // 2)
    return [abrupt, gradual, bits, walk, heavy, offset]


RIVER_CONFIGS = [
    {},
    {"mode": "up"},
    {"mode": "down"},
    {"min_instances": 5, "delta": 0.05, "threshold": 10.0, "alpha": 0.99},
    {"min_instances": 100, "delta": 0.0, "threshold": 25.0, "alpha": 1.0, "mode": "up"},
    {"min_instances": 1, "delta": 0.5, "threshold": 3.0, "alpha": 0.9, "mode": "down"},
]


@pytest.mark.parametrize("cfg", RIVER_CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drift_indices_equal_river(cfg, seed):
    n_drifts = 0
    for x in shift_streams(seed):
        expected = river_drifts(x, **cfg)
        _, alarms = PageHinkley(**cfg).update_many(x)
        assert np.flatnonzero(alarms[:, 0]).tolist() == expected
        n_drifts += len(expected)
    assert n_drifts > 0


def test_river_docstring_example():
    import random

    rng = random.Random(12345)
    data = rng.choices([0, 1], k=1000) + rng.choices(range(4, 8), k=1000)
    _, a = PageHinkley().update_many(np.array(data, dtype=float))
    assert np.flatnonzero(a[:, 0]).tolist() == [1006]  # as printed in river's docstring


def test_bank_equals_independent_river_detectors():
    x = np.stack(shift_streams(4, t=2000), axis=1)
    cfg = {"threshold": 20.0, "min_instances": 10}
    s_bank, a_bank = PageHinkley(n_series=x.shape[1], **cfg).update_many(x)
    s_loop, a_loop = stream(PageHinkley(n_series=x.shape[1], **cfg), x)
    np.testing.assert_array_equal(s_bank, s_loop)
    np.testing.assert_array_equal(a_bank, a_loop)
    for j in range(x.shape[1]):
        assert np.flatnonzero(a_bank[:, j]).tolist() == river_drifts(x[:, j], **cfg)


CONFIGS = [
    {},
    {"threshold": 5.0, "min_instances": 3, "mode": "up"},
    {"threshold": 5.0, "delta": 0.1, "mode": "down", "alpha": 0.95},
    {"threshold": 8.0, "reset_on_drift": False},
    {"min_instances": 0, "threshold": 1.0, "alpha": 0.0},
]


#: N(0, 1) levels stepping up by 2.5 at t/2, an extra NaN on series 0
noisy_stream = partial(make_noisy_stream, t=500, log=False, sigma=1.0,
                       steps=(((1, 2), 2.5),), sets=(((1, 7), 0, np.nan),))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_every_prefix(cfg, seed):
    x = noisy_stream(seed)
    miss = np.zeros_like(x, dtype=bool)
    miss[::13, 2] = True
    s, a = stream(PageHinkley(n_series=3, **cfg), x, missing=miss)
    for i in range(3):
        rs, ra = ref_page_hinkley(x[:, i], miss=miss[:, i], **cfg)
        np.testing.assert_array_equal(s[:, i], rs)
        np.testing.assert_array_equal(a[:, i], ra)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_equals_batch_and_roundtrip(cfg):
    f = lambda n: PageHinkley(n_series=n, **cfg)  # noqa: E731
    x = noisy_stream(3)
    check_streaming_contract(f, x, splits=(1, 17, 250, 499))
    check_state_roundtrip(f, x, split=0, via_json=True)  # inf / -1 initial values survive JSON


def test_missing_and_nonfinite_never_enter_state():
    det = PageHinkley(min_instances=2)
    det.update_many(np.arange(10.0))
    before = det.state_dict()["state"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad)[0] and det.score[0] == np.inf
    assert not det.update(1.0, missing=[True])[0] and np.isnan(det.score[0])
    np.testing.assert_array_equal(det.state_dict()["state"], before)


def test_constant_streams_and_large_offset():
    for c in (0.0, 3.0, -1e8):
        s, a = PageHinkley().update_many(np.full(5000, c))
        assert not a.any() and (s[:29] == 0.0).all()
        assert s.max() < 1.0  # only the delta drift: 0.005 per step, bounded by forgetting
    rng = np.random.default_rng(0)
    y = 1e8 + rng.normal(0.0, 0.2, 3000)
    assert not PageHinkley().update_many(y)[1].any()
    y[2000:] += 5.0
    hits = np.flatnonzero(PageHinkley().update_many(y)[1][:, 0])
    assert hits.tolist() == river_drifts(y) and 2000 <= hits[0] < 2030


def test_warmup_score_zero_and_restart_after_drift():
    x = np.r_[np.zeros(100), np.full(100, 10.0)]
    s, a = PageHinkley(min_instances=30).update_many(x)
    assert (s[:29] == 0.0).all()
    first = int(np.flatnonzero(a[:, 0])[0])
    assert 100 <= first < 110
    assert (s[first + 1 : first + 30] == 0.0).all()  # warm-up again after the restart
    assert PageHinkley(min_instances=30).update_many(x[: first + 1])[0][first, 0] > 50.0


def test_golden_alarm_indices():
    rng = np.random.default_rng(12345)
    x = np.r_[rng.normal(0, 1, 2000), rng.normal(2, 1, 2000), rng.normal(-1, 2, 2000)]
    _, a = PageHinkley().update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == GOLDEN


GOLDEN = [1155, 2023, 3993, 4083, 4335, 4601, 5164, 5555, 5744]


def test_threshold_monotone_without_restart():
    x = noisy_stream(9, t=1500)
    check_threshold_monotone(
        lambda t: PageHinkley(n_series=3, threshold=t, reset_on_drift=False),
        x,
        thresholds=[0.5, 2, 5, 20, 50, 200],
    )


def test_set_threshold_matches_constructor():
    x = noisy_stream(2)
    det = PageHinkley(n_series=3)
    det.set_threshold(10.0)
    np.testing.assert_array_equal(
        det.update_many(x)[1], PageHinkley(n_series=3, threshold=10.0).update_many(x)[1]
    )


def test_zero_and_one_length():
    det = PageHinkley(n_series=2)
    s, a = det.update_many(np.zeros((0, 2)))
    assert s.shape == (0, 2) and a.shape == (0, 2)
    s, a = det.update_many(np.ones((1, 2)))
    assert s.shape == (1, 2) and not a.any()
    assert det.n_observations.tolist() == [1.0, 1.0] and det.mean.tolist() == [1.0, 1.0]


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=-1e6, max_value=1e6),
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
        ),
        min_size=1,
        max_size=80,
    ),
    st.integers(0, 80),
    st.sampled_from(["up", "down", "both"]),
)
def test_property_river_reference_stream_batch(values, split, mode):
    x = np.array(values)[:, None]
    cfg = {"min_instances": 3, "threshold": 5.0, "mode": mode}
    f = lambda n: PageHinkley(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, x)
    check_state_roundtrip(f, x, split=min(split, len(values)))
    s, a = f(1).update_many(x)
    rs, ra = ref_page_hinkley(x[:, 0], **cfg)
    np.testing.assert_array_equal(s[:, 0], rs)
    np.testing.assert_array_equal(a[:, 0], ra)
    finite = x[np.isfinite(x[:, 0]), 0]
    expected = np.flatnonzero(a[np.isfinite(x[:, 0]), 0]).tolist()
    assert river_drifts(finite, **cfg) == expected


@pytest.mark.parametrize("reset_on_drift", [True, False])
def test_overflowing_value_alarms_and_restarts(reset_on_drift):
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 0.1, 600)
    x[[100, 101, 300, 301]] = [1.7e308, -1.7e308, -1e308, 1e308]
    det = PageHinkley(reset_on_drift=reset_on_drift)
    with np.errstate(over="ignore", invalid="ignore"):
        s, a = det.update_many(x)
    fresh = PageHinkley()
    assert np.all(np.isfinite(det._state) | ~np.isfinite(fresh._state))
    over = np.flatnonzero(s[:, 0] == np.inf)
    assert over.size and a[over, 0].all() and over.max() < 310
    # after an overflow the series restarts: the rest is a fresh detector's output
    last = over.max() + 1
    s2, a2 = PageHinkley(reset_on_drift=reset_on_drift).update_many(x[last:])
    np.testing.assert_array_equal(s[last:], s2)
    np.testing.assert_array_equal(a[last:], a2)
