from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.cusum import CUSUM

from .generic import (
    check_state_roundtrip,
    check_stream_equals_batch,
    check_streaming_contract,
    check_threshold_monotone,
    make_noisy_stream,
    stream,
)
from .naive import ref_cusum


def test_welford_warmup_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, 40)
    det = CUSUM(warmup=40)
    det.update_many(x)
    assert abs(det.mean[0] - x.mean()) < 1e-12
    assert abs(det.state_dict()["state"][1, 0] - x.var(ddof=1)) < 1e-12


CONFIGS = [
    {},
    {"warmup": 20, "threshold": 4.0, "k": 0.25, "alpha": 0.05},
    {"warmup": 10, "direction": "up", "log_space": True, "reset_on_alarm": False},
    {
        "warmup": 10,
        "direction": "down",
        "alpha": 0.1,
        "reset_on_alarm": False,
        "freeze_on_alarm": True,
        "threshold": 3.0,
    },
    {"warmup": 2, "min_std": 0.0, "k": 0.0, "threshold": 2.0},
]


#: lognormal levels shifted by +0.4 (log) at t/2 and -0.6 at 4t/5, a negative value on series 0
noisy_stream = partial(make_noisy_stream, t=500, steps=(((1, 2), 0.4), ((4, 5), -0.6)),
                       sets=(((1, 7), 0, -1.0),))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_every_prefix(cfg, seed):
    x = noisy_stream(seed)
    miss = np.zeros_like(x, dtype=bool)
    miss[::9, 0] = True
    s, a = stream(CUSUM(n_series=3, **cfg), x, missing=miss)
    for i in range(3):
        rs, ra = ref_cusum(x[:, i], miss=miss[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], rs, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(a[:, i], ra)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_equals_batch_and_roundtrip(cfg):
    f = lambda n: CUSUM(n_series=n, **cfg)  # noqa: E731
    check_streaming_contract(f, noisy_stream(3), splits=(1, 17, 250, 499))


def test_missing_and_nonfinite_never_enter_state():
    det = CUSUM(warmup=5)
    det.update_many(np.arange(10.0))
    before = det.state_dict()["state"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad)[0] and det.score[0] == np.inf
    assert not det.update(1.0, missing=[True])[0] and np.isnan(det.score[0])
    np.testing.assert_array_equal(det.state_dict()["state"], before)


def test_constant_streams_and_large_offset():
    for c in (0.0, 3.0, -1e8, 0.1):
        s, a = CUSUM().update_many(np.full(3000, c))
        assert not a.any() and (s == 0.0).all()
    rng = np.random.default_rng(0)
    y = 1e8 + rng.normal(0.0, 1.0, 3000)
    assert not CUSUM(min_std=0.0, threshold=12.0).update_many(y)[1].any()
    y[2000:] += 3.0
    hits = np.flatnonzero(CUSUM(min_std=0.0, threshold=12.0).update_many(y)[1][:, 0])
    assert hits.size == 1 and 2000 <= hits[0] < 2015


def test_detects_both_directions_once_per_shift():
    rng = np.random.default_rng(3)
    x = np.r_[rng.normal(0, 1, 400), rng.normal(2, 1, 400), rng.normal(-1, 1, 400)]
    s, a = CUSUM().update_many(x)
    hits = np.flatnonzero(a[:, 0]).tolist()
    assert len(hits) == 2 and 400 <= hits[0] < 420 and 800 <= hits[1] < 820
    up = np.flatnonzero(CUSUM(direction="up").update_many(x)[1][:, 0]).tolist()
    down = np.flatnonzero(CUSUM(direction="down").update_many(x)[1][:, 0]).tolist()
    assert up == hits[:1]
    # the one-sided chart never restarted at the upward shift: its reference is still 0, so the
    # drop to -1 is a 1-sigma shift for it (2 after the restart of the two-sided chart): slower
    assert len(down) == 1 and hits[1] <= down[0] < 850


def test_golden_alarm_indices():
    rng = np.random.default_rng(12345)
    x = np.exp(np.r_[rng.normal(0, 0.05, 1500), rng.normal(0.1, 0.05, 1500)])
    _, a = CUSUM(log_space=True).update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == GOLDEN


GOLDEN = [1505]


def test_threshold_monotone():
    x = noisy_stream(9, t=1500)
    check_threshold_monotone(
        lambda t: CUSUM(n_series=3, threshold=t, reset_on_alarm=False, alpha=0.01),
        x,
        thresholds=[0.5, 1, 2, 4, 8, 16],
    )


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
    st.sampled_from([0.0, 0.1]),
)
def test_property_reference_stream_batch(values, split, alpha):
    x = np.array(values)[:, None]
    cfg = {"warmup": 3, "threshold": 3.0, "alpha": alpha}
    f = lambda n: CUSUM(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, x)
    check_state_roundtrip(f, x, split=min(split, len(values)))
    s, a = f(1).update_many(x)
    rs, ra = ref_cusum(x[:, 0], **cfg)
    np.testing.assert_allclose(s[:, 0], rs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("reset_on_alarm", [True, False])
def test_overflowing_value_alarms_and_restarts(reset_on_alarm):
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 0.1, 600)
    x[[100, 101, 300, 301]] = [1.7e308, -1.7e308, -1e308, 1e308]
    det = CUSUM(reset_on_alarm=reset_on_alarm)
    with np.errstate(over="ignore", invalid="ignore"):
        s, a = det.update_many(x)
    fresh = CUSUM()
    assert np.all(np.isfinite(det._state) | ~np.isfinite(fresh._state))
    over = np.flatnonzero(s[:, 0] == np.inf)
    assert over.size and a[over, 0].all() and over.max() < 310
    # after an overflow the series restarts: the rest is a fresh detector's output
    last = over.max() + 1
    s2, a2 = CUSUM(reset_on_alarm=reset_on_alarm).update_many(x[last:])
    np.testing.assert_array_equal(s[last:], s2)
    np.testing.assert_array_equal(a[last:], a2)


def test_value_beyond_the_range_of_z_restarts():
    # an ordinary value against an all-zero warm-up (std floored at 1e-300): z overflows
    det = CUSUM(warmup=5)
    s, a = det.update_many(np.r_[np.zeros(5), 1e10, np.zeros(10)])
    assert s[5, 0] == np.inf and a[5, 0] and np.isfinite(det._state).all()
    assert not a[6:, 0].any() and (s[6:11, 0] == 0.0).all()  # warm-up again
