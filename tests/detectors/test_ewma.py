from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from river import stats

from detectors import EWMAZScore

from .generic import (
    check_state_roundtrip,
    check_stream_equals_batch,
    check_streaming_contract,
    make_noisy_stream,
    stream,
)
from .naive import ref_ewma

#: lognormal levels and one x30 spike on series 0
noisy_stream = partial(make_noisy_stream, t=400, spikes=(((1, 2), 0, 30.0, 1),))


CONFIGS = [
    {},
    {
        "log_space": False,
        "alpha": 0.03,
        "warmup": 25,
        "threshold": 2.5,
        "clip": math.inf,
        "debias": False,
    },
    {"direction": "both", "freeze_on_alarm": True, "clip": 2.0},
    {"direction": "down", "min_std": 0.0},
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_every_prefix(cfg, seed):
    x = noisy_stream(seed)
    det = EWMAZScore(n_series=3, **cfg)
    s, a = stream(det, x)
    for i in range(3):
        rs, ra = ref_ewma(x[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], rs, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(a[:, i], ra)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_equals_batch_and_roundtrip(cfg):
    f = lambda n: EWMAZScore(n_series=n, **cfg)  # noqa: E731
    check_streaming_contract(f, noisy_stream(3), splits=(1, 17, 200, 399))


def test_missing_values_do_not_touch_state():
    x = noisy_stream(4)[:, :1]
    miss = np.zeros_like(x, dtype=bool)
    miss[50:60] = True
    s, a = EWMAZScore().update_many(x, missing=miss)
    assert np.isnan(s[50:60]).all() and not a[50:60].any()
    rs, ra = ref_ewma(x[:, 0], miss=miss[:, 0])
    np.testing.assert_allclose(s[:, 0], rs, rtol=1e-12)


@pytest.mark.parametrize("fading", [0.03, 0.3, 0.9])
def test_ew_mean_var_equal_river(fading):
    rng = np.random.default_rng(7)
    x = rng.normal(5.0, 2.0, 500)
    det = EWMAZScore(alpha=fading, log_space=False, debias=False, clip=math.inf, warmup=0)
    m, v = stats.EWMean(fading), stats.EWVar(fading)
    for xi in x:
        det.update(xi)
        m.update(xi)
        v.update(xi)
        assert abs(det.mean[0] - m.get()) <= 1e-9 * max(1.0, abs(m.get()))
        assert abs(det.std[0] ** 2 - v.get()) <= 1e-9 * max(1.0, abs(v.get()))


def test_constant_stream_and_large_offset_quiet():
    x = np.full((1000, 1), 3.0)
    assert not EWMAZScore().update_many(x)[1].any()
    rng = np.random.default_rng(0)
    y = 1e8 + rng.normal(0, 1.0, (1000, 1))
    assert not EWMAZScore(log_space=False, threshold=8, min_std=0.0).update_many(y)[1].any()
    y[600] += 100.0
    assert EWMAZScore(log_space=False, threshold=8, min_std=0.0).update_many(y)[1][600, 0]


def test_spike_is_scored_against_state_before_update():
    x = np.ones((100, 1))
    x[60] = 100.0
    s, a = EWMAZScore().update_many(x)
    assert a[60, 0] and np.flatnonzero(a[:, 0]).tolist() == [60]


def test_golden_alarm_indices():
    rng = np.random.default_rng(12345)
    x = np.exp(np.cumsum(rng.normal(0, 0.01, 3000)) + rng.normal(0, 0.05, 3000))
    x[[500, 1500, 2500]] *= [3.0, 10.0, 1.6]
    _, a = EWMAZScore().update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [500, 1500, 2500]


def test_grow_keeps_existing_series():
    x = noisy_stream(5)[:, :2]
    a = EWMAZScore(n_series=2)
    a.update_many(x[:100])
    a.grow(1)
    b = EWMAZScore(n_series=2)
    b.update_many(x[:100])
    x3 = np.concatenate([x[100:], np.ones((300, 1))], axis=1)
    sa, _ = a.update_many(x3)
    sb, _ = b.update_many(x[100:])
    np.testing.assert_array_equal(sa[:, :2], sb)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=1e-6, max_value=1e6),
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0]),
        ),
        min_size=1,
        max_size=80,
    ),
    st.integers(0, 80),
)
def test_property_stream_batch_reference(values, split):
    x = np.array(values)[:, None]
    f = lambda n: EWMAZScore(n_series=n, warmup=3)  # noqa: E731
    check_stream_equals_batch(f, x)
    check_state_roundtrip(f, x, split=min(split, len(values)))
    s, _ = f(1).update_many(x)
    rs, _ = ref_ewma(x[:, 0], warmup=3)
    np.testing.assert_allclose(s[:, 0], rs, rtol=1e-12, atol=1e-12)
    det = f(1)
    det.update_many(x)
    assert np.isfinite(det.state_dict()["state"]).all()
