from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.divergence import TrainValDivergence, ValSpike

from . import realruns
from .generic import (
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
    check_threshold_monotone,
    stream,
)
from .naive import ref_tv, ref_vs

# ----------------------------------------------------------------------------- references



# ----------------------------------------------------------------------------- streams


def tv_stream(seed, t=1500, n=3, every=25, onset=900):
    """Train falls; val follows, then (series 0, 2) rises from ``onset`` (over-fitting)."""
    rng = np.random.default_rng(seed)
    s = np.arange(t)
    base = np.exp(-s / 500)[:, None] + 0.5
    loss = base * np.exp(rng.normal(0, 0.05, (t, n)))
    val = 1.1 * base * np.exp(rng.normal(0, 0.01, (t, n)))
    over = np.exp(np.maximum(0, s - onset) / 1000)[:, None]
    val[:, [0, 2]] *= over
    vmiss = np.broadcast_to((s % every != 0)[:, None], (t, n)).copy()
    vmiss[-1] = False
    lmiss = np.zeros((t, n), dtype=bool)
    lmiss[::37, 1] = True
    loss[t // 3, 2] = np.nan
    val[t // 2, 1] = np.inf  # a val step (t // 2 = 750 is a multiple of 25)
    return loss, val, lmiss, vmiss


def _miss(lmiss, vmiss):
    return np.stack([lmiss, vmiss], axis=1)


TV_CFGS = [{}, {"n_points": 3, "warmup": 2, "alpha": 0.2, "threshold": 2.0},
           {"freeze_on_alarm": True, "threshold": 2.0, "min_scale": 0.0}]
VS_CFGS = [{}, {"window": 3, "warmup": 1, "threshold": 2.0, "min_scale": 0.0},
           {"freeze_on_alarm": True, "threshold": 1.0}]


# ----------------------------------------------------------------------------- TrainValDivergence


@pytest.mark.parametrize("cfg", TV_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tv_matches_reference_on_every_prefix(cfg, seed):
    loss, val, lmiss, vmiss = tv_stream(seed)
    s, a = stream(TrainValDivergence(n_series=3, **cfg), loss, val, missing=_miss(lmiss, vmiss))
    for i in range(3):
        r = ref_tv(loss[:, i], val[:, i], lmiss[:, i], vmiss[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], r, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cfg", TV_CFGS)
def test_tv_stream_batch_roundtrip(cfg):
    loss, val, lmiss, vmiss = tv_stream(3, t=600)
    miss = _miss(lmiss, vmiss)
    f = lambda n: TrainValDivergence(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, loss, val, missing=miss)
    # generic splits/round trips run without a mask: every step then is a val step
    check_split_batches(f, loss, val)
    for split in (1, 17, 300, 599):
        check_state_roundtrip(f, loss, val, split=split)
    check_state_roundtrip(f, loss, val, split=250, via_json=True)
    # and with the mask, by hand
    full = f(3)
    s_full, _ = full.update_many(loss, val, missing=miss)
    first = f(3)
    first.update_many(loss[:310], val[:310], missing=miss[:310])
    second = f(3)
    second.load_state_dict(first.state_dict())
    s2, _ = second.update_many(loss[310:], val[310:], missing=miss[310:])
    np.testing.assert_array_equal(s_full[310:], s2)


def test_tv_golden_overfit_quiet_before():
    loss, val, lmiss, vmiss = tv_stream(11)
    s, a = TrainValDivergence(n_series=3).update_many(loss, val, missing=_miss(lmiss, vmiss))
    fin = np.isfinite(s)
    hits = [np.flatnonzero(a[:, i] & fin[:, i]) for i in range(3)]
    assert hits[1].size == 0  # no over-fitting in series 1
    for i in (0, 2):
        assert 900 < hits[i][0] <= 900 + 6 * 25, hits[i][:3]  # within six evaluations
    assert np.isnan(s[vmiss & ~lmiss]).all()  # only val steps are scored
    assert a[np.isinf(s)].all() and np.isinf(s).sum() == 2


def test_tv_both_rising_is_not_overfitting():
    t = 1000
    s_ = np.arange(t)
    loss = np.exp(s_ / 500)  # train and val rise together: instability, not a gap
    val = 1.2 * loss
    vmiss = s_ % 20 != 0
    miss = _miss(np.zeros(t, bool)[:, None], vmiss[:, None])
    sc, a = TrainValDivergence().update_many(loss, val, missing=miss)
    assert not a.any()
    # the same val with a falling train loss is over-fitting
    sc2, a2 = TrainValDivergence().update_many(np.exp(-s_ / 500), val, missing=miss)
    assert a2.any()


def test_tv_constant_and_offset():
    t = 500
    vmiss = (np.arange(t) % 10 != 0)[:, None]
    miss = _miss(np.zeros((t, 1), bool), vmiss)
    s, a = TrainValDivergence().update_many(np.full(t, 2.0), np.full(t, 2.5), missing=miss)
    assert not a.any() and np.nanmax(s) == 0.0
    loss, val, lmiss, vmiss3 = tv_stream(2)
    s1, _ = TrainValDivergence(n_series=3).update_many(loss, val, missing=_miss(lmiss, vmiss3))
    s2, _ = TrainValDivergence(n_series=3).update_many(loss * 1e8, val * 1e8,
                                                       missing=_miss(lmiss, vmiss3))
    np.testing.assert_allclose(s1, s2, atol=1e-6)  # log space: scale invariant


def test_tv_threshold_monotone():
    loss, val, _, _ = tv_stream(5, t=800, every=1)
    check_threshold_monotone(lambda t: TrainValDivergence(n_series=3, threshold=t), loss, val,
                             thresholds=[-1, 0, 1, 2, 4, 8])


# ----------------------------------------------------------------------------- ValSpike


def val_series(seed, t=300, n=3):
    rng = np.random.default_rng(seed)
    v = np.exp(-np.arange(t) / 200)[:, None] * np.exp(rng.normal(0, 0.02, (t, n))) + 0.2
    v[t // 2, 0] *= 1.8
    v[t // 3, 1] = np.nan
    v[t // 4, 2] = -np.inf
    v[t // 5, 2] = 0.0
    return v


@pytest.mark.parametrize("cfg", VS_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_vs_matches_reference_on_every_prefix(cfg, seed):
    v = val_series(seed)
    s, _ = stream(ValSpike(n_series=3, **cfg), v)
    for i in range(3):
        np.testing.assert_allclose(s[:, i], ref_vs(v[:, i], **cfg), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", VS_CFGS)
def test_vs_stream_batch_roundtrip(cfg):
    v = val_series(3)
    miss = np.zeros_like(v, dtype=bool)
    miss[1::2] = True  # val every other step
    f = lambda n: ValSpike(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, v, missing=miss)
    check_split_batches(f, v)
    for split in (1, 17, 150, 299):
        check_state_roundtrip(f, v, split=split)
    check_state_roundtrip(f, v, split=77, via_json=True)
    s, _ = f(3).update_many(v, missing=miss)
    np.testing.assert_allclose(s[:, 0], ref_vs(v[:, 0], miss[:, 0], **cfg), rtol=1e-12)


def test_vs_golden_constant_offset():
    v = val_series(12)
    s, a = ValSpike(n_series=3).update_many(v)
    assert np.flatnonzero(a[:, 0] & np.isfinite(s[:, 0])).tolist() == [150]
    assert not (a[:, 1] & np.isfinite(s[:, 1])).any()
    assert a[61, 2]  # back up from the 0.0 at step 60: a jump of ~70 in log space
    c = np.full((100, 1), 0.7)
    sc, ac = ValSpike().update_many(c)
    assert not ac.any() and (sc == 0).all()
    s1, _ = ValSpike(n_series=3).update_many(v * 1e8)
    fin = np.isfinite(s)[:, :2]  # series 2 has a 0.0, which is not scale invariant
    np.testing.assert_allclose(s1[:, :2][fin], s[:, :2][fin], atol=1e-6)


def test_vs_threshold_monotone():
    check_threshold_monotone(lambda t: ValSpike(n_series=3, threshold=t), val_series(4),
                             thresholds=[-5, 0, 1, 3, 6, 20])


# ----------------------------------------------------------------------------- validation


def test_bad_inputs_and_short_input():
    det = TrainValDivergence(n_series=2)
    with pytest.raises(ValueError, match=r"takes 2 input\(s\) \(loss, val_loss\)"):
        det.update(np.ones(2))
    with pytest.raises(ValueError, match="'missing' has shape"):
        det.update_many(np.ones((3, 2)), np.ones((3, 2)), missing=np.zeros((3, 2), bool))
    s, a = det.update_many(np.zeros((0, 2)), np.zeros((0, 2)))
    assert s.shape == (0, 2)
    s, _ = det.update_many(np.ones((1, 2)), np.ones((1, 2)))
    assert s.tolist() == [[0.0, 0.0]]
    vs = ValSpike(n_series=2)
    assert vs.update_many(np.zeros((0, 2)))[0].shape == (0, 2)
    with pytest.raises(ValueError, match=r"expected \(steps, 2\)"):
        vs.update_many(np.ones((4, 3)))


def test_nonfinite_never_enters_state():
    det = TrainValDivergence(warmup=2)
    for k in range(10):
        det.update(1.0 / (k + 1), 1.1 / (k + 1))
    before = det.state_dict()["state"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad, 1.0)[0] and det.score[0] == np.inf
        assert det.update(1.0, bad)[0]
    np.testing.assert_array_equal(det.state_dict()["state"], before)


@settings(deadline=None, max_examples=40)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.floats(1e-3, 1e3), st.sampled_from([math.nan, math.inf, 0.0])),
            st.one_of(st.floats(1e-3, 1e3), st.sampled_from([math.nan, -math.inf])),
            st.booleans(),
            st.booleans(),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 60),
)
def test_property_stream_batch_reference(rows, split):
    loss = np.array([r[0] for r in rows])[:, None]
    val = np.array([r[1] for r in rows])[:, None]
    lmiss = np.array([r[2] for r in rows])[:, None]
    vmiss = np.array([r[3] for r in rows])[:, None]
    miss = _miss(lmiss, vmiss)
    f = lambda n: TrainValDivergence(n_series=n, warmup=2, n_points=3)  # noqa: E731
    check_stream_equals_batch(f, loss, val, missing=miss)
    check_state_roundtrip(f, loss, val, split=min(split, len(rows)))
    s, _ = f(1).update_many(loss, val, missing=miss)
    r = ref_tv(loss[:, 0], val[:, 0], lmiss[:, 0], vmiss[:, 0], warmup=2, n_points=3)
    np.testing.assert_allclose(s[:, 0], r, rtol=1e-9, atol=1e-12)
    g = lambda n: ValSpike(n_series=n, window=3, warmup=1)  # noqa: E731
    check_stream_equals_batch(g, val, missing=vmiss)
    check_state_roundtrip(g, val, split=min(split, len(rows)))
    s, _ = g(1).update_many(val, missing=vmiss)
    np.testing.assert_allclose(s[:, 0], ref_vs(val[:, 0], vmiss[:, 0], window=3, warmup=1),
                               rtol=1e-12, atol=1e-12)
    for det in (f(1), g(1)):
        if det.n_inputs == 2:
            det.update_many(loss, val, missing=miss)
        else:
            det.update_many(val, missing=vmiss)
        assert np.isfinite(det.state_dict()["state"]).all()


# ----------------------------------------------------------------------------- real runs


def _run(run_id):
    cols, _ = realruns.columns(run_id, ["loss", "val_loss"])
    (loss, lm), (val, vm) = cols["loss"], cols["val_loss"]
    return loss, val, _miss(lm[:, None], vm[:, None])


def test_real_overfit_runs_alarm_after_onset_and_clean_runs_are_quiet():
    over = realruns.runs_of("overfit")
    clean = realruns.runs_of("clean")
    assert over and clean
    for r in over:
        loss, val, miss = _run(r["run_id"])
        s, a = TrainValDivergence().update_many(loss, val, missing=miss)
        hits = np.flatnonzero(a[:, 0])
        on = r["onset_step"]
        every = int(np.median(np.diff(np.flatnonzero(~miss[:, 1, 0]))))
        assert not a[:on].any(), r["run_id"]
        assert len(hits) and hits[0] <= on + 10 * every, (r["run_id"], hits[:3], on)
    for r in clean:
        loss, val, miss = _run(r["run_id"])
        assert not TrainValDivergence().update_many(loss, val, missing=miss)[1].any(), r["run_id"]
        assert not ValSpike().update_many(val, missing=miss[:, 1])[1].any(), r["run_id"]
