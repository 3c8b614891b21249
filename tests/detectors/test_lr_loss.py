from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.lr_loss import LRJump, LRLevelInstability, LRLossCorrelation

from . import realruns
from .generic import (
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
    check_threshold_monotone,
    stream,
)
from .naive import ref_corr, ref_jump, ref_level

# ----------------------------------------------------------------------------- references



# ----------------------------------------------------------------------------- streams


def schedule(t=600, peak=1e-3, warm=50, kind="cosine"):
    s = np.arange(t, dtype=float)
    w = np.minimum(1.0, (s + 1) / warm)
    if kind == "cosine":
        return peak * w * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * s / t)))
    if kind == "step":
        return peak * w * np.where(s < t // 2, 1.0, 0.1)
    return peak * w


def lr_stream(seed, t=600, n=3):
    rng = np.random.default_rng(seed)
    lr = np.stack([schedule(t, kind=k) for k in ("cosine", "step", "const")][:n], 1)
    lr = lr * np.exp(rng.normal(0, 0.001, (t, n)))
    lr[t // 2 + 10, 0] *= 20.0
    lr[t // 3, 1] = np.nan
    lr[t // 4, 2] = np.inf
    lr[t // 5, 2] = 0.0
    return lr


def loss_lr_stream(seed, t=500, n=2, offset=0.0):
    rng = np.random.default_rng(seed)
    lr = np.full((t, n), 1e-3)
    lr[: t // 10] *= np.linspace(0.1, 1.0, t // 10)[:, None]
    lr[t // 2:, 0] *= 30.0
    lr[t // 2 + 100:, 1] *= np.linspace(1.0, 10.0, t - t // 2 - 100)
    loss = np.exp(-np.arange(t) / 400)[:, None] * np.exp(rng.normal(0, 0.03, (t, n))) + offset
    loss[t // 2 + 1:, 0] *= 3.0 * np.exp(rng.normal(0, 0.3, t - t // 2 - 1))
    hot = lr[:, 1] > 3e-3
    loss[hot, 1] *= np.exp(rng.normal(0, 0.4, hot.sum()))
    loss[t // 3, 0] = np.nan
    lr[t // 4, 1] = -np.inf
    return loss, lr


JUMP_CFGS = [
    {},
    {"direction": "both", "clip": math.inf},
    {"direction": "down", "freeze_on_alarm": True, "min_delta": 0.0},
]
CORR_CFGS = [{}, {"window": 10, "alpha": 1.0, "min_lr_ratio": 1.0, "threshold": 0.1},
             {"freeze_on_alarm": True, "threshold": 0.2, "window": 20}]
LEVEL_CFGS = [{}, {"warmup": 20, "margin": 1.0, "stable_ratio": 1.5, "threshold": 2.0},
              {"freeze_on_alarm": True, "warmup": 30, "min_var": 0.0}]


# ----------------------------------------------------------------------------- LRJump


@pytest.mark.parametrize("cfg", JUMP_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_jump_matches_reference_on_every_prefix(cfg, seed):
    lr = lr_stream(seed)
    s, a = stream(LRJump(n_series=3, **cfg), lr)
    for i in range(3):
        r = ref_jump(lr[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], r, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(a[:, i], r > LRJump(**cfg).threshold)


@pytest.mark.parametrize("cfg", JUMP_CFGS)
def test_jump_stream_batch_roundtrip(cfg):
    lr = lr_stream(3)
    miss = np.zeros_like(lr, dtype=bool)
    miss[::7, 1] = True
    f = lambda n: LRJump(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, lr, missing=miss)
    check_split_batches(f, lr)
    for split in (1, 17, 310, 599):
        check_state_roundtrip(f, lr, split=split)
    check_state_roundtrip(f, lr, split=123, via_json=True)
    s, _ = f(3).update_many(lr, missing=miss)
    assert np.isnan(s[miss]).all()
    np.testing.assert_allclose(s[:, 1], ref_jump(lr[:, 1], miss=miss[:, 1], **cfg), rtol=1e-12)


@pytest.mark.parametrize("cfg", JUMP_CFGS)
def test_jump_piecewise_constant_lr_reuses_logs_exactly(cfg):
    """Repeated LRs (whose log the kernel reuses), zeros and non-finite values between them:
    the batch equals the step-by-step stream and every split, bit for bit."""
    rng = np.random.default_rng(5)
    lr = np.repeat(rng.choice([1e-4, 3e-4, 1e-3, 3e-2], size=(40, 2)), 15, axis=0)
    lr[[50, 51, 300], 0] = 0.0
    lr[[120, 421], 1] = np.nan
    miss = np.zeros_like(lr, dtype=bool)
    miss[200:230, 0] = True
    f = lambda n: LRJump(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, lr, missing=miss)
    check_split_batches(f, lr)
    s, _ = f(2).update_many(lr, missing=miss)
    for i in range(2):
        np.testing.assert_allclose(s[:, i], ref_jump(lr[:, i], miss=miss[:, i], **cfg),
                                   rtol=1e-12, atol=1e-12)


def test_jump_golden_and_benign_schedules():
    lr = schedule(1000, kind="step")
    lr2 = schedule(1000, kind="cosine")
    lr2[[400, 700]] *= [8.0, 1.5]
    lr3 = np.full(1000, 3e-4)
    lr3[500:] *= 2.0
    x = np.stack([lr, lr2, lr3], 1)
    s, a = LRJump(n_series=3).update_many(x)
    assert not a[:, 0].any()  # warmup + 10x step decay: benign
    assert np.flatnonzero(a[:, 1]).tolist() == [400, 700]
    assert np.flatnonzero(a[:, 2]).tolist() == [500]
    _, a_both = LRJump(n_series=3, direction="both").update_many(x)
    assert a_both[500, 0]  # the decay is flagged only when decreases count


def test_jump_zero_lr_is_off_and_nonfinite_alarms():
    lr = np.concatenate([[0.0], np.linspace(1e-5, 1e-3, 99), [0.0, 1e-3]])
    s, a = LRJump(warmup=2).update_many(lr)
    assert not a.any() and s[0, 0] == 0.0 and s[100, 0] == 0.0 and s[101, 0] == 0.0
    det = LRJump(warmup=1)
    det.update_many(np.full(10, 1e-3))
    before = det.state_dict()["state"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad)[0] and det.score[0] == np.inf
    np.testing.assert_array_equal(det.state_dict()["state"], before)


def test_jump_constant_and_offset_invariance():
    x = np.full((500, 1), 1e-3)
    assert not LRJump().update_many(x)[1].any()
    lr = schedule(600)[:, None]
    s1, _ = LRJump().update_many(lr)
    s2, _ = LRJump().update_many(lr * 1e8)  # log space: a scale factor is invisible
    np.testing.assert_allclose(s1, s2, atol=1e-6)


def test_jump_threshold_monotone():
    check_threshold_monotone(lambda t: LRJump(n_series=3, threshold=t), lr_stream(9),
                             thresholds=[0.5, 1, 3, 10, 100])


# ----------------------------------------------------------------------------- LRLossCorrelation


@pytest.mark.parametrize("cfg", CORR_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_corr_matches_reference_on_every_prefix(cfg, seed):
    loss, lr = loss_lr_stream(seed)
    s, a = stream(LRLossCorrelation(n_series=2, **cfg), loss, lr)
    for i in range(2):
        r = ref_corr(loss[:, i], lr[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cfg", CORR_CFGS)
def test_corr_constant_lr_windows_skip_the_sums_and_match_the_reference(cfg):
    # long constant-LR stretches (every stored LR change zero: the sums are skipped below the
    # gate) between ramps that open it, across several batch calls and a state round trip
    rng = np.random.default_rng(3)
    t = 900
    lr = np.full(t, 1e-3)
    lr[300:340] *= np.linspace(1.0, 8.0, 40)
    lr[340:] *= 8.0
    lr[700:720] *= np.linspace(1.0, 0.5, 20)
    lr[720:] *= 0.5
    loss = np.exp(rng.normal(0, 0.03, t))
    loss[310:360] *= np.linspace(1.0, 3.0, 50)
    det = LRLossCorrelation(**cfg)
    parts = []
    for lo, hi in ((0, 250), (250, 500), (500, t)):
        parts.append(det.update_many(loss[lo:hi], lr[lo:hi])[0][:, 0])
        det.load_state_dict(det.state_dict())
    s = np.concatenate(parts)
    r = ref_corr(loss, lr, **cfg)
    np.testing.assert_allclose(s, r, rtol=1e-9, atol=1e-9)
    assert np.any(s != 0.0)  # the gate opened on the ramp
    np.testing.assert_array_equal(s[r == 0.0], 0.0)


@pytest.mark.parametrize("cfg", CORR_CFGS)
def test_corr_repeated_lrs_reuse_logs_exactly(cfg):
    """LRs that repeat (the kernel reuses the log of the two LRs last logged), alternate
    between two values, ramp, and pass through 0 / NaN / missing, on series of their own: the
    batch equals the step-by-step stream and every split, bit for bit, and the reference."""
    rng = np.random.default_rng(11)
    t = 600
    lr = np.repeat(rng.choice([1e-4, 3e-4, 1e-3], size=(40, 3)), 15, axis=0)
    lr[100:160, 0] = np.where(np.arange(60) % 2, 1e-3, 2e-3)  # alternating
    lr[200:260, 1] = np.linspace(1e-3, 9e-3, 60)  # a ramp: a new LR every step
    lr[[50, 51, 330], 2] = 0.0
    lr[[120, 421], 1] = np.nan
    loss = np.exp(rng.normal(0, 0.05, (t, 3)))
    loss[200:260, 1] *= np.linspace(1.0, 4.0, 60)
    miss = np.zeros((t, 2, 3), dtype=bool)
    miss[400:430, 1, 0] = True
    f = lambda n: LRLossCorrelation(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, loss, lr, missing=miss)
    check_split_batches(f, loss, lr)
    s, _ = f(3).update_many(loss, lr)
    for i in range(3):
        np.testing.assert_allclose(s[:, i], ref_corr(loss[:, i], lr[:, i], **cfg),
                                   rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cfg", CORR_CFGS)
def test_corr_stream_batch_roundtrip(cfg):
    loss, lr = loss_lr_stream(2)
    miss = np.zeros((loss.shape[0], 2, 2), dtype=bool)
    miss[::9, 0, 1] = True
    f = lambda n: LRLossCorrelation(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, loss, lr, missing=miss)
    check_split_batches(f, loss, lr)
    for split in (1, 60, 251, 499):
        check_state_roundtrip(f, loss, lr, split=split)
    check_state_roundtrip(f, loss, lr, split=300, via_json=True)


def test_corr_golden_and_gates():
    loss, lr = loss_lr_stream(5)
    s, a = LRLossCorrelation(n_series=2).update_many(loss, lr)
    first = np.flatnonzero(a[:, 0] & np.isfinite(s[:, 0]))
    assert 251 <= first[0] <= 253  # LR x30 at 250; the loss answers from 251
    assert np.flatnonzero(a[:251, 0]).tolist() == [166]  # the NaN loss
    # warm-up (LR up, loss down) and step decays (LR down) are gated to 0
    lr2 = schedule(600, kind="step")
    rng = np.random.default_rng(0)
    loss2 = np.exp(-np.arange(600) / 300 + rng.normal(0, 0.05, 600))
    s2, a2 = LRLossCorrelation().update_many(loss2, lr2)
    assert not a2.any() and (s2 == 0.0).mean() > 0.9


def test_corr_constant_offset_short():
    x = np.full((300, 1), 2.0)
    s, a = LRLossCorrelation().update_many(x, np.full((300, 1), 1e-3))
    assert not a.any() and (s == 0).all()
    loss, lr = loss_lr_stream(1, offset=1e8)
    s, a = LRLossCorrelation(n_series=2).update_many(loss, lr)
    assert np.isfinite(s[np.isfinite(loss) & np.isfinite(lr)]).all()
    det = LRLossCorrelation(n_series=2)
    assert det.update_many(np.zeros((0, 2)), np.zeros((0, 2)))[0].shape == (0, 2)
    assert det.update_many(np.ones((1, 2)), np.ones((1, 2)))[0].tolist() == [[0.0, 0.0]]


def test_corr_threshold_monotone():
    loss, lr = loss_lr_stream(8)
    check_threshold_monotone(lambda t: LRLossCorrelation(n_series=2, threshold=t), loss, lr,
                             thresholds=[-1, 0, 0.2, 0.5, 0.9])


# ----------------------------------------------------------------------------- LRLevelInstability


@pytest.mark.parametrize("cfg", LEVEL_CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_level_matches_reference_on_every_prefix(cfg, seed):
    loss, lr = loss_lr_stream(seed)
    s, a = stream(LRLevelInstability(n_series=2, **cfg), loss, lr)
    for i in range(2):
        r = ref_level(loss[:, i], lr[:, i], **cfg)
        np.testing.assert_allclose(s[:, i], r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", LEVEL_CFGS)
def test_level_stream_batch_roundtrip(cfg):
    loss, lr = loss_lr_stream(4)
    miss = np.zeros((loss.shape[0], 2, 2), dtype=bool)
    miss[::11, 1, 0] = True
    f = lambda n: LRLevelInstability(n_series=n, **cfg)  # noqa: E731
    check_stream_equals_batch(f, loss, lr, missing=miss)
    check_split_batches(f, loss, lr)
    for split in (1, 99, 260, 499):
        check_state_roundtrip(f, loss, lr, split=split)
    check_state_roundtrip(f, loss, lr, split=333, via_json=True)
    s, a = f(2).update_many(loss, lr, missing=miss)
    assert np.isnan(s[miss.any(1)]).all() and not a[miss.any(1)].any()


def test_level_golden():
    loss, lr = loss_lr_stream(6)
    s, a = LRLevelInstability(n_series=2).update_many(loss, lr)
    a = a & np.isfinite(s)  # leave out the non-finite inputs (+inf)
    assert not a[:250].any()
    f1 = np.flatnonzero(a[:, 1])
    hot = int(np.argmax(lr[:, 1] > 3e-3))
    assert hot <= f1[0] <= hot + 40  # noisy only once the ramp passes 3x the stable LR
    assert a[250:, 0].any()


def test_level_constant_and_nonfinite():
    x = np.full((400, 1), 1.5)
    assert not LRLevelInstability().update_many(x, np.full((400, 1), 1e-3))[1].any()
    det = LRLevelInstability(warmup=5)
    det.update_many(np.ones(20), np.full(20, 1e-3))
    before = det.state_dict()["state"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        assert det.update(bad, 1e-3)[0] and det.score[0] == np.inf
        assert det.update(1.0, bad)[0]
    np.testing.assert_array_equal(det.state_dict()["state"], before)


def test_level_threshold_monotone():
    loss, lr = loss_lr_stream(7)
    check_threshold_monotone(lambda t: LRLevelInstability(n_series=2, threshold=t), loss, lr,
                             thresholds=[0.5, 1, 2, 4, 8])


# ----------------------------------------------------------------------------- validation


def test_zero_and_one_length():
    for det, k in ((LRJump(n_series=2), 1), (LRLevelInstability(n_series=2), 2)):
        s, a = det.update_many(*[np.zeros((0, 2))] * k)
        assert s.shape == (0, 2) and a.shape == (0, 2)
        s, _ = det.update_many(*[np.ones((1, 2))] * k)
        assert s.tolist() == [[0.0, 0.0]]


@settings(deadline=None, max_examples=40)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.floats(1e-4, 1e4), st.sampled_from([math.nan, math.inf, 0.0, -1.0])),
            st.one_of(st.floats(1e-6, 1.0), st.sampled_from([math.nan, -math.inf, 0.0])),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 60),
)
def test_property_stream_batch_reference(pairs, split):
    loss = np.array([p[0] for p in pairs])[:, None]
    lr = np.array([p[1] for p in pairs])[:, None]
    split = min(split, len(pairs))
    cases = [
        (lambda n: LRJump(n_series=n, warmup=2), (lr,), lambda: ref_jump(lr[:, 0], warmup=2)),
        (lambda n: LRLossCorrelation(n_series=n, window=4), (loss, lr),
         lambda: ref_corr(loss[:, 0], lr[:, 0], window=4)),
        (lambda n: LRLevelInstability(n_series=n, warmup=3), (loss, lr),
         lambda: ref_level(loss[:, 0], lr[:, 0], warmup=3)),
    ]
    for f, inputs, ref in cases:
        check_stream_equals_batch(f, *inputs)
        check_state_roundtrip(f, *inputs, split=split)
        s, _ = f(1).update_many(*inputs)
        np.testing.assert_allclose(s[:, 0], ref(), rtol=1e-9, atol=1e-9)
        det = f(1)
        det.update_many(*inputs)
        assert np.isfinite(det.state_dict()["state"]).all()


# ----------------------------------------------------------------------------- real runs


def _lr_loss(run_id):
    cols, _ = realruns.columns(run_id, ["loss", "lr"])
    return cols["loss"][0], cols["lr"][0]


def test_real_lr_schedule_bugs_alarm_at_onset_and_clean_runs_are_quiet():
    bugs = realruns.runs_of("lr_schedule_bug")
    clean = realruns.runs_of("clean")
    assert bugs and clean
    for r in bugs:
        loss, lr = _lr_loss(r["run_id"])
        _, a = LRJump().update_many(lr)
        hits = np.flatnonzero(a[:, 0])
        on = r["onset_step"]
        assert len(hits) and on <= hits[0] <= on + 2, (r["run_id"], hits[:3], on)
        _, ac = LRLossCorrelation().update_many(loss, lr)
        assert not ac[:on].any() and ac[on:on + 20].any(), r["run_id"]
    level_hits = 0
    for r in clean:
        loss, lr = _lr_loss(r["run_id"])
        assert not LRJump().update_many(lr)[1].any(), r["run_id"]
        assert not LRLossCorrelation().update_many(loss, lr)[1].any(), r["run_id"]
        level_hits += int(LRLevelInstability().update_many(loss, lr)[1].any())
    assert level_hits == 0


def test_real_lr_too_high_is_seen_by_the_family():
    runs = realruns.runs_of("lr_too_high") + realruns.runs_of("lr_schedule_bug")
    caught = 0
    for r in runs:
        loss, lr = _lr_loss(r["run_id"])
        on = r["onset_step"]
        end = r["nan_step"] or len(loss)
        hit = False
        for det, inputs in ((LRJump(), (lr,)), (LRLossCorrelation(), (loss, lr)),
                            (LRLevelInstability(), (loss, lr))):
            _, a = det.update_many(*(x[:end] for x in inputs))
            assert not a[:on].any(), (r["run_id"], type(det).__name__)
            hit |= bool(a[on:on + 300].any())
        caught += hit
    assert caught >= 0.8 * len(runs)
