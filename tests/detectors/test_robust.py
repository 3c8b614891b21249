from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.robust import (
    COUNT_UP_TO,
    RobustZScore,
    sorted_mad,
    sorted_median,
    sorted_push,
)

from .generic import (
    check_state_roundtrip,
    check_stream_equals_batch,
    check_streaming_contract,
    check_threshold_monotone,
    make_noisy_stream,
    stream,
)
from .naive import ref_robust
from .spike_realdata import bloom_with_history, public_runs

#: lognormal levels, x30 and x5 spikes on series 0, a near-zero value on series 1
noisy_stream = partial(make_noisy_stream, t=400,
                       spikes=(((1, 2), 0, 30.0, 1), ((1, 2, 3), 0, 5.0, 1)),
                       sets=(((1, 6), 1, 0.02),))


CONFIGS = [
    {},
    {"window": 128, "robust": False, "threshold": 6.0, "log_space": False},
    {"window": 16, "warmup": 1, "direction": "both", "freeze_on_alarm": True, "threshold": 4.0},
    {"window": 33, "direction": "down", "min_std": 0.0, "threshold": 3.0},
    {"window": 1, "robust": False, "log_space": False},
    {"window": 50, "warmup": 50, "robust": True, "log_space": False, "freeze_on_alarm": True},
    {"window": 32, "tail_max": 3.0, "threshold": 4.0},
    {"window": 24, "tail_max": 2.0, "tail_q": 0.99, "tail_rate": 0.5, "direction": "both",
     "freeze_on_alarm": True, "threshold": 3.0, "tail_gap": 7},
    {"window": 32, "tail_max": 3.0, "threshold": 4.0, "tail_gap": 20},
]


def test_sorted_window_median_and_mad_equal_numpy():
    # exact equality with numpy on streams with ties, trends and rotations of sorted data
    rng = np.random.default_rng(0)
    streams = [
        rng.normal(size=300),
        np.sort(rng.normal(size=300)),
        np.sort(rng.normal(size=300))[::-1].copy(),
        rng.integers(0, 3, 300).astype(float),
    ]
    for window in (1, 2, 3, 8, 33):
        for x in streams:
            det = RobustZScore(window=window, warmup=1, log_space=False, threshold=np.inf)
            for k, v in enumerate(x):
                det.update(v)
                win = x[max(0, k + 1 - window) : k + 1]
                buf = det.state_dict()["buf"][:, 0]
                sorted_part = buf[window : window + len(win)]
                np.testing.assert_array_equal(sorted_part, np.sort(win))


def test_sorted_push_counting_and_search_paths_agree():
    # full windows up to COUNT_UP_TO find the push positions by counting, longer ones by
    # binary search: both keep the window sorted, with ties and repeated values
    rng = np.random.default_rng(1)
    for window in (4, 37, COUNT_UP_TO, COUNT_UP_TO + 1):
        x = rng.integers(0, 5, window + 300).astype(float)
        x[::7] = rng.normal(size=x[::7].size)
        ring = np.zeros(window)
        col = np.zeros(window)
        for k, v in enumerate(x):
            count = min(k, window)
            sorted_push(col, count, window, ring[k % window], v)
            ring[k % window] = v
            np.testing.assert_array_equal(col[: count + 1 if count < window else window],
                                          np.sort(x[max(0, k + 1 - window) : k + 1]))


def test_sorted_mad_equals_numpy_with_ties_and_overflow():
    # the first value >= the median is looked up next to the middle unless values tie with
    # it (or the middle pair's mean overflows): every case equals numpy bit for bit
    rng = np.random.default_rng(2)
    for n in range(1, 40):
        for v in (rng.normal(size=n), rng.integers(0, 3, n).astype(float), np.full(n, 1.5),
                  rng.choice([1.7e308, -1.7e308, 1e308, 0.0], n)):
            v = np.sort(v)
            with np.errstate(over="ignore", invalid="ignore"):
                m = sorted_median(v, n)
                want = np.median(np.abs(v - m))
            got = sorted_mad(v, n, m)
            assert got == want or (np.isnan(got) and np.isnan(want)), (v, got, want)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_every_prefix(cfg, seed):
    x = noisy_stream(seed)
    det = RobustZScore(n_series=3, **cfg)
    s, a = stream(det, x)
    for i in range(3):
        rs, ra = ref_robust(x[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], rs, rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(a[:, i], ra)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_equals_batch_and_roundtrip(cfg):
    f = lambda n: RobustZScore(n_series=n, **cfg)  # noqa: E731
    check_streaming_contract(f, noisy_stream(3), splits=(1, 17, 200, 399))


def test_missing_values_do_not_touch_state():
    x = noisy_stream(4)[:, :1]
    miss = np.zeros_like(x, dtype=bool)
    miss[50:60] = True
    miss[200] = True
    s, a = RobustZScore(window=32).update_many(x, missing=miss)
    assert np.isnan(s[50:60]).all() and not a[50:60].any()
    rs, ra = ref_robust(x[:, 0], miss=miss[:, 0], window=32)
    np.testing.assert_allclose(s[:, 0], rs, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(a[:, 0], ra)


@pytest.mark.parametrize("robust", [True, False])
def test_nonfinite_alarms_and_never_enters_state(robust):
    det = RobustZScore(window=8, warmup=3, robust=robust)
    for v in [1.0, 1.1, 0.9, 1.0]:
        det.update(v)
    before = det.state_dict()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad)[0]
        assert det.score[0] == np.inf
    after = det.state_dict()
    np.testing.assert_array_equal(after["state"], before["state"])
    np.testing.assert_array_equal(after["buf"], before["buf"])
    assert det.count.tolist() == [4.0]


@pytest.mark.parametrize("pos", [0, 5, 40, 299])
def test_nonfinite_at_several_positions(pos):
    rng = np.random.default_rng(pos)
    clean = np.exp(rng.normal(0, 0.05, 300))
    for bad in (np.nan, np.inf, -np.inf):
        x = clean.copy()
        x[pos] = bad
        s, a = RobustZScore(window=64).update_many(x)
        s0, a0 = RobustZScore(window=64).update_many(np.delete(clean, pos))
        assert a[pos, 0] and s[pos, 0] == np.inf
        # removing the bad value gives the same scores on every other step
        np.testing.assert_array_equal(np.delete(s[:, 0], pos), s0[:, 0])


@pytest.mark.parametrize("robust", [True, False])
@pytest.mark.parametrize("log_space", [True, False])
def test_constant_stream_and_large_offset_quiet(robust, log_space):
    x = np.full((1000, 1), 3.0)
    det = RobustZScore(robust=robust, log_space=log_space)
    s, a = det.update_many(x)
    assert not a.any() and np.abs(s).max() < 1e-9
    rng = np.random.default_rng(0)
    y = 1e8 + rng.normal(0, 1.0, (1000, 1))
    kw = {"robust": robust, "log_space": False, "min_std": 0.0, "threshold": 8.0}
    assert not RobustZScore(**kw).update_many(y)[1].any()
    y[600] += 100.0
    _, a = RobustZScore(**kw).update_many(y)
    assert np.flatnonzero(a[:, 0]).tolist() == [600]


def test_spike_is_scored_against_window_before_update():
    x = np.ones((100, 1))
    x[60] = 100.0
    s, a = RobustZScore(window=16).update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [60]
    assert s[60, 0] == pytest.approx(math.log(100.0) / 0.01)


def test_robust_window_is_not_masked_by_a_previous_spike():
    rng = np.random.default_rng(1)
    x = np.exp(rng.normal(0.0, 0.05, 400))
    x[200], x[220] = 100.0, 8.0
    _, a_rob = RobustZScore().update_many(x)
    _, a_std = RobustZScore(robust=False, threshold=6.0, log_space=False).update_many(x)
    assert np.flatnonzero(a_rob[:, 0]).tolist() == [200, 220]
    assert np.flatnonzero(a_std[:, 0]).tolist() == [200]


def test_golden_alarm_indices():
    rng = np.random.default_rng(12345)
    x = np.exp(np.cumsum(rng.normal(0, 0.01, 3000)) + rng.normal(0, 0.05, 3000))
    x[[500, 1500, 2500]] *= [3.0, 10.0, 1.8]
    _, a = RobustZScore().update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [500, 1500, 2500]
    _, a = RobustZScore(window=128, robust=False, threshold=6.0, log_space=False).update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [500, 1500, 2500]


def test_golden_alarm_indices_heavy_tailed():
    rng = np.random.default_rng(2024)
    x = np.exp(0.05 * rng.standard_t(3, 3000))
    x[[700, 1700, 1710]] *= [4.0, 20.0, 3.0]
    _, a = RobustZScore().update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [36, 700, 1700, 1710, 1747, 2107, 2111]
    # "6 sigma over 128 steps": the 20x spike at 1700 masks the 3x one at 1710
    _, a = RobustZScore(window=128, robust=False, threshold=6.0, log_space=False).update_many(x)
    assert np.flatnonzero(a[:, 0]).tolist() == [36, 700, 1586, 1700, 2111, 2263]


def test_threshold_monotone():
    x = noisy_stream(9)
    for robust in (True, False):
        check_threshold_monotone(
            lambda t, r=robust: RobustZScore(n_series=3, window=32, threshold=t, robust=r),
            x,
            thresholds=[0.5, 1, 2, 3, 6, 10],
        )


def test_zero_and_one_length():
    det = RobustZScore(n_series=2)
    s, a = det.update_many(np.zeros((0, 2)))
    assert s.shape == (0, 2) and a.shape == (0, 2)
    s, a = det.update_many(np.ones((1, 2)))
    assert s.shape == (1, 2) and not a.any()
    assert det.count.tolist() == [1.0, 1.0]


def test_reset_and_grow():
    x = noisy_stream(5)[:, :2]
    a = RobustZScore(n_series=2, window=20)
    a.update_many(x[:100])
    a.grow(1)
    b = RobustZScore(n_series=2, window=20)
    b.update_many(x[:100])
    x3 = np.concatenate([x[100:], np.ones((300, 1))], axis=1)
    sa, _ = a.update_many(x3)
    sb, _ = b.update_many(x[100:])
    np.testing.assert_array_equal(sa[:, :2], sb)
    a.reset()
    assert a.count.tolist() == [0.0, 0.0, 0.0]


def test_defaults_and_params():
    det = RobustZScore()
    assert det.get_params() == {
        "n_series": 1,
        "threshold": 8.0,
        "freeze_on_alarm": False,
        "window": 128,
        "warmup": 32,
        "robust": True,
        "log_space": True,
        "min_std": 0.01,
        "direction": "up",
        "tail_q": 0.999,
        "tail_rate": 1.0,
        "tail_max": 1.0,
        "tail_gap": 1,
    }
    assert RobustZScore(window=4).warmup == 2
    assert RobustZScore(window=1).warmup == 1


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
    st.integers(1, 12),
    st.booleans(),
)
def test_property_stream_batch_reference(values, split, window, robust):
    x = np.array(values)[:, None]
    f = lambda n: RobustZScore(n_series=n, window=window, warmup=1, robust=robust)  # noqa: E731
    check_stream_equals_batch(f, x)
    check_state_roundtrip(f, x, split=min(split, len(values)))
    s, a = f(1).update_many(x)
    rs, ra = ref_robust(x[:, 0], window=window, warmup=1, robust=robust)
    np.testing.assert_allclose(s[:, 0], rs, rtol=1e-9, atol=1e-9)
    det = f(1)
    det.update_many(x)
    sd = det.state_dict()
    assert np.isfinite(sd["state"]).all() and np.isfinite(sd["buf"]).all()


# ---------------------------------------------------------------- real data
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bloom_176b_grad_norm_spike_detected(seed):
    x, h = bloom_with_history("grad_norm", sigma=0.1, seed=seed)
    real = x[h:]
    for det in (RobustZScore(), RobustZScore(window=64, robust=False)):
        _, a = det.update_many(x)
        alarms = np.flatnonzero(a[:, 0])
        assert alarms.size and (alarms >= h).all()  # nothing on the healthy history
        assert h + 1 <= alarms[0] <= h + 5  # within the 5-step blow-up
        assert a[h + int(np.argmax(real)), 0]  # the 960 peak itself


@pytest.mark.parametrize("seed", [0, 1])
def test_bloom_176b_loss_spike_detected(seed):
    x, h = bloom_with_history("loss", sigma=0.01, seed=seed)
    _, a = RobustZScore().update_many(x)
    alarms = np.flatnonzero(a[:, 0])
    assert (alarms >= h).all()
    assert a[h + int(np.argmax(x[h:])), 0]


def test_public_runs_clean_quiet_and_diverged_detected():
    clean = public_runs("clean")
    if not clean:
        pytest.skip("no clean public runs")
    n_clean_alarms = sum(int(RobustZScore().update_many(d["loss"])[1].sum()) for _, d in clean)
    assert n_clean_alarms <= len(clean)  # at most ~one false alarm per 2000-step clean run
    diverged = [(r, d) for r, d in public_runs("diverged") if r["onset_step"] is not None]
    if not diverged:
        pytest.skip("no diverged public runs")
    hits = pre = 0
    for r, d in diverged:
        _, a = RobustZScore().update_many(d["loss"])
        steps = d["step"][a[:, 0]]
        on = r["onset_step"]
        hits += bool(((steps >= on) & (steps <= on + 100)).any())
        pre += int((steps < on).sum())
    assert hits >= 0.75 * len(diverged)
    assert pre <= len(diverged)


def _spiky(seed: int, n: int = 600, every: int = 0) -> np.ndarray:
    """Log-normal noise (log std 0.05); with ``every``, a healthy ~5-7 sigma spike every
    ``every`` steps (small-batch SGD)."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.05, n))
    if every:
        x[60::every] *= np.exp(rng.uniform(0.25, 0.35, len(x[60::every])))
    return x


def test_tail_calibration_the_same_z_counts_less_on_a_spiky_run():
    smooth, spiky = _spiky(0), _spiky(0, every=25)
    smooth[590] = spiky[590] = np.exp(0.6)  # the same ~12 sigma spike in both
    plain = RobustZScore(window=128, threshold=8.0)
    cal_smooth = RobustZScore(window=128, threshold=8.0, tail_max=3.0)
    cal_spiky = RobustZScore(window=128, threshold=8.0, tail_max=3.0)
    assert plain.update_many(spiky)[1][590, 0]  # uncalibrated: the spiky run alarms
    assert cal_smooth.update_many(smooth)[1][590, 0]  # a smooth run keeps its alarm
    s, a = cal_spiky.update_many(spiky)
    assert not a[590, 0] and cal_spiky.tail_factor[0] > 1.3
    assert cal_smooth.tail_factor[0] < cal_spiky.tail_factor[0]


def test_tail_calibration_a_fault_does_not_raise_the_bar():
    det = RobustZScore(window=64, threshold=8.0, tail_max=3.0)
    det.update_many(_spiky(1, n=300))
    before = det.tail_factor[0]
    assert det.update_many(np.full(5, 1e3))[1].all()  # a persistent fault: alarms throughout
    assert det.tail_factor[0] == before


def test_tail_calibration_version1_snapshot_loads_uncalibrated():
    det = RobustZScore(window=32, tail_max=3.0)
    det.update_many(_spiky(2, n=200, every=20))
    snap = det.state_dict()
    assert snap["state_version"] == 2
    old = {**snap, "state_version": 1, "state": np.asarray(snap["state"])[:2].tolist()}
    restored = RobustZScore(window=32, tail_max=3.0)
    restored.load_state_dict(old)
    assert restored.tail_factor[0] == 1.0  # q = tail_ref: uncalibrated, window kept
    fresh_q = RobustZScore(window=32, tail_max=3.0)
    fresh_q.load_state_dict({**snap, "state": np.concatenate(
        [np.asarray(snap["state"])[:2], fresh_q.state_dict()["state"][2:]]).tolist()})
    x = _spiky(3, n=100, every=20)
    np.testing.assert_array_equal(restored.update_many(x)[0], fresh_q.update_many(x)[0])
    with pytest.raises(ValueError, match="state_version 1 snapshot must have 2"):
        RobustZScore(window=32).load_state_dict({**snap, "state_version": 1})
    with pytest.raises(ValueError, match="newer"):
        RobustZScore(window=32).load_state_dict({**snap, "state_version": 3})


def test_tail_calibration_a_noisy_build_up_is_one_event():
    # a fault that builds up by 4 -> 10 sigma spikes every third step (quiet in between): with
    # tail_gap = 1 each spike is its own healthy event until the first alarm, the bar climbs to
    # the cap and the fault is never flagged; with tail_gap = 10 the build-up is one event,
    # which alarms, and never lifts the bar
    x = _spiky(4, n=400)
    k = np.arange(40)
    y = np.concatenate([x, x[:40] * np.exp(0.05 * np.where(k % 3 == 0, 4 + 0.17 * k, 0.0))])
    per_spike = RobustZScore(window=128, threshold=8.0, tail_max=3.0, tail_gap=1)
    one_event = RobustZScore(window=128, threshold=8.0, tail_max=3.0, tail_gap=10)
    assert not per_spike.update_many(y)[1].any() and per_spike.tail_factor[0] == 3.0
    a = one_event.update_many(y)[1][:, 0]
    assert not a[:400].any() and a[400:].any() and one_event.tail_factor[0] == 1.0
