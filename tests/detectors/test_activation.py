from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.activation import ActivationShift, HistogramDrift

from . import realruns
from .generic import (
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
    check_threshold_monotone,
    stream,
)
from .naive import ref_hist, ref_shift

SIG = math.sqrt(math.pi / 2)

# ----------------------------------------------------------------------------- references



# ----------------------------------------------------------------------------- streams


def act_stream(seed, t=300, layers=3):
    rng = np.random.default_rng(seed)
    mean = rng.normal(0.0, 0.05, (t, layers)) + 0.2
    std = np.exp(np.cumsum(rng.normal(0, 0.005, (t, layers)), 0) + rng.normal(0, 0.03, (t, layers)))
    absmax = 5 * std * np.exp(rng.normal(0, 0.1, (t, layers)))
    kurt = 3 * np.exp(rng.normal(0, 0.05, (t, layers)))
    std[200:, 0] *= 8.0
    absmax[200:, 0] *= 8.0
    mean[150, 1] = np.nan
    kurt[121, 2] = np.inf
    absmax[90, 1] = -np.inf
    return [mean, std, absmax, kurt]


def act_missing(t=300, layers=3):
    m = np.zeros((t, 4, layers), dtype=bool)
    m[::5, 3, :] = True  # kurtosis logged every 5th step only
    m[40:45, :, 2] = True  # layer 2 absent for 5 steps
    m[::11, 0, 1] = True
    return m


SHIFT_CFGS = [
    {},
    {"aggregate": "max", "clip": math.inf, "warmup": 5, "alpha": 0.1},
    {"freeze_on_alarm": True, "min_scale": 0.0, "threshold": 3.0},
    {"n_features": 2, "log_space": True},
]


def _shift_inputs(cfg, feats):
    k = cfg.get("n_features", 4)
    return feats[1:1 + k] if k == 2 else feats


@pytest.mark.parametrize("cfg", SHIFT_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_shift_matches_reference_on_every_prefix(cfg, seed):
    feats = _shift_inputs(cfg, act_stream(seed))
    k = len(feats)
    miss = act_missing()[:, :k]
    s, _ = stream(ActivationShift(n_series=3, **cfg), *feats, missing=miss)
    kw = {key: v for key, v in cfg.items() if key != "n_features"}
    for i in range(3):
        f = np.stack([x[:, i] for x in feats], 1)
        r = ref_shift(f, miss[:, :, i], **kw)
        np.testing.assert_allclose(s[:, i], r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", SHIFT_CFGS)
def test_shift_stream_batch_roundtrip(cfg):
    feats = _shift_inputs(cfg, act_stream(3))
    miss = act_missing()[:, : len(feats)]
    f = lambda n: ActivationShift(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, *feats, missing=miss)
    check_split_batches(f, *feats)
    for split in (1, 31, 150, 299):
        check_state_roundtrip(f, *feats, split=split)
    check_state_roundtrip(f, *feats, split=201, via_json=True)


def test_shift_golden_missing_and_nonfinite():
    feats = act_stream(7)
    miss = act_missing()
    s, a = ActivationShift(n_series=3).update_many(*feats, missing=miss)
    fin = np.isfinite(s)
    assert np.flatnonzero(a[:, 0] & fin[:, 0])[0] == 200  # scale x8 on layer 0
    assert not (a[:, 1:] & fin[:, 1:]).any()
    assert np.isnan(s[40:45, 2]).all() and not a[40:45, 2].any()  # all features missing
    assert s[150, 1] == np.inf and s[121, 2] == np.inf and s[90, 1] == np.inf
    # non-finite steps do not enter the state: same scores afterwards as with them missing
    miss2 = miss.copy()
    miss2[150, :, 1] = miss2[90, :, 1] = miss2[121, :, 2] = True
    s2, _ = ActivationShift(n_series=3).update_many(*feats, missing=miss2)
    np.testing.assert_array_equal(s[151:], s2[151:])


def test_shift_constant_and_offset():
    c = [np.full((200, 2), v) for v in (0.1, 1.0, 5.0, 3.0)]
    s, a = ActivationShift(n_series=2).update_many(*c)
    assert not a.any() and (s == 0).all()
    rng = np.random.default_rng(0)
    x = 1e8 + rng.normal(0, 1.0, (400, 1))
    det = lambda: ActivationShift(n_features=1, log_space=False, min_scale=0.0)  # noqa: E731
    assert not det().update_many(x)[1].any()
    x[300] += 50.0
    assert np.flatnonzero(det().update_many(x)[1][:, 0]).tolist() == [300]


def test_shift_threshold_monotone():
    feats = act_stream(9)
    check_threshold_monotone(lambda t: ActivationShift(n_series=3, threshold=t), *feats,
                             thresholds=[0.5, 1, 2, 4, 6, 20])


# ----------------------------------------------------------------------------- HistogramDrift


def drift_stream(seed, t=400, n=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (t, n))
    x[250:, 0] += np.linspace(0, 3, t - 250)
    x[:, 2] = np.round(x[:, 2])  # ties
    x[100, 1] = np.nan
    x[200, 2] = np.inf
    return x


HIST_CFGS = [
    {"window": 50},
    {"window": 40, "n_bins": 5, "warmup": 10, "stride": 3, "refresh": 60},
    {"window": 30, "freeze_on_alarm": True, "threshold": 0.3, "smoothing": 1.0},
]


@pytest.mark.parametrize("cfg", HIST_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_hist_matches_reference_on_every_prefix(cfg, seed):
    x = drift_stream(seed)
    s, _ = stream(HistogramDrift(n_series=3, **cfg), x)
    for i in range(3):
        np.testing.assert_allclose(s[:, i], ref_hist(x[:, i], **cfg), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cfg", HIST_CFGS)
def test_hist_stream_batch_roundtrip(cfg):
    x = drift_stream(3)
    miss = np.zeros_like(x, dtype=bool)
    miss[::6, 1] = True
    f = lambda n: HistogramDrift(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, x, missing=miss)
    check_split_batches(f, x)
    for split in (1, 49, 120, 399):
        check_state_roundtrip(f, x, split=split)
    check_state_roundtrip(f, x, split=233, via_json=True)
    s, _ = f(3).update_many(x, missing=miss)
    np.testing.assert_allclose(s[:, 1], ref_hist(x[:, 1], miss[:, 1], **cfg), rtol=1e-10)


def test_hist_golden_slow_drift_and_invariance():
    x = drift_stream(5, t=1200)
    s, a = HistogramDrift(n_series=3).update_many(x)
    fin = np.isfinite(s)
    hits = np.flatnonzero(a[:, 0] & fin[:, 0])
    assert 400 < hits[0] < 700  # 3 sigma over 950 steps: the window passes PSI 1 part way
    assert not (a[:, 1:] & fin[:, 1:]).any()
    s2, _ = HistogramDrift(n_series=3).update_many(1e8 + 1e3 * x)  # rank based
    np.testing.assert_allclose(s2[:, :2], s[:, :2], atol=1e-9)


def test_hist_constant_stream_and_level_change():
    x = np.full((600, 1), 2.5)
    s, a = HistogramDrift(window=100).update_many(x)
    assert not a.any() and (s == 0).all()
    x[450:] = 3.0
    s, a = HistogramDrift(window=100).update_many(x)
    assert not a[:450].any() and a[500:].all()


def test_hist_threshold_monotone():
    check_threshold_monotone(lambda t: HistogramDrift(n_series=3, window=50, threshold=t),
                             drift_stream(8), thresholds=[0.01, 0.1, 0.5, 1, 3])


# ----------------------------------------------------------------------------- validation


def test_bad_inputs_and_short_input():
    det = ActivationShift(n_series=2)
    assert det.n_inputs == 4 and ActivationShift.n_inputs == 1
    with pytest.raises(ValueError, match=r"takes 4 input\(s\)"):
        det.update(np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match=r"input 'x1' has shape \(3,\); expected \(2,\)"):
        det.update(np.ones(2), np.ones(3), np.ones(2), np.ones(2))
    s, a = det.update_many(*[np.zeros((0, 2))] * 4)
    assert s.shape == (0, 2) and a.shape == (0, 2)
    s, _ = det.update_many(*[np.ones((1, 2))] * 4)
    assert s.tolist() == [[0.0, 0.0]]
    h = HistogramDrift(n_series=2)
    assert h.update_many(np.zeros((0, 2)))[0].shape == (0, 2)
    with pytest.raises(ValueError, match=r"expected \(steps, 2\)"):
        h.update_many(np.ones((3, 4)))


def test_grow_keeps_existing_layers():
    feats = act_stream(2)
    a = ActivationShift(n_series=3)
    a.update_many(*(f[:100] for f in feats))
    a.grow(1)
    assert a.n_series == 4 and a.location.shape == (4, 4)
    h = HistogramDrift(n_series=1, window=20)
    h.update_many(feats[1][:50, :1])
    h.grow(2)
    s, _ = h.update_many(feats[1][50:, :3])
    ref = HistogramDrift(n_series=1, window=20)
    ref.update_many(feats[1][:50, :1])
    s_ref, _ = ref.update_many(feats[1][50:, :1])
    np.testing.assert_array_equal(s[:, 0], s_ref[:, 0])


@settings(deadline=None, max_examples=40)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.floats(-1e3, 1e3), st.sampled_from([math.nan, math.inf, -math.inf])),
            st.one_of(st.floats(1e-3, 1e3), st.sampled_from([0.0, math.nan])),
            st.booleans(),
        ),
        min_size=1,
        max_size=70,
    ),
    st.integers(0, 70),
)
def test_property_stream_batch_reference(rows, split):
    m = np.array([r[0] for r in rows])[:, None]
    sd = np.array([r[1] for r in rows])[:, None]
    miss = np.zeros((len(rows), 2, 1), dtype=bool)
    miss[:, 0, 0] = [r[2] for r in rows]
    split = min(split, len(rows))
    f = lambda n: ActivationShift(n_series=n, n_features=2, log_space=(False, True),  # noqa: E731
                                  warmup=3)
    check_stream_equals_batch(f, m, sd, missing=miss)
    check_state_roundtrip(f, m, sd, split=split)
    s, _ = f(1).update_many(m, sd, missing=miss)
    r = ref_shift(np.concatenate([m, sd], 1), miss[:, :, 0], log_space=(False, True), warmup=3)
    np.testing.assert_allclose(s[:, 0], r, rtol=1e-10, atol=1e-12)
    g = lambda n: HistogramDrift(n_series=n, window=8, n_bins=4, stride=2, refresh=5)  # noqa: E731
    check_stream_equals_batch(g, m)
    check_state_roundtrip(g, m, split=split)
    s, _ = g(1).update_many(m)
    np.testing.assert_allclose(s[:, 0], ref_hist(m[:, 0], window=8, n_bins=4, stride=2,
                                                 refresh=5), rtol=1e-10, atol=1e-12)
    for det, inputs in ((f(1), (m, sd)), (g(1), (m,))):
        det.update_many(*inputs)
        assert np.isfinite(det.state_dict()["state"]).all()


# ----------------------------------------------------------------------------- real runs

FEATURES = ("mean", "std", "absmax", "kurtosis")


def _act(run_id):
    cols, names = realruns.columns(run_id, prefix="act_")
    layers = sorted({c.split("/", 1)[1] for c in names if c.startswith("act_mean/")})
    feats = [np.stack([cols[f"act_{f}/{lay}"][0] for lay in layers], 1) for f in FEATURES]
    miss = np.stack(
        [np.stack([cols[f"act_{f}/{lay}"][1] for lay in layers], 1) for f in FEATURES], 1
    )
    return feats, miss


def test_real_input_scale_shift_alarms_after_onset_and_clean_runs_mostly_quiet():
    shifted = realruns.runs_of("input_scale_shift")
    clean = realruns.runs_of("clean")
    assert shifted and clean
    for r in shifted:
        feats, miss = _act(r["run_id"])
        s, a = ActivationShift(n_series=feats[0].shape[1]).update_many(*feats, missing=miss)
        on = r["onset_step"]
        assert a[on:on + 5].any(), r["run_id"]
        assert a[:on].any(1).sum() <= 3, r["run_id"]  # a stray pre-onset alarm at most
    pre = 0
    for r in clean:
        feats, miss = _act(r["run_id"])
        _, a = ActivationShift(n_series=feats[0].shape[1]).update_many(*feats, missing=miss)
        pre += int(a.any(1).sum())
    assert pre <= 2 * len(clean)  # a handful of alarm steps over ~16k clean steps
